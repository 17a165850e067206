"""Colocated memory (training/offload.py): the optimizer state, main-grad buffers and fp32 masters go to host memory
and come back bit-exactly, and the next step is the step the run would have taken without the round trip (DP=2,
bf16 params with fp32 masters, the distributed optimizer: each rank moves its own shards)."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.offload_ranks import offload_round_trip


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(offload_round_trip, {}, "bf16", world_size=2)


def test_offload_frees_the_state_and_reload_restores_it_bit_exactly(ranks):
    for r in ranks:
        run = r["offloaded"]
        assert run["freed"] and run["gib"] > 0
        assert "torch.float32" in run["kinds"]  # grad buffers, Adam moments, masters
        assert len(run["before"]) >= 3 and any(run["is_grad"]) and not all(run["is_grad"])
        for before, after, grad in zip(run["before"], run["after"], run["is_grad"]):
            # Adam moments and masters come back bit-exact; grad buffers (dead until the next update zeroes them)
            # are freed without a copy and come back zeroed.
            assert torch.equal(after, torch.zeros_like(before) if grad else before)
        assert any(t.abs().max() > 0 for t, grad in zip(run["before"], run["is_grad"]) if not grad)
        assert any(t.abs().max() > 0 for t, grad in zip(run["before"], run["is_grad"]) if grad)


def test_the_next_step_after_a_round_trip_is_the_same(ranks):
    for r in ranks:
        plain, offloaded = r["plain"], r["offloaded"]
        assert offloaded["first"] == plain["first"] and offloaded["second"] == plain["second"]
        for name, value in plain["weights"].items():
            assert torch.equal(offloaded["weights"][name], value), name


@pytest.mark.gpu
def test_offload_frees_device_memory_on_cuda():
    """tools/gpu_smoke.sh part colocated-memory: on a GPU the device allocation drops by what was moved."""
    (r,) = run_distributed(offload_round_trip, {}, "bf16", world_size=1)
    run = r["offloaded"]
    assert run["device"].startswith("cuda")
    assert run["allocated_drop_gib"] >= 0.99 * run["gib"] > 0
    for before, after, grad in zip(run["before"], run["after"], run["is_grad"]):
        assert torch.equal(after, torch.zeros_like(before) if grad else before)
    assert run["second"] == r["plain"]["second"]
