"""The rollout producer (training/producer.py): how far it runs ahead, weight syncs at generate-call boundaries,
errors reaching the training stage; and the training stage's bookkeeping on 2 data-parallel ranks (gloo): every
rank takes as many groups, no prompt twice or skipped, and a resume from the checkpointed state continues the
same global order.

The produce function here stands in for generate + score (a server engine is what runs there; tests/training/
test_async_modes.py runs it for real): these tests are about which batch is made when, under which version."""

from __future__ import annotations

import threading
import time
import types
import zlib
from collections import Counter

import pytest
import torch

from megatron_gspo.data.dataset import PromptSampler
from megatron_gspo.data.types import PromptItem
from megatron_gspo.rollout.types import Rollout
from megatron_gspo.training.producer import AheadStage, RolloutProducer, produce_batch, scored_groups
from megatron_gspo.training.rollout_buffer import RolloutGroup
from tests.distributed import run_distributed

DATA = [PromptItem(f"p{i}", "0") for i in range(400)]
G = 2


def _rollouts(n: int, version: int) -> list[Rollout]:
    return [Rollout([1], [2], [0.0], "stop", weight_version=version) for _ in range(n)]


def _rewards(items: list[PromptItem]) -> torch.Tensor:
    """Scripted: a prompt's group varies when crc32(prompt) is odd, else it is flat."""
    return torch.tensor([[float(zlib.crc32(it.prompt.encode()) % 2), 0.0] for it in items]).reshape(-1)


class Engine:
    """Records which batch started under which weight version; `gate` holds a call until released."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.version = 0
        self.started: list[tuple[int, int]] = []
        self.gate: threading.Event | None = None
        self.in_call = threading.Event()
        self.rank, self.world = rank, world

    def produce(self, index: int, items: list[PromptItem]):
        self.started.append((index, self.version))
        self.in_call.set()
        gate = self.gate_of(index)
        if gate is not None:
            assert gate.wait(10), f"batch {index} was never released"
        per = len(items) // self.world
        mine = items[self.rank * per : (self.rank + 1) * per]
        groups = scored_groups(mine, _rollouts(len(mine) * G, self.version), _rewards(mine))
        return groups, {"reward_errors": 0.0, "window": (len(mine) * G, 0, None)}

    def gate_of(self, index: int) -> threading.Event | None:
        return self.gate


def _producer(engine: Engine, lookahead: int, **kw) -> RolloutProducer:
    return RolloutProducer(engine.produce, PromptSampler(DATA, 4, seed=3), first=0, version=0,
                           lookahead=lookahead, **kw)


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _sync(producer: RolloutProducer, engine: Engine, version: int) -> None:
    with producer.engine_turn(version):
        engine.version = version


@pytest.mark.parametrize("lookahead, calls", [(0, 1), (1, 1), (2, 1), (2, 2)])
def test_the_producer_runs_ahead_by_lookahead_versions_and_no_further(lookahead, calls):
    engine = Engine()
    producer = _producer(engine, lookahead, calls=calls, immediate_sync=calls > 1)
    try:
        for step in range(4):
            producer.batch(step)
            _wait_for(lambda: len(engine.started) >= min(step + lookahead + 1, 6))
            time.sleep(0.05)  # would it start one more? (it must not)
            assert len(engine.started) == step + lookahead + 1
            _sync(producer, engine, step + 1)
        # batch p started under a version >= p - lookahead, so the step that takes it lags at most lookahead
        assert all(version >= index - lookahead for index, version in engine.started)
        if lookahead == 0:
            assert engine.started[:4] == [(0, 0), (1, 1), (2, 2), (3, 3)]  # sync's rollouts
    finally:
        producer.close()


def test_on_demand_producer_generates_only_while_the_trainer_waits():
    engine = Engine()
    producer = _producer(engine, 0, ahead=False)
    try:
        producer.batch(0)
        _sync(producer, engine, 1)
        time.sleep(0.05)
        assert engine.started == [(0, 0)]
        producer.batch(1)
        assert engine.started == [(0, 0), (1, 1)]
    finally:
        producer.close()


def test_a_weight_sync_waits_for_the_producers_call_and_holds_the_next():
    engine = Engine()
    engine.gate = threading.Event()
    producer = _producer(engine, 1)
    try:
        engine.in_call.wait(5)
        synced = threading.Event()
        syncer = threading.Thread(target=lambda: (_sync(producer, engine, 1), synced.set()))
        syncer.start()
        time.sleep(0.1)
        assert not synced.is_set()  # the call under version 0 is still running
        engine.gate.set()
        syncer.join(5)
        assert synced.is_set()
        producer.batch(0)
        producer.batch(1)
        assert engine.started[:2] == [(0, 0), (1, 1)]  # batch 1 was held until the sync was done
        times = producer.take_times()
        assert times["time_sync_wait"] >= 0.09 and times["time_producer_busy"] >= 0.09
    finally:
        producer.close()


def test_a_call_spanning_two_steps_is_split_between_them():
    """take_times credits each step with the producer's time inside it: a generate call still running at a step's
    end counts there for its share so far (the CI failure of 15015a8: credited only at its end, a one-step-off call
    could land wholly in the next step and leave a step with time_producer_busy == 0)."""
    engine = Engine()
    engine.gate = threading.Event()
    producer = _producer(engine, 1)
    try:
        engine.in_call.wait(5)
        time.sleep(0.3)
        first = producer.take_times()
        assert first["time_producer_busy"] >= 0.29
        time.sleep(0.1)
        engine.gate.set()
        producer.batch(0)
        second = producer.take_times()
        assert 0.09 <= second["time_producer_busy"] < 0.25  # the rest of the call, not the whole call again
    finally:
        producer.close()


def test_calls_peak_counts_the_generate_calls_in_flight_at_once():
    """producer_calls_peak: 2 while both calls of a two-call producer are held in flight, and 2 again in the next
    interval (calls still running count there too, not only where they started)."""
    engine = Engine()
    engine.gate = threading.Event()
    producer = _producer(engine, 2, immediate_sync=True, calls=2)
    try:
        _wait_for(lambda: len(engine.started) == 2)
        assert producer.take_times()["producer_calls_peak"] == 2.0
        assert producer.take_times()["producer_calls_peak"] == 2.0  # both still in flight
        engine.gate.set()
        producer.batch(0)
    finally:
        producer.close()


def test_an_engine_with_partial_rollouts_syncs_without_waiting():
    engine = Engine()
    engine.gate = threading.Event()
    producer = _producer(engine, 1, immediate_sync=True)
    try:
        engine.in_call.wait(5)
        _sync(producer, engine, 1)  # returns while the call is held
        assert not engine.gate.is_set()
        engine.gate.set()
        producer.batch(0)
    finally:
        producer.close()


class GatedEngine(Engine):
    """Each batch's call is held by its own gate: which calls overlap, and in which order they end, is the
    test's."""

    def __init__(self):
        super().__init__()
        self.gates = {i: threading.Event() for i in range(8)}
        self.items: dict[int, list[str]] = {}

    def produce(self, index: int, items: list[PromptItem]):
        self.items[index] = [it.prompt for it in items]
        return super().produce(index, items)

    def gate_of(self, index: int) -> threading.Event:
        return self.gates[index]


def test_with_partial_rollouts_calls_overlap_and_batches_arrive_in_order_with_their_own_prompts():
    engine = GatedEngine()
    producer = _producer(engine, 2, immediate_sync=True, calls=2)
    try:
        _wait_for(lambda: len(engine.started) == 2)
        time.sleep(0.05)
        assert sorted(engine.started) == [(0, 0), (1, 0)]  # two calls in flight, no third thread
        engine.gates[1].set()  # batch 1 ends first
        _wait_for(lambda: 1 in producer._ready)
        taken = threading.Thread(target=producer.batch, args=(0,))
        taken.start()
        time.sleep(0.05)
        assert taken.is_alive(), "batch 0 was handed over before its call ended"
        engine.gates[0].set()
        taken.join(5)
        _sync(producer, engine, 1)  # immediate: the next calls start under version 1
        groups, _ = producer.batch(1)
        oracle = PromptSampler(DATA, 4, seed=3)
        expected = [[it.prompt for it in next(oracle)] for _ in range(4)]
        assert [g.item.prompt for g in groups] == expected[1] == engine.items[1]
        assert engine.items[0] == expected[0]
        _wait_for(lambda: len(engine.started) == 4)
        time.sleep(0.05)
        assert sorted(i for i, _ in engine.started) == [0, 1, 2, 3]  # batch 4 waits for a taken batch
        assert all(version >= index - 2 for index, version in engine.started)  # the staleness bound holds
        assert engine.items[2] == expected[2] and engine.items[3] == expected[3]
    finally:
        for gate in engine.gates.values():
            gate.set()
        producer.close()


def test_several_calls_in_flight_need_an_engine_that_syncs_mid_call():
    with pytest.raises(ValueError, match=r"calls=2.*immediate_sync=True"):
        _producer(Engine(), 2, calls=2)


def test_a_producer_error_reaches_the_training_stage():
    def failing(index, items):
        raise ConnectionError(f"server gone at batch {index}")

    producer = RolloutProducer(failing, PromptSampler(DATA, 4, seed=3), first=0, version=0, lookahead=1)
    with pytest.raises(ConnectionError, match="server gone at batch 0"):
        producer.batch(0)
    producer.close()


def _stage(engine: Engine, sampler_state: dict | None, taken: int, lookahead: int, needs_of) -> AheadStage:
    sampler = PromptSampler(DATA, 4, seed=3)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    mine = PromptSampler(DATA, 4, seed=3)
    mine.load_state_dict(sampler.state_dict())
    producer = RolloutProducer(engine.produce, mine, first=taken, version=engine.version, lookahead=lookahead)
    return AheadStage(producer, sampler, taken=taken, want=4 // engine.world, max_staleness=lookahead,
                      dynamic_sampling=True, max_topup_rounds=2, needs_of=needs_of)


def ahead_bookkeeping_rank(steps: int, stop_at: int) -> dict:
    """One rank of a DP=2 run of the training stage with dynamic sampling, stopped after `stop_at` steps (state
    saved, producer discarded) and resumed from that state for the rest."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def needs_of(need: int) -> list[int]:
        every = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(every, torch.tensor([need]))
        return [int(t) for t in every]

    engine = Engine(rank, world)
    stage = _stage(engine, None, 0, 1, needs_of)
    trained, counts, dropped, state = [], [], 0, None
    for step in range(steps):
        if step == stop_at:  # a stop: checkpoint (sampler + batches taken), then a new process resumes
            state = (stage.sampler.state_dict(), stage.taken)
            stage.close()
            stage = _stage(engine, state[0], state[1], 1, needs_of)
        taken, stats = stage.take(engine.version)
        trained += [g.item.prompt for g in taken.groups]
        counts.append(len(taken.groups))
        dropped += taken.dropped
        assert max(taken.staleness) <= 1 and taken.stale == 0
        _sync(stage.producer, engine, step + 1)
    stage.close()
    dist.destroy_process_group()
    return {"trained": trained, "counts": counts, "dropped": dropped, "sampler": stage.sampler.state_dict(),
            "taken": stage.taken, "resumed_at": state[1]}


def test_data_parallel_ranks_take_equal_batches_of_one_global_order_across_a_resume():
    ranks = run_distributed(ahead_bookkeeping_rank, 5, 2, world_size=2)
    assert ranks[0]["counts"] == ranks[1]["counts"] == [2] * 5
    assert ranks[0]["sampler"] == ranks[1]["sampler"] and ranks[0]["taken"] == ranks[1]["taken"]
    taken = ranks[0]["taken"]
    assert taken > 5, "no top-up batch: the dynamic-sampling path is untested"
    # The oracle: the sampler's first `taken` batches, each prompt trained at most once, by the rank of its shard.
    oracle = PromptSampler(DATA, 4, seed=3)
    batches = [next(oracle) for _ in range(taken)]
    for rank in (0, 1):
        shard = [it.prompt for b in batches for it in b[rank * 2 : rank * 2 + 2]]
        trained = ranks[rank]["trained"]
        assert Counter(trained) == Counter(set(trained)), "a prompt trained twice"
        assert set(trained) <= set(shard)
        # every prompt of the shard was trained or dropped (counted), none silently skipped
        assert len(shard) == len(trained) + ranks[rank]["dropped"]
    assert ranks[0]["sampler"] == {**oracle.state_dict()}


class FlatFirstEngine(Engine):
    """Batch 0 has no reward variance (every group flat: a dynamic-sampling top-up follows); the others vary."""

    def produce(self, index: int, items: list[PromptItem]):
        groups, stats = super().produce(index, items)
        if index == 0:
            groups = [RolloutGroup(g.item, g.rollouts, torch.zeros_like(g.rewards_G), g.weight_version) for g in groups]
        else:
            groups = [RolloutGroup(g.item, g.rollouts, torch.tensor([1.0, 0.0]), g.weight_version) for g in groups]
        return groups, stats


def test_a_top_up_does_not_eat_the_lookahead_one_step_off_stays_one_step_off():
    engine = FlatFirstEngine()
    stage = _stage(engine, None, 0, 1, lambda need: [need])
    staleness = []
    try:
        for step in range(5):
            taken, stats = stage.take(engine.version)
            staleness.append(max(taken.staleness))
            # one_step_off: the next batch starts under this step's weights, before the sync (give it the chance)
            deadline = time.monotonic() + 2.0
            while len(engine.started) <= stage.taken and time.monotonic() < deadline:
                time.sleep(0.01)
            _sync(stage.producer, engine, step + 1)
        assert stage.taken == 6, "batch 0 was not topped up: the test checks nothing"
        assert staleness == [0, 1, 1, 1, 1]
    finally:
        stage.close()


def test_closing_while_a_generate_call_is_in_flight_returns_at_once_and_an_evaluation_need_not_wait():
    engine = Engine()
    engine.gate = threading.Event()  # a slow generate call (a server engine's), held until released
    producer = _producer(engine, 1)
    try:
        engine.in_call.wait(5)
        producer.close()
        with producer.engine_turn():  # the final evaluation
            pass
        assert producer._threads[0].is_alive(), "close / engine_turn waited for the discarded call to end"
    finally:
        engine.gate.set()
    producer._threads[0].join(5)
    assert not producer._threads[0].is_alive() and engine.started == [(0, 0)]  # the call's end starts nothing more


def test_a_call_that_waited_for_the_scoring_lock_while_the_producer_closed_does_not_score():
    """The trainer stands in for GSPOTrainer (generate / score are a server engine's and a scorer's; here only
    the order of close and the scoring lock matters)."""
    waiting, scored = threading.Event(), []

    class Scoring:
        """The producer's scoring lock, held by another thread's scoring; says when the call waits for it."""

        def __init__(self):
            self.lock = threading.Lock()

        def __enter__(self):
            waiting.set()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    trainer = types.SimpleNamespace(
        rt=types.SimpleNamespace(shard=lambda items: items),
        cfg=types.SimpleNamespace(trainer=types.SimpleNamespace(seed=1)),
        generate=lambda items, seed: _rollouts(len(items) * G, 0),
        score=lambda items, rollouts, scorer: scored.append(items) or _rewards(items),
    )
    scoring, stopped, out = Scoring(), threading.Event(), []
    scoring.lock.acquire()  # another call is scoring
    call = threading.Thread(
        target=lambda: out.append(produce_batch(trainer, None, scoring, stopped, 0, DATA[:4]))
    )
    call.start()
    assert waiting.wait(5)
    stopped.set()  # close() while the call waits for the lock
    scoring.lock.release()
    call.join(5)
    assert scored == [] and out == [([], {"reward_errors": 0.0, "window": (0, 0, None)})]


def test_the_first_error_of_several_calls_reaches_the_training_stage():
    first_failed = threading.Event()

    def failing(index, items):
        if index == 0:
            first_failed.set()
            raise ConnectionError("server gone at batch 0")
        assert first_failed.wait(5)
        time.sleep(0.05)  # batch 0's error is recorded by now
        raise RuntimeError(f"batch {index} failed after the first")

    producer = RolloutProducer(failing, PromptSampler(DATA, 4, seed=3), first=0, version=0, lookahead=2,
                               immediate_sync=True, calls=2)
    _wait_for(lambda: not producer._alive())
    with pytest.raises(ConnectionError, match="server gone at batch 0"):
        producer.batch(0)
    producer.close()


def test_close_waits_close_timeout_s_for_all_threads_together():
    engine = Engine()
    producer = _producer(engine, 2, immediate_sync=True, calls=3, close_timeout_s=0.2)
    _wait_for(lambda: len(engine.started) == 3 and producer._generating == 0)  # idle: close joins the threads
    waits: list[float] = []

    class Stuck:
        """A producer thread that does not end within the time it is given."""

        def join(self, timeout=None):
            waits.append(timeout)
            time.sleep(timeout)

    real, producer._threads = producer._threads, [Stuck(), Stuck(), Stuck()]
    producer.close()
    for thread in real:
        thread.join(5)
    assert waits[0] == pytest.approx(0.2, abs=0.05) and sum(waits) <= 0.25, waits
