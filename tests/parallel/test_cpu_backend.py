"""The CPU backend patches megatron-core only, only when asked, only for tested versions."""

import pytest
import torch

from megatron_gspo.parallel import cpu_backend
from tests.distributed import run_distributed


def test_refuses_untested_megatron_version(monkeypatch):
    monkeypatch.setattr(cpu_backend, "_version", lambda: "0.12.0")
    monkeypatch.setattr(cpu_backend, "_applied", False)
    with pytest.raises(RuntimeError, match=r"supports megatron-core .*found 0\.12\.0"):
        cpu_backend.apply(force=True)


def test_noop_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_backend.apply() is False


def _patched_behaviour():
    from megatron_gspo.parallel import cpu_backend as cb

    assert cb.apply() is True
    assert cb.apply() is True  # idempotent
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules

    out = {}
    # megatron-core's "cuda" factories land on the CPU ...
    out["megatron_device"] = str(schedules.torch.zeros([], dtype=torch.int, device="cuda").device)
    # ... while torch itself (and our code) is untouched.
    try:
        torch.zeros(1, device="cuda")
        out["plain_cuda_raises"] = False
    except (RuntimeError, AssertionError):
        out["plain_cuda_raises"] = True
    # RNG tracker: named streams are reproducible, distinct, and leave the default stream alone.
    tensor_parallel.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        a = torch.rand(3)
    after = torch.rand(3)
    tensor_parallel.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
    with tracker.fork():
        a2 = torch.rand(3)
    out.update(default_untouched=torch.equal(before, after), fork_reproducible=torch.equal(a, a2),
               fork_distinct=not torch.equal(a, before))
    # Gradient clipping by total norm works on CPU grads.
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    out["clipped"] = p.grad.clone()
    return out


def test_patched_megatron_runs_on_cpu():
    out = run_distributed(_patched_behaviour, world_size=1)[0]
    assert out["megatron_device"] == "cpu"
    assert out["plain_cuda_raises"]
    assert out["default_untouched"] and out["fork_reproducible"] and out["fork_distinct"]
    torch.testing.assert_close(out["clipped"], torch.full((4,), 2.0 * 1.0 / (4.0 + 1e-6)))
