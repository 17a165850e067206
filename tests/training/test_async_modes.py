"""rollout.mode: `async` with `max_staleness: 0` is synchronous RL (same rollouts, losses and weights) run through
the producer thread; a killed async run resumes exactly; the modes a run cannot use are one-line errors.

The in-process engine runs here (async with max_staleness 0 is the one async setting it supports: production on
demand, never beside training); tests/rollout/vllm/test_async_vllm.py runs one_step_off on the real vLLM server."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from megatron_gspo.training.config import load_run_config
from tests.training.test_end_to_end import ROOT, VOLATILE, _kill_and_resume, _rows, _train

ASYNC0 = ["rollout.mode=async", "rollout.max_staleness=0"]
EXAMPLE = ROOT / "examples" / "tiny_moe_gspo.yaml"


def _weights(run_dir: Path) -> dict[str, str]:
    """Digest of every file of the final checkpoint's model and optimizer state."""
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.suffix in (".distcp", ".pt")}


@pytest.mark.slow
def test_async_with_zero_staleness_equals_sync(tmp_path):
    # (dynamic sampling tops up whole batches in async modes, exact shortfalls in sync: it differs by design)
    steps = ["trainer.steps=3", "data.reward=tests.training.rewards:contains_one"]
    _train(tmp_path / "sync", steps)
    _train(tmp_path / "async", [*steps, *ASYNC0])
    sync, run = _rows(tmp_path / "sync"), _rows(tmp_path / "async")
    assert sorted(run) == [1, 2, 3]
    for step, row in sync.items():
        for key, value in row.items():
            if not key.startswith(VOLATILE):
                assert run[step][key] == value, (step, key)  # bit-identical: rewards, losses, grad norms
        assert run[step]["staleness_max"] == 0 and "time_producer_busy" in run[step] and "time_producer_busy" not in row
    weights = _weights(tmp_path / "sync")
    assert weights and _weights(tmp_path / "async") == weights


@pytest.mark.slow
def test_killed_async_run_resumes_exactly(tmp_path):
    """kill -9 mid-run: batches produced ahead are lost with the process; the resumed run makes them again from
    the checkpointed sampler position (the batches taken), so every step equals the uninterrupted run's."""
    _kill_and_resume(tmp_path, ["trainer.steps=4", "trainer.ckpt_every=1", "trainer.save_final=false", *ASYNC0],
                     4, 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.mode=later"], r"rollout\.mode='later' must be sync, one_step_off or async"),
        (["rollout.mode=async", "rollout.max_staleness=-1"], r"rollout\.max_staleness=-1 must be an integer >= 0"),
        (["rollout.mode=one_step_off", "rollout.engine=vllm", "rollout.max_staleness=0"],
         r"rollout\.mode=one_step_off .* set rollout\.max_staleness >= 1"),
        (["rollout.mode=one_step_off"], r"rollout\.mode=one_step_off needs a server engine .*rollout\.engine=vllm"),
        (["rollout.mode=async", "rollout.max_staleness=2"], r"rollout\.engine=local generates with the training"),
    ],
)
def test_modes_a_run_cannot_use_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(EXAMPLE, overrides)


def test_sync_stays_the_default():
    cfg = load_run_config(EXAMPLE)
    assert cfg.rollout.mode == "sync"
    assert load_run_config(EXAMPLE, ["rollout.engine=vllm", "rollout.mode=async", "rollout.max_staleness=4"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=2"], r"rollout\.mode=async needs parallel\.tp=parallel\.pp=parallel\.cp=1: .*broadcast"),
        (["rollout.engine=sglang", "sglang.colocated=true"], r"cannot run with sglang\.colocated=true"),
    ],
)
def test_async_where_generating_is_a_collective_or_shares_memory_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(EXAMPLE, [*ASYNC0, "rollout.engine=vllm", *overrides])
