"""Reward calls with a deadline: worker processes that a looping or hanging reward cannot stall.

math_verify can loop on adversarial expressions (sympy), and user rewards call sandboxes and services. A call that
runs past `timeout_s` is abandoned by killing its worker (a thread could not be stopped) and scored as an error; a
fresh worker takes over the rest of the batch. Items travel to a worker in chunks and come back one small message
per few milliseconds of work (results are flushed at least every FLUSH_S), so a fast reward pays little for its
deadline (tools/bench_rewards.py measures it against calling the function in-process).

Which call is running, and since when, the worker writes into two shared-memory doubles before each call (a
pipe message per call would cost more than a fast reward itself). The deadline runs from that start, and a stuck or
crashing call is the one blamed: the calls that finished before it in its chunk keep the results already received,
and the few whose results were still unsent (at most FLUSH_S of work) run again in the replacement worker.

Workers are spawned, not forked: the trainer holds threads and process-group sockets. They ignore SIGINT, SIGTERM
and SIGUSR1 (Ctrl-C and Slurm's signals reach the whole process group; the trainer decides when to stop and still
needs its rewards for the step it finishes) from their first instruction (process_tree.stop_signals_blocked), and
die with the trainer: Linux's parent-death signal where available,
else when their pipe closes or their parent changes.
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from megatron_gspo.process_tree import start_helper, stop_signals_blocked

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
"""Seconds a new worker may take to start and import the reward function."""
FLUSH_S = 0.002
"""A worker sends the results it has at least this often (a deadline then runs from the last results received)."""


class Outcome(NamedTuple):
    """One reward call: its value (0.0 on error), the error in one line, and the traceback text when it raised."""

    value: float
    error: str | None = None
    detail: str | None = None


def call_reward(fn: Callable[[str, str, dict], Any], response: str, answer: str, meta: dict) -> Outcome:
    """Calls a reward function once; anything but a finite real number (an exception, sys.exit, NaN, a string,
    None) is an error scored 0."""
    try:
        value = fn(response, answer, meta)
    except SystemExit as exc:  # a reward must not end the run; count it like any other failure
        return Outcome(0.0, f"called sys.exit({exc.code!r})", traceback.format_exc())
    except Exception as exc:  # noqa: BLE001 - any bug in a reward function is the reward's error
        return Outcome(0.0, f"{type(exc).__name__}: {exc}", traceback.format_exc())
    if value is None or isinstance(value, (str, bytes)):
        return Outcome(0.0, f"returned {type(value).__name__} {value!r:.60}, not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        return Outcome(0.0, f"returned {type(value).__name__} {value!r:.60}, not a number")
    if not math.isfinite(number):
        return Outcome(0.0, f"returned {number}, not a finite number")
    return Outcome(number)


# ---------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------
def _watch_parent(parent: int) -> None:
    """Beside process_tree's parent-death signal (Linux; it SIGKILLs a worker even while the reward spins in C
    code): elsewhere, notice the re-parenting."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="reward-worker-orphan-check").start()


def _serve(conn, fn_bytes: bytes, parent: int, running) -> None:
    """Worker main loop: `ready`, then for each chunk of (index, response, answer, meta) lists of (index, Outcome),
    sent every FLUSH_S and when the chunk is done. `running` [index, start] names the call in progress."""
    start_helper(parent)  # stop signals ignored (blocked since the spawn: _Worker), dies with the trainer
    _watch_parent(parent)
    try:
        fn = pickle.loads(fn_bytes)
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which names the reward
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        done, flushed = [], time.monotonic()
        for index, response, answer, meta in chunk:
            # Start first, then index: a reader that sees this index twice around its read of the start cannot
            # get an older call's start (CLOCK_MONOTONIC is one clock for all processes).
            running[1] = time.monotonic()
            running[0] = index
            done.append((index, call_reward(fn, response, answer, meta)))
            now = time.monotonic()
            if now - flushed >= FLUSH_S:
                conn.send(("done", done))
                done, flushed = [], now
        if done:
            conn.send(("done", done))


# ---------------------------------------------------------------------------------------------------------
# Trainer side
# ---------------------------------------------------------------------------------------------------------
class _Worker:
    def __init__(self, ctx, fn_bytes: bytes, number: int):
        self.conn, child = ctx.Pipe()
        self.running = ctx.RawArray("d", [-1.0, 0.0])  # [index, monotonic start] of the call in progress
        self.proc = ctx.Process(
            target=_serve, args=(child, fn_bytes, os.getpid(), self.running), name=f"reward-worker-{number}",
            daemon=False,
        )
        with stop_signals_blocked():  # the child starts with them blocked (module doc)
            self.proc.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.inflight: deque[int] = deque()  # indices sent and not answered yet, in the order they run
        self.deadline = math.inf

    def call_in_progress(self) -> tuple[int, float] | None:
        """(index, monotonic start) of the call the worker runs now, if it is one of `inflight`; None when it is
        between calls or has not started this chunk yet."""
        first = self.running[0]
        start = self.running[1]
        if self.running[0] != first or first < 0:
            return None  # it moved on meanwhile: it is making progress
        index = int(first)
        return (index, start) if index in self.inflight else None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class RewardPool:
    """Scores items in `workers` processes; a call running longer than `timeout_s` seconds is an error.

    `fn` must be picklable by reference (a module-level function): `RewardPool.supports(fn)` says whether it is.
    """

    def __init__(
        self, fn: Callable, *, workers: int, timeout_s: float, name: str = "reward", slow_warning_s: float = 0.0
    ):
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool needs workers >= 1 and timeout_s > 0 (got {workers}, {timeout_s})")
        self.name = name
        self.timeout_s = float(timeout_s)
        self.slow_warning_s = float(slow_warning_s)
        self._fn_bytes = pickle.dumps(fn)
        self._ctx = multiprocessing.get_context("spawn")
        # Every worker is spawned from this one thread, alive until close: Linux's parent-death signal fires when
        # the thread that forked a worker ends, and a replacement spawned from a producer thread (async rollouts)
        # was SIGKILLed when that thread ended (found in review).
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-spawner-{name}")
        self._started = 0
        self._workers = [self._new_worker() for _ in range(workers)]
        self.timeouts = 0
        self.restarts = 0
        # Before multiprocessing's own exit hook, which would wait for non-daemon children forever.
        atexit.register(self.close)

    @staticmethod
    def supports(fn: Callable) -> bool:
        """Whether `fn` can be sent to a worker (module-level functions can; lambdas and closures cannot)."""
        try:
            pickle.dumps(fn)
        except Exception:  # noqa: BLE001 - pickling errors come in several types
            return False
        return True

    def _new_worker(self) -> _Worker:
        self._started += 1
        return self._spawner.submit(_Worker, self._ctx, self._fn_bytes, self._started).result()

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self.restarts += 1
        fresh = self._new_worker()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def map(self, items: Sequence[tuple[str, str, dict]]) -> list[Outcome]:
        """Outcome of every (response, answer, meta), in order."""
        if not self._workers:
            raise RuntimeError(f"reward pool for {self.name!r} is closed")
        results: list[Outcome | None] = [None] * len(items)
        todo = deque(range(len(items)))
        chunk = max(1, min(64, -(-len(items) // (4 * len(self._workers)))))
        remaining = len(items)
        began = time.monotonic()
        report = began + self.slow_warning_s if self.slow_warning_s > 0 else math.inf
        while remaining:
            now = time.monotonic()
            if now >= report:
                report = now + self.slow_warning_s
                self._report_slow(now, len(items) - remaining, len(items), now - began)
            for w in self._workers:
                if w.ready and not w.inflight and todo:
                    ids = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                    w.inflight.extend(ids)
                    w.deadline = now + self.timeout_s
                    w.running[0] = -1.0  # it is waiting in recv: its last chunk is all answered
                    try:
                        w.conn.send([(i, *items[i]) for i in ids])
                    except OSError:  # it died between two batches: its EOF is read below
                        pass
            waits = [w.deadline if w.ready else w.started + STARTUP_TIMEOUT_S for w in self._workers
                     if w.inflight or not w.ready]
            waits.append(report)
            timeout = max(0.0, min(waits) - now) if math.isfinite(min(waits)) else None
            for conn in multiprocessing.connection.wait([w.conn for w in self._workers], timeout):
                w = next(x for x in self._workers if x.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == "done":
                    taken, open_ = self._take(w, results, msg[1])  # and everything else already there
                    remaining -= taken
                    msg = msg if open_ else None
                if msg is None:
                    w.proc.join(timeout=5)
                    if not w.ready:
                        self.close()
                        raise RuntimeError(
                            f"reward {self.name!r}: a worker process exited while starting (exit code {w.proc.exitcode})"
                        ) from None
                    remaining -= self._lost(w, results, todo, f"ended its worker process (exit code {w.proc.exitcode})")
                    continue
                if msg[0] == "ready":
                    w.ready = True
                elif msg[0] == "failed":
                    self.close()
                    raise ValueError(f"reward {self.name!r} cannot be loaded in a worker process: {msg[1]}")
            now = time.monotonic()
            for w in list(self._workers):
                if not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(
                        f"reward {self.name!r}: a worker process did not start within {STARTUP_TIMEOUT_S:.0f} s"
                    )
                if w.inflight and now > w.deadline:
                    taken, open_ = self._take(w, results, [])  # results sent just before the deadline count
                    remaining -= taken
                    if not (w.inflight and open_):
                        continue  # all answered, or it died: its EOF is read above
                    running = w.call_in_progress()
                    if running is not None and running[1] + self.timeout_s > now:
                        w.deadline = running[1] + self.timeout_s  # results were late, the call is not
                        continue
                    if running is None and taken:
                        continue  # progress, and no call known to have run too long
                    self.timeouts += 1
                    remaining -= self._lost(w, results, todo, f"timed out after {self.timeout_s:g} s")
        return results  # type: ignore[return-value]

    def _report_slow(self, now: float, done: int, total: int, elapsed: float) -> None:
        """Warns about the calls running longer than `slow_warning_s`: how many are in flight and the oldest's age
        (a slow reward is otherwise silent until its timeout or the trainer's hang warning)."""
        running = [w.call_in_progress() for w in self._workers]
        slow = sorted((now - r[1] for r in running if r is not None and now - r[1] >= self.slow_warning_s),
                      reverse=True)
        if not slow:
            return
        log.warning("reward %r is slow: %d call(s) running for more than %g s (the oldest for %.0f s; "
                    "scoring.timeout_s=%g); %d of %d calls done after %.0f s", self.name, len(slow),
                    self.slow_warning_s, slow[0], self.timeout_s, done, total, elapsed)

    def _take(self, worker: _Worker, results: list, done: list) -> tuple[int, bool]:
        """Stores `done` and every result message already waiting in the worker's pipe (one at a time, so an EOF
        behind them loses none); returns how many items they answered and whether the pipe is still open. The
        worker's deadline restarts."""
        count = 0
        while True:
            for index, outcome in done:
                results[index] = outcome
                worker.inflight.remove(index)
            count += len(done)
            if done:
                worker.deadline = time.monotonic() + self.timeout_s
            try:
                if not worker.conn.poll():
                    return count, True
                msg = worker.conn.recv()
            except (EOFError, OSError):
                return count, False
            done = msg[1]  # only results follow `ready`

    def _lost(self, worker: _Worker, results: list, todo: deque, why: str) -> int:
        """The call `worker` was running failed (`why`): score it as an error, give the worker's other items back
        (those that finished before it but whose results were not sent yet run again), start a replacement.
        Returns the number of items finished (1, or 0 when it held none)."""
        finished = 0
        running = worker.call_in_progress()
        if running is None and worker.inflight:
            running = (worker.inflight[0], 0.0)  # it never reported a call of this chunk: blame the first
        if running is not None:
            worker.inflight.remove(running[0])
            results[running[0]] = Outcome(0.0, f"reward call {why}")
            finished = 1
        todo.extendleft(reversed(worker.inflight))
        self._replace(worker)
        return finished

    def close(self) -> None:
        """Stops the workers (idempotent)."""
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()
        self._spawner.shutdown(wait=False)
        atexit.unregister(self.close)
