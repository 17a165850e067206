"""The rollout stage: synchronous (`produce_groups`) and run ahead of training (`rollout.mode: one_step_off |
async`; DESIGN.md "The loop as stages").

A producer thread in the trainer process generates and scores whole prompt batches while the main thread trains;
the servers are separate processes, so generation really overlaps the update. Batch p is the p-th batch of the
global prompt order (the trainer's `PromptSampler`), this rank's shard of it, sampled with seed
`trainer.seed * 1_000_003 + p`: the very requests synchronous RL makes for step p. The training stage takes
batch after batch in that order through a `RolloutBuffer` bounded by `rollout.max_staleness`.

How far ahead (lookahead; one_step_off: 1, async: max_staleness): with T batches taken, the next one taken at
step s, and the engine at weight version v, the producer starts batch p once (p - T) + (s - v) <= lookahead, or at
once when the training stage asks for it (a dynamic-sampling top-up). Every step takes at least one batch, in
order, so batch p is taken at a step <= s + (p - T) and lags at most lookahead versions; counting batches taken
rather than batch indices keeps top-ups (extra batches within one step) from eating the lookahead.
`max_staleness: 0` async produces sync's rollouts, each sampled right after the weights it trains were synced.

Weight syncs and evaluation wait for the producer's current generate call (`engine_turn`): a server engine runs
one private event loop and is not re-entrant, so a sync between calls is the safe default. An engine that sets
`supports_partial_rollouts = True` (it continues in-flight generations under new weights) takes the sync at once
in async mode, and there the producer keeps up to `lookahead` generate calls in flight (one thread each, every
start still under the bound above): a single call's server batch drains to its longest answers, where each
engine step is paid for a few sequences; the next batch's requests fill it (ServerEngine.generate serves
concurrent callers). Batch p is still made from the p-th prompts with batch p's seed, and the training stage
takes batches strictly in index order whichever call ends first. The threads score under one lock, so each
batch's scorer window is its own. The in-process engine samples from the training model itself: it only runs on
demand (production never overlaps training), which is why config.py allows it with async and max_staleness 0 only.

No collectives in the producer thread: torch.distributed calls of two threads of one process would interleave
on the same groups. Each data-parallel rank produces its shard of the same global batches on its own; every
decision the ranks must share (dynamic-sampling top-ups) is taken by the training stage in the main thread.
So the trainer refuses async modes where generating is itself a collective (a model replica over several
ranks: tensor / pipeline parallel peers receive the rollouts by broadcast).

Dynamic sampling: the training stage takes its batch, then, while some rank holds fewer groups with reward
variance than a batch needs (main-thread all-gather), whole further batches (at most rollout.max_topup_rounds).
The batch gets informative groups first (RolloutBuffer.take); groups left over are dropped and counted, so the
prompts consumed are always a prefix of the global order.

Checkpoints and resume: the checkpointed sampler position and `rollout_batches` count the batches the training
stage has taken. Batches produced ahead, buffered or in flight are discarded at a stop (SIGTERM / SIGUSR1) or at
the run's end (the producer's current call is not waited for: its result is dropped unscored and the engine's
close cancels it) or lost with the process (kill -9); a resumed run produces them again from the same prompts
and seeds (under its newer weights), so no prompt is trained twice or skipped and no step is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_gspo.data.dataset import PromptSampler
from megatron_gspo.data.types import PromptItem
from megatron_gspo.rollout.types import Rollout
from megatron_gspo.training.rollout_buffer import RolloutBuffer, RolloutGroup, Taken, group_version

BatchResult = tuple[list[RolloutGroup], dict]
"""A produced batch: this rank's scored groups and its statistics: reward_errors and `window`, the producer's
scorer window (calls, failed calls, first failure; `RewardScorer.take_window`)."""


def scored_groups(items: list[PromptItem], rollouts: list[Rollout], rewards_B: torch.Tensor) -> list[RolloutGroup]:
    """Groups of G consecutive rollouts per prompt, each with the weight version that sampled it."""
    g = len(rollouts) // len(items) if items else 0
    return [
        RolloutGroup(item, rollouts[i * g : (i + 1) * g], rewards_B[i * g : (i + 1) * g],
                     group_version(rollouts[i * g : (i + 1) * g]))
        for i, item in enumerate(items)
    ]


def topup_items(sampler: PromptSampler, needs: list[int], rank: int) -> list[PromptItem]:
    """This rank's slice of the next sum(needs) prompts of the global sampler (every rank draws them all)."""
    drawn = sampler.next_items(sum(needs))
    start = sum(needs[:rank])
    return drawn[start : start + needs[rank]]


def merge_stats(a: dict, b: dict) -> dict:
    """Two batches' statistics: counts add up; the scorer windows (calls, errors, first error) too."""
    (calls, errors, first), (calls_b, errors_b, first_b) = a["window"], b["window"]
    return {"reward_errors": a["reward_errors"] + b["reward_errors"],
            "window": (calls + calls_b, errors + errors_b, first or first_b)}


def topup_needs(rt, need: int) -> list[int]:
    """How many groups each data-parallel rank lacks, in rank order, identical on every rank (a collective: main
    thread only)."""
    if rt.dp.size == 1:
        return [need]
    from megatron.core import parallel_state as ps

    mine = torch.tensor([need], dtype=torch.long, device=rt.device)
    every = torch.empty(rt.dp.size, dtype=torch.long, device=rt.device)
    dist.all_gather_into_tensor(every, mine, group=ps.get_data_parallel_group())
    return every.tolist()


def produce_groups(trainer, step_seed: int) -> tuple[list[RolloutGroup], dict]:
    """The synchronous rollout stage of a GSPOTrainer (its `produce`): generate -> score, with dynamic sampling
    (top up until this rank holds as many groups with reward variance as a batch needs, at most
    rollout.max_topup_rounds times). Groups carry the weight version the engine reports for them (synchronous:
    the current step, the engine was synced after the last update).

    Top-ups keep one global prompt order: each round every data-parallel rank says how many groups it lacks,
    and the ranks take consecutive slices, in rank order, of the next prompts of the (identical) global
    sampler, so no prompt is used twice or skipped and every rank's sampler stays the checkpointed one.
    """
    r, rt = trainer.cfg.rollout, trainer.rt
    extra = rt.shard(next(trainer.sampler))
    want = len(extra)
    groups: list[RolloutGroup] = []
    errors, rounds = 0.0, 0
    while True:
        if extra:
            rollouts = trainer.generate(extra, step_seed + 7919 * rounds)
            rewards = trainer.score(extra, rollouts)
            errors += float(trainer.scorer.last_metrics.get("reward_errors", 0.0))
            groups += scored_groups(extra, rollouts, rewards)
        if not r.dynamic_sampling or rounds == r.max_topup_rounds:
            break
        needs = topup_needs(rt, want - sum(x.informative for x in groups))
        if not any(needs):
            break
        rounds += 1
        extra = topup_items(trainer.sampler, needs, rt.dp.rank)
    # Counts over all scoring rounds of the step (summed over data-parallel ranks in the step metrics).
    return groups, {"reward_errors": errors, "topup_rounds": float(rounds)}


def produce_batch(trainer, scorer, scoring: threading.Lock, stopped: threading.Event, index: int,
                  items: list[PromptItem]) -> BatchResult:
    """Batch `index` of the global prompt order, in a producer thread: this rank's shard, generated with the
    seed synchronous RL uses at step `index` (GSPOTrainer.produce, round 0), scored under `scoring` (the
    producer's threads share one scorer: its last_metrics and window are per call). No collectives. Once the
    producer is `stopped` the batch would be dropped: it is not scored (the scorer may be closed by then)."""
    mine = trainer.rt.shard(items)
    rollouts = trainer.generate(mine, trainer.cfg.trainer.seed * 1_000_003 + index)
    with scoring:
        # Checked under the lock: a thread that waited for it (another was scoring) may find close() ran.
        if stopped.is_set():
            return [], {"reward_errors": 0.0, "window": (0, 0, None)}
        rewards = trainer.score(mine, rollouts, scorer)
        errors = float(scorer.last_metrics.get("reward_errors", 0.0))
        window = scorer.take_window()
    return scored_groups(mine, rollouts, rewards), {"reward_errors": errors, "window": window}


def ahead_stage(trainer) -> AheadStage:
    """Starts the producer of a GSPOTrainer (rollout.mode one_step_off / async) at the batches it has taken."""
    cfg, rt = trainer.cfg, trainer.rt
    r = cfg.rollout
    sampler = PromptSampler(rt.train_data, cfg.trainer.prompts_per_step, seed=cfg.data.seed)
    sampler.load_state_dict(trainer.sampler.state_dict())
    scorer = trainer.scorer.sharing()  # its own counters: the main thread takes the trainer scorer's window
    stopped = threading.Event()
    immediate_sync = r.mode == "async" and bool(getattr(rt.engine, "supports_partial_rollouts", False))
    producer = RolloutProducer(
        functools.partial(produce_batch, trainer, scorer, threading.Lock(), stopped),
        sampler,
        first=trainer.rollout_batches,
        version=trainer.step,
        lookahead=1 if r.mode == "one_step_off" else r.max_staleness,
        ahead=r.engine != "local",  # the in-process engine samples from the training model: on demand only
        immediate_sync=immediate_sync,
        # The multi-turn driver keeps per-call state (its last_metrics): one call at a time there.
        calls=max(1, r.max_staleness) if immediate_sync and trainer.multiturn is None else 1,
        barrier=dist.barrier if dist.is_initialized() and dist.get_world_size() > 1 else None,
        device=rt.device,
        stopped=stopped,
    )
    return AheadStage(
        producer, trainer.sampler, taken=trainer.rollout_batches, want=trainer.groups_per_rank,
        max_staleness=r.max_staleness, dynamic_sampling=r.dynamic_sampling, max_topup_rounds=r.max_topup_rounds,
        needs_of=functools.partial(topup_needs, rt),
    )


class RolloutProducer:
    """Threads producing prompt batches ahead of the training stage (module doc). `produce(index, items)` makes
    batch `index` from the global batch `items`; it runs in a producer thread and must use no collectives.
    `calls`: generate calls kept in flight (one thread each; above 1 only with `immediate_sync`, as syncs wait
    for every call otherwise). `device`: the trainer's (made current in the threads); `stopped` is set by
    `close`."""

    def __init__(self, produce: Callable[[int, list[PromptItem]], BatchResult], sampler: PromptSampler, *,
                 first: int, version: int, lookahead: int, ahead: bool = True, immediate_sync: bool = False,
                 calls: int = 1, barrier: Callable[[], None] | None = None,
                 device: torch.device | None = None, stopped: threading.Event | None = None,
                 close_timeout_s: float = 5.0):
        if calls < 1 or (calls > 1 and not immediate_sync):
            raise ValueError(f"RolloutProducer(calls={calls}) must be 1, or >= 1 with immediate_sync=True "
                             "(an engine that takes weight syncs mid-call)")
        self._produce = produce
        self._sampler = sampler
        self._next = first
        self._version = version
        self._taken = first  # batches the training stage has taken (T)
        self._taken_at: int | None = None  # the weight version of the step that took the last one
        self.device = device
        self.stopped = stopped if stopped is not None else threading.Event()
        self._demand = first - 1
        self.lookahead = lookahead
        self.ahead = ahead
        self.immediate_sync = immediate_sync
        self.barrier = barrier
        self.close_timeout_s = close_timeout_s
        self._ready: dict[int, BatchResult] = {}
        self._cond = threading.Condition()
        self._generating = 0  # calls in flight
        self._peak = 0  # the most calls in flight at once since the last take_times
        self._turns = 0
        self._error: BaseException | None = None
        self._times = {"time_producer_busy": 0.0, "time_producer_idle": 0.0, "time_wait_producer": 0.0,
                       "time_sync_wait": 0.0}
        # Per producer thread: what it is doing since when, so take_times splits a generate call (or an idle wait)
        # that spans a step between the steps instead of crediting all of it to the step in which it ends.
        self._since: dict[int, tuple[str, float]] = {}
        self._threads = [threading.Thread(target=self._run, name=f"rollout-producer-{i}", daemon=True)
                         for i in range(calls)]
        for thread in self._threads:
            thread.start()

    def _may_start(self) -> bool:
        if self._turns:  # a weight sync or evaluation is waiting for the engine
            return False
        if self._next <= self._demand:
            return True
        # The step that takes the next batch: the current one (= the engine's version) unless it took its batches.
        step = self._version + (self._taken_at == self._version)
        return self.ahead and (self._next - self._taken) + (step - self._version) <= self.lookahead

    def _run(self) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                # The current CUDA device is per thread and a new thread starts on device 0: without this, whatever
                # generate / score put on "cuda" in this thread would land on device 0, another rank's GPU.
                torch.cuda.set_device(self.device)
            me = threading.get_ident()
            while True:
                with self._cond:
                    self._since[me] = ("time_producer_idle", time.monotonic())
                    while not (self.stopped.is_set() or self._may_start()):
                        self._cond.wait()
                    self._account(me)
                    if self.stopped.is_set():
                        return
                    # Index and prompts together: batch p is the sampler's p-th batch, whichever thread.
                    index, items = self._next, next(self._sampler)
                    self._next += 1
                    self._generating += 1
                    self._peak = max(self._peak, self._generating)
                    self._since[me] = ("time_producer_busy", time.monotonic())
                try:
                    result = self._produce(index, items)
                finally:
                    with self._cond:
                        self._generating -= 1
                        self._account(me)
                        self._cond.notify_all()
                with self._cond:
                    self._ready[index] = result
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the training stage, which raises it
            with self._cond:
                if self._error is None:  # the first failure is the cause; later calls may fail from it
                    self._error = e
                self._cond.notify_all()

    def _account(self, thread: int) -> None:
        """Adds the thread's time since its last mark to what it was doing (under the lock)."""
        kind, t0 = self._since.pop(thread)
        self._times[kind] += time.monotonic() - t0

    def _alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def batch(self, index: int) -> BatchResult:
        """Batch `index` (main thread), waiting for the producer (started at once if it is not yet)."""
        with self._cond:
            self._demand = max(self._demand, index)
            self._cond.notify_all()
            t0 = time.monotonic()
            while index not in self._ready and self._error is None and self._alive():
                self._cond.wait(timeout=1.0)
            self._times["time_wait_producer"] += time.monotonic() - t0
            self._raise_error()
            if index not in self._ready:
                raise RuntimeError(f"the rollout producer stopped before batch {index}")
            self._taken, self._taken_at = max(self._taken, index + 1), self._version
            self._cond.notify_all()  # a batch taken may let the producer run ahead
            return self._ready.pop(index)

    @contextlib.contextmanager
    def engine_turn(self, version: int | None = None) -> Iterator[None]:
        """The engine to the main thread: waits for the producer's generate calls in flight and holds back the next
        ones meanwhile. With `version`, a weight sync to it (at once when the engine continues in-flight
        generations across it), after which the producer may run ahead of `version`. Once the producer is closed
        nothing is waited for: its call's result is dropped (a server engine serves several callers at once)."""
        if version is not None and self.immediate_sync:
            yield
            self.advance(version)
            return
        with self._cond:
            self._turns += 1
            t0 = time.monotonic()
            while self._generating and self._error is None and not self.stopped.is_set():
                self._cond.wait(timeout=1.0)
            self._times["time_sync_wait"] += time.monotonic() - t0
        synced = False
        try:
            if version is not None and self.barrier is not None:
                # Data-parallel ranks share the servers: the leader's push aborts every request on them, so every
                # rank's producer must be between calls first (a follower's retried sample would come back newer
                # than its engine's version). A collective of the main thread.
                t0 = time.monotonic()
                self.barrier()
                with self._cond:
                    self._times["time_sync_wait"] += time.monotonic() - t0
            yield
            synced = version is not None
        finally:
            with self._cond:
                self._turns -= 1
                if synced:
                    self._version = version
                self._cond.notify_all()

    def advance(self, version: int) -> None:
        """The engine now holds weight `version` (after a sync)."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def take_times(self) -> dict[str, float]:
        """Seconds since the last call: the producer generating / waiting (summed over its threads: with several
        calls in flight busy can exceed the wall time; a call or wait still running counts here for its share so
        far), the trainer waiting for a batch / for the producer's calls before a weight sync or evaluation; and
        `producer_calls_peak`, the most generate calls in flight at once meanwhile (2+: the producer overlapped
        its calls, whatever the seconds say on a loaded machine)."""
        with self._cond:
            now = time.monotonic()
            for thread, (kind, t0) in self._since.items():  # a call or wait in progress: its share so far
                self._times[kind] += now - t0
                self._since[thread] = (kind, now)
            times, self._times = self._times, dict.fromkeys(self._times, 0.0)
            peak, self._peak = self._peak, self._generating  # calls still in flight count for the next step too
        return {**times, "producer_calls_peak": float(peak)}

    def close(self) -> None:
        """Stops the producer; unused batches go. Idle producer threads end at once (waited for up to
        close_timeout_s); generate calls in flight are not waited for: each is left to its daemon thread, its
        batch is neither scored nor kept, and the engine's close cancels it (ServerEngine.close). The engines offer
        no abort of one call from another thread."""
        with self._cond:
            self.stopped.set()
            generating = self._generating
            self._cond.notify_all()
        if not generating:
            deadline = time.monotonic() + self.close_timeout_s  # one wait for all threads, not one each
            for thread in self._threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))


class AheadStage:
    """The training stage's side of `RolloutProducer`: takes whole batches in order, tops up (dynamic sampling)
    and keeps the checkpointed sampler at the batches taken (module doc)."""

    def __init__(self, producer: RolloutProducer, sampler: PromptSampler, *, taken: int, want: int,
                 max_staleness: int, dynamic_sampling: bool, max_topup_rounds: int,
                 needs_of: Callable[[int], list[int]]):
        self.producer = producer
        self.sampler = sampler
        self.taken = taken
        self.want = want
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.max_topup_rounds = max_topup_rounds
        self.needs_of = needs_of

    def _next_batch(self) -> BatchResult:
        groups, stats = self.producer.batch(self.taken)
        expected = {id(item) for item in next(self.sampler)}  # the checkpointed position follows the batches taken
        if not all(id(g.item) in expected for g in groups):
            raise RuntimeError(f"rollout batch {self.taken} does not hold the prompts of the global order")
        self.taken += 1
        return groups, stats

    def take(self, version: int) -> tuple[Taken, dict]:
        """One rollout batch for weights of `version` and its rollout statistics."""
        buffer = RolloutBuffer(self.max_staleness)
        groups, stats = self._next_batch()
        buffer.put(groups)
        produced, rounds = list(groups), 0
        while self.dynamic_sampling and rounds < self.max_topup_rounds:
            informative = sum(g.informative and version - g.weight_version <= self.max_staleness for g in produced)
            if not any(self.needs_of(max(0, self.want - informative))):
                break
            rounds += 1
            more, more_stats = self._next_batch()
            buffer.put(more)
            produced += more
            stats = merge_stats(stats, more_stats)
        taken = buffer.take(self.want, version)
        taken.dropped += len(buffer)  # informative groups left over: dropped, the prompts consumed stay a prefix
        return taken, {**stats, **self.producer.take_times(), "topup_rounds": float(rounds),
                       "rollout_batches": float(self.taken)}

    def close(self) -> None:
        self.producer.close()
