"""Core attention for megatron-core's local (non-TE) layer spec that also runs packed sequences (THD).

megatron-core's local `DotProductAttention` asserts `packed_seq_params is None` (REFERENCE.md §2); TE's attention
supports THD but needs CUDA. This spec module (ModuleSpec / build_module, like models/norm.py; not a patch) is
megatron's `DotProductAttention` for padded batches and adds the packed path: with `packed_seq_params.qkv_format
== "thd"` megatron's `Attention.forward` hands it q [T, heads, d] and k, v [T, groups, d] of ONE packed row whose
sequences are delimited by `cu_seqlens_q` (RoPE was already applied per sequence, positions restarting at each
boundary), and each token may attend only to the earlier tokens of its own sequence: block-diagonal causal
attention.

It runs torch's scaled_dot_product_attention over runs of consecutive sequences ("blocks"): a sequence at least
`BLOCK_TOKENS` long is its own block (plain causal attention, cost l^2), shorter neighbours are grouped into a block
of at most `BLOCK_TOKENS` tokens with an explicit block-diagonal causal mask. Cost is sum over blocks of size^2 --
close to sum_i l_i^2 of per-sequence attention, never the T^2 of one mask over the whole pack -- with a bounded
number of kernel calls for packs of many short sequences.

Legend: T tokens of the pack, Hq query heads and G key/value groups of this TP rank, D head dim, C block tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

BLOCK_TOKENS = 256
"""Sequences shorter than this are grouped (with a mask) into blocks of at most this many tokens."""


def attention_blocks(cu_seqlens: list[int], block_tokens: int = BLOCK_TOKENS) -> list[tuple[int, int, list[int]]]:
    """Runs of consecutive sequences: (start, end, segment starts relative to `start`) per block.

    `cu_seqlens` [n + 1] (python ints) delimits n sequences covering [0, cu[-1]); zero-length entries are skipped.
    """
    blocks: list[tuple[int, int, list[int]]] = []
    start, cuts = None, []
    for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if hi <= lo:
            continue
        if start is not None and hi - start > block_tokens:
            blocks.append((start, lo, cuts))
            start, cuts = None, []
        if start is None:
            start = lo
        cuts.append(lo - start)
    if start is not None:
        blocks.append((start, cu_seqlens[-1], cuts))
    return blocks


def block_causal_mask(length: int, cuts: list[int], device) -> torch.Tensor:
    """bool [C, C]: True where query i may attend key j (same sequence and j <= i)."""
    # Segment id of each position: how many cuts (sequence starts after the first) are at or before it. One
    # scatter + cumsum (a block of 128 short answers had a 128-step host loop of in-place adds per forward).
    starts_C = torch.zeros(length, dtype=torch.int32, device=device)
    if len(cuts) > 1:
        starts_C[torch.tensor(cuts[1:], dtype=torch.long, device=device)] = 1
    seg_C = starts_C.cumsum(0, dtype=torch.int32)
    pos_C = torch.arange(length, device=device)
    return (seg_C[:, None] == seg_C[None, :]) & (pos_C[None, :] <= pos_C[:, None])


@dataclass
class PackedAttentionParams(PackedSeqParams):
    """megatron's PackedSeqParams plus what the local packed attention reuses in every layer of one micro-batch:
    the blocks (from the host-side sequence lengths, so no device sync per layer) and their masks (built once, on
    first use). TE's attention reads only PackedSeqParams' own fields."""

    cu_seqlens_host: tuple[int, ...] | None = None
    """cu_seqlens_q as Python ints."""
    _blocks: list | None = field(default=None, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)

    def blocks(self) -> list[tuple[int, int, list[int]]]:
        if self._blocks is None:
            cu = self.cu_seqlens_host
            if cu is None:
                cu = tuple(int(x) for x in self.cu_seqlens_q.tolist())
            self._blocks = attention_blocks(list(cu))
        return self._blocks

    def mask(self, start: int, end: int, cuts: list[int], device) -> torch.Tensor:
        key = (start, str(device))
        if key not in self._masks:
            self._masks[key] = block_causal_mask(end - start, cuts, device)
        return self._masks[key]


class PackedDotProductAttention(DotProductAttention):
    """megatron's DotProductAttention; packed (THD) inputs get block-diagonal causal attention (module doc)."""

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
        blocks = params.blocks()
        q_THD, k_TGD, v_TGD = query, key, value
        if q_THD.dim() != 3 or not blocks or blocks[0][0] != 0 or blocks[-1][1] != q_THD.shape[0]:
            raise ValueError(
                f"packed attention got q {tuple(q_THD.shape)} (expected [T, heads, dim]) and cu_seqlens covering "
                f"[0, {blocks[-1][1] if blocks else 0}): cu_seqlens must start at 0 and cover all T tokens of the pack"
            )
        gqa = q_THD.shape[1] != k_TGD.shape[1]
        # [T, heads, D] -> [1, heads, T, D] views: SDPA's layout.
        q_1HTD, k_1GTD, v_1GTD = (t.permute(1, 0, 2).unsqueeze(0) for t in (q_THD, k_TGD, v_TGD))
        parts = []
        for start, end, cuts in blocks:
            sl = slice(start, end)
            mask = None if len(cuts) == 1 else params.mask(start, end, cuts, q_THD.device)
            o = F.scaled_dot_product_attention(
                q_1HTD[:, :, sl],
                k_1GTD[:, :, sl],
                v_1GTD[:, :, sl],
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
            parts.append(o)
        out_THD = torch.cat(parts, dim=2).squeeze(0).permute(1, 0, 2)
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
