"""Public API: per-token and per-sequence log-probs of packed sequences, from logits or from the LM head.

    logp_t = logits_t[target_t] / T - logsumexp(logits_t / T)         (REFERENCE.md §5)

These feed GSPO's sequence ratio (paper Eq. 7: s_i = exp(mean_t[log pi_theta - log pi_old])), so the
per-sequence sum and count of selected tokens come out of the same call: `seq_sum / seq_count` is the
length-normalised sequence log-likelihood, and gradients from both the per-token and the per-sequence output
flow back in one pass.

Forward-only: when autograd cannot ask for a gradient (`torch.no_grad()`, inference mode, or inputs that do
not require grad), no autograd Function is entered and no tensor is saved -- the old-policy / reference
log-prob pass keeps no lse, no logits and no hidden states alive.

Shape legend: N packed tokens, V vocab columns of this shard (V_local), H hidden size, B sequences;
`_N` [N], `_NV` [N, V], `_NH` [N, H], `_VH` [V, H], `_B` [B], `_B1` [B + 1].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_gspo.kernels.backends import BACKENDS, resolve_backend
from megatron_gspo.kernels.chunked_linear import LinearSequenceLogprobsFunction, linear_logprob_forward
from megatron_gspo.kernels.logprob_function import SequenceLogprobsFunction, logprob_forward

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SequenceLogprobs(NamedTuple):
    """Log-probs of packed sequences; token_logprobs and seq_sum carry gradients."""

    token_logprobs: torch.Tensor
    """fp32 [N]: log pi(target_t | prefix) at temperature T; 0 where loss_mask is 0."""
    seq_sum: torch.Tensor
    """fp32 [B]: sum of token_logprobs over each sequence's selected tokens (0 for empty / fully masked)."""
    seq_count: torch.Tensor
    """int64 [B]: number of selected tokens per sequence, |y_i| in GSPO Eq. 7 (no gradient)."""

    def seq_mean(self) -> torch.Tensor:
        """fp32 [B]: seq_sum / seq_count, the mean token log-prob (0 for sequences with no selected token)."""
        return self.seq_sum / self.seq_count.clamp(min=1).to(self.seq_sum.dtype)


def _check_common(
    name: str,
    n_tokens: int,
    device: torch.device,
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor | None,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    vocab_start_index: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Checks the shared arguments; returns (targets_N, cu_seqlens_B1 int32, active_N uint8, all_active)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if not (isinstance(temperature, int | float) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a positive number")
    if vocab_start_index < 0:
        raise ValueError(f"vocab_start_index={vocab_start_index} must be >= 0")
    if tp_group is not None and not dist.is_initialized():
        raise ValueError("tp_group is given but torch.distributed is not initialised")
    if targets.shape != (n_tokens,) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"targets must be int32/int64 [{n_tokens}] (one id per {name} row), "
            f"got {targets.dtype} {tuple(targets.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be an int32 [B+1] tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    for tensor_name, tensor in (("targets", targets), ("cu_seqlens", cu_seqlens), ("loss_mask", loss_mask)):
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{tensor_name} is on {tensor.device} but {name} is on {device}")
    cu_seqlens_B1 = cu_seqlens.to(torch.int32).contiguous()
    first, last = cu_seqlens_B1[0], cu_seqlens_B1[-1]
    ordered = (first == 0) & (last <= n_tokens) & (cu_seqlens_B1[1:] >= cu_seqlens_B1[:-1]).all()
    if not bool(ordered):  # one host sync for the three checks
        shown = cu_seqlens_B1.tolist() if cu_seqlens_B1.numel() <= 16 else "[...]"
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at most at N={n_tokens}: got {shown}"
        )
    if loss_mask is None:
        active_N = torch.ones(n_tokens, dtype=torch.uint8, device=device)
    else:
        if loss_mask.shape != (n_tokens,):
            raise ValueError(f"loss_mask must be [{n_tokens}], got {tuple(loss_mask.shape)}")
        active_N = (loss_mask != 0).to(torch.uint8)
    return targets.contiguous(), cu_seqlens_B1, active_N, loss_mask is None


def sequence_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start_index: int = 0,
    backend: str = "auto",
    inplace_backward: bool = True,
) -> SequenceLogprobs:
    """Per-token and per-sequence log-probs of `targets` under `logits / temperature`.

    Args:
        logits: [N, V_local] bf16/fp16/fp32 logits of N packed tokens (unit stride along the vocab, any row
            stride).
        targets: [N] int global vocab ids (the next token). Ids of masked tokens are never read (-100 is
            fine).
        cu_seqlens: int32 [B+1] sequence boundaries: sequence b is tokens [cu[b], cu[b+1]); tokens past
            cu[-1] belong to no sequence.
        loss_mask: optional [N], nonzero = selected (response) token; masked tokens get log-prob 0 and no
            gradient.
        temperature: the sampling temperature T > 0 (logits are divided by it).
        tp_group: tensor-parallel group whose ranks hold consecutive vocab shards; one all_gather combines
            them.
        vocab_start_index: first global vocab id of this rank's shard.
        backend: "triton", "torch" (fp32 torch, memory-lean) or "auto" (triton on CUDA; torch on CPU unless
            TRITON_INTERPRET=1).
        inplace_backward: the backward writes d logits over `logits` (no second [N, V] buffer) when `logits`
            is not a leaf tensor, e.g. the LM head's output: its values are gone after the backward, and
            another autograd user of the same tensor fails loudly (logprob_function.py). False, or leaf
            logits: a new buffer.

    Returns:
        SequenceLogprobs(token_logprobs fp32 [N], seq_sum fp32 [B], seq_count int64 [B]), differentiable
        w.r.t. `logits` through token_logprobs and seq_sum. Under TP the values are global and identical on
        every rank; the gradient is this rank's d logits shard (no collective in the backward). Without a
        possible gradient (no_grad, or logits not requiring grad) nothing is saved for backward.
    """
    if logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be [N, V_local>0] in {_FLOAT_DTYPES}, got {logits.dtype} {tuple(logits.shape)}"
        )
    targets_N, cu_seqlens_B1, active_N, _ = _check_common(
        "logits",
        logits.shape[0],
        logits.device,
        targets,
        cu_seqlens,
        loss_mask,
        temperature,
        tp_group,
        vocab_start_index,
        backend,
    )
    logits_NV = logits if logits.stride(1) == 1 else logits.contiguous()
    ops = resolve_backend(backend, logits.device)
    inv_temperature = 1.0 / temperature
    args = (logits_NV, targets_N, active_N, cu_seqlens_B1, inv_temperature, tp_group, vocab_start_index, ops)
    if torch.is_grad_enabled() and logits.requires_grad:
        # A contiguous copy made here is ours to overwrite; a caller's leaf tensor (or a view of one) never is.
        base = logits_NV if logits_NV._base is None else logits_NV._base
        inplace = inplace_backward and not base.is_leaf
        return SequenceLogprobs(*SequenceLogprobsFunction.apply(*args, inplace))
    token_N, seq_sum_B, seq_count_B, _ = logprob_forward(*args)
    return SequenceLogprobs(token_N, seq_sum_B, seq_count_B)


def linear_sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start_index: int = 0,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> SequenceLogprobs:
    """`sequence_logprobs(hidden @ weight.T, ...)` without ever materialising the [N, V_local] logits.

    Args:
        hidden: [N, H] final hidden states of N packed tokens (under TP: the full, all-gathered states).
        weight: [V_local, H] LM-head (output layer) weight shard, same dtype and device as `hidden`.
        targets, cu_seqlens, loss_mask, temperature, tp_group, vocab_start_index, backend: as in
            `sequence_logprobs`.
        chunk_size: vocab columns per chunk (default: an fp32 [N, chunk] buffer of at most 512 MiB on CUDA,
            64 MiB on CPU).

    Returns:
        SequenceLogprobs, differentiable w.r.t. `hidden` and `weight`. Under TP the d hidden returned is this
        rank's partial sum (d logits_local @ weight_local): the caller (Megatron's column-parallel LM head)
        all-reduces it over the TP group. Masked tokens are skipped in the GEMMs; their d hidden is 0.
    """
    if hidden.dim() != 2 or hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"hidden must be [N, H] in {_FLOAT_DTYPES}, got {hidden.dtype} {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V_local>0, H={hidden.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})"
        )
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive (or None for the default)")
    targets_N, cu_seqlens_B1, active_N, all_active = _check_common(
        "hidden",
        hidden.shape[0],
        hidden.device,
        targets,
        cu_seqlens,
        loss_mask,
        temperature,
        tp_group,
        vocab_start_index,
        backend,
    )
    ops = resolve_backend(backend, hidden.device)
    args = (
        hidden,
        weight,
        targets_N,
        active_N,
        all_active,
        cu_seqlens_B1,
        1.0 / temperature,
        tp_group,
        vocab_start_index,
        chunk_size,
        ops,
    )
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return SequenceLogprobs(*LinearSequenceLogprobsFunction.apply(*args))
    token_N, seq_sum_B, seq_count_B, _ = linear_logprob_forward(*args)
    return SequenceLogprobs(token_N, seq_sum_B, seq_count_B)
