"""The model inputs of one micro-batch: padded rows (the reference) or one packed THD row.

Legend: n sequences of the micro-batch, L = columns of the rollout batch (seq_len + 1), S = L - 1 label columns,
B rows and P positions per row of the model input (padded: B = n, P = S; packed: B = 1, P = T the pack length),
A response tokens of the micro-batch (its loss-mask entries). Suffixes name shapes (`ids_BP`, `index_A`).

Sequence i feeds its first len_i = prompt + response - 1 tokens (the last sampled token predicts nothing); label
position t of row i predicts tokens[i, t + 1] and is a response token where loss_mask_NS[i, t].

Packed (megatron's `PackedSeqParams`, qkv_format "thd"): the n sequences back to back, then padding up to T (a
multiple of the sequence-parallel size, or a length shared with other micro-batches: `packed_inputs(length=)`).
The padding is one more segment in `cu_seqlens` (so every token belongs to a segment: no attention row is empty on
either spec, and RoPE's per-segment split covers all T tokens), is marked in `padding_mask` (kept out of the
router's statistics) and holds no loss position. RoPE positions restart at every segment (megatron applies
RoPE per cu_seqlens segment; position ids are given restarting too). `cu_seqlens` is int32 on the tokens' device
and `max_seqlen` a Python int (TE's and megatron's THD contract). Our local attention takes its blocks from the
host-side lengths; megatron's unfused THD RoPE still reads `cu_seqlens` back to the host (`.tolist()`) in each
layer, a device sync per layer on GPU unless RoPE fusion is on.

Response tokens: `response_index_A` are the flat positions b * P + p of the label positions of response tokens, in
the row-major order of loss_mask_NS (sequence by sequence), so values computed there scatter back into [n, S] with
`loss_mask_NS`; `hidden_index_A` are the same positions in the decoder's [P, B] (sequence-major) order. Only these
rows reach the LM head on the fused path (batching/logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_gspo.models.attention import PackedAttentionParams
from megatron_gspo.moe.routes import TokenLayout


@dataclass
class ModelInputs:
    """What one micro-batch feeds the model and where its response tokens are in the model's output."""

    input_ids_BP: torch.Tensor
    position_ids_BP: torch.Tensor
    padding_mask_BP: torch.Tensor | None
    """True at padding (megatron-core 0.16 `padding_mask`); None when every position is a real token."""
    packed_seq_params: PackedSeqParams | None
    """THD boundaries (packed inputs) or None (padded rows)."""
    token_layout: TokenLayout
    """Where each sequence sits (routing replay)."""
    response_index_A: torch.Tensor
    """Flat [B * P] (row-major) positions of the response labels, in loss_mask_NS's row-major order."""
    hidden_index_A: torch.Tensor
    """The same positions in the decoder's sequence-major [P * B] order."""
    targets_A: torch.Tensor
    """Token ids predicted at those positions."""
    response_cu_B1: torch.Tensor
    """int32 [n + 1]: sequence boundaries in the A order (cumulative response-token counts)."""

    @property
    def seq_length(self) -> int:
        return self.input_ids_BP.shape[1]

    @property
    def micro_batch_size(self) -> int:
        return self.input_ids_BP.shape[0]

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None


def input_lengths(batch) -> list[int]:
    """Tokens each sequence feeds the model: prompt + response - 1, or all S columns when the lengths are unknown."""
    lens = batch.input_lens_N
    if lens is None:
        return [batch.tokens_NL.shape[1] - 1] * batch.num_sequences
    return [int(x) for x in lens.tolist()]


def _responses(batch, starts_N: torch.Tensor, row_N: torch.Tensor, positions: int, rows: int):
    mask_NS = batch.loss_mask_NS
    seq_A, col_A = mask_NS.nonzero(as_tuple=True)
    p_A = starts_N[seq_A] + col_A
    b_A = row_N[seq_A]
    counts_N = mask_NS.sum(-1)
    cu_B1 = torch.zeros(batch.num_sequences + 1, dtype=torch.int32, device=mask_NS.device)
    cu_B1[1:] = counts_N.cumsum(0)
    targets_A = batch.tokens_NL[:, 1:][seq_A, col_A]
    return b_A * positions + p_A, p_A * rows + b_A, targets_A, cu_B1


def padded_inputs(batch) -> ModelInputs:
    """Rows as they are in the rollout batch: inputs tokens[:, :-1], positions 0..S-1, pads masked."""
    tokens_NL = batch.tokens_NL
    n, s = tokens_NL.shape[0], tokens_NL.shape[1] - 1
    device = tokens_NL.device
    ids_NS = tokens_NL[:, :-1]
    positions_NS = torch.arange(s, device=device).unsqueeze(0).expand(n, -1)
    lengths = input_lengths(batch)
    arange_n = torch.arange(n, device=device)
    resp, hidden, targets, cu = _responses(batch, torch.zeros(n, dtype=torch.long, device=device), arange_n, s, n)
    return ModelInputs(
        input_ids_BP=ids_NS,
        position_ids_BP=positions_NS,
        padding_mask_BP=padding_mask(tokens_NL, batch.input_lens_N),
        packed_seq_params=None,
        token_layout=TokenLayout.padded(lengths, s),
        response_index_A=resp,
        hidden_index_A=hidden,
        targets_A=targets,
        response_cu_B1=cu,
    )


def packed_length(lengths: list[int], multiple: int = 1) -> int:
    """The pack length of sequences of `lengths` tokens: their sum rounded up to `multiple`."""
    total = sum(lengths)
    return -(-total // multiple) * multiple


def packed_inputs(batch, *, multiple: int = 1, length: int | None = None, pad_id: int = 0) -> ModelInputs:
    """The micro-batch as ONE packed THD row of T tokens (module doc).

    `multiple`: T is a multiple of it (the sequence-parallel split); `length`: T itself (>= the tokens, a
    multiple of `multiple`), when micro-batches must share a shape (pipeline p2p, the allgather dispatcher).
    """
    lengths = input_lengths(batch)
    total = sum(lengths)
    t = packed_length(lengths, multiple) if length is None else int(length)
    if t < total or t % multiple:
        raise ValueError(f"pack length {t} must hold {total} tokens and be a multiple of {multiple}")
    tokens_NL = batch.tokens_NL
    device = tokens_NL.device
    n = len(lengths)
    lens_N = torch.tensor(lengths, dtype=torch.long, device=device)
    starts_N = torch.zeros(n, dtype=torch.long, device=device)
    starts_N[1:] = lens_N.cumsum(0)[:-1]
    seq_T = torch.repeat_interleave(torch.arange(n, device=device), lens_N, output_size=total)
    col_T = torch.arange(total, device=device) - starts_N[seq_T]
    ids_1T = torch.full((1, t), pad_id, dtype=tokens_NL.dtype, device=device)
    ids_1T[0, :total] = tokens_NL[seq_T, col_T]
    positions_1T = torch.zeros((1, t), dtype=torch.long, device=device)
    positions_1T[0, :total] = col_T
    positions_1T[0, total:] = torch.arange(t - total, device=device)
    bounds = [0]
    for length_i in lengths:
        bounds.append(bounds[-1] + length_i)
    if t > total:
        bounds.append(t)  # the padding segment
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    max_seqlen = max(max(lengths), t - total)
    params = PackedAttentionParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        cu_seqlens_host=tuple(bounds),
    )
    pad_1T = torch.zeros((1, t), dtype=torch.bool, device=device)
    pad_1T[0, total:] = True
    resp, hidden, targets, cu = _responses(batch, starts_N, torch.zeros(n, dtype=torch.long, device=device), t, 1)
    return ModelInputs(
        input_ids_BP=ids_1T,
        position_ids_BP=positions_1T,
        padding_mask_BP=pad_1T,
        packed_seq_params=params,
        token_layout=TokenLayout.packed(lengths, t),
        response_index_A=resp,
        hidden_index_A=hidden,
        targets_A=targets,
        response_cu_B1=cu,
    )


def padding_mask(tokens_NL: torch.Tensor, input_lens_N: torch.Tensor | None) -> torch.Tensor | None:
    """megatron-core 0.16's `padding_mask` for the inputs tokens_NL[:, :-1]: bool [N, S], True at padding.

    The contract is the router's code (not its docstrings, which say the opposite): `compute_routing_scores_for_
    aux_loss`, `z_loss_func` and the expert-bias update all use `~padding_mask` as the valid tokens, and
    `GPTModel.forward` documents "True = padding (exclude)". Pads are then left out of the load-balancing counts,
    the probabilities the aux loss averages, its token count and the z-loss. None when the lengths are unknown.
    """
    if input_lens_N is None:
        return None
    positions_S = torch.arange(tokens_NL.shape[1] - 1, device=tokens_NL.device)
    return positions_S[None, :] >= input_lens_N.to(tokens_NL.device)[:, None]


def sequence_parallel_slice(mask_NS: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Columns [rank * S / tp, (rank + 1) * S / tp) of an [N, S] mask: the positions a sequence-parallel rank holds."""
    s = mask_NS.shape[1]
    if s % tp_size:
        raise ValueError(f"sequence length {s} does not split over {tp_size} sequence-parallel ranks")
    part = s // tp_size
    return mask_NS[:, tp_rank * part : (tp_rank + 1) * part].contiguous()


def micro_batch_inputs(mb) -> ModelInputs:
    """The micro-batch's model inputs (its padded rows when the micro-batcher set none)."""
    return mb.inputs if mb.inputs is not None else padded_inputs(mb)
