"""The GSPO RL loop (DESIGN.md "One RL step"), one named phase per method:

    generate -> score -> advantages -> old_logprobs -> update (K minibatches) -> sync_weights -> evaluate -> checkpoint
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from megatron.core import parallel_state as ps

from megatron_gspo.algorithms import combine_metrics, group_advantages, make_policy_loss
from megatron_gspo.batching.batch import RolloutBatch, minibatch_group_order, pack_rollouts
from megatron_gspo.batching.dp_balance import balance_data_parallel
from megatron_gspo.batching.micro_batches import MicroBatcher
from megatron_gspo.checkpoint.manager import CheckpointManager, CheckpointWriteError, new_run_id
from megatron_gspo.checkpoint.trainer_contents import (
    FORMAT,
    RUN_CONFIG,
    check_resumable,
    current_layout,
    layout_changes,
    load_trainer_contents,
    write_trainer_contents,
)
from megatron_gspo.data.dataset import PromptSampler
from megatron_gspo.data.types import PromptItem
from megatron_gspo.errors import RunFailure, StopRequested
from megatron_gspo.lifecycle.health import HealthMonitor
from megatron_gspo.lifecycle.run_dir import check_new_run_dir, check_resume_config, check_resume_dir, trim_log
from megatron_gspo.lifecycle.signals import StopSignals
from megatron_gspo.lifecycle.watchdog import PhaseWatchdog
from megatron_gspo.metrics.log import MetricsLogger, reduce_step_metrics
from megatron_gspo.models.modes import set_training
from megatron_gspo.moe import MoEConfig
from megatron_gspo.rewards.registry import RewardScorer
from megatron_gspo.rollout.multiturn import make_multiturn, trajectory_stats, turn_token_advantages
from megatron_gspo.training.config import RunConfig, dump_run_config
from megatron_gspo.training.corrections import BatchCorrections
from megatron_gspo.training.engine import (
    broadcast_from_last_stage,
    forward_backward,
    guarded_optimizer_step,
    is_last_stage,
    schedule_shape,
)
from megatron_gspo.training.evaluate import evaluate
from megatron_gspo.training.offload import ColocatedMemory
from megatron_gspo.training import producer
from megatron_gspo.training.rollout_buffer import RolloutBuffer, RolloutGroup, Taken
from megatron_gspo.training.routing import RoutingControl, drift_rows, drift_sample
from megatron_gspo.training.runtime import Runtime
from megatron_gspo.training.steps import logprob_forward_step, policy_forward_step, policy_units

log = logging.getLogger(__name__)


class GSPOTrainer:
    """Trains the policy with GSPO / GSPO-token / GRPO on rollouts from a RolloutEngine."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False):
        self.cfg = cfg
        t = cfg.trainer
        self.run_dir = Path(t.run_dir)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep_last=t.keep_last, run_id=new_run_id(),
                                      writer_timeout_s=t.async_save_timeout_s or None)
        # Before any expensive set-up: a run directory or a resume that is refused costs nothing.
        resume_point = self._resume_point(resume)
        total_optimizer_steps = t.steps * t.minibatches
        self.moe = MoEConfig.from_dict(cfg.moe)
        self.rt = Runtime(cfg, cfg.optim, total_optimizer_steps, routing_replay=self.moe.needs_router_replay,
                          resume=resume)
        self.routing = RoutingControl(
            self.moe, self.rt.chunks, self.rt.model_config.num_experts, self.rt.seq_len, cfg.rollout.old_logprobs
        )
        if t.prompts_per_step % self.rt.dp.size:
            raise ValueError(
                f"trainer.prompts_per_step={t.prompts_per_step} is not divisible by the data-parallel size "
                f"{self.rt.dp.size}"
            )
        n_local = t.prompts_per_step // self.rt.dp.size * cfg.rollout.group_size
        per_minibatch = n_local // t.minibatches
        if n_local % t.minibatches or (
            not t.max_tokens_per_micro_batch and per_minibatch % min(t.micro_batch_size, per_minibatch)
        ):
            raise ValueError(
                f"each rank's rollout batch ({n_local} sequences) must split into trainer.minibatches={t.minibatches} "
                f"minibatches of whole micro-batches (trainer.micro_batch_size={t.micro_batch_size})"
            )
        # Replicas re-deal each minibatch's sequences for balanced token counts (packed layouts: padded rows cost the
        # same whatever their lengths).
        self.balance_replicas = t.balance_data_parallel and t.batch_layout == "packed" and self.rt.dp.size > 1
        self.micro_batcher = MicroBatcher.for_model(
            self.rt.models[0].config,
            layout=t.batch_layout,
            micro_batch_size=t.micro_batch_size,
            max_tokens=t.max_tokens_per_micro_batch,
        )
        self.policy_loss = make_policy_loss(cfg.loss)
        self.corrections = BatchCorrections(cfg)
        self.scorer = RewardScorer(cfg.data.reward, scoring=cfg.scoring)
        self.multiturn = make_multiturn(cfg.multiturn, self.rt.engine, self.rt.tokenizer)  # None: single-turn
        self.sampler = PromptSampler(self.rt.train_data, t.prompts_per_step, seed=cfg.data.seed)
        self.step = 0
        # Synchronous RL: the rollout buffer with no look-ahead (training/rollout_buffer.py).
        self.buffer = RolloutBuffer()
        self.groups_per_rank = t.prompts_per_step // self.rt.dp.size
        self.ahead: producer.AheadStage | None = None  # one_step_off / async: the producer, started by train()
        self.rollout_batches = 0  # prompt batches taken (the producer's batch index; training/producer.py)
        self.history: list[dict] = []
        self.summary: dict = {}
        self.stop_signals = StopSignals()
        self.health = HealthMonitor(cfg.health, lr=cfg.optim.lr)
        self.watchdog = PhaseWatchdog(t.hang_warning_s, rank=self.rt.env.rank, timeout_s=cfg.parallel.timeout_s)
        if self.rt.is_logging_rank:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_run_config(cfg, self.run_dir / "config.yaml")
        if resume:
            self._resume(resume_point)
        # Colocated servers hold their memory from the start: the trainer's state waits in host memory until the
        # first generation is over.
        self.colocated = None
        if self._colocated:
            self.colocated = ColocatedMemory(self.rt.engine, self.rt.chunks, self.rt.optimizer,
                                             masters=bool(cfg.sglang.get("offload_masters", False)))
        self.offload = self.colocated.state if self.colocated is not None else None
        self.memory_metrics: dict = self.colocated.metrics if self.colocated is not None else {}
        self.logger = MetricsLogger(
            self.run_dir, enabled=self.rt.is_logging_rank, append=resume, purge_step=self.step + 1 if resume else None
        )

    # ---- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Loop state saved with each checkpoint (beside model, optimizer and RNG states)."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "summary": self.summary,
                "health": self.health.state_dict(), "rollout_batches": self.rollout_batches}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.summary = dict(state.get("summary", {}))
        self.health.load_state_dict(state.get("health", {}))  # absent in checkpoints of older versions
        self.rollout_batches = int(state.get("rollout_batches", self.step))

    # ---- resume (run directory checks, config compatibility, logs) -------------------------------------
    def _resume_point(self, resume: bool) -> tuple[Path, dict] | None:
        """The checkpoint a resumed run continues from (None: none yet), after checking that this config may
        continue it; a new run instead refuses a directory that already holds a run. Raises ValueError."""
        if not resume:
            check_new_run_dir(self.run_dir)
            return None
        check_resume_dir(self.run_dir)
        found = self.ckpt.find_latest()
        return None if found is None else self._checked(*found)

    def _checked(self, path: Path, state: dict) -> tuple[Path, dict]:
        """(path, state) once this run's config may continue checkpoint `path` (else ValueError)."""
        check_resumable(path, state, distributed_optimizer=self.cfg.optim.distributed, ep=self.cfg.parallel.ep)
        saved = path / RUN_CONFIG
        if saved.is_file():
            aux = self.cfg.model.model_config().router_aux_loss_coef
            for change in check_resume_config(saved.read_text(), self.cfg.to_dict(), path, state["step"],
                                              router_aux_loss_coef=aux, reshardable=True,
                                              defaults=RunConfig().to_dict()):
                log.info("resume: %s", change)
        else:
            log.warning("%s has no %s (written by an older version): the config is not compared", path, RUN_CONFIG)
        return path, state

    def _resume(self, point: tuple[Path, dict] | None) -> None:
        """Continues from `point`: weights, optimizer, RNG and loop state; the logs are cut back to its step."""
        point = self.ckpt.intact(point, self._checked)
        if point is None:
            log.info("no checkpoint under %s: starting from scratch", self.ckpt.root)
        else:
            path, state = point
            saved_layout = state.get("layout") or {"world_size": state.get("world_size")}
            changes = layout_changes(saved_layout, current_layout(self.rt))
            if changes:
                log.info("resume: layout changed (%s): model and optimizer state resharded from %s; RNG states "
                         "are this run's own", ", ".join(changes), path.name)
            self.ckpt.run_id = state.get("run_id")
            load_trainer_contents(path, self.rt, same_layout=not changes)
            self.load_state_dict(state)
            self.rt.sync_engine(self.step)
            log.info("resumed from %s at step %d", path, self.step)
        if self.rt.is_logging_rank:
            # Rows after the checkpoint belong to steps this run does again; a partial last line is dropped.
            last = self.step if point is not None else -1
            for name in ("metrics.jsonl", "eval.jsonl"):
                trim_log(self.run_dir / name, last)

    # ---- phases -----------------------------------------------------------------------------------------
    def generate(self, items: list[PromptItem], seed: int):
        """G rollouts per prompt from the rollout engine (this rank's prompts)."""
        prompts = [self.rt.encode_prompt(it.prompt) for it in items]
        sampling = self.rt.sampling(self.cfg.rollout.group_size, self.cfg.rollout.temperature, seed)
        if self.multiturn is not None:  # trajectories: model turn -> environment -> model turn ...
            return self.multiturn.generate(items, prompts, sampling)
        return self.rt.engine.generate(prompts, sampling)

    def score(self, items: list[PromptItem], rollouts, scorer: RewardScorer | None = None) -> torch.Tensor:
        """Rewards [n_prompts * G]; reward-function errors count as 0 and are logged; DAPO's overlong penalty added
        (loss.overlong_buffer)."""
        if self.multiturn is not None:  # the environments' rewards; a failed environment is a failed reward call
            values = self.multiturn.rewards(rollouts)
            (scorer or self.scorer).count_external(values, [f"environment {r.extra['env_error']}" for r in rollouts
                                                            if "env_error" in r.extra])
            return self.corrections.penalize(torch.tensor(values), rollouts)
        g = self.cfg.rollout.group_size
        responses = [self.rt.tokenizer.decode(r.response_ids) for r in rollouts]
        answers = [items[i // g].answer for i in range(len(rollouts))]
        metas = [{**items[i // g].meta, "finish_reason": r.finish_reason} for i, r in enumerate(rollouts)]
        return self.corrections.penalize((scorer or self.scorer).score(responses, answers, metas), rollouts)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-relative advantages (Eq.6)."""
        return group_advantages(rewards, self.cfg.rollout.group_size)

    def collect(self, step_seed: int) -> tuple[RolloutBatch, dict]:
        """One rollout batch through the rollout buffer: the rollout stage produces scored groups into it (`produce`;
        synchronous: right before they are needed, no look-ahead; one_step_off / async: the producer's batches, made
        ahead, training/producer.py), the training stage takes a batch out (`assemble`)."""
        if self.ahead is not None:
            taken, stats = self.ahead.take(self.step)
            self.scorer.add_window(*stats.pop("window"))  # the step boundary's reward-failure check sees them
            self.rollout_batches = self.ahead.taken
        else:
            produced, stats = self.produce(step_seed)
            self.buffer.put(produced)
            taken = self.buffer.take(self.groups_per_rank, version=self.step)
            self.rollout_batches += 1
        return self.assemble(taken, stats)

    def produce(self, step_seed: int) -> tuple[list[RolloutGroup], dict]:
        """The synchronous rollout stage: generate -> score, with dynamic sampling (`producer.produce_groups`)."""
        return producer.produce_groups(self, step_seed)

    def assemble(self, taken: Taken, produced_stats: dict) -> tuple[RolloutBatch, dict]:
        """The training stage's rollout batch from the buffer's groups: minibatch order, advantages (Eq. 6),
        training layout on the model's device, data-parallel balance; with the step's rollout statistics."""
        # Every data-parallel rank holds exactly as many groups, so micro-batch counts match across ranks; the
        # zero-variance groups that fill the gap (all of them without dynamic sampling) contribute no gradient.
        groups = taken.groups
        num_informative = len(groups) - taken.zero_variance_kept
        # Minibatches of whole groups in a seeded order (the same on every rank), the informative groups dealt
        # evenly: no minibatch is left with only zero-advantage groups while informative ones remain.
        order = minibatch_group_order(num_informative, len(groups), self.cfg.trainer.minibatches,
                                      seed=(self.cfg.trainer.seed & (2**63 - 1), self.step))
        groups = [groups[i] for i in order]
        rollouts = [ro for x in groups for ro in x.rollouts]
        rewards = torch.cat([x.rewards_G for x in groups])
        adv = self.advantages(rewards)
        # The one host -> device move of the rollout batch: every forward, loss and collective below uses it.
        token_adv = None
        if self.multiturn is not None and self.cfg.multiturn.advantage == "turn_return":  # A_i,t of GSPO-token
            token_adv = turn_token_advantages(rollouts, rewards, self.cfg.rollout.group_size)
        batch = pack_rollouts(rollouts, self.rt.seq_len, self.rt.tokenizer.pad_id, rewards, adv,
                              token_advantages=token_adv).to(self.rt.device)
        lens = batch.model_lens_N.float()  # the model's tokens: a trajectory's environment tokens are not its answer
        stats = {
            "reward_mean": rewards.mean().item(),
            "accuracy": (rewards > 0.5).float().mean().item(),
            "response_length": lens.mean().item(),
            "finish_stop_frac": sum(ro.finish_reason == "stop" for ro in rollouts) / len(rollouts),
            # Zero-variance groups left out, zero-variance groups trained on (zero advantage), reward errors.
            "groups_dropped": float(taken.dropped),
            "groups_zero_variance_kept": float(taken.zero_variance_kept),
            # Weight versions the batch lags the weights it trains; groups dropped as older than max_staleness.
            "staleness_mean": sum(taken.staleness) / len(taken.staleness),
            "staleness_max": float(max(taken.staleness)),
            "groups_stale": float(taken.stale),
            **produced_stats,  # reward errors, top-up rounds; async: the producer's and the trainer's waits
        }
        if self.multiturn is not None:  # turns, tool calls, environment failures, limits hit
            stats.update(trajectory_stats(rollouts))
        if self.balance_replicas:
            batch = balance_data_parallel(batch, self.cfg.trainer.minibatches, ps.get_data_parallel_group())
        return batch, stats

    def old_logprobs(self, batch: RolloutBatch) -> dict:
        """pi_old per-token log-probs: recomputed with the training model, or the engine's (paper §5.4); then the
        corrections (training/corrections.py). Returns this replica's share of their metrics."""
        measure = self.moe.measure_drift(self.step + 1)  # the same test as in `update`
        engine = self.cfg.rollout.old_logprobs == "engine"
        if engine:
            batch.old_logprobs_NS = batch.engine_logprobs_NS.clone()
            if self.routing.active:
                with self.routing.old_policy_pass(batch.rollouts, batch, measure=measure):
                    # A forward only to record pi_old's routes of the drift sample: skipped on steps that do not
                    # report drift, and under R3 (the engine's routes are the "before" side).
                    if self.routing.records_old_policy(measure):
                        k = self.cfg.trainer.minibatches
                        sample = drift_sample(batch, k, self.moe.drift_sample_sequences,
                                              index=self.routing.drift_minibatch(k))
                        self.compute_logprobs(sample)
        else:
            with self.routing.old_policy_pass(batch.rollouts, batch, measure=measure):
                batch.old_logprobs_NS = self.compute_logprobs(batch)
        return self.corrections.apply(batch, self.step, recomputed=not engine)

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """Per-token log-probs [N, S] of the batch under the current weights (forward only)."""
        groups = self.micro_batcher.plan(batch)
        micro = self.micro_batcher.build(batch, groups)
        t = self.cfg.trainer
        fwd = logprob_forward_step(
            self.rt.model_config.vocab_size,
            self.cfg.rollout.temperature,
            self.routing.before_forward,
            logprob_path=t.logprob_path,
        )
        seq_length, mbs = schedule_shape(micro)
        for m in self.rt.chunks:
            set_training(m, False)
        try:
            outs = forward_backward(
                self.rt.chunks, micro, fwd, seq_length=seq_length, micro_batch_size=mbs, forward_only=True
            )
        finally:
            for m in self.rt.chunks:
                set_training(m, True)
        # Non-last stages receive the result into a buffer on the device (the broadcast is an NCCL collective).
        result = torch.zeros(batch.num_sequences, self.rt.seq_len, dtype=torch.float32, device=self.rt.device)
        if is_last_stage():
            rows = torch.tensor([i for g in groups for i in g], dtype=torch.long, device=self.rt.device)
            result[rows] = torch.cat([o["token_logprobs"] for o in outs], dim=0)
        return broadcast_from_last_stage(result.contiguous())

    def update(self, batch: RolloutBatch) -> list[dict]:
        """K optimizer steps, one per minibatch (paper §5.1), each a Megatron forward/backward over micro-batches."""
        t = self.cfg.trainer
        metrics = []
        vocab, temp = self.rt.model_config.vocab_size, self.cfg.rollout.temperature
        loss_fn = self.policy_loss
        drift: dict = {}
        engine_mismatch: dict = {}
        fwd = policy_forward_step(loss_fn, vocab, temp, self.routing.before_forward, logprob_path=t.logprob_path,
                                  consumer_version=self.step)
        sample = None
        # The minibatch the drift is measured on (routing.py): with free routing its own training forward records
        # the "after" routes (after exactly one optimizer step); else one extra forward after the first step.
        measure = self.routing.active and self.moe.measure_drift(self.step + 1)
        drift_k = self.routing.drift_minibatch(t.minibatches) if measure else -1
        own = measure and self.routing.drift_in_training_forward(t.minibatches)
        for k, (minibatch, micro) in enumerate(self.micro_batcher.minibatches(batch, t.minibatches)):
            seq_length, mbs = schedule_shape(micro)
            # megatron's RouterReplay RECORD routes as free routing does (the same top-k), and keeps the ids.
            records = own and k == drift_k
            with self.routing.record() if records else self.routing.training_pass() as recording:
                parts = forward_backward(self.rt.chunks, micro, fwd, seq_length=seq_length, micro_batch_size=mbs,
                                         units_of=policy_units(loss_fn))
            if records:
                sample = drift_rows(minibatch, self.moe.drift_sample_sequences)
                drift = self.routing.drift(recording.routes, sample)
            loss_metrics = combine_metrics(parts) if parts else {}
            if k == 0 and self.cfg.rollout.old_logprobs == "engine":
                # Before the first optimizer step pi_theta is the training engine's pi_old, so the first
                # minibatch's ratios against the engine's log-probs are the train / inference mismatch.
                engine_mismatch = dict(loss_metrics)
            ok, grad_norm = self._optimizer_step()
            if measure and not own and k == 0:
                sample = drift_sample(batch, t.minibatches, self.moe.drift_sample_sequences, index=drift_k)
                drift = self.measure_drift(sample)
            metrics.append(
                {
                    "loss_parts": loss_metrics,
                    "grad_norm": grad_norm,
                    "skipped": float(not ok),
                    "lr": self.rt.optimizer.param_groups[0]["lr"],
                }
            )
        if drift and t.minibatches > 1 and self.moe.drift_rollout:
            # pi_old vs the policy after all K steps (the next rollout batch's pi_old): the drift accumulated over
            # the rollout batch, beside the per-step drift above (stability benchmark).
            drift.update(self.measure_drift(sample, prefix="expert_drift_rollout"))
        metrics[0]["drift"] = {**drift, **self.routing.mismatch}
        metrics[0]["engine_mismatch_parts"] = engine_mismatch
        return metrics

    def measure_drift(self, sample: RolloutBatch, prefix: str = "expert_drift") -> dict:
        """Expert drift since pi_old (paper §5.3): routes of the drift sample (`drift_rows` of the drift
        minibatch) under pi_old vs the current weights, by one forward-only pass."""
        with self.routing.record() as rec:
            self.compute_logprobs(sample)
        return self.routing.drift(rec.routes, sample, prefix=prefix)

    def _optimizer_step(self) -> tuple[bool, float]:
        """Steps unless any rank holds a non-finite gradient (then the step is skipped, logged, and the run goes on)."""
        ok, grad_norm, skipped = guarded_optimizer_step(self.rt.chunks, self.rt.optimizer, self.rt.scheduler,
                                                        self.rt.device)
        if skipped:
            log.warning("step %d: %s: optimizer step skipped", self.step, skipped)
        return ok, grad_norm

    @property
    def _colocated(self) -> bool:
        return self.cfg.rollout.engine == "sglang" and bool(self.cfg.sglang.get("colocated", False))

    def sync_weights(self) -> None:
        """Makes the rollout engine sample from the updated policy (after the producer's current call)."""
        with self._engine_turn(version=self.step):
            self.rt.sync_engine(self.step)

    def _engine_turn(self, version: int | None = None):
        return self.ahead.producer.engine_turn(version) if self.ahead else contextlib.nullcontext()

    def evaluate(self) -> dict:
        """Held-out avg@n / pass@k with the current weights."""
        self.watchdog.mark("evaluate")
        seed = self.cfg.trainer.seed + 1_000_003 * (self.step + 1)
        with self._engine_turn():
            return evaluate(self.rt, seed=seed, scorer=self.scorer.sharing(), multiturn=self.multiturn)

    def checkpoint(self, *, background: bool = False) -> Path:
        """Writes checkpoint iter_<step> (atomic; checkpoint/manager.py) and returns its path. `background` (with
        trainer.async_save): returns once the tensors are staged; the checkpoint completes at a later `poll`."""
        self.watchdog.mark("checkpoint")
        asynchronous = background and self.cfg.trainer.async_save
        config_text = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
        state = {**self.state_dict(), "format": FORMAT, "layout": current_layout(self.rt)}
        offloaded = self.offload is not None and self.offload.offloaded
        if offloaded:  # the writer reads the optimizer state from the device (briefly back beside the servers)
            self.offload.reload()
        try:
            return self.ckpt.save(
                self.step,
                lambda tmp: write_trainer_contents(tmp, self.rt, self.step, config_text, asynchronous=asynchronous),
                state,
                asynchronous=asynchronous,
            )
        finally:
            if offloaded:
                self.offload.offload()

    # ---- step boundary: stop signals, failing rewards, health ------------------------------------------
    def _step_boundary(self, batch: RolloutBatch, updates: list[dict], metrics: dict) -> tuple[str | None, str | None]:
        """What every rank must agree on after a step, in one collective: whether any rank received a stop signal,
        the step's reward failures (all ranks and top-up rounds) and whether any rank's batch had learning signal.
        Adds `reward_error_frac` and `health_*` to `metrics`; returns (stop signal name, failure message)."""
        self.watchdog.mark("step_boundary")
        calls, errors, first_error = self.scorer.take_window()
        received = self.stop_signals.received
        local = [
            float(calls),
            float(errors),
            float(bool((batch.advantages_N != 0).any())),
            float(received == "SIGTERM"),
            float(received is not None and received != "SIGTERM"),
        ]
        flags = torch.tensor(local, dtype=torch.float64, device=self.rt.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags)
        calls, errors, ranks_with_signal, sigterm, other = flags.tolist()
        metrics["reward_error_frac"] = errors / calls if calls else 0.0
        grad_norms = [u["grad_norm"] for u in updates]
        metrics.update(self.health.observe(self.step, grad_norms, ranks_with_signal > 0, metrics.get("reward_mean", 0.0)))
        failure = self.health.failure
        if calls and errors / calls >= self.cfg.scoring.max_error_frac:
            first = next((m for m in self.rt.gather_objects(first_error) if m), "on another rank")
            failure = (
                f"step {self.step}: {errors:.0f} of {calls:.0f} reward calls failed (scoring.max_error_frac="
                f"{self.cfg.scoring.max_error_frac:g}); the first: {first}"
            )
        stop = "SIGTERM" if sigterm else ("SIGUSR1" if other else None)
        return stop, failure

    def _stop(self, signal_name: str, wall_seconds: float) -> None:
        """Honours a stop signal after the step every rank finished: checkpoint, then StopRequested."""
        self.summary["wall_seconds"] = wall_seconds
        path = self.checkpoint()
        self._stopped = True
        raise StopRequested(
            f"stopped by {signal_name} after step {self.step} of {self.cfg.trainer.steps}: checkpoint {path} "
            "written; continue with --resume",
            signal_name,
            self.step,
        )

    # ---- loop -------------------------------------------------------------------------------------------
    def train(self) -> dict:
        """Runs until trainer.steps; returns the summary written to summary.json."""
        t, start_time = self.cfg.trainer, time.time()
        self.stop_signals.install()
        if "eval_accuracy_before" not in self.summary:
            before = self.evaluate()
            self.summary["eval_accuracy_before"] = before["eval_accuracy"]
            self.logger.log_eval(self.step, before)
            log.info("held-out accuracy before RL: %.3f", before["eval_accuracy"])
        if self.cfg.rollout.mode != "sync" and self.ahead is None:
            self.ahead = producer.ahead_stage(self)
        bar = self.logger.progress(t.steps, initial=self.step, enabled=t.progress)
        wall_before = float(self.summary.get("wall_seconds", 0.0))
        while self.step < t.steps:
            times = {}
            t0 = time.time()
            self.watchdog.mark("generate")
            batch, rollout_stats = self.collect(step_seed=t.seed * 1_000_003 + self.step)
            times["time_generate"] = time.time() - t0
            if self.colocated is not None:  # the servers' GPU memory to the update (training/offload.py)
                self.colocated.release()
            t0 = time.time()
            self.watchdog.mark("old_logprobs")
            mismatch = self.old_logprobs(batch)
            times["time_old_logprobs"] = time.time() - t0
            t0 = time.time()
            self.watchdog.mark("update")
            updates = self.update(batch)
            times["time_update"] = time.time() - t0
            self.step += 1
            t0 = time.time()
            self.watchdog.mark("sync_weights")
            if self.colocated is not None:  # and back to the servers for the weight sync
                self.colocated.resume()
            self.sync_weights()
            times["time_sync"] = time.time() - t0
            self.watchdog.mark("metrics")
            step_metrics = reduce_step_metrics(self.rt, rollout_stats, updates, mismatch, times, batch)
            step_metrics.update(self.memory_metrics)
            stop, failure = self._step_boundary(batch, updates, step_metrics)
            self.logger.log_step(self.step, step_metrics)
            self.history.append(step_metrics)
            bar.update(step_metrics)
            if failure is not None:
                try:
                    self.ckpt.wait()  # a checkpoint in flight predates the failure: keep it
                except CheckpointWriteError as err:  # the step's failure is what ended the run
                    log.error("%s", err)
                    raise RunFailure(failure) from err
                raise RunFailure(failure)
            self.ckpt.poll()
            if stop is not None:
                bar.close()
                self._stop(stop, wall_before + time.time() - start_time)
            if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.step < t.steps:
                self.logger.log_eval(self.step, self.evaluate())
            if t.ckpt_every and self.step % t.ckpt_every == 0 and self.step < t.steps:
                self.summary["wall_seconds"] = wall_before + time.time() - start_time
                self.checkpoint(background=True)
        bar.close()
        if self.ahead is not None:  # nothing more to produce: the final evaluation need not wait for a batch
            self.ahead.close()
        after = self.evaluate()
        self.logger.log_eval(self.step, after)
        self.summary.update(
            eval_accuracy_after=after["eval_accuracy"],
            eval_pass_at_n_after=after.get(f"eval_pass@{self.cfg.eval.n}"),
            steps=self.step,
            wall_seconds=wall_before + time.time() - start_time,
            algorithm=self.cfg.loss.algorithm,
        )
        if t.save_final:
            self.checkpoint()
        self.ckpt.wait()
        self.watchdog.mark(None)
        self.logger.write_summary(self.summary)
        log.info(
            "held-out accuracy: before %.3f -> after %.3f (%d steps, %.0f s)",
            self.summary["eval_accuracy_before"], after["eval_accuracy"], self.step, self.summary["wall_seconds"],
        )
        return self.summary

    def close(self) -> None:
        stopped = getattr(self, "_stopped", False)
        if self.ahead is not None:  # before the engine closes: the producer's batches ahead are discarded
            self.ahead.close()
        self.ckpt.close()
        if not stopped:
            self.stop_signals.restore()
        self.watchdog.close()
        self.scorer.close()
        self.logger.close()
        self.routing.close()
        if stopped and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank leaves together: torchrun stops the others as soon as one exits (75), and a rank still
            # closing (the logging rank flushes its logs) would be killed before it reports the stop.
            dist.barrier()
        self.rt.close()
        if stopped:
            # Only now: until here torchrun's SIGTERM to a rank still closing (sent as soon as another rank exited
            # 75) is recorded, not fatal, so the rank lives to record its own exit code for the launch scripts.
            self.stop_signals.restore()

