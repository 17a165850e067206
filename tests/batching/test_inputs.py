"""Micro-batch model inputs (batching/inputs.py): a packed THD row holds each sequence's input tokens back to back,
positions restarting per sequence, a padding segment up to the pack length, and response positions that point at
the same labels as the padded rows; the token-budget bins (batching/bin_packing.py); the data-parallel deal."""

import pytest
import torch

from megatron_gspo.batching.batch import pack_rollouts
from megatron_gspo.batching.bin_packing import (
    balanced_bins,
    bin_loads,
    equal_count_partition,
    refine_bins,
    token_budget_bins,
)
from megatron_gspo.batching.dp_balance import deal
from megatron_gspo.batching.inputs import packed_inputs, padded_inputs
from megatron_gspo.batching.logprobs import scatter_to_rows
from megatron_gspo.rollout.types import Rollout


def _batch():
    rollouts = [
        Rollout([5, 6, 7], [8, 1], [-0.5, -0.5], "stop"),  # feeds 4 tokens
        Rollout([5, 6], [9, 9, 9], [-0.5] * 3, "length"),  # feeds 4 tokens
        Rollout([4], [3], [-0.5], "stop"),  # feeds 1 token
    ]
    return pack_rollouts(rollouts, seq_len=6, pad_id=0, rewards=torch.zeros(3), advantages=torch.zeros(3))


def test_packed_row_layout():
    inputs = packed_inputs(_batch(), multiple=4)
    assert inputs.input_ids_BP.tolist() == [[5, 6, 7, 8, 5, 6, 9, 9, 4, 0, 0, 0]]
    assert inputs.position_ids_BP.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 1, 2]]
    assert inputs.padding_mask_BP.tolist() == [[False] * 9 + [True] * 3]
    p = inputs.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == [0, 4, 8, 9, 12]  # the padding is its own segment: every token is covered
    assert p.cu_seqlens_kv is p.cu_seqlens_q and p.max_seqlen_q == p.max_seqlen_kv == 4
    assert isinstance(p.max_seqlen_q, int)
    layout = inputs.token_layout
    assert (layout.seq_length, layout.micro_batch_size, layout.starts, layout.lengths) == (12, 1, (0, 4, 8), (4, 4, 1))


def test_packed_and_padded_response_positions_name_the_same_labels():
    batch = _batch()
    padded, packed = padded_inputs(batch), packed_inputs(batch)
    labels = batch.tokens_NL[:, 1:][batch.loss_mask_NS]
    assert labels.tolist() == [8, 1, 9, 9, 9, 3]
    for inputs in (padded, packed):
        assert inputs.targets_A.tolist() == labels.tolist()
        assert inputs.response_cu_B1.tolist() == [0, 2, 5, 6]
    # The token fed at a response position, followed by its label, is the next token of that sequence.
    pk_ids = packed.input_ids_BP.reshape(-1)
    assert pk_ids[packed.response_index_A].tolist() == [7, 8, 6, 9, 9, 4]
    pd_ids = padded.input_ids_BP.reshape(-1)
    assert pd_ids[padded.response_index_A].tolist() == [7, 8, 6, 9, 9, 4]
    # Decoder order [P, B]: packed B = 1 (same index); padded s * B + b.
    assert packed.hidden_index_A.tolist() == packed.response_index_A.tolist()
    sb = padded.input_ids_BP.t().reshape(-1)
    assert sb[padded.hidden_index_A].tolist() == [7, 8, 6, 9, 9, 4]
    values = torch.arange(1.0, 7.0)
    rows = scatter_to_rows(values, batch.loss_mask_NS)
    assert rows[batch.loss_mask_NS].tolist() == values.tolist() and rows[~batch.loss_mask_NS].abs().sum() == 0


def test_pack_length_can_be_shared_and_is_checked():
    batch = _batch()
    assert packed_inputs(batch).input_ids_BP.shape == (1, 9)  # no padding segment needed
    assert packed_inputs(batch).packed_seq_params.cu_seqlens_q.tolist() == [0, 4, 8, 9]
    assert packed_inputs(batch, multiple=2, length=16).packed_seq_params.max_seqlen_q == 7
    with pytest.raises(ValueError, match="pack length 8 must hold 9 tokens"):
        packed_inputs(batch, length=8)
    with pytest.raises(ValueError, match="multiple of 4"):
        packed_inputs(batch, multiple=4, length=14)


def test_balanced_bins_and_token_budget():
    lengths = [24, 4, 14, 2, 17, 16, 13, 15]
    bins = balanced_bins(lengths, 3)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert max(bin_loads(lengths, bins)) <= 4 / 3 * -(-sum(lengths) // 3) + max(lengths)
    budget = token_budget_bins(lengths, 30)
    loads = bin_loads(lengths, budget)
    assert max(loads) <= 30 and len(budget) == 4  # 105 tokens need at least 4 bins of 30
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=20"):
        token_budget_bins(lengths, 20)
    more = refine_bins(lengths, budget, 6, 30)
    assert len(more) == 6 and max(bin_loads(lengths, more)) <= 30
    assert sorted(i for b in more for i in b) == list(range(8))


def test_refine_splits_when_a_fresh_assignment_would_not_fit():
    lengths = [10, 9, 9, 2]
    bins = [[0], [1], [2, 3]]  # fits a budget of 11
    out = refine_bins(lengths, bins, 4, 11)
    assert len(out) == 4 and max(bin_loads(lengths, out)) <= 11


def test_equal_count_partition_and_deal():
    lengths = [100, 1, 1, 1, 50, 50, 2, 2]
    parts = equal_count_partition(lengths, 2)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(bin_loads(lengths, parts)) == [103, 104]  # the optimum: {100, 1, 1, 1} and {50, 50, 2, 2}
    # Replica 0 holds the long sequences: the deal evens the tokens per minibatch, equal counts each.
    plan = deal([[100, 90, 80, 70], [1, 2, 3, 4]], minibatches=2)
    assert [len(p) for p in plan] == [4, 4]
    assert sorted(src for p in plan for src in p) == [(r, i) for r in range(2) for i in range(4)]
    lens = {(0, 0): 100, (0, 1): 90, (0, 2): 80, (0, 3): 70, (1, 0): 1, (1, 1): 2, (1, 2): 3, (1, 3): 4}
    for d in range(2):
        first, second = plan[d][:2], plan[d][2:]
        assert {i for _, i in first} <= {0, 1} and {i for _, i in second} <= {2, 3}  # minibatches kept
    totals = [sum(lens[s] for s in p) for p in plan]
    assert abs(totals[0] - totals[1]) < 100 < abs(340 - 10)
