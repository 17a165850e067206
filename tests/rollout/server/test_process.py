"""Process supervision shared by the server engines."""

import os
import signal
import sys

from megatron_gspo.rollout.server.process import ProcessSupervisor


def test_supervisor_stops_processes_on_sigterm_then_runs_the_previous_handler():
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        supervisor = ProcessSupervisor(grace_s=5)
        proc = supervisor.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]
        assert proc.popen.poll() is not None and supervisor.processes == []
        supervisor.close()
        assert signal.getsignal(signal.SIGTERM) is not supervisor._on_signal
    finally:
        signal.signal(signal.SIGTERM, previous)
