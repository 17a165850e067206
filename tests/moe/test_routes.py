"""RouteStore and TokenLayout (no megatron): megatron's [s, b] token order, the sequence-parallel slice, padding
ids, compact storage."""

import pytest
import torch

from megatron_gspo.moe import RouteStore, TokenLayout, pad_expert_ids
from megatron_gspo.moe.routes import gather_from_grid, scatter_to_grid
from megatron_gspo.rollout.types import Rollout


def random_routes(n_tokens, n_layers=3, topk=2, experts=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(n_layers)]) for _ in range(n_tokens)]
    ).to(torch.uint8)


def test_pad_ids_are_distinct_per_token_and_spread():
    ids = pad_expert_ids(10, 3, 8)
    assert ids.shape == (10, 3) and ids.dtype == torch.int64
    assert all(len(set(row.tolist())) == 3 for row in ids)
    assert set(ids.flatten().tolist()) == set(range(8))
    assert all(len(set(row.tolist())) == 8 for row in pad_expert_ids(4, 8, 8))  # topk == experts
    with pytest.raises(ValueError, match="topk"):
        pad_expert_ids(2, 9, 8)


def test_sequence_major_token_order_by_hand():
    # padded layout: S=2, B=2; seq 10 has 2 tokens (row 0), seq 11 has 1 token (row 1).
    # megatron's router tokens: (s0,b0), (s0,b1), (s1,b0), (s1,b1) = seq10[0], seq11[0], seq10[1], pad
    r10 = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.uint8)
    r11 = torch.tensor([[[4, 5]]], dtype=torch.uint8)
    store = RouteStore.from_sequences({10: r10, 11: r11}, num_experts=8)
    layout = TokenLayout.padded([2, 1], seq_length=2)
    (layer0,) = store.routes_for_microbatch([10, 11], layout)
    assert layer0.dtype == torch.int64 and layer0.shape == (4, 2)
    assert layer0[:3].tolist() == [[0, 1], [4, 5], [2, 3]]
    assert layer0[3].tolist() == pad_expert_ids(4, 2, 8)[3].tolist()  # pad of full-grid token index 3
    # sequence parallel over 2: rank 0 routes row s=0 (tokens 0, 1), rank 1 row s=1 (tokens 2, 3)
    (rank0,) = store.routes_for_microbatch([10, 11], layout, split_rank=0, split_size=2)
    (rank1,) = store.routes_for_microbatch([10, 11], layout, split_rank=1, split_size=2)
    assert torch.equal(torch.cat([rank0, rank1]), layer0)


@pytest.mark.parametrize("packed", [False, True])
def test_grid_round_trip_and_split(packed):
    lengths = [5, 3, 6]
    routes = {i: random_routes(n, seed=i) for i, n in zip([7, 2, 9], lengths)}
    store = RouteStore.from_sequences(routes, num_experts=8)
    layout = TokenLayout.packed(lengths, 16) if packed else TokenLayout.padded(lengths, 8)
    grid = scatter_to_grid([routes[i] for i in (7, 2, 9)], layout, 8)
    assert grid.shape == (layout.seq_length, layout.micro_batch_size, 3, 2)
    for i, back in zip((7, 2, 9), gather_from_grid(grid, layout)):
        assert torch.equal(back, routes[i])
    full = store.routes_for_microbatch([7, 2, 9], layout)
    assert len(full) == 3 and all(t.shape == (layout.num_tokens, 2) for t in full)
    for layer in range(3):
        assert torch.equal(full[layer], grid[:, :, layer].reshape(-1, 2).long())
        # no token (real or padding) repeats an expert
        assert bool((full[layer][:, 0] != full[layer][:, 1]).all())
    parts = [store.routes_for_microbatch([7, 2, 9], layout, split_rank=r, split_size=4) for r in range(4)]
    for layer in range(3):
        assert torch.equal(torch.cat([p[layer] for p in parts]), full[layer])


def test_layer_selection_by_global_id():
    routes = random_routes(4, n_layers=4)
    store = RouteStore.from_sequences([routes], num_experts=8)
    layout = TokenLayout.padded([4])
    stage1 = store.routes_for_microbatch([0], layout, layer_ids=[2, 3])
    assert [t.tolist() for t in stage1] == [routes[:, 2].long().tolist(), routes[:, 3].long().tolist()]
    sub = store.select_layers([1, 3])
    assert sub.layer_ids == (1, 3) and torch.equal(sub[0], routes[:, [1, 3]])
    with pytest.raises(ValueError, match="layer 5"):
        store.routes_for_microbatch([0], layout, layer_ids=[5])


def test_compact_dtype_and_memory():
    store = RouteStore.from_sequences([random_routes(5), random_routes(7)], num_experts=8)
    assert store.dtype == torch.uint8 and store[0].dtype == torch.uint8
    assert store.memory_bytes() == (5 + 7) * 3 * 2 and store.num_tokens() == 12
    big = RouteStore(300, 2, range(3))
    big.add(0, torch.tensor([[[299, 0], [1, 2], [3, 4]]], dtype=torch.int64))
    assert big.dtype == torch.int16 and big.memory_bytes() == 3 * 2 * 2
    assert big[0][0, 0, 0] == 299


def test_bad_routes_and_layouts_are_refused():
    store = RouteStore(8, 2, range(3))
    with pytest.raises(ValueError, match="outside"):
        store.add(0, torch.full((2, 3, 2), 8))
    with pytest.raises(ValueError, match="repeat an expert"):
        store.add(0, torch.zeros(2, 3, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected"):
        store.add(0, torch.zeros(2, 4, 2, dtype=torch.uint8))
    store.add(0, random_routes(3))
    with pytest.raises(ValueError, match="already stored"):
        store.add(0, random_routes(3))
    with pytest.raises(KeyError, match="sequence 5"):
        store.routes_for_microbatch([5], TokenLayout.padded([3]))
    with pytest.raises(ValueError, match="feeds 4 tokens"):
        store.routes_for_microbatch([0], TokenLayout.padded([4]))
    with pytest.raises(ValueError, match="not divisible"):
        store.routes_for_microbatch([0], TokenLayout.padded([3], 5), split_size=2)
    with pytest.raises(ValueError, match="overlap"):
        TokenLayout.packed([3, 3], 8, starts=[0, 2])
    with pytest.raises(ValueError, match="outside"):
        TokenLayout.padded([9], 8)


def test_from_rollouts_r3_storage():
    rollouts = [
        Rollout([1, 2, 3], [4, 5], [-0.1, -0.2], "stop", routed_experts=random_routes(4, n_layers=4, seed=1).int()),
        Rollout([1, 2], [4], [-0.3], "length", routed_experts=random_routes(2, n_layers=4, seed=2)),
    ]
    store = RouteStore.from_rollouts(rollouts, num_experts=8, first_index=10)
    assert store.seq_indices == [10, 11] and store.layer_ids == (0, 1, 2, 3)
    assert store[10].dtype == torch.uint8 and torch.equal(store[10], rollouts[0].routed_experts.to(torch.uint8))
    rollouts[1].routed_experts = None
    with pytest.raises(ValueError, match="routed experts"):
        RouteStore.from_rollouts(rollouts, num_experts=8)


def test_from_sequences_checks_every_sequence_and_names_the_first_faulty_one():
    good = [random_routes(3, seed=s) for s in range(5)]
    store = RouteStore.from_sequences(good, num_experts=8)
    assert store.seq_indices == list(range(5)) and all(torch.equal(store[i], good[i]) for i in range(5))
    out_of_range = [*good[:2], torch.full((2, 3, 2), 8, dtype=torch.uint8), *good[2:]]
    with pytest.raises(ValueError, match="sequence 2 hold expert ids outside"):
        RouteStore.from_sequences(out_of_range, num_experts=8)
    repeated = dict(enumerate(good))
    repeated[7] = torch.zeros(2, 3, 2, dtype=torch.uint8)
    repeated[9] = torch.full((2, 3, 2), 9, dtype=torch.uint8)
    with pytest.raises(ValueError, match="sequence 7 repeat an expert"):
        RouteStore.from_sequences(repeated, num_experts=8)
    with pytest.raises(ValueError, match=r"sequence 1 have shape \(2, 4, 2\)"):
        RouteStore.from_sequences([good[0], torch.zeros(2, 4, 2, dtype=torch.uint8), good[1]], num_experts=8)
    with pytest.raises(ValueError, match="sequence 1 must be integer"):
        RouteStore.from_sequences([good[0], good[1].float()], num_experts=8)
    empty = RouteStore.from_sequences([torch.zeros(0, 3, 2, dtype=torch.uint8), good[0]], num_experts=8)
    assert empty[0].shape == (0, 3, 2)


@pytest.mark.parametrize("chunk_ids", [1, 7, 12, 1 << 22])
def test_from_sequences_checks_in_chunks_and_still_finds_a_fault_in_the_last_one(monkeypatch, chunk_ids):
    """The all-at-once check runs on chunks of about CHECK_CHUNK_IDS ids (its int64 copy and sort of a whole
    batch's routes would take ~3x 8 bytes per id at once): a fault in any chunk, the last included, is named.
    The chunk size is shrunk here (a parameter, not a stand-in: the real 4M ids would need batches far larger than
    a unit test should build) so the faults land in the first, a middle and the last chunk."""
    import megatron_gspo.moe.routes as routes_module

    monkeypatch.setattr(routes_module, "CHECK_CHUNK_IDS", chunk_ids)
    good = [random_routes(3, seed=s) for s in range(5)]  # 18 ids each
    store = RouteStore.from_sequences(good, num_experts=8)
    assert all(torch.equal(store[i], good[i]) for i in range(5))
    for faulty in (0, 4):
        bad = list(good)
        bad[faulty] = torch.full((1, 3, 2), 8, dtype=torch.uint8)
        with pytest.raises(ValueError, match=f"sequence {faulty} hold expert ids outside"):
            RouteStore.from_sequences(bad, num_experts=8)
        repeated = list(good)
        repeated[faulty] = torch.zeros(1, 3, 2, dtype=torch.uint8)
        with pytest.raises(ValueError, match=f"sequence {faulty} repeat an expert"):
            RouteStore.from_sequences(repeated, num_experts=8)
