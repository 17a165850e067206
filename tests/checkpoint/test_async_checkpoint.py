"""Asynchronous checkpoints (trainer.async_save): megatron's forked writers write a snapshot of the step's state
while training goes on; the checkpoint becomes visible only once every rank's writes are done; a failed writer
fails every rank and leaves the previous checkpoint as the newest."""

import pytest
import torch

from tests.checkpoint.async_checkpoint_ranks import failing_writers, save_while_training
from tests.distributed import run_distributed

EP2 = ("parallel.ep=2", "model.dtype=bf16")  # dense params DP=2 (distributed optimizer), experts EP=2


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _moved(after: dict, saved: dict) -> int:
    return sum(not torch.equal(t, saved[name]) for name, t in after.items())


def test_an_async_checkpoint_holds_its_steps_state_while_training_goes_on(tmp_path):
    # Spawned, as torchrun starts ranks: each with its own string-hash seed (dist_checkpointing plans from dicts).
    outs = run_distributed(save_while_training, str(tmp_path / "run"), EP2, world_size=2, start_method="spawn")
    for rank, out in enumerate(outs):
        assert out["in_flight"] == 1 and out["poll"] is None
        # The staged copies live until the writer is done (on a GPU they are pinned blocks PyTorch would reuse).
        assert out["staged"] > 0 and out["staged_alive"] == out["staged"] == out["staged_released"]
        # While the writers run: only the unfinished directory, no `latest`, nothing a resume would pick.
        assert out["while_writing"] == ["iter_0000001.tmp"] and out["latest_while_writing"] is None
        assert out["done"] == out["path"] and out["after_wait"] == ["iter_0000001", "latest"]
        assert out["latest"] == "iter_0000001"
        # The resumed state is the state at the save, not the one the update during the write made.
        assert _same(out["resumed"], out["saved"])
        # Each rank's files were hashed once, after they were written, by its background writer (not the trainer).
        assert len(out["hashed_by"]) == 1 and out["hashed_by"] != [out["pid"]]
        assert f"rng/rank_{rank:05d}.pt" in out["record"]
        assert any(f.startswith(f"model/__{rank}_") for f in out["record"]), out["record"]
        assert _moved(out["after"]["weights"], out["saved"]["weights"])
        for key in ("param", "exp_avg", "exp_avg_sq"):  # fp32 masters and moments
            assert _moved(out["after"]["optimizer"][key], out["saved"]["optimizer"][key]), key
    assert _same(outs[0]["resumed"], outs[1]["resumed"])


# (rank, what fails): its writers (ENOSPC inside megatron's writer), one of its per-file writer processes (SIGKILL,
# as from the OOM killer: megatron's writer would wait for it forever), megatron's writer itself (SIGKILL), the
# start of its writer (staging), a file rank 0 alone writes in megatron's finalize functions, each followed by a
# collective (a broadcast, a barrier) that a raising rank 0 would skip: the other rank would wait there forever,
# or the distributed optimizer's files, which each rank writes before the background part starts (rank 1's shard,
# rank 0's common file).
FAILURES = [(0, "writer"), (1, "writer"), (1, "killed"), (0, "writer-killed"), (1, "start"), (0, "model/.metadata"),
            (0, "model/metadata.json"), (1, "optimizer/rank_00001.pt"), (0, "optimizer/distributed.pt")]
CAUSES = {  # what the one-line error must say (default: "No space left on device")
    "start": ["MemoryError: staging the checkpoint tensors"],
    "killed": ["a checkpoint file writer process (pid", "was killed by SIGKILL"],
    "writer-killed": ["the checkpoint writer process (pid", "was killed by SIGKILL"],
}


def test_a_failed_write_fails_every_rank_and_the_next_checkpoint_works(tmp_path):
    # One trainer per rank goes through every failure in turn: each must leave it able to write the next one.
    outs = run_distributed(failing_writers, str(tmp_path / "run"), FAILURES, EP2, world_size=2, timeout=300)
    for case, (rank, what) in enumerate(FAILURES):
        failed, written = 2 * case + 2, 2 * case + 3  # checkpoint 1 was written first
        causes = CAUSES.get(what, ["No space left on device"])
        for out in (per_rank[case] for per_rank in outs):
            error = out["error"]
            assert error is not None and error.startswith(f"checkpoint iter_{failed:07d} not written"), (what, error)
            assert all(c in error for c in causes) and f"rank {rank}" in error and "\n" not in error, (what, error)
            # only the rank that failed is named (not megatron's coordinator echoing it as its own failure)
            assert f"rank {1 - rank}:" not in error, (what, error)
            assert out["in_flight"] is None and out["stale"] == 0, what
            assert out["survivors"] == [], what  # no writer process of the failed checkpoint is left running
            assert out["step"] == written and out["next"].endswith(f"iter_{written:07d}"), what
            assert out["latest"] == f"iter_{written:07d}", what
            # keep_last=2; the failed checkpoint left nothing, not even its .tmp
            assert out["entries"] == [f"iter_{written - 2:07d}", f"iter_{written:07d}", "latest"], (what, out)
        if what in ("writer", "killed", "writer-killed", "start"):
            # the writers had started (for `start`: those of the rank that did not fail)
            started = [r for r in range(2) if not (what == "start" and r == rank)]
            assert all(outs[r][case]["writers"] > 0 for r in started), what


@pytest.mark.gpu
def test_an_async_checkpoint_on_cuda_holds_its_steps_state(tmp_path):
    """tools/gpu_smoke.sh part async-save: on a GPU the writer cannot read device memory; the tensors are staged in
    host memory before it forks, so the update during the write must not reach the checkpoint either."""
    (out,) = run_distributed(save_while_training, str(tmp_path / "run"), ("model.dtype=bf16",), world_size=1)
    assert out["device"].startswith("cuda")
    assert out["in_flight"] == 1 and out["poll"] is None and out["while_writing"] == ["iter_0000001.tmp"]
    assert out["latest"] == "iter_0000001"
    assert _same(out["resumed"], out["saved"]) and _moved(out["after"]["weights"], out["saved"]["weights"])
