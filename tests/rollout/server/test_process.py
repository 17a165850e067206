"""Process supervision shared by the server engines."""

import os
import signal
import sys

import pytest

from megatron_gspo.rollout.server.errors import ServerError
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


def test_a_command_that_cannot_be_started_is_a_one_line_server_error(tmp_path):
    """The CLI prints a ServerError in one line (exit 1); a RuntimeError would be a traceback."""
    supervisor = ProcessSupervisor()
    try:
        with pytest.raises(ServerError, match=r"could not start vLLM server 0 \(.*/nope\): No such file or directory"):
            supervisor.start("vLLM server 0", [str(tmp_path / "nope"), "-m", "vllm"])
    finally:
        supervisor.close()
