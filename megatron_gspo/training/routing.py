"""Routing replay (R2 / R3) and expert-drift measurement inside the RL step (moe/ does the mechanics).

- off: routers route freely; drift is still measured (it is the paper's §5.3 statistic for every algorithm).
- r2: the old-policy pass records routes (RECORD); every training forward of the rollout batch replays them.
- r3: the rollout engine's routes are replayed in the old-policy pass and in training.
Drift: routes of the drift sample under pi_old (before the step) vs after exactly one optimizer step, over
response tokens: 1 - mean |S_old ∩ S_new| / k, plus the fraction of tokens whose set changed in any layer
(`expert_drift*`); the same after all K optimizer steps of the rollout batch (`expert_drift_rollout*`).
The drift sample is a minibatch's sequences (or its first `moe.drift_sample_sequences`), routed under pi_old in
the old-policy pass (which records them). Which minibatch (`RoutingControl.drift_minibatch`): with K >= 2 the
second one, for every routing mode: it is the first not trained on by the step being measured (minibatch 0's), so
the statistic is the same whether or not replay is on. With free routing its own training forward runs after
exactly one optimizer step and routes freely: recording that forward gives the "after" routes at no extra forward.
R2 / R3 training forwards replay routes, so there one forward-only pass of that minibatch right after the first
optimizer step routes it again. K = 1 has only minibatch 0 (trained on by the step: measured by that extra
forward too). Results at the commits before 9009678 measured minibatch 0 for every mode (also one statistic
across modes: results/stability_moe).
Drift and routing mismatch are statistics of all data-parallel replicas' tokens together (not rank 0's share).
"""

from __future__ import annotations

import contextlib

from megatron.core import parallel_state as ps

from megatron_gspo.batching.batch import RolloutBatch
from megatron_gspo.moe import MoEConfig, RouteStore, TokenLayout, response_token_mask, store_route_change


class RoutingControl:
    """One per trainer. `before_forward(mb)` must run before every micro-batch forward (all phases)."""

    def __init__(self, moe: MoEConfig, chunks: list, num_experts: int, seq_len: int, old_logprobs: str):
        self.moe = moe
        self.seq_len = seq_len
        self.routes: RouteStore | None = None
        self.pre_routes: RouteStore | None = None
        self.mismatch: dict = {}
        """Routing mismatch rollout engine vs trainer of the last old-policy pass (off / r2 modes)."""
        if moe.routing_replay == "r2" and old_logprobs != "recompute":
            raise ValueError(
                "moe.routing_replay=r2 records routes in the old-policy pass: set rollout.old_logprobs=recompute"
            )
        self.rr = None
        if moe.needs_router_replay:
            from megatron_gspo.moe import RoutingReplay

            self.rr = RoutingReplay(chunks, num_experts, mode=moe.routing_replay if moe.replays else "r2")

    @property
    def active(self) -> bool:
        return self.rr is not None

    def before_forward(self, mb: RolloutBatch) -> None:
        """Declares where the micro-batch's sequences sit in the model input (padded rows or a packed row), so the
        routes of each token follow it through micro-batching, sequence-parallel splits and pipeline stages."""
        if self.rr is None:
            return
        if mb.inputs is not None:
            layout = mb.inputs.token_layout
        else:
            layout = TokenLayout.padded((mb.prompt_lens_N + mb.response_lens_N - 1).tolist(), self.seq_len)
        self.rr.set_microbatch(mb.seq_index_N.tolist(), layout)

    def drift_minibatch(self, minibatches: int) -> int:
        """The minibatch (0-based) whose sequences the drift is measured on (module doc): 1 when there are two."""
        return 1 if minibatches >= 2 else 0

    def drift_in_training_forward(self, minibatches: int) -> bool:
        """Whether the drift minibatch's own training forward gives the "after" routes (free routing, K >= 2);
        otherwise one forward-only pass right after the first optimizer step does."""
        return minibatches >= 2 and not self.moe.replays

    def records_old_policy(self, measure: bool) -> bool:
        """Whether the old-policy pass records routes: always for R2 (training replays them); with replay off only
        on steps that measure drift (`measure`), whose "before" routes they are (the routing mismatch rollout
        engine vs trainer comes from the same recording); never for R3 (the engine's routes are replayed)."""
        if self.rr is None or self.moe.routing_replay == "r3":
            return False
        return self.moe.routing_replay == "r2" or measure

    # ---- phases -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def old_policy_pass(self, rollouts, batch: RolloutBatch, *, measure: bool = True):
        """Around the old-policy log-prob pass: R2 / drift record, R3 replays the engine's routes.

        `measure`: whether this step reports expert drift. With replay off, a step that does not routes freely
        through the pass (no recording, no routing-mismatch statistics): the recording would serve nothing.
        """
        self.routes = self.pre_routes = None
        self.mismatch = {}
        if self.rr is None:
            yield
            return
        if self.moe.routing_replay == "off" and not measure:
            with self.rr.off():
                yield
            return
        if self.moe.routing_replay == "r3":
            self.routes = RouteStore.from_rollouts(rollouts, self._num_experts())
            # The engine routed the rollouts under pi_old: its routes are the "before" side of the drift.
            self.pre_routes = self.routes
            with self.rr.replay(self.routes):
                yield
            return
        with self.rr.record() as rec:
            yield
        self.pre_routes = rec.routes
        if self.moe.routing_replay == "r2":
            self.routes = rec.routes
        self.mismatch = self._routing_mismatch(rollouts, batch, rec.routes)

    def _routing_mismatch(self, rollouts, batch: RolloutBatch, trainer_routes: RouteStore) -> dict:
        """Rollout-engine routes vs the trainer's own routes for the same tokens and weights (response tokens)."""
        if not rollouts or any(r.routed_experts is None for r in rollouts):
            return {}
        engine_routes = RouteStore.from_rollouts(rollouts, self._num_experts())
        # Only the recorded sequences (all of them, or the drift sample when pi_old came from the engine).
        recorded = set(trainer_routes.seq_indices)
        rows = [
            (int(i), int(p), int(r))
            for i, p, r in zip(batch.seq_index_N.tolist(), batch.prompt_lens_N.tolist(), batch.response_lens_N.tolist())
            if int(i) in recorded
        ]
        if not rows:
            return {}
        idx = [i for i, _, _ in rows]
        masks = {i: response_token_mask(p, p + r - 1) for i, p, r in rows}
        return store_route_change(
            engine_routes, trainer_routes, masks=masks, seq_indices=idx, prefix="routing_mismatch", **self._groups()
        )

    def training_pass(self):
        """Around each minibatch's forward/backward: replay for r2 / r3, free routing otherwise."""
        if self.rr is None:
            return contextlib.nullcontext()
        if self.moe.replays and self.routes is not None:
            return self.rr.replay(self.routes)
        return self.rr.off()

    def record(self):
        """A recording context (drift measurement passes)."""
        return self.rr.record()

    def _groups(self) -> dict:
        """How route statistics combine over ranks: pipeline stages hold the other layers of the same tokens,
        data-parallel replicas the other tokens (TP ranks hold the full sequences after `record()`'s gather);
        the collectives' buffers live on the routers' device."""
        pp = ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1 else None
        dp = ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
        return {"group": pp, "reduce_group": dp, "device": self.rr.placement.device}

    def _num_experts(self) -> int:
        return int(self.rr.num_experts) if hasattr(self.rr, "num_experts") else 0

    def drift(self, post: RouteStore, sample: RolloutBatch, prefix: str = "expert_drift") -> dict:
        """Expert drift between pi_old routes (recorded before the step) and `post` on the sample's responses,
        as `{prefix}*` keys."""
        if self.pre_routes is None:
            return {}
        idx = sample.seq_index_N.tolist()
        masks = {
            int(i): response_token_mask(int(p), int(p + r - 1))
            for i, p, r in zip(idx, sample.prompt_lens_N.tolist(), sample.response_lens_N.tolist())
        }
        metrics = store_route_change(
            self.pre_routes, post, masks=masks, seq_indices=idx, prefix=prefix, **self._groups()
        )
        if self.routes is not None:
            metrics.update({k: float(v) for k, v in self.rr.metrics(self.routes).items()})
        return metrics

    def close(self) -> None:
        if self.rr is not None:
            self.rr.close()


def drift_sample(batch: RolloutBatch, minibatches: int, sample_sequences: int, index: int = 0) -> RolloutBatch:
    """The sequences the drift is measured on: minibatch `index` (`RoutingControl.drift_minibatch`), or its first
    `sample_sequences`."""
    return drift_rows(batch.split(minibatches)[index], sample_sequences)


def drift_rows(minibatch: RolloutBatch, sample_sequences: int) -> RolloutBatch:
    """The drift sample of a rollout batch from its drift minibatch: all of it, or its first `sample_sequences`."""
    if sample_sequences and sample_sequences < minibatch.num_sequences:
        return minibatch.rows(slice(0, sample_sequences))
    return minibatch

