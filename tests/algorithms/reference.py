"""Independent reference formulas for the algorithms tests: direct, loop-by-loop translations of the paper's
equations (arXiv:2507.18071), written without the package's helpers. The clipped surrogate is written
piecewise (constant where the clip is active, r A elsewhere) rather than as min(), so it checks the package's
min() form.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def make_batch(
    lengths: list[int],
    T: int,
    *,
    seq_offsets: list[float] | None = None,
    token_noise: float = 1e-3,
    seed: int = 0,
    dtype: torch.dtype = F64,
    garbage: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [B, T] leaf requiring grad, old_logprobs [B, T], mask [B, T] bool), right-padded.

    log pi_theta - log pi_old = per-token noise; with `seq_offsets` the noise is centred per sequence and
    offset_i added, so the sequence log-ratio (Eq.7) is exactly offset_i. `garbage` puts nan / inf / -inf in
    the padding of both log-prob tensors.
    """
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    old = -5.0 * torch.rand(B, T, generator=gen, dtype=F64) - 0.01
    noise = token_noise * torch.randn(B, T, generator=gen, dtype=F64)
    if seq_offsets is not None:
        for i, length in enumerate(lengths):
            if length:
                noise[i, :length] += seq_offsets[i] - noise[i, :length].mean()
    new = old + noise
    if garbage:
        pattern = torch.tensor([math.nan, math.inf, -math.inf], dtype=F64)
        fill = pattern[torch.arange(B * T) % 3].reshape(B, T)
        new = torch.where(mask, new, fill)
        old = torch.where(mask, old, fill.flip(0))
    return new.to(dtype).requires_grad_(True), old.to(dtype), mask


def piecewise_clipped(ratio: torch.Tensor, adv: float, clip_low: float, clip_high: float) -> torch.Tensor:
    """min(r A, clip(r) A) as cases: the clip bound times A where the clip binds, r A elsewhere."""
    if adv > 0 and float(ratio.detach()) > 1.0 + clip_high:
        return torch.tensor((1.0 + clip_high) * adv, dtype=F64)
    if adv < 0 and float(ratio.detach()) < 1.0 - clip_low:
        return torch.tensor((1.0 - clip_low) * adv, dtype=F64)
    return ratio * adv


def is_clipped(ratio: float, adv: float, clip_low: float, clip_high: float) -> tuple[bool, bool]:
    """(low, high): clip active with A < 0 below 1 - eps_low, with A > 0 above 1 + eps_high."""
    return (adv < 0 and ratio < 1.0 - clip_low), (adv > 0 and ratio > 1.0 + clip_high)


def seq_ratio(lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, i: int) -> torch.Tensor:
    """Eq.7: s_i = (prod_t pi_theta / pi_old)^(1/|y_i|), computed as exp of the mean log-ratio."""
    idx = mask[i].nonzero().flatten()
    diff = lp[i, idx].to(F64) - old[i, idx].to(F64)
    return torch.exp(diff.sum() / len(idx))


def gspo_objective(lp, old, adv, mask, clip_low, clip_high, n) -> torch.Tensor:
    """Eq.5 summed over the given rows and divided by n; returns the LOSS -J."""
    total = torch.zeros((), dtype=F64)
    for i in range(lp.shape[0]):
        if int(mask[i].sum()) == 0:
            continue
        total = total + piecewise_clipped(seq_ratio(lp, old, mask, i), float(adv[i]), clip_low, clip_high)
    return -total / n


def gspo_grad(lp, old, adv, mask, clip_low, clip_high, n) -> torch.Tensor:
    """Eq.10 in closed form: d(-J)/d log pi_theta(y_i,t) = -(1/n) s_i A_i / |y_i| for unclipped responses."""
    grad = torch.zeros(lp.shape, dtype=F64)
    with torch.no_grad():
        for i in range(lp.shape[0]):
            length = int(mask[i].sum())
            if length == 0:
                continue
            s = float(seq_ratio(lp, old, mask, i))
            if not any(is_clipped(s, float(adv[i]), clip_low, clip_high)):
                grad[i, mask[i]] = -s * float(adv[i]) / (length * n)
    return grad


def gspo_token_objective(lp, old, adv_BT, mask, clip_low, clip_high, n) -> torch.Tensor:
    """Eq.13-14: s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]; returns the LOSS -J."""
    total = torch.zeros((), dtype=F64)
    for i in range(lp.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        if not idx:
            continue
        s_i = seq_ratio(lp, old, mask, i).detach()
        seq_total = torch.zeros((), dtype=F64)
        for t in idx:
            logp = lp[i, t].to(F64)
            s_it = s_i * torch.exp(logp) / torch.exp(logp.detach())
            seq_total = seq_total + piecewise_clipped(s_it, float(adv_BT[i, t]), clip_low, clip_high)
        total = total + seq_total / len(idx)
    return -total / n


def gspo_token_grad(lp, old, adv_BT, mask, clip_low, clip_high, n) -> torch.Tensor:
    """Eq.17 in closed form: -(1/n) s_i A_i,t / |y_i| for each token whose clip is inactive."""
    grad = torch.zeros(lp.shape, dtype=F64)
    with torch.no_grad():
        for i in range(lp.shape[0]):
            idx = mask[i].nonzero().flatten().tolist()
            if not idx:
                continue
            s = float(seq_ratio(lp, old, mask, i))
            for t in idx:
                a = float(adv_BT[i, t])
                if not any(is_clipped(s, a, clip_low, clip_high)):
                    grad[i, t] = -s * a / (len(idx) * n)
    return grad


def grpo_objective(lp, old, adv_BT, mask, clip_low, clip_high, aggregation, n_seq, n_tok) -> torch.Tensor:
    """Eq.2 (seq-mean-token-mean) or the token-mean variant; returns the LOSS -J."""
    total = torch.zeros((), dtype=F64)
    for i in range(lp.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        seq_total = torch.zeros((), dtype=F64)
        for t in idx:
            w = torch.exp(lp[i, t].to(F64) - old[i, t].to(F64))
            seq_total = seq_total + piecewise_clipped(w, float(adv_BT[i, t]), clip_low, clip_high)
        if aggregation == "seq-mean-token-mean":
            total = total + (seq_total / len(idx) if idx else 0.0)
        else:
            total = total + seq_total
    return -total / (n_seq if aggregation == "seq-mean-token-mean" else n_tok)


def grpo_grad(lp, old, adv_BT, mask, clip_low, clip_high, aggregation, n_seq, n_tok) -> torch.Tensor:
    """Eq.11 in closed form: each unclipped token weighs w_i,t A_i,t."""
    grad = torch.zeros(lp.shape, dtype=F64)
    lp = lp.detach()
    with torch.no_grad():
        for i in range(lp.shape[0]):
            idx = mask[i].nonzero().flatten().tolist()
            for t in idx:
                w = math.exp(float(lp[i, t]) - float(old[i, t]))
                a = float(adv_BT[i, t])
                if any(is_clipped(w, a, clip_low, clip_high)):
                    continue
                scale = 1.0 / (len(idx) * n_seq) if aggregation == "seq-mean-token-mean" else 1.0 / n_tok
                grad[i, t] = -w * a * scale
    return grad


def k3_kl(lp, old, mask) -> float:
    """Mean over response tokens of exp(d) - 1 - d, d = log pi_theta - log pi_old."""
    values = []
    lp = lp.detach()
    for i in range(lp.shape[0]):
        for t in mask[i].nonzero().flatten().tolist():
            d = float(lp[i, t]) - float(old[i, t])
            values.append(math.exp(d) - 1.0 - d)
    return sum(values) / len(values)
