"""Pure-PyTorch RL math for GSPO (arXiv:2507.18071): group advantages (Eq.6), the sequence ratio (Eq.7), the
GSPO (Eq.5/10), GSPO-token (Eq.13-14/17) and GRPO (Eq.2/11) losses, clip metrics, rollout-mismatch
correction (TIS / MIS / icepop / the decoupled objective / the geometric mask band), DAPO's overlong penalty and
metrics per staleness bucket.

Never imports megatron: usable and tested on its own.
"""

from megatron_gspo.algorithms.advantages import group_advantages, turn_return_advantages
from megatron_gspo.algorithms.config import (
    ALGORITHMS,
    CORRECTION_PRESETS,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from megatron_gspo.algorithms.correction import CORRECTION_METRICS, rollout_correction
from megatron_gspo.algorithms.grpo import grpo_loss
from megatron_gspo.algorithms.gspo import gspo_loss, gspo_loss_from_sums, gspo_token_loss
from megatron_gspo.algorithms.metrics import METRIC_REDUCTIONS, combine_metrics
from megatron_gspo.algorithms.off_policy import CorrectedAdvantages, corrected_advantages, geometric_mask_band
from megatron_gspo.algorithms.output import PolicyLossOutput
from megatron_gspo.algorithms.overlong import mask_truncated_advantages, overlong_penalty, overlong_stats
from megatron_gspo.algorithms.policy import (
    POLICY_LOSSES,
    GRPOLoss,
    GSPOLoss,
    GSPOTokenLoss,
    PolicyLoss,
    make_policy_loss,
)
from megatron_gspo.algorithms.ratios import LOG_RATIO_CLAMP, sequence_ratio
from megatron_gspo.algorithms.staleness import by_staleness, has_stale_buckets, rollout_bucket_stats

__all__ = [
    "ALGORITHMS",
    "CORRECTION_METRICS",
    "CORRECTION_PRESETS",
    "CorrectedAdvantages",
    "by_staleness",
    "corrected_advantages",
    "geometric_mask_band",
    "has_stale_buckets",
    "mask_truncated_advantages",
    "overlong_penalty",
    "overlong_stats",
    "rollout_bucket_stats",
    "GRPOLoss",
    "GSPOLoss",
    "GSPOTokenLoss",
    "LOG_RATIO_CLAMP",
    "METRIC_REDUCTIONS",
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "RolloutCorrectionConfig",
    "combine_metrics",
    "group_advantages",
    "turn_return_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_loss_from_sums",
    "gspo_token_loss",
    "make_policy_loss",
    "rollout_correction",
    "sequence_ratio",
]
