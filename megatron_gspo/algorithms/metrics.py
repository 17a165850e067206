"""Diagnostics shared by the policy losses: clip fractions (lower / upper, over sequences and tokens),
sequence ratio statistics, approximate KL, counts; and how metrics of several micro-batches / ranks combine.

Legend: B = sequences, T = token positions, `*_BT` per token, `*_B` per sequence.

Definitions (all over the LOCAL part of the batch, detached, 0-dim fp32):
- clip_frac_low_*: the clip is active because ratio < 1 - eps_low with A < 0 (the objective is constant there,
  the gradient zero); clip_frac_high_*: ratio > 1 + eps_high with A > 0. Ties and A = 0 never count.
- *_tok: fraction of response tokens clipped. For GSPO a token counts as clipped when its sequence is.
- *_seq: mean over sequences (with at least one token) of the fraction of that sequence's tokens clipped. For
  GSPO this is the fraction of clipped sequences; for GRPO / GSPO-token every sequence weighs the same,
  however long.
- seq_ratio_mean / min / max: the sequence ratio s_i of Eq.7 (clamped as in `ratios`) over sequences with
  tokens. With no such sequence: mean 0, min +inf, max -inf (the neutral elements of the min / max
  combination).
- approx_kl: KL(pi_old || pi_theta) estimated per response token with Schulman's k3 estimator for samples
  drawn from pi_old, exp(d) - 1 - d with d = log pi_theta - log pi_old (>= 0, low variance), averaged over
  tokens. approx_kl_k1: the k1 estimator -d averaged over tokens (unbiased, can be negative; computable from
  per-sequence sums, so it is what `gspo_loss_from_sums` reports as approx_kl too).
- num_sequences: sequences with at least one response token; num_tokens: response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_gspo.algorithms.ratios import LOG_RATIO_CLAMP

METRIC_REDUCTIONS: dict[str, str] = {
    "clip_frac_low_seq": "num_sequences",
    "clip_frac_high_seq": "num_sequences",
    "clip_frac_low_tok": "num_tokens",
    "clip_frac_high_tok": "num_tokens",
    "seq_ratio_mean": "num_sequences",
    "seq_ratio_min": "min",
    "seq_ratio_max": "max",
    "approx_kl": "num_tokens",
    "approx_kl_k1": "num_tokens",
    "num_sequences": "sum",
    "num_tokens": "sum",
    # rollout_correction's metrics
    "mismatch_kl": "num_tokens",
    "mismatch_kl_k1": "num_tokens",
    "is_weight_mean": "is_weight_count",
    "is_weight_min": "min",
    "is_weight_max": "max",
    "is_weight_count": "sum",
    "is_weight_frac_above": "is_weight_count",
    "is_weight_frac_below": "is_weight_count",
    "is_weight_mean_applied": "is_weight_count",
    "mismatch_frac_ratio_above_2": "num_tokens",
    "mismatch_frac_ratio_outside_2": "num_tokens",
    "seq_weight_geo_mean": "num_sequences",
    "seq_weight_geo_min": "min",
    "seq_weight_geo_max": "max",
    "seq_weight_prod_mean": "num_sequences",
    "seq_weight_prod_min": "min",
    "seq_weight_prod_max": "max",
    "seq_log_weight_sum_mean": "num_sequences",
    # off_policy.py: the geometric mask band, truncated / overlong answers, rollouts per staleness bucket
    "geo_mask_frac": "num_sequences",
    "samples": "sum",
    "reward_mean": "samples",
    "response_length": "samples",
    "truncated_frac": "samples",
    "overlong_penalty_mean": "samples",
    "overlong_penalized_frac": "samples",
}
"""How each metric combines across parts: weighted mean by the named count, or min / max / sum. A key
"<bucket>/<name>" (staleness buckets, `staleness.py`) follows the rule of <name>, weighted by "<bucket>/<count>"."""


def _fp32(value: torch.Tensor) -> torch.Tensor:
    return value.detach().to(torch.float32).reshape(())


def _safe_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return total / count.clamp(min=1)


def clip_fractions_from_tokens(
    clipped_low_BT: torch.Tensor, clipped_high_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Clip fractions from per-token clip flags (bool [B, T]; masked positions are ignored)."""
    with torch.no_grad():
        mask_BT = mask_BT.bool()
        counts_B = mask_BT.sum(dim=-1).to(torch.float64)
        valid_B = counts_B > 0
        num_seq = valid_B.sum().to(torch.float64)
        num_tok = counts_B.sum()
        out = {}
        for name, flags_BT in (("low", clipped_low_BT), ("high", clipped_high_BT)):
            per_seq_B = (flags_BT.bool() & mask_BT).sum(dim=-1).to(torch.float64)
            seq_frac_B = torch.where(valid_B, per_seq_B / counts_B.clamp(min=1), 0.0)
            out[f"clip_frac_{name}_seq"] = _fp32(_safe_mean(seq_frac_B.sum(), num_seq))
            out[f"clip_frac_{name}_tok"] = _fp32(_safe_mean(per_seq_B.sum(), num_tok))
        return out


def clip_fractions_from_sequences(
    clipped_low_B: torch.Tensor, clipped_high_B: torch.Tensor, token_counts_B: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Clip fractions from per-sequence clip flags (GSPO: a sequence's tokens are clipped with it)."""
    with torch.no_grad():
        counts_B = token_counts_B.detach().to(torch.float64)
        valid_B = counts_B > 0
        num_seq = valid_B.sum().to(torch.float64)
        num_tok = counts_B.sum()
        out = {}
        for name, flags_B in (("low", clipped_low_B), ("high", clipped_high_B)):
            flags_B = flags_B.bool() & valid_B
            out[f"clip_frac_{name}_seq"] = _fp32(_safe_mean(flags_B.sum().to(torch.float64), num_seq))
            out[f"clip_frac_{name}_tok"] = _fp32(_safe_mean((flags_B * counts_B).sum(), num_tok))
        return out


def masked_mean_min_max(
    values: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean / min / max of `values` where `valid`; with none valid: 0, +inf, -inf (neutral when combined)."""
    with torch.no_grad():
        values = values.detach().to(torch.float64).reshape(-1)
        valid = valid.bool().reshape(-1)
        count = valid.sum().to(torch.float64)
        # The appended neutral element keeps min / max defined for an empty selection.
        low = torch.cat([torch.where(valid, values, torch.inf), values.new_full((1,), torch.inf)]).min()
        high = torch.cat([torch.where(valid, values, -torch.inf), values.new_full((1,), -torch.inf)]).max()
        mean = _safe_mean(torch.where(valid, values, 0.0).sum(), count)
        return _fp32(mean), _fp32(low), _fp32(high)


def sequence_ratio_stats(seq_ratio_B: torch.Tensor, valid_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """seq_ratio_mean / _min / _max over valid sequences (0, +inf, -inf when there are none)."""
    mean, low, high = masked_mean_min_max(seq_ratio_B, valid_B)
    return {"seq_ratio_mean": mean, "seq_ratio_min": low, "seq_ratio_max": high}


def token_kl(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """approx_kl (k3) and approx_kl_k1 over response tokens; `log_ratio_BT` = log pi_theta - log pi_old."""
    with torch.no_grad():
        mask_BT = mask_BT.bool()
        d_BT = torch.where(mask_BT, log_ratio_BT.detach().to(torch.float64), 0.0)
        # The clamp only matters for absurd log-ratios: it keeps one bad token from making the mean inf.
        k3_BT = torch.expm1(d_BT.clamp(max=LOG_RATIO_CLAMP)) - d_BT
        num_tok = mask_BT.sum().to(torch.float64)
        return {
            "approx_kl": _fp32(_safe_mean(torch.where(mask_BT, k3_BT, 0.0).sum(), num_tok)),
            "approx_kl_k1": _fp32(_safe_mean(-d_BT.sum(), num_tok)),
        }


def sequence_kl_k1(log_ratio_sum_B: torch.Tensor, token_counts_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """The k1 KL estimate from per-sequence log-ratio sums (reported as both approx_kl and approx_kl_k1)."""
    with torch.no_grad():
        counts_B = token_counts_B.detach().to(torch.float64)
        sums_B = torch.where(counts_B > 0, log_ratio_sum_B.detach().to(torch.float64), 0.0)
        k1 = _fp32(_safe_mean(-sums_B.sum(), counts_B.sum()))
        return {"approx_kl": k1, "approx_kl_k1": k1.clone()}


def counts(token_counts_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """num_sequences (with at least one token) and num_tokens."""
    with torch.no_grad():
        counts_B = token_counts_B.detach().to(torch.float64)
        return {"num_sequences": _fp32((counts_B > 0).sum()), "num_tokens": _fp32(counts_B.sum())}


def combine_metrics(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the metrics of micro-batches / ranks into the metrics of their union (see METRIC_REDUCTIONS).

    Means are re-weighted by each part's num_sequences or num_tokens, min / max / counts reduce directly; the
    result equals the metrics the full batch would report. A key combines over the parts that hold it (a
    staleness bucket is absent from parts without such samples). Keys outside METRIC_REDUCTIONS raise a
    ValueError.
    """
    if not parts:
        raise ValueError("combine_metrics needs at least one part")
    if len(parts) == 1:
        return _one_part(parts[0])
    return _general(parts)


def _general(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    keys = list(dict.fromkeys(key for p in parts for key in p))
    return {key: _combine_key(key, [p for p in parts if key in p]) for key in keys}


def _combine_key(key: str, holders: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    bucket, _, name = key.rpartition("/")
    reduction = METRIC_REDUCTIONS.get(name)
    if reduction is None:
        raise ValueError(f"metric {key!r} has no reduction rule; add it to METRIC_REDUCTIONS")
    values = torch.stack([p[key].detach().to(torch.float64) for p in holders])
    if reduction == "sum":
        return _fp32(values.sum())
    if reduction == "min":
        return _fp32(values.min())
    if reduction == "max":
        return _fp32(values.max())
    weight_key = f"{bucket}/{reduction}" if bucket else reduction
    weights = torch.stack([p[weight_key].detach().to(torch.float64) for p in holders])
    return _fp32(_safe_mean((values * weights).sum(), weights.sum()))


def _one_part(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`combine_metrics([part])` without its ~8 tensor ops per key (a minibatch of one micro-batch: every update
    of a small RL step). min / max / sum of one value are the value (a sum: -0.0 becomes +0.0); a weighted mean
    of one fp32 value v with an integer weight 1 <= w < 2^29 is (v * w) / w in fp64, exact (the product needs at
    most 24 + 29 bits), so v (-0.0 again +0.0). Any other key (an fp64 value, a zero or fractional weight, a
    tensor off the CPU, where float(weight) would be a device sync) is combined as with several parts."""
    out: dict[str, torch.Tensor] = {}
    for key, value in part.items():
        bucket, _, name = key.rpartition("/")
        reduction = METRIC_REDUCTIONS.get(name)
        fast = reduction is not None and value.dtype == torch.float32 and value.numel() == 1
        fast = fast and value.device.type == "cpu"
        if fast and reduction in ("min", "max"):
            out[key] = value.detach().reshape(()).clone()
            continue
        if fast and reduction != "sum":
            weight = part.get(f"{bucket}/{reduction}" if bucket else reduction)
            w = float(weight) if weight is not None and weight.numel() == 1 and weight.device.type == "cpu" else 0.0
            fast = 1.0 <= w < 2.0**29 and w == int(w)
        # + 0.0: a sum (also the weighted mean's) of a single -0.0 is +0.0; every other value stays as it is.
        out[key] = value.detach().reshape(()) + 0.0 if fast else _combine_key(key, [part])
    return out
