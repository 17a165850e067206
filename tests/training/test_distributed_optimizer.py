"""megatron's distributed optimizer (the default) on 2 gloo ranks equals the plain optimizer in one process.

Two AdamW steps on one batch, in DP=2 (dense and expert state sharded over 2 replicas), TP=2 + sequence parallel
(DP=1: nothing to shard, the grad norm spans TP shards) and EP=2 (dense state sharded over DP=2, experts over
EP): loss and grad norm of both steps, the weights after them, and the fp32 master weights and Adam moments
gathered to one layout. fp32 to reduction-order rounding; bf16 (bf16 params, fp32 masters and grads) to bf16
accuracy, the tolerances of tests/models/test_layouts.py, whose measurements they come from. A missing DP
reduction, a shard left unsynchronised, or a grad norm over one shard only are errors of 10% or more.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.distributed_optimizer_ranks import ADAM, adam_steps

DTYPES = ["fp32", "bf16"]
LAYOUTS = {"dp2": {}, "tp2_sp": dict(tp=2, sequence_parallel=True), "ep2": dict(ep=2)}
TOL = {
    # ulp: the weights' rounding (rtol); loss, grad norm (rtol); weights / masters (atol in units of lr: every Adam step moves a weight <= ~lr);
    # moments (norm-wise relative over all tensors)
    "fp32": dict(ulp=0.0, loss=1e-6, grad_norm=1e-5, weights=1e-3, moments=1e-5),
    "bf16": dict(ulp=2.0**-7, loss=2e-3, grad_norm=2e-2, weights=0.5, moments=0.05),
}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(adam_steps, {}, DTYPES, False, world_size=1)[0]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request):
    return request.param, run_distributed(adam_steps, LAYOUTS[request.param], DTYPES, True, world_size=2)


def _rel_all(got: dict, ref: dict) -> float:
    """Norm-wise relative difference over all tensors (an expert that saw few tokens has tiny, noisy moments)."""
    diff = sum(((got[k] - v) ** 2).sum() for k, v in ref.items())
    return (diff / sum((v**2).sum() for v in ref.values())).sqrt().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_distributed_optimizer_steps_equal_the_single_process(reference, layout, dtype):
    name, ranks = layout
    ref, tol = reference[dtype], TOL[dtype]
    assert ref["types"] != ["DistributedOptimizer"] and ref["grad_norm"][0] > 0
    for r in (x[dtype] for x in ranks):
        assert r["types"] == ["DistributedOptimizer"], (name, r["types"])
        assert r["loss"] == pytest.approx(ref["loss"], rel=tol["loss"]), name
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=tol["grad_norm"]), name
        assert r["state"]["step"] == ref["state"]["step"] == [2]
        for key, value in ref["weights"].items():  # bf16 weights: a master on a rounding boundary rounds either way
            torch.testing.assert_close(r["weights"][key], value, atol=tol["weights"] * ADAM["lr"], rtol=tol["ulp"],
                                       msg=f"{name}: weight {key}")
        for key, value in ref["state"]["param"].items():
            torch.testing.assert_close(r["state"]["param"][key], value, atol=tol["weights"] * ADAM["lr"], rtol=0,
                                       msg=f"{name}: fp32 master {key}")
        for moment in ("exp_avg", "exp_avg_sq"):
            assert all(v.abs().max() > 0 for v in ref["state"][moment].values()), moment
            assert _rel_all(r["state"][moment], ref["state"][moment]) < tol["moments"], (name, moment)


@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_state_is_not_duplicated_across_replicas(reference, layout, dtype):
    """Each rank holds only its shard of the fp32 masters (and the moments beside them): DP=2 halves them."""
    name, ranks = layout
    total = reference[dtype]["total_params"]
    held = [x[dtype]["local_masters"] for x in ranks]
    assert reference[dtype]["local_masters"] == total
    if name == "dp2":
        assert sum(held) == total and max(held) <= total // 2 + 64, held
    else:  # tp2 / ep2: each rank holds a different half of the model, and dense state is split over DP when DP > 1
        assert sum(held) <= sum(x[dtype]["total_params"] for x in ranks), held


@pytest.fixture(scope="module")
def overlapped():
    return run_distributed(adam_steps, {}, ["fp32"], True, 2, True, world_size=2)


def test_overlapped_reduce_and_gather_equal_the_single_process_once_the_gather_is_forced(reference, overlapped):
    """overlap_grad_reduce + overlap_param_gather with small buckets (the GPU settings): the steps are the same;
    weights read right after a step (as a weight sync or checkpoint would) miss the other rank's updated shard
    until `finish_param_gather` completes the gather."""
    ref = reference["fp32"]
    for r in (x["fp32"] for x in overlapped):
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        stale = max((r["stale"][k] - v).abs().max().item() for k, v in ref["weights"].items())
        assert stale > 0.3 * ADAM["lr"], stale
        for key, value in ref["weights"].items():
            torch.testing.assert_close(r["weights"][key], value, atol=1e-3 * ADAM["lr"], rtol=0, msg=key)
