"""Reward calls in worker processes (rewards/pool.py): per-call timeouts, crashes and sys.exit become counted
errors, and the rest of the batch is scored as usual."""

import logging
import os
import time

import pytest

from megatron_gspo.rewards import RewardScorer
from megatron_gspo.rewards.config import ScoringConfig
from tests.rewards import misbehaving

FAST = ScoringConfig(workers=2, timeout_s=0.5)


def _scored(fn, responses, scoring=FAST, answers=None):
    scorer = RewardScorer(fn, scoring=scoring)
    try:
        rewards = scorer.score(responses, answers or responses, None)
        return rewards.tolist(), scorer.take_window(), scorer
    finally:
        scorer.close()


def test_a_hanging_call_times_out_and_the_rest_is_scored(caplog):
    responses = ["1", "hang1", "2", "3", "hang2", "4", "5"]
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.rewards.registry"):
        rewards, (calls, errors, first), scorer = _scored(misbehaving.sleepy, responses, answers=responses)
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert (calls, errors) == (7, 2) and scorer.num_errors == 2
    assert "timed out after 0.5 s" in first and "'hang1'" in first
    assert scorer.pool.timeouts == 2 and scorer.pool.restarts == 2
    assert any("timed out after 0.5 s" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fn, bad, why", [(misbehaving.sleepy, "hang", "timed out after 0.5 s"),
                                           (misbehaving.dies, "die", "exit code 9")])
def test_only_the_stuck_call_fails_when_fast_calls_ran_before_it_in_its_chunk(fn, bad, why):
    # One worker, 64 items: chunks of 16, so items 0..9 finish (in microseconds, before any flush) in the same chunk
    # as the call that hangs or kills its worker. That call alone is the error; the finished ones keep their values,
    # and it costs one timeout (one restart), not one per item that ran before it.
    responses = [f"r{i}" for i in range(64)]
    responses[10] = bad
    answers = list(responses)
    answers[3] = "other"
    rewards, (calls, errors, first), scorer = _scored(
        fn, responses, scoring=ScoringConfig(workers=1, timeout_s=0.5), answers=answers
    )
    expected = [1.0] * 64
    expected[10] = 0.0
    if fn is misbehaving.sleepy:
        expected[3] = 0.0  # exact match against a different answer: a real 0, not an error
    assert rewards == expected
    assert (calls, errors) == (64, 1), first
    assert f"failed on {bad!r}" in first and why in first
    assert scorer.pool.restarts == 1 and scorer.pool.timeouts == (1 if fn is misbehaving.sleepy else 0)


def test_slow_calls_are_reported_while_they_run(caplog):
    """Calls far below their timeout but slower than scoring.slow_warning_s: reported while they run (how many,
    the oldest's age), and scored as usual."""
    scoring = ScoringConfig(workers=2, timeout_s=60, slow_warning_s=0.5)
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.rewards.pool"):
        rewards, (calls, errors, _), _ = _scored(misbehaving.slow, ["a", "slow1", "slow2", "b"], scoring=scoring)
    assert rewards == [1.0, 1.0, 1.0, 1.0] and (calls, errors) == (4, 0)
    reports = [r.getMessage() for r in caplog.records if "is slow" in r.getMessage()]
    assert reports, [r.getMessage() for r in caplog.records]
    assert all("reward 'slow' is slow:" in m and "running for more than 0.5 s" in m and "scoring.timeout_s=60" in m
               and "of 4 calls done" in m for m in reports), reports
    assert any("2 call(s)" in m for m in reports), reports  # both workers' calls in flight at once
    quiet = ScoringConfig(workers=2, timeout_s=60, slow_warning_s=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.rewards.pool"):
        _scored(misbehaving.slow, ["slow1"], scoring=quiet)
    assert not [r for r in caplog.records if "is slow" in r.getMessage()]


def test_a_pure_python_loop_times_out():
    rewards, (calls, errors, first), _ = _scored(misbehaving.spins, ["a", "loop", "b"])
    assert rewards == [1.0, 0.0, 1.0] and errors == 1 and "timed out" in first


def test_sys_exit_and_a_dying_worker_are_errors_not_the_end_of_the_run():
    rewards, (_, errors, first), _ = _scored(misbehaving.exits, ["a", "exit", "b"])
    assert rewards == [1.0, 0.0, 1.0] and errors == 1 and "called sys.exit(3)" in first
    rewards, (_, errors, first), _ = _scored(misbehaving.dies, ["a", "die", "b", "c"])
    assert rewards == [1.0, 0.0, 1.0, 1.0] and errors == 1 and "exit code 9" in first


def test_sys_exit_in_process_is_an_error_too():
    rewards, (_, errors, first), _ = _scored(misbehaving.exits, ["exit", "a"], scoring=None)
    assert rewards == [0.0, 1.0] and "called sys.exit(3)" in first


def test_a_string_is_not_a_reward():
    rewards, (_, errors, first), _ = _scored(misbehaving.stringly, ["a", "b"], scoring=None)
    assert rewards == [0.0, 0.0] and errors == 2 and "returned str '1.0', not a number" in first


def test_a_wrong_signature_is_refused_before_scoring():
    with pytest.raises(ValueError, match=r"signature \(response\).*fn\(response, answer, meta\)"):
        RewardScorer(misbehaving.one_argument, scoring=FAST)


def test_calls_run_in_workers_and_results_keep_their_order():
    scorer = RewardScorer(misbehaving.pid, scoring=ScoringConfig(workers=2, timeout_s=30))
    try:
        pids = scorer.score([str(i) for i in range(40)], ["x"] * 40).tolist()
        assert os.getpid() not in pids and 1 <= len(set(pids)) <= 2
        assert RewardScorer(misbehaving.sleepy, scoring=None).pool is None
        echo = RewardScorer("exact_match", scoring=ScoringConfig(workers=3, timeout_s=30))
        try:
            answers = [str(i % 5) for i in range(50)]
            assert echo.score([str(i % 7) for i in range(50)], answers).tolist() == [
                float(str(i % 7) == str(i % 5)) for i in range(50)
            ]
        finally:
            echo.close()
    finally:
        scorer.close()


def test_a_closure_runs_in_process_with_a_warning(caplog):
    offset = 1.0

    def closure(response, answer, meta):
        return float(os.getpid()) + offset

    with caplog.at_level(logging.WARNING, logger="megatron_gspo.rewards.registry"):
        scorer = RewardScorer(closure, scoring=FAST)
    assert scorer.pool is None and "cannot be sent to a worker process" in caplog.text
    assert scorer.score(["a"], ["a"]).tolist() == [float(os.getpid()) + 1.0]


def test_sharing_keeps_the_pool_and_separate_counts():
    scorer = RewardScorer(misbehaving.stringly, scoring=ScoringConfig(workers=1, timeout_s=30))
    try:
        other = scorer.sharing()
        assert other.pool is scorer.pool
        other.score(["a"], ["a"])
        assert scorer.take_window() == (0, 0, None) and other.take_window()[:2] == (1, 1)
        other.close()  # not its pool: still usable
        assert scorer.score(["a"], ["a"]).tolist() == [0.0]
    finally:
        scorer.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(workers=-1), r"scoring\.workers=-1"),
        (dict(timeout_s=0), r"scoring\.timeout_s=0"),
        (dict(max_error_frac=0), r"scoring\.max_error_frac=0"),
        (dict(max_error_frac=1.5), r"scoring\.max_error_frac=1\.5"),
        (dict(slow_warning_s=-1), r"scoring\.slow_warning_s=-1"),
    ],
)
def test_scoring_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScoringConfig(**kwargs)


def test_a_sharing_scorers_window_counts_in_the_owner_once_added():
    """The rollout producer scores with a sharing scorer in its thread; the training stage adds each batch's
    window to the trainer's scorer, whose window the step boundary checks against scoring.max_error_frac."""
    scorer = RewardScorer(misbehaving.stringly)
    other = scorer.sharing()
    other.score(["a", "b"], ["a", "b"])
    window = other.take_window()
    assert window[:2] == (2, 2) and "stringly" in window[2]
    scorer.add_window(1, 0, None)
    scorer.add_window(*window)
    assert scorer.take_window() == (3, 2, window[2])


def test_stop_signals_reaching_a_worker_while_it_starts_do_not_kill_it(monkeypatch):
    """Slurm's scancel / preemption SIGTERM, Ctrl-C's SIGINT and the requeue SIGUSR1 reach every process of the job
    step, reward workers included, also in the ~0.1-1 s a spawned worker takes to reach its own handlers (CI at
    3c6a38f: 'a worker process exited while starting (exit code -15)' instead of the stop checkpoint). Real signals
    sent the moment each worker is spawned: the workers live and score the batch. The wrapper around
    `_Worker.__init__` stands in for no component, only for the timing: it sends the signals inside the start-up
    window, which a real `scancel` hits by chance (tests/launch/test_slurm_jobs.py's scancel test hit it once in
    CI); processes, signals and the pool are the real ones."""
    import signal

    from megatron_gspo.rewards import pool

    spawned = []
    start = pool._Worker.__init__

    def signalled(self, *args, **kwargs):
        start(self, *args, **kwargs)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(self.proc.pid, sig)
        spawned.append(self)

    monkeypatch.setattr(pool._Worker, "__init__", signalled)
    rewards, (calls, errors, first), scorer = _scored(misbehaving.sleepy, ["1", "2", "3", "4"])
    assert len(spawned) == 2 and scorer.pool.restarts == 0, first
    assert rewards == [1.0] * 4 and (calls, errors) == (4, 0), first


def test_a_worker_replaced_from_a_thread_that_ends_lives_on():
    """Linux's parent-death signal fires when the thread that spawned a worker ends, not the process: a
    replacement made from a producer thread (asynchronous rollouts score there) must outlive that thread
    (found in review: it was SIGKILLed with it, and the next scoring lost a call to a dead worker)."""
    import threading

    from megatron_gspo.rewards.pool import RewardPool

    pool = RewardPool(misbehaving.sleepy, workers=1, timeout_s=5.0)
    try:
        # replaced and used in the thread: the worker set its parent-death signal while the thread lived
        thread = threading.Thread(target=lambda: (pool._replace(pool._workers[0]), pool.map([("0", "0", {})])))
        thread.start()
        thread.join(30)
        time.sleep(0.5)  # time for a parent-death SIGKILL to land
        (worker,) = pool._workers
        assert worker.proc.is_alive(), worker.proc.exitcode
        outcomes = pool.map([("1", "1", {}), ("2", "2", {})])
        assert [o.value for o in outcomes] == [1.0, 1.0] and pool.restarts == 1
    finally:
        pool.close()
