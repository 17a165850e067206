"""Pure-PyTorch RL math for GSPO (arXiv:2507.18071): group advantages (Eq.6), the sequence ratio (Eq.7), the
GSPO (Eq.5/10), GSPO-token (Eq.13-14/17) and GRPO (Eq.2/11) losses, clip metrics and rollout-mismatch
correction.

Never imports megatron: usable and tested on its own.
"""

from megatron_gspo.algorithms.advantages import group_advantages
from megatron_gspo.algorithms.config import ALGORITHMS, PolicyLossConfig, RolloutCorrectionConfig
from megatron_gspo.algorithms.correction import rollout_correction
from megatron_gspo.algorithms.grpo import grpo_loss
from megatron_gspo.algorithms.gspo import gspo_loss, gspo_loss_from_sums, gspo_token_loss
from megatron_gspo.algorithms.metrics import METRIC_REDUCTIONS, combine_metrics
from megatron_gspo.algorithms.output import PolicyLossOutput
from megatron_gspo.algorithms.policy import (
    POLICY_LOSSES,
    GRPOLoss,
    GSPOLoss,
    GSPOTokenLoss,
    PolicyLoss,
    make_policy_loss,
)
from megatron_gspo.algorithms.ratios import LOG_RATIO_CLAMP, sequence_ratio

__all__ = [
    "ALGORITHMS",
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
    "grpo_loss",
    "gspo_loss",
    "gspo_loss_from_sums",
    "gspo_token_loss",
    "make_policy_loss",
    "rollout_correction",
    "sequence_ratio",
]
