"""What the trainer does to a rollout batch between its old-policy pass and the update (the `old_logprobs` phase's
second half), and to the rewards it scores: off-policy corrections, overlong answers and the step's metrics per
staleness bucket. The math is in algorithms/ (off_policy.py, overlong.py, staleness.py); this module applies it to
a `RolloutBatch` as the run's config says.

pi_old, named: `rollout.old_logprobs=engine` takes the rollout engine's log-probs as pi_old (paper §5.4; with
partial rollouts one answer's tokens may come from several weight versions, each token's log-prob from the
version that sampled it), nothing is corrected and the mismatch is measured by the update's first minibatch;
`recompute` takes the trainer's forward as pi_old (= pi_prox), and `rollout.correction` corrects for the engine's
sampling (pi_behav) before the update.
"""

from __future__ import annotations

import torch

from megatron_gspo.algorithms import (
    by_staleness,
    corrected_advantages,
    mask_truncated_advantages,
    overlong_penalty,
    overlong_stats,
    rollout_bucket_stats,
    rollout_correction,
)
from megatron_gspo.batching.batch import RolloutBatch


class BatchCorrections:
    """The run's corrections (`rollout.correction`, `loss.mask_truncated`, `loss.overlong_*`)."""

    def __init__(self, cfg) -> None:
        """`cfg`: the RunConfig."""
        self.correction = cfg.rollout.correction.resolved()
        self.loss = cfg.loss
        # DAPO's L_max: the longest answer; a multi-turn trajectory's model tokens are capped by its token budget.
        self.max_length = cfg.multiturn.max_total_tokens if cfg.multiturn.enabled else cfg.rollout.max_new_tokens

    def penalize(self, rewards: torch.Tensor, rollouts: list) -> torch.Tensor:
        """Rewards with DAPO's overlong penalty added (`loss.overlong_buffer` > 0; the rewards as they are
        otherwise). L = the model's tokens (`loss_mask`'s ones), L_max = what the token budget leaves them: a
        multi-turn trajectory's environment / tool tokens are not the model's answer, but they use up the budget
        that cuts it (`multiturn.max_total_tokens`), so a trajectory about to be cut is penalised."""
        if not self.loss.overlong_buffer:
            return rewards
        model = torch.tensor([r.num_model_tokens for r in rollouts], dtype=torch.long)
        total = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.long)
        return rewards + self._penalty(model, total).to(rewards.device, rewards.dtype)

    def _penalty(self, model_lens_N: torch.Tensor, response_lens_N: torch.Tensor) -> torch.Tensor:
        # DAPO with L = model tokens and L_max = max_length - environment tokens is DAPO with L = all response
        # tokens and L_max = max_length (both move by the environment's tokens). A sample with no model tokens (a
        # failed environment's) has no answer to penalise.
        pen = overlong_penalty(response_lens_N, self.max_length, self.loss.overlong_buffer,
                               self.loss.overlong_penalty_factor)
        return torch.where(model_lens_N.to(pen.device) == 0, torch.zeros_like(pen), pen)

    def apply(self, batch: RolloutBatch, step: int, *, recomputed: bool) -> dict:
        """Corrects `batch` in place for the update at weight version `step` and returns this replica's share of
        the metrics (floats; reduce_step_metrics combines the replicas' shares):
        - with `recomputed` pi_old: the correction of the engine / trainer gap (`corrected_advantages`), its
          metrics logged before any truncation, and the mismatch per staleness bucket;
        - `loss.mask_truncated`: zero advantage for responses cut at max_new_tokens;
        - samples, truncated_frac, overlong_penalty_mean / _penalized_frac, and reward and response length per
          staleness bucket (staleness = `step` - the row's weight version).
        """
        metrics: dict[str, torch.Tensor] = {}
        staleness_N = None
        if batch.weight_version_N is not None:
            staleness_N = step - batch.weight_version_N
        if recomputed:
            c = self.correction
            out = corrected_advantages(
                batch.advantages_N, batch.old_logprobs_NS, batch.engine_logprobs_NS, batch.loss_mask_NS, c
            )
            batch.advantages_N = out.advantages_B
            if "token_advantages_NS" in batch.extra:  # per-turn advantages: the same weights / mask band per row
                batch.extra["token_advantages_NS"] = corrected_advantages(
                    batch.extra["token_advantages_NS"], batch.old_logprobs_NS, batch.engine_logprobs_NS,
                    batch.loss_mask_NS, c).advantages_B
            if out.token_weights_BT is not None:
                batch.extra["token_weights_NS"] = out.token_weights_BT
            metrics.update(out.metrics)
            if staleness_N is not None:
                kwargs = {"level": c.level, "mode": c.mode, "threshold": c.threshold, "mask_below": c.mask_below,
                          "sequence_weight": c.sequence_weight}
                metrics.update(by_staleness(staleness_N, lambda rows: rollout_correction(
                    batch.old_logprobs_NS[rows], batch.engine_logprobs_NS[rows], batch.loss_mask_NS[rows], **kwargs
                )[1]))
        if batch.truncated_N is not None:
            if self.loss.mask_truncated:
                batch.advantages_N = mask_truncated_advantages(batch.advantages_N, batch.truncated_N)
                if "token_advantages_NS" in batch.extra:
                    batch.extra["token_advantages_NS"] = mask_truncated_advantages(
                        batch.extra["token_advantages_NS"], batch.truncated_N)
            metrics.update(overlong_stats(batch.truncated_N, self._penalty(batch.model_lens_N, batch.response_lens_N)))
        if staleness_N is not None:
            metrics.update(rollout_bucket_stats(staleness_N, batch.rewards_N, batch.model_lens_N))
        return {k: float(v) for k, v in metrics.items()}
