"""Packed (THD) micro-batches with fused response-only log-probs give the padded, materialised-logits result: old
log-probs (R2 recording), the GSPO loss and every gradient, with routing replay R2 on and the router aux loss on,
single-process and for TP=2+SP (full recompute), EP=2 (selective recompute; two data-parallel replicas whose packs
the allgather dispatcher needs equally long) and PP=2 (fixed p2p shapes: one pack length), each against the
single-process padded reference. A token budget gives the full-batch loss and gradient (aux loss off: its value
is per micro-batch by definition), with a replica that needs more micro-batches than the other."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.packed_ranks import LENGTHS, N, run_many

REF = ("padded", "logits", 2, 0)
PACKED = ("packed", "fused", 2, 0)
SINGLE = [REF, PACKED, ("packed", "logits", 2, 0), ("padded", "fused", 2, 0)]
BUDGET = ("packed", "fused", 1, 24)
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def single():
    fp32, no_aux, bf16 = run_distributed(run_many, [
        ({}, SINGLE, {}),
        ({}, [REF, BUDGET], {"aux": 0.0}),
        ({}, [REF, PACKED], {"dtype": "bf16"}),
    ], world_size=1)[0]
    return {"fp32": fp32, "no_aux": no_aux, "bf16": bf16}


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(run_many, [({"tp": 2, "sequence_parallel": True}, [PACKED], {"recompute": "full"})])


@pytest.fixture(scope="module")
def ep2():
    return run_distributed(run_many, [
        ({"ep": 2}, [PACKED], {"recompute": "selective"}),
        ({"ep": 2}, [BUDGET], {"aux": 0.0}),
    ])


@pytest.fixture(scope="module")
def pp2():
    return run_distributed(run_many, [({"pp": 2}, [PACKED], {})])


def assert_same(got: dict, ref: dict, *, old: bool = True, replicas: int = 1) -> None:
    """Old log-probs (gathered over replicas), metrics (one replica's share when there are several) and gradients."""
    if old:
        torch.testing.assert_close(got["old_logprobs"], ref["old_logprobs"], **TOL)
    if got["metrics"] is not None:
        assert got["metrics"]["num_sequences"] == N // replicas
        if replicas == 1:
            for key in ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max", "approx_kl"):
                assert got["metrics"][key] == pytest.approx(ref["metrics"][key], abs=1e-6), key
    assert ref["grads"].keys() == got["grads"].keys()
    for key, value in ref["grads"].items():
        torch.testing.assert_close(got["grads"][key], value, **TOL, msg=key)


def test_reference_is_not_trivial(single):
    ref = single["fp32"][REF]
    mask = ref["old_logprobs"] != 0
    assert int(mask.sum()) == sum(r for _, r in LENGTHS) and bool((ref["old_logprobs"][mask] < 0).all())
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.gate.weight", "lm_head.weight"):
        assert ref["grads"][key].abs().max() > 1e-4, key


@pytest.mark.parametrize("case", SINGLE[1:], ids=lambda c: f"{c[0]}-{c[1]}")
def test_single_process_layouts_and_paths_match_padded_logits(single, case):
    assert_same(single["fp32"][case], single["fp32"][REF])


def test_r2_routes_recorded_from_packs_are_the_padded_routes(single, tp2, ep2, pp2):
    ref = single["fp32"][REF]["routes"]
    assert len(ref) == N
    for got in [single["fp32"][PACKED]["routes"], tp2[0][0][PACKED]["routes"], pp2[0][0][PACKED]["routes"]]:
        for i in range(N):
            torch.testing.assert_close(got[i], ref[i], rtol=0, atol=0)
    for rank, part in enumerate(ep2):  # two replicas, 4 sequences each
        for i, routes in part[0][PACKED]["routes"].items():
            torch.testing.assert_close(routes, ref[rank * N // 2 + i], rtol=0, atol=0)


def test_tp2_sequence_parallel_full_recompute(single, tp2):
    for rank in tp2:
        assert_same(rank[0][PACKED], single["fp32"][REF])
        assert all(length % 2 == 0 for length in rank[0][PACKED]["pack_lengths"])


def test_ep2_two_replicas_selective_recompute(single, ep2):
    lengths = [rank[0][PACKED]["pack_lengths"] for rank in ep2]
    assert lengths[0] == lengths[1]  # the allgather dispatcher gathers equal token counts over the expert group
    for rank in ep2:
        assert_same(rank[0][PACKED], single["fp32"][REF], replicas=2)


def test_pp2_one_pack_length(single, pp2):
    last = [rank[0][PACKED] for rank in pp2 if rank[0][PACKED]["is_last_stage"]]
    assert len(last) == 1
    assert len(set(last[0]["pack_lengths"])) == 1
    for rank in pp2:
        assert_same(rank[0][PACKED], single["fp32"][REF], old=rank[0][PACKED]["is_last_stage"])


def test_pads_of_a_pack_replay_distinct_experts(tp2, pp2):
    seen = 0
    for rank in [*tp2, *pp2]:
        for pad_routes in rank[0][PACKED]["pad_routes"] or []:
            for ids in pad_routes:
                seen += 1
                assert len(set(ids.tolist())) == ids.numel()
    assert seen > 0


def test_token_budget_gives_the_full_batch_loss_and_gradient(single, ep2):
    ref = single["no_aux"][REF]
    got = single["no_aux"][BUDGET]
    assert_same(got, ref)
    assert all(length <= 24 for length in got["pack_lengths"]) and len(got["micro_batches"]) > N // 2
    counts = [len(rank[1][BUDGET]["micro_batches"]) for rank in ep2]
    assert counts == [4, 4]  # rows 4-7 need 4 micro-batches under the budget, so rows 0-3 get 4 too
    for rank in ep2:
        assert_same(rank[1][BUDGET], ref, replicas=2)
        assert all(length <= 24 for length in rank[1][BUDGET]["pack_lengths"])


def test_bf16_packed_fused_is_as_accurate_as_padded_logits(single):
    """bf16 params (fp32 main grads), the cluster configuration: the packed path runs other kernels (SDPA per block,
    the fused LM head), so it is compared with the fp32 result as the padded bf16 path is: its error (norm-wise,
    over all gradients; over all old log-probs) is of the same size as the padded path's."""
    exact = single["fp32"][REF]
    mask = exact["old_logprobs"] != 0

    def errors(run):
        lp = (run["old_logprobs"] - exact["old_logprobs"])[mask].norm() / exact["old_logprobs"][mask].norm()
        flat = torch.cat([run["grads"][k].flatten() for k in exact["grads"]])
        ref = torch.cat([v.flatten() for v in exact["grads"].values()])
        return float(lp), float((flat - ref).norm() / ref.norm())

    padded, packed = errors(single["bf16"][REF]), errors(single["bf16"][PACKED])
    assert 0 < padded[0] < 0.01 and 0 < padded[1] < 0.05  # bf16 differs from fp32, but not by much
    assert packed[0] < 2 * padded[0] and packed[1] < 2 * padded[1], (packed, padded)
