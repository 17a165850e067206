"""Launching and stopping server processes (SGLang, vLLM, a router) from the trainer.

Servers run from their own environment (`<section>.python`, REFERENCE.md §6), each in a new process group so
that stopping it also stops its children (schedulers, detokenizers, engine cores). Whatever the `ProcessSupervisor`
started it stops: on `stop_all()`, at interpreter exit (atexit) and on SIGTERM / SIGINT (then the previous
handler runs).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from megatron_gspo.rollout.server.errors import ServerError

logger = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on host:port (e.g. a server left over from an earlier run)."""
    target = "127.0.0.1" if host in ("", "0.0.0.0") else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((target, port)) == 0


def check_python(cfg: Any) -> None:
    """Raises ValueError naming `<section>.python` when the server environment's interpreter cannot be run (a
    wrong path), before anything is started."""
    # The server starts with the trainer's environment plus `<section>.server_env`: its PATH is the one searched.
    search = (getattr(cfg, "server_env", None) or {}).get("PATH") or os.environ.get("PATH")
    if shutil.which(cfg.python, path=search) is None:
        where = "" if os.path.isabs(cfg.python) else f" (relative to {os.getcwd()} or on PATH)"
        raise ValueError(f"{cfg.section}.python={cfg.python!r} is not an executable file{where}: set it to the "
                         f"python of the {cfg.section} server's environment")


@dataclass
class ManagedProcess:
    """A process we started, leader of its own process group."""

    name: str
    """Human-readable name used in errors ('SGLang server 0', 'vLLM server 1', 'sglang-router')."""
    command: list[str]
    """The command line it runs."""
    popen: subprocess.Popen
    """The process handle."""
    log_path: Path | None = None
    """Where its output goes (None: inherited)."""

    @property
    def pid(self) -> int:
        """Process id (= process group id)."""
        return self.popen.pid

    def exit_message(self) -> str | None:
        """None while running, else how it ended (with the log location)."""
        code = self.popen.poll()
        if code is None:
            return None
        where = f"; see {self.log_path}" if self.log_path else ""
        return f"{self.name} (pid {self.pid}) exited with code {code}{where}"

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):  # group gone (PermissionError: its id was reused)
            return False

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`; waits until the leader is reaped."""
        if self._signal_group(signal.SIGTERM):
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # Even when the leader exited, children that ignored SIGTERM may still hold the group.
            self._signal_group(signal.SIGKILL)
        try:
            self.popen.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %d) survived SIGKILL", self.name, self.pid)


class ProcessSupervisor:
    """Starts processes and guarantees they are stopped (stop_all, atexit, SIGTERM/SIGINT)."""

    def __init__(self, grace_s: float = 10.0):
        self.grace_s = grace_s
        self.processes: list[ManagedProcess] = []
        self._lock = threading.RLock()  # re-entered when a signal arrives during stop_all
        self._previous: dict[int, Any] = {}
        self._log_files: list[IO] = []
        atexit.register(self.stop_all)
        self._install_signal_handlers()

    def start(
        self,
        name: str,
        command: list[str],
        *,
        env: dict[str, str | None] | None = None,
        log_path: Path | None = None,
    ) -> ManagedProcess:
        """Starts `command` in a new process group (environment: ours + `env`, where None unsets a variable);
        output to `log_path` (appended) or inherited."""
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset it for the child
        out: Any = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(log_path, "ab")  # noqa: SIM115 - closed in stop_all
            self._log_files.append(out)
        try:
            err = subprocess.STDOUT if out else None
            popen = subprocess.Popen(command, env=full_env, stdout=out, stderr=err, start_new_session=True)
        except OSError as e:  # one line in the CLI (a ServerError), naming what could not be run
            raise ServerError(f"could not start {name} ({command[0]}): {e.strerror or e}") from e
        proc = ManagedProcess(name, command, popen, log_path)
        with self._lock:
            self.processes.append(proc)
        logger.info("started %s (pid %d): %s", name, proc.pid, " ".join(command))
        return proc

    def stop_all(self) -> None:
        """Stops every process started here, router first (idempotent, safe from a signal handler)."""
        with self._lock:
            # Pop only after a process is stopped: a signal handler re-entering here finishes the rest.
            while self.processes:
                self.processes[-1].stop(self.grace_s)
                self.processes.pop()
            while self._log_files:
                self._log_files.pop().close()

    def close(self) -> None:
        """Stops everything and restores the signal handlers and atexit state found at construction."""
        self.stop_all()
        atexit.unregister(self.stop_all)
        self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still covers normal exits
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:  # someone installed a handler after us: leave theirs
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.warning("signal %d: stopping %d server process(es)", signum, len(self.processes))
        self.stop_all()
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            handler: Callable[[int, FrameType | None], Any] = previous
            handler(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # SIG_DFL: let the default action (terminate) happen
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
