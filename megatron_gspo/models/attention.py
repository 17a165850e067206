"""Core attention for megatron-core's local (non-TE) layer spec that also runs packed sequences (THD).

megatron-core's local `DotProductAttention` asserts `packed_seq_params is None` (REFERENCE.md §2); TE's attention
supports THD but needs CUDA. This spec module (ModuleSpec / build_module, like models/norm.py; not a patch) is
megatron's `DotProductAttention` for padded batches and adds the packed path: with `packed_seq_params.qkv_format
== "thd"` megatron's `Attention.forward` hands it q [T, heads, d] and k, v [T, groups, d] of ONE packed row whose
sequences are delimited by `cu_seqlens_q` (RoPE was already applied per sequence, positions restarting at each
boundary), and each token may attend only to the earlier tokens of its own sequence: block-diagonal causal
attention.

It runs torch's scaled_dot_product_attention on padded groups: the sequences, sorted by length, are grouped so that
a group's longest is at most `group_slack` longer than its shortest; a group of n sequences padded to its longest,
m, is one [n, heads, m, D] causal SDPA call (each sequence right-padded by repeating its last token: a real query
sees only keys at or before it, all its own; the padded rows' outputs are dropped). Cost sum over groups of n m^2,
within a small factor of per-sequence attention's sum_i l_i^2 (a block-diagonal mask over runs of 256 packed
tokens, the previous scheme, cost 256^2 per run: ~20x the attention work for 128 answers of ~12 tokens), in a few
kernel calls (one per length class) and four index gathers per layer, built once per micro-batch.

Legend: T tokens of the pack, Hq query heads and G key/value groups of this TP rank, D head dim, N sequences of a
group, M its padded length, R the rows of all groups (sum of N * M).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention


def group_slack(shortest: int) -> int:
    """How much longer than a group's shortest sequence its longest may be: 8 tokens or a quarter, the larger
    (padding wastes at most ~1.6x of the group's attention work; fewer groups mean fewer kernel calls)."""
    return max(8, shortest // 4)


@dataclass(frozen=True)
class AttentionGroups:
    """The padded groups of one pack: `shapes` (N, M) per group; `gather_R` the pack token each padded row reads
    (groups one after the other, sequence-major, each row of a sequence past its length repeating its last token);
    `take_T` the padded row holding each pack token's output."""

    shapes: tuple[tuple[int, int], ...]
    gather_R: torch.Tensor
    take_T: torch.Tensor


def attention_groups(cu_seqlens: list[int], device) -> AttentionGroups:
    """The groups of the sequences delimited by `cu_seqlens` [n + 1] (python ints, covering [0, cu[-1]); zero-length
    entries are skipped): sorted by length (stable), a new group once a length exceeds the group's shortest by more
    than `group_slack`."""
    seqs = sorted(((hi - lo, lo) for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]) if hi > lo), key=lambda s: s[0])
    groups: list[list[tuple[int, int]]] = []
    for length, lo in seqs:
        if not groups or length > groups[-1][0][0] + group_slack(groups[-1][0][0]):
            groups.append([])
        groups[-1].append((length, lo))
    gather: list[int] = []
    take = [0] * cu_seqlens[-1]
    shapes = []
    for group in groups:
        m = group[-1][0]  # sorted: the last is the longest
        shapes.append((len(group), m))
        for length, lo in group:
            row = len(gather)
            take[lo : lo + length] = range(row, row + length)
            gather += [*range(lo, lo + length), *[lo + length - 1] * (m - length)]
    as_long = dict(dtype=torch.long, device=device)
    return AttentionGroups(tuple(shapes), torch.tensor(gather, **as_long), torch.tensor(take, **as_long))


@dataclass
class PackedAttentionParams(PackedSeqParams):
    """megatron's PackedSeqParams plus what the local packed attention reuses in every layer of one micro-batch:
    the padded groups (from the host-side sequence lengths, so no device sync per layer; built on first use per
    device). TE's attention reads only PackedSeqParams' own fields."""

    cu_seqlens_host: tuple[int, ...] | None = None
    """cu_seqlens_q as Python ints."""
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Per (device, cu_seqlens_host): a copy (dataclasses.replace) starts with its own, empty cache."""

    def host(self) -> tuple[int, ...]:
        if self.cu_seqlens_host is None:
            self.cu_seqlens_host = tuple(int(x) for x in self.cu_seqlens_q.tolist())
        return self.cu_seqlens_host

    def groups(self, device) -> AttentionGroups:
        key = (str(device), self.host())
        if key not in self._groups:
            self._groups[key] = attention_groups(list(self.host()), device)
        return self._groups[key]


class PackedDotProductAttention(DotProductAttention):
    """megatron's DotProductAttention; packed (THD) inputs get per-sequence causal attention (module doc)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias
            )
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' is supported")
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("packed (THD) attention takes its mask from cu_seqlens; attention_mask / bias must be None")
        if self.training and self.config.attention_dropout > 0:
            raise ValueError("packed (THD) attention on the local spec has no attention dropout (model dropout is 0)")
        if self.softmax_offset is not None or self.config.apply_query_key_layer_scaling or self.config.window_size:
            raise ValueError("packed (THD) attention on the local spec supports vanilla softmax attention only")
        params = packed_seq_params
        if not isinstance(params, PackedAttentionParams):
            params = _checked_params(params)
        q_THD, k_TGD, v_TGD = query, key, value
        cu = params.host()
        if q_THD.dim() != 3 or cu[0] != 0 or cu[-1] != q_THD.shape[0]:
            raise ValueError(
                f"packed attention got q {tuple(q_THD.shape)} (expected [T, heads, dim]) and cu_seqlens covering "
                f"[{cu[0]}, {cu[-1]}): cu_seqlens must start at 0 and cover all T tokens of the pack"
            )
        groups = params.groups(q_THD.device)
        gqa = q_THD.shape[1] != k_TGD.shape[1]
        q_RHD, k_RGD, v_RGD = (t.index_select(0, groups.gather_R) for t in (q_THD, k_TGD, v_TGD))
        parts, row = [], 0
        for n, m in groups.shapes:
            # rows [row, row + n m) as [N, M, heads, D] -> SDPA's [N, heads, M, D] (views)
            q, k, v = (t[row : row + n * m].view(n, m, t.shape[1], t.shape[2]).transpose(1, 2)
                       for t in (q_RHD, k_RGD, v_RGD))
            o_NHMD = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa)
            parts.append(o_NHMD.transpose(1, 2).reshape(n * m, o_NHMD.shape[1], o_NHMD.shape[3]))
            row += n * m
        out_RHD = parts[0] if len(parts) == 1 else torch.cat(parts)
        out_THD = out_RHD.index_select(0, groups.take_T)
        # megatron's THD path reshapes [T, heads, D] -> [T, 1, heads * D] itself.
        return out_THD.reshape(out_THD.shape[0], -1)


def _checked_params(params: PackedSeqParams) -> PackedAttentionParams:
    """A plain PackedSeqParams (made elsewhere) as PackedAttentionParams, its self-attention contract checked."""
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    host = tuple(int(x) for x in cu.tolist())
    if kv is not None and kv is not cu and tuple(int(x) for x in kv.tolist()) != host:
        raise ValueError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
    return PackedAttentionParams(qkv_format=params.qkv_format, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=params.max_seqlen_q, max_seqlen_kv=params.max_seqlen_kv,
                                 cu_seqlens_host=host)
