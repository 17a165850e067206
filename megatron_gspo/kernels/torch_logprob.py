"""The fp32 torch backend: the same row statistics / d logits / segment sums as the Triton kernels.

Memory-lean by construction: rows are processed in chunks so that the fp32 temporaries stay under
`ROW_CHUNK_BYTES` whatever N and the input dtype; nothing [N, V]-sized is allocated except the d logits
output. Deterministic: every reduction is a torch reduction over a fixed layout, the one-hot term is an
index_put with one (row, column) pair per row, and the per-sequence sums use `segments.segment_sums_torch`.

Shape legend: N tokens (or rows of a chunk), V vocab columns of this shard (or chunk), B sequences.
"""

from __future__ import annotations

import torch

from megatron_gspo.kernels.segments import segment_sums_torch

ROW_CHUNK_BYTES = 64 * 2**20


def _row_chunks(N: int, V: int):
    rows = max(1, ROW_CHUNK_BYTES // (4 * max(V, 1)))
    for start in range(0, N, rows):
        yield start, min(N, start + rows)


def _owned_columns(targets_N: torch.Tensor, vocab_start: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    local_N = targets_N.long() - vocab_start
    owned_N = (local_N >= 0) & (local_N < V)
    return owned_N, torch.where(owned_N, local_N, 0)


def row_stats_torch(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    active_N: torch.Tensor,
    vocab_start: int,
    inv_temperature: float,
    *,
    overwrite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local log-sum-exp of `logits/T` and owned target logit `/T` per row, in fp32 (0 for inactive rows).

    With `overwrite=True` an fp32 `logits_NV` serves as scratch space (the linear path's recomputable chunks).
    """
    N, V = logits_NV.shape
    lse_N = torch.zeros(N, dtype=torch.float32, device=logits_NV.device)
    target_logit_N = torch.zeros_like(lse_N)
    owned_N, column_N = _owned_columns(targets_N, vocab_start, V)
    for start, end in _row_chunks(N, V):
        chunk = logits_NV[start:end]
        if overwrite and chunk.dtype == torch.float32:
            z = chunk.mul_(inv_temperature)
        else:
            z = chunk.float() * inv_temperature
        target_logit_N[start:end] = z.gather(1, column_N[start:end, None]).squeeze(1)
        row_max = z.amax(dim=1)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        lse_N[start:end] = row_max + z.sub_(row_max[:, None]).exp_().sum(dim=1).log()
    keep_N = active_N.bool()
    lse_N = torch.where(keep_N, lse_N, 0.0)
    target_logit_N = torch.where(keep_N & owned_N, target_logit_N, 0.0)
    return lse_N, target_logit_N


def dlogits_torch(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    grad_N: torch.Tensor,
    lse_N: torch.Tensor,
    vocab_start: int,
    inv_temperature: float,
    out_NV: torch.Tensor,
) -> None:
    """Writes grad * (onehot(target) - exp(logits/T - lse)) / T into `out_NV` (may alias `logits_NV`)."""
    N, V = logits_NV.shape
    owned_N, column_N = _owned_columns(targets_N, vocab_start, V)
    scale_N = grad_N.float() * inv_temperature
    for start, end in _row_chunks(N, V):
        chunk = logits_NV[start:end]
        in_place = out_NV.data_ptr() == logits_NV.data_ptr() and chunk.dtype == torch.float32
        z = chunk.mul_(inv_temperature) if in_place else chunk.float() * inv_temperature
        z.sub_(lse_N[start:end, None]).exp_().mul_(-scale_N[start:end, None])
        # Masked rows (grad 0) may hold any lse: zero them exactly rather than trusting 0 * exp(...).
        z.masked_fill_(scale_N[start:end, None] == 0, 0.0)
        rows = torch.arange(end - start, device=z.device)
        cols = column_N[start:end]
        z[rows, cols] = z[rows, cols] + torch.where(owned_N[start:end], scale_N[start:end], 0.0)
        if not in_place:
            out_NV[start:end].copy_(z)


class TorchLogprobOps:
    """`LogprobOps` in plain torch with fp32 math: the fallback for CPU (and any device)."""

    name = "torch"

    def row_stats(self, logits_NV, targets_N, active_N, vocab_start, inv_temperature, overwrite=False):
        return row_stats_torch(
            logits_NV, targets_N, active_N, vocab_start, inv_temperature, overwrite=overwrite
        )

    def dlogits(self, logits_NV, targets_N, grad_N, lse_N, vocab_start, inv_temperature, out_NV):
        dlogits_torch(logits_NV, targets_N, grad_N, lse_N, vocab_start, inv_temperature, out_NV)

    def segment_sums(self, values_N, active_N, cu_seqlens_B1):
        return segment_sums_torch(values_N, active_N, cu_seqlens_B1)
