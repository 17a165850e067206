"""Vocab-parallel (tensor-parallel) combine of per-shard log-prob statistics: ONE collective.

Each TP rank holds vocab columns [vocab_start, vocab_start + V_local) and computes, per token, its local
lse_r = logsumexp(logits_r / T) and its owned target logit (0 when the target id lies on another rank). One
all_gather of the packed [N, 2] tensor (lse_r, target_r) gives every rank all shards' pairs; then

    lse = logsumexp_r(lse_r),   target_logit = sum_r(target_r)

computed identically (same order) on every rank. Megatron's cross entropy uses three all-reduces (max,
target logit, sum-exp); packing (lse, target) needs one. The backward needs no collective: d logits_r depends
only on the rank's own logits and the global lse.

Shape legend: N tokens, R ranks in the TP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_world_size(tp_group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `tp_group` (1 when None, i.e. no tensor parallelism)."""
    if tp_group is None:
        return 1
    return dist.get_world_size(tp_group)


def _all_gather_single():
    """Newer torch names the single-tensor all_gather `all_gather_single` (and deprecates the old name)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def combine_vocab_parallel(
    lse_local_N: torch.Tensor, target_local_N: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (lse, target logit) per token from every rank's local pair, with one all_gather."""
    world = tp_world_size(tp_group)
    if world == 1:
        return lse_local_N, target_local_N
    packed_N2 = torch.stack([lse_local_N.float(), target_local_N.float()], dim=1).contiguous()
    gathered_RN2 = packed_N2.new_empty((world * packed_N2.shape[0], 2))
    _all_gather_single()(gathered_RN2, packed_N2, group=tp_group)
    gathered_RN2 = gathered_RN2.view(world, -1, 2)
    lse_N = torch.logsumexp(gathered_RN2[..., 0], dim=0)
    target_logit_N = gathered_RN2[..., 1].sum(dim=0)
    return lse_N, target_logit_N
