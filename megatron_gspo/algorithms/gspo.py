"""GSPO (arXiv:2507.18071): the sequence-level loss (Eq.5, gradient Eq.10), its per-sequence-sums form, and
the token-level variant GSPO-token (Eq.13-14, gradient Eq.17).

Legend: B = sequences, T = token positions, `*_BT` per token, `*_B` per sequence; |y_i| = response tokens
of row i.

Normalisation: the objective is a mean over sequences (Eq.5's 1/G), so each loss returns
-(1/N) sum_{local i} J_i with N = `num_sequences` (the GLOBAL sequence count of the minibatch, default: the
local B). Summing the returned losses of all micro-batches and data-parallel ranks, each called with the same
global N, gives the full-batch loss exactly; no per-token averaging and no length weighting enters anywhere.
"""

from __future__ import annotations

import torch

from megatron_gspo.algorithms import metrics as M
from megatron_gspo.algorithms.output import PolicyLossOutput
from megatron_gspo.algorithms.ratios import (
    clamped_exp,
    compute_dtype,
    masked_log_ratio,
    sequence_log_ratio_from_sums,
)
from megatron_gspo.algorithms.surrogate import (
    broadcast_token_advantages,
    check_clip,
    check_count,
    clip_flags,
    clipped_surrogate,
)

GSPO_CLIP_LOW = 3e-4
"""eps_low of the paper's GSPO runs (§5.1)."""
GSPO_CLIP_HIGH = 4e-4
"""eps_high of the paper's GSPO runs (§5.1)."""


def _gspo_from_log_ratio_sums(
    log_ratio_sum_B: torch.Tensor,
    token_counts_B: torch.Tensor,
    advantages_B: torch.Tensor,
    clip_low: float,
    clip_high: float,
    num_sequences: int | None,
) -> PolicyLossOutput:
    check_clip(clip_low, clip_high)
    check_count("num_sequences", num_sequences)
    batch = log_ratio_sum_B.shape[0]
    if advantages_B.shape != (batch,) or token_counts_B.shape != (batch,):
        raise ValueError(
            "GSPO needs one advantage and one token count per sequence: got advantages "
            f"{tuple(advantages_B.shape)} and token_counts {tuple(token_counts_B.shape)} for B={batch}"
        )
    log_s_B, valid_B = sequence_log_ratio_from_sums(log_ratio_sum_B, token_counts_B)
    s_B = clamped_exp(log_s_B)
    adv_B = advantages_B.detach().to(s_B.dtype)
    # Eq.5: whole responses are clipped; an empty row has no response and contributes nothing (and no NaN from
    # a garbage advantage either, since where() drops it).
    objective_B = torch.where(valid_B, clipped_surrogate(s_B, adv_B, clip_low, clip_high), 0.0)
    divisor = num_sequences if num_sequences is not None else batch
    loss = -objective_B.sum() / divisor

    low_B, high_B = clip_flags(s_B, adv_B, clip_low, clip_high)
    metrics = M.clip_fractions_from_sequences(low_B, high_B, token_counts_B)
    metrics.update(M.sequence_ratio_stats(s_B, valid_B))
    metrics.update(M.sequence_kl_k1(log_ratio_sum_B, token_counts_B))
    metrics.update(M.counts(token_counts_B))
    return PolicyLossOutput(loss=loss, metrics=metrics)


def gspo_loss_from_sums(
    logprob_sum: torch.Tensor,
    old_logprob_sum: torch.Tensor,
    token_counts: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = GSPO_CLIP_LOW,
    clip_high: float = GSPO_CLIP_HIGH,
    num_sequences: int | None = None,
) -> PolicyLossOutput:
    """GSPO loss (Eq.5, gradient Eq.10) from per-sequence sums of response-token log-probs.

    s_i = exp((logprob_sum_i - old_logprob_sum_i) / token_counts_i) (Eq.7); loss = -(1/N) sum_i min(s_i A_i,
    clip(s_i, 1 - clip_low, 1 + clip_high) A_i), N = `num_sequences` (global count; default B).

    Args: `logprob_sum` [B], differentiable (the log-prob kernel's per-sequence output; with context
    parallelism, the sum of the ranks' partial sums); `old_logprob_sum` [B] (treated as a constant);
    `token_counts` [B] response tokens per sequence (rows with 0 contribute 0 loss, 0 gradient, no NaN);
    `advantages` [B] (constant). The difference of the two sums is formed in the dtype of the inputs (fp32 at
    least): pass fp64 sums, or sums of token log-ratios, when responses are tens of thousands of tokens long
    and the clip range is 3e-4. Metrics as `gspo_loss`, except approx_kl, which here is the k1 estimate (the
    only one sums allow).
    """
    if logprob_sum.dim() != 1 or old_logprob_sum.shape != logprob_sum.shape:
        raise ValueError(
            f"logprob_sum and old_logprob_sum must both be [B], got {tuple(logprob_sum.shape)} and "
            f"{tuple(old_logprob_sum.shape)}"
        )
    if token_counts.shape != logprob_sum.shape or advantages.shape != logprob_sum.shape:
        raise ValueError(
            f"token_counts {tuple(token_counts.shape)} and advantages {tuple(advantages.shape)} must match "
            f"logprob_sum {tuple(logprob_sum.shape)} (one per sequence)"
        )
    dtype = compute_dtype(logprob_sum, old_logprob_sum)
    valid_B = token_counts.detach() > 0
    # Mask before subtracting: an empty row's sums may be garbage (inf - inf would give a NaN gradient path).
    new_B = torch.where(valid_B, logprob_sum.to(dtype), 0.0)
    old_B = torch.where(valid_B, old_logprob_sum.detach().to(dtype), 0.0)
    return _gspo_from_log_ratio_sums(
        new_B - old_B, token_counts, advantages, clip_low, clip_high, num_sequences
    )


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = GSPO_CLIP_LOW,
    clip_high: float = GSPO_CLIP_HIGH,
    num_sequences: int | None = None,
) -> PolicyLossOutput:
    """GSPO loss, -J of Eq.5, whose gradient is Eq.10.

    J = (1/N) sum_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i) with the sequence ratio s_i of
    Eq.7 and N = `num_sequences` (global sequence count of the minibatch; default the local B). Gradient
    (Eq.10): -(1/N) s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_i,t) for each unclipped response, 0 for a
    clipped one: every token of a response weighs the same and a response's weight does not grow with its
    length.

    Args: `logprobs` [B, T] differentiable per-token log-probs of the response tokens, `old_logprobs` [B, T]
    (constant), `advantages` [B] (Eq.6, constant), `response_mask` [B, T] bool or 0/1. Any dtype; computed in
    fp32 (fp64 for fp64 inputs). Padded positions may hold anything, inf and NaN included.
    Returns a PolicyLossOutput; metrics are described in `megatron_gspo.algorithms.metrics` (approx_kl: k3).
    """
    log_ratio_BT, mask_BT = masked_log_ratio(logprobs, old_logprobs, response_mask)
    # Summing the token differences (not differencing two sums) keeps the precision a 3e-4 clip range needs.
    out = _gspo_from_log_ratio_sums(
        log_ratio_BT.sum(dim=-1), mask_BT.sum(dim=-1), advantages, clip_low, clip_high, num_sequences
    )
    out.metrics.update(M.token_kl(log_ratio_BT, mask_BT))
    return out


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = GSPO_CLIP_LOW,
    clip_high: float = GSPO_CLIP_HIGH,
    num_sequences: int | None = None,
) -> PolicyLossOutput:
    """GSPO-token loss, -J of Eq.14 with the token ratio of Eq.13; its gradient is Eq.17.

    s_i,t = sg[s_i] pi_theta(y_i,t) / sg[pi_theta(y_i,t)] (Eq.13; equal to s_i in value), and
    J = (1/N) sum_i (1/|y_i|) sum_t min(s_i,t A_i,t, clip(s_i,t, 1 - clip_low, 1 + clip_high) A_i,t) (Eq.14).
    Gradient (Eq.17): -(1/N) s_i (1/|y_i|) A_i,t grad log pi_theta(y_i,t) for each token whose clip is
    inactive. With A_i,t = A_i for all t this equals `gspo_loss` in value, clipping and gradient.

    Args as `gspo_loss`, except `advantages` is [B, T] per token ([B] is broadcast over the tokens).
    Clip metrics count tokens (a token is clipped when its own clip is active); approx_kl is k3.
    """
    log_ratio_BT, mask_BT = masked_log_ratio(logprobs, old_logprobs, response_mask)
    check_clip(clip_low, clip_high)
    check_count("num_sequences", num_sequences)
    counts_B = mask_BT.sum(dim=-1)
    log_s_B, valid_B = sequence_log_ratio_from_sums(log_ratio_BT.sum(dim=-1), counts_B)
    s_B = clamped_exp(log_s_B)
    adv_BT = broadcast_token_advantages(advantages, log_ratio_BT.shape, log_ratio_BT.dtype)
    adv_BT = torch.where(mask_BT, adv_BT, 0.0)
    # exp(x - sg[x]) is 1 in value and carries d log pi_theta(y_i,t) in gradient: Eq.13 without forming the
    # (possibly under/overflowing) token probabilities.
    s_BT = s_B.detach()[:, None] * torch.exp(log_ratio_BT - log_ratio_BT.detach())
    objective_BT = torch.where(mask_BT, clipped_surrogate(s_BT, adv_BT, clip_low, clip_high), 0.0)
    objective_B = objective_BT.sum(dim=-1) / counts_B.clamp(min=1).to(objective_BT.dtype)
    divisor = num_sequences if num_sequences is not None else logprobs.shape[0]
    loss = -objective_B.sum() / divisor

    low_BT, high_BT = clip_flags(s_BT, adv_BT, clip_low, clip_high)
    metrics = M.clip_fractions_from_tokens(low_BT, high_BT, mask_BT)
    metrics.update(M.sequence_ratio_stats(s_B, valid_B))
    metrics.update(M.token_kl(log_ratio_BT, mask_BT))
    metrics.update(M.counts(counts_B))
    return PolicyLossOutput(loss=loss, metrics=metrics)
