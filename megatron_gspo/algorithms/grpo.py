"""GRPO, the token-level baseline GSPO is compared with (paper Eq.2, gradient Eq.11).

Legend: B = sequences, T = token positions, `*_BT` per token, `*_B` per sequence; |y_i| = response tokens
of row i.

Normalisation: "seq-mean-token-mean" (Eq.2) returns -(1/N) sum_{local i} (1/|y_i|) sum_t J_i,t with N =
`num_sequences` (global; default the local B); "token-mean" returns -(1/N_tok) sum_{local i,t} J_i,t with
N_tok = `num_tokens` (global response-token count; default the local count). Either way the losses of all
micro-batches and ranks, called with the same global divisor, sum to the full-batch loss.
"""

from __future__ import annotations

import torch

from megatron_gspo.algorithms import metrics as M
from megatron_gspo.algorithms.output import PolicyLossOutput
from megatron_gspo.algorithms.ratios import clamped_exp, masked_log_ratio, sequence_log_ratio_from_sums
from megatron_gspo.algorithms.surrogate import (
    broadcast_token_advantages,
    check_clip,
    check_count,
    clip_flags,
    clipped_surrogate,
)

GRPO_CLIP_LOW = 0.2
"""eps_low of the paper's GRPO baseline (§5.1)."""
GRPO_CLIP_HIGH = 0.27
"""eps_high of the paper's GRPO baseline (§5.1)."""
GRPO_AGGREGATIONS = ("seq-mean-token-mean", "token-mean")
"""Ways to average GRPO's per-token objective; the first is Eq.2's."""


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = GRPO_CLIP_LOW,
    clip_high: float = GRPO_CLIP_HIGH,
    aggregation: str = "seq-mean-token-mean",
    num_sequences: int | None = None,
    num_tokens: int | None = None,
) -> PolicyLossOutput:
    """GRPO loss, -J of Eq.2, whose gradient is Eq.11.

    w_i,t = pi_theta(y_i,t) / pi_old(y_i,t); J_i,t = min(w_i,t A_i,t, clip(w_i,t, 1 - clip_low, 1 + clip_high)
    A_i,t) and J = (1/N) sum_i (1/|y_i|) sum_t J_i,t (Eq.2, aggregation "seq-mean-token-mean") or
    J = (1/N_tok) sum_i sum_t J_i,t ("token-mean"); see the module docstring for N and N_tok. Gradient
    (Eq.11): -(1/N) (1/|y_i|) w_i,t A_i,t grad log pi_theta(y_i,t) for each token whose clip is inactive
    (1/N_tok instead of (1/N)(1/|y_i|) for "token-mean").

    Args: `logprobs` [B, T] differentiable, `old_logprobs` [B, T] (constant), `advantages` [B] (one per
    response, Eq.2) or [B, T] (constant), `response_mask` [B, T] bool or 0/1. Computed in fp32 (fp64 for fp64
    inputs); padded positions may hold anything. Token log-ratios are clamped to +-20 before exp, value only
    (see `ratios`). Metrics: clip flags per token (*_seq = mean over sequences of each one's clipped-token
    fraction); seq_ratio_* are the diagnostic sequence ratios s_i of Eq.7; approx_kl is k3.
    """
    if aggregation not in GRPO_AGGREGATIONS:
        choices = ", ".join(GRPO_AGGREGATIONS)
        raise ValueError(f"aggregation={aggregation!r} is unknown; choose one of {choices}")
    log_ratio_BT, mask_BT = masked_log_ratio(logprobs, old_logprobs, response_mask)
    check_clip(clip_low, clip_high)
    check_count("num_sequences", num_sequences)
    check_count("num_tokens", num_tokens)
    counts_B = mask_BT.sum(dim=-1)
    adv_BT = broadcast_token_advantages(advantages, log_ratio_BT.shape, log_ratio_BT.dtype)
    adv_BT = torch.where(mask_BT, adv_BT, 0.0)
    w_BT = clamped_exp(log_ratio_BT)
    objective_BT = torch.where(mask_BT, clipped_surrogate(w_BT, adv_BT, clip_low, clip_high), 0.0)
    if aggregation == "token-mean":
        divisor = num_tokens if num_tokens is not None else counts_B.sum().clamp(min=1).to(objective_BT.dtype)
        loss = -objective_BT.sum() / divisor
    else:
        objective_B = objective_BT.sum(dim=-1) / counts_B.clamp(min=1).to(objective_BT.dtype)
        loss = -objective_B.sum() / (num_sequences if num_sequences is not None else logprobs.shape[0])

    low_BT, high_BT = clip_flags(w_BT, adv_BT, clip_low, clip_high)
    metrics = M.clip_fractions_from_tokens(low_BT, high_BT, mask_BT)
    with torch.no_grad():
        log_s_B, valid_B = sequence_log_ratio_from_sums(log_ratio_BT.sum(dim=-1), counts_B)
        metrics.update(M.sequence_ratio_stats(clamped_exp(log_s_B), valid_B))
    metrics.update(M.token_kl(log_ratio_BT, mask_BT))
    metrics.update(M.counts(counts_B))
    return PolicyLossOutput(loss=loss, metrics=metrics)
