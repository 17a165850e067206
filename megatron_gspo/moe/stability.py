"""MoE stability metrics: expert drift across an optimizer step (GSPO paper §5.3), routing mismatch between the
rollout engine and the trainer, and the train / inference log-prob mismatch.

Legend: T = tokens, L = MoE layers, K = top-k; `*_TLK` are expert-id tensors (any integer dtype), `mask_T` marks
the tokens that count (response tokens). Top-k sets hold distinct ids (as routers produce them).

Definitions, for two routings a (e.g. pi_old) and b (pi_theta after the step) of the same tokens:
- overlap(t, l) = |S_a(t, l) ∩ S_b(t, l)|; drift = 1 - mean over counted tokens and layers of overlap / K.
- tokens_changed: fraction of counted tokens whose top-k set differs in at least one layer.
- per layer l: drift_layer{l} = 1 - mean_t overlap(t, l) / K and tokens_changed_layer{l} = fraction of tokens
  whose set changed in layer l.
Expert drift compares the routing of the same batch before and after one optimizer step; routing mismatch
compares the rollout engine's routes (R3 storage) with the trainer's own routing of the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from megatron_gspo.algorithms import rollout_correction
from megatron_gspo.moe.routes import RouteStore


def topk_overlap(a_TLK: torch.Tensor, b_TLK: torch.Tensor) -> torch.Tensor:
    """|S_a ∩ S_b| per token and layer, int64 [T, L] (sets of distinct ids; the order within a set is free)."""
    if a_TLK.shape != b_TLK.shape or a_TLK.dim() != 3:
        raise ValueError(f"top-k id tensors must both be [tokens, layers, topk], got {tuple(a_TLK.shape)} and "
                         f"{tuple(b_TLK.shape)}")
    a = a_TLK.to(torch.int64)
    b = b_TLK.to(torch.int64).to(a.device)
    out = torch.empty(a.shape[:2], dtype=torch.int64, device=a.device)
    for layer in range(a.shape[1]):  # [T, K, K] per layer keeps memory at T * K * K
        out[:, layer] = (a[:, layer, :, None] == b[:, layer, None, :]).any(dim=-1).sum(dim=-1)
    return out


def _mask(mask_T: torch.Tensor | None, num_tokens: int, device) -> torch.Tensor:
    if mask_T is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    mask_T = mask_T.reshape(-1).to(device=device, dtype=torch.bool)
    if mask_T.numel() != num_tokens:
        raise ValueError(f"mask has {mask_T.numel()} entries for {num_tokens} tokens")
    return mask_T


def _change_sums(a_TLK, b_TLK, mask_T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(overlap sum per layer [L], changed-token count per layer [L], changed-in-any-layer flag per token [T])."""
    overlap_TL = topk_overlap(a_TLK, b_TLK)
    mask_T = _mask(mask_T, overlap_TL.shape[0], overlap_TL.device)
    changed_TL = (overlap_TL < a_TLK.shape[2]) & mask_T[:, None]
    overlap_L = torch.where(mask_T[:, None], overlap_TL, 0).sum(dim=0).to(torch.float64)
    return overlap_L, changed_TL.sum(dim=0).to(torch.float64), changed_TL.any(dim=1)


def route_change(
    a_TLK: torch.Tensor, b_TLK: torch.Tensor, mask_T: torch.Tensor | None = None, *, prefix: str = "expert_drift"
) -> dict[str, torch.Tensor]:
    """Drift between two routings of the same tokens (definitions in the module docstring).

    Returns 0-dim fp64 tensors `{prefix}`, `{prefix}_tokens_changed`, `{prefix}_num_tokens`, and [L] tensors
    `{prefix}_per_layer`, `{prefix}_tokens_changed_per_layer`. With no counted token the drifts are 0.
    """
    topk = a_TLK.shape[2]
    overlap_L, changed_L, any_T = _change_sums(a_TLK, b_TLK, mask_T)
    n = _mask(mask_T, a_TLK.shape[0], overlap_L.device).sum().to(torch.float64)
    denom = n.clamp(min=1)
    per_layer = torch.where(n > 0, 1.0 - overlap_L / (topk * denom), 0.0)
    return {
        prefix: per_layer.mean() if per_layer.numel() else torch.zeros((), dtype=torch.float64),
        f"{prefix}_tokens_changed": any_T.sum().to(torch.float64) / denom,
        f"{prefix}_num_tokens": n,
        f"{prefix}_per_layer": per_layer,
        f"{prefix}_tokens_changed_per_layer": changed_L / denom,
    }


def expert_drift(old_TLK: torch.Tensor, new_TLK: torch.Tensor, mask_T: torch.Tensor | None = None):
    """Expert drift of one optimizer step: top-k sets of the same batch before (`old`) and after (`new`)."""
    return route_change(old_TLK, new_TLK, mask_T, prefix="expert_drift")


def routing_mismatch(rollout_TLK: torch.Tensor, train_TLK: torch.Tensor, mask_T: torch.Tensor | None = None):
    """Routing mismatch: the rollout engine's top-k sets vs the trainer's for the same tokens and weights."""
    return route_change(rollout_TLK, train_TLK, mask_T, prefix="routing_mismatch")


def response_token_mask(prompt_len: int, num_tokens: int) -> torch.Tensor:
    """Bool [num_tokens] over route rows (input positions): True where the position predicts a response token,
    i.e. rows prompt_len - 1 .. num_tokens - 1."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len} must be >= 1")
    return torch.arange(num_tokens) >= prompt_len - 1


def store_route_change(
    a: RouteStore,
    b: RouteStore,
    *,
    masks: Mapping[int, torch.Tensor] | None = None,
    seq_indices: Iterable[int] | None = None,
    group=None,
    reduce_group=None,
    device: torch.device | str = "cpu",
    prefix: str = "expert_drift",
) -> dict[str, float]:
    """`route_change` over the sequences of two RouteStores (default: those in `a`), on the layers both hold.

    `masks[i]`: bool [T_i] tokens of sequence i that count (e.g. `response_token_mask`); default all. Two process
    groups combine what other ranks hold (collectives: every rank of a group calls with the same layers):
    - `group`: ranks holding the other layers of the same tokens (pipeline stages); the result covers every
      stage's layers.
    - `reduce_group`: ranks holding other tokens of the same layers (data-parallel replicas); overlaps, changed
      tokens and token counts are summed, so the result is that of all their tokens together.
    The result is the same on every rank of both groups. `device`: where the collectives' buffers live (the
    model's device; NCCL takes CUDA tensors only). Returns floats: `{prefix}`, `{prefix}_tokens_changed`,
    `{prefix}_num_tokens`, and per global layer l `{prefix}_layer{l}`, `{prefix}_tokens_changed_layer{l}`.
    """
    if a.topk != b.topk:
        raise ValueError(f"routes with top-{a.topk} and top-{b.topk} cannot be compared")
    layers = [layer for layer in a.layer_ids if layer in b.layer_ids]
    seqs = list(a.seq_indices if seq_indices is None else seq_indices)
    a_sel, b_sel = a.select_layers(layers), b.select_layers(layers)
    a_parts, b_parts, m_parts = [], [], []
    for i in seqs:
        ra, rb = a_sel[i], b_sel[i]
        if ra.shape[0] != rb.shape[0]:
            raise ValueError(f"sequence {i} has {ra.shape[0]} routed tokens in one store and {rb.shape[0]} in the other")
        a_parts.append(ra)
        b_parts.append(rb.to(ra.device))
        mask = torch.ones(ra.shape[0], dtype=torch.bool) if masks is None else masks[i].reshape(-1).bool()
        m_parts.append(mask.to(ra.device))
    topk = a.topk
    if a_parts:
        a_TLK, b_TLK, mask_T = torch.cat(a_parts), torch.cat(b_parts), torch.cat(m_parts)
    else:
        a_TLK = b_TLK = torch.empty(0, len(layers), topk, dtype=torch.int64)
        mask_T = torch.empty(0, dtype=torch.bool)
    overlap_L, changed_L, any_T = _change_sums(a_TLK, b_TLK, mask_T)
    n_tok = float(mask_T.sum())
    per_layer = {layer: (float(overlap_L[j]), float(changed_L[j])) for j, layer in enumerate(layers)}
    if group is not None and dist.get_world_size(group) > 1:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (per_layer, n_tok, int(any_T.numel())), group=group)
        if any(g[1] != n_tok or g[2] != any_T.numel() for g in gathered):
            raise ValueError("ranks compare different tokens; every stage must hold the same sequences")
        per_layer = {}
        for g in gathered:
            per_layer.update(g[0])
        flags = any_T.to(device=device, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        any_T = flags.bool()
    n_changed = float(any_T.sum())
    ordered = sorted(per_layer)
    if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
        sums = [per_layer[layer][0] for layer in ordered] + [per_layer[layer][1] for layer in ordered]
        totals = torch.tensor([*sums, n_tok, n_changed], dtype=torch.float64, device=device)
        dist.all_reduce(totals, group=reduce_group)
        values = totals.tolist()
        k = len(ordered)
        per_layer = {layer: (values[j], values[k + j]) for j, layer in enumerate(ordered)}
        n_tok, n_changed = values[2 * k], values[2 * k + 1]
    out: dict[str, float] = {}
    drifts = []
    for layer in ordered:
        overlap, changed = per_layer[layer]
        drift = 1.0 - overlap / (topk * n_tok) if n_tok else 0.0
        drifts.append(drift)
        out[f"{prefix}_layer{layer}"] = drift
        out[f"{prefix}_tokens_changed_layer{layer}"] = changed / n_tok if n_tok else 0.0
    out[prefix] = math.fsum(drifts) / len(drifts) if drifts else 0.0
    out[f"{prefix}_tokens_changed"] = n_changed / n_tok if n_tok else 0.0
    out[f"{prefix}_num_tokens"] = n_tok
    return out


def logprob_mismatch(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Train / inference log-prob mismatch of the same tokens ([B, T] each, `mask` = response tokens).

    With d = log pi_train - log pi_rollout per token: `train_infer_kl` = mean of exp(d) - 1 - d (k3 estimate of
    KL(pi_rollout || pi_train) for samples from the rollout engine), `train_infer_kl_k1` = mean of -d, and the
    sequence ratio exp(mean_t d) of each response (Eq.7 applied to the mismatch) as `train_infer_seq_ratio_mean`
    / `_min` / `_max` over sequences with tokens. Computed by `algorithms.rollout_correction` (no truncation).
    """
    _, metrics = rollout_correction(
        train_logprobs, rollout_logprobs, mask, level="sequence", mode="truncate", threshold=math.inf
    )
    return {
        "train_infer_kl": metrics["mismatch_kl"],
        "train_infer_kl_k1": metrics["mismatch_kl_k1"],
        "train_infer_seq_ratio_mean": metrics["is_weight_mean"],
        "train_infer_seq_ratio_min": metrics["is_weight_min"],
        "train_infer_seq_ratio_max": metrics["is_weight_max"],
        "train_infer_num_tokens": metrics["num_tokens"],
    }


def record_routes(replay, run_forward: Callable[[], object]) -> RouteStore:
    """Routes of one forward pass: runs `run_forward()` (a forward_backward whose forward_step calls
    `replay.set_microbatch`) inside `replay.record()` and returns the recorded RouteStore (this stage's layers)."""
    with replay.record() as recording:
        run_forward()
    return recording.routes
