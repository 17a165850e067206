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
    assert cpu_backend.apply_without_te() is False  # the no-TE router fix is not applied blind either


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


def _float16_optimizer_on_cpu():
    """megatron's Float16OptimizerWithFloat16Params with CPU params: bf16 params get fp32 main copies, fp32 params
    are used as they are, one SGD step goes through the masters; the CUDA type names are gone afterwards."""
    from megatron_gspo.parallel import cpu_backend as cb

    assert cb.apply() is True
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    w16 = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    w32 = torch.nn.Parameter(torch.tensor([3.0]))
    config = OptimizerConfig(optimizer="sgd", lr=0.25, bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0)
    opt = Float16OptimizerWithFloat16Params(torch.optim.SGD([w16, w32], lr=0.25), config, None, None)
    out = dict(
        sorted=(opt.float16_groups[0] == [w16], opt.fp32_from_fp32_groups[0] == [w32]),
        main_dtype=w16.main_param.dtype,
        types=(w16.type(), w32.type(), "type" in vars(w16) or "type" in vars(w32)),
    )
    w16.main_grad = torch.tensor([0.5, 1.0])
    w32.main_grad = torch.tensor([2.0])
    w16.main_param.data.add_(1e-3)  # an fp32-only change: the step starts from the master, not the bf16 copy
    ok, _, _ = opt.step()
    out.update(ok=ok, w16=w16.detach().clone(), main=w16.main_param.detach().clone(), w32=w32.detach().clone())
    return out


def test_float16_optimizer_keeps_fp32_masters_on_cpu():
    out = run_distributed(_float16_optimizer_on_cpu, world_size=1)[0]
    assert out["sorted"] == (True, True) and out["main_dtype"] == torch.float32
    assert out["types"] == ("torch.BFloat16Tensor", "torch.FloatTensor", False)
    assert out["ok"]
    expected_main = torch.tensor([1.001 - 0.125, -2.0 + 0.001 - 0.25])
    torch.testing.assert_close(out["main"], expected_main, rtol=0, atol=1e-6)
    assert out["w16"].dtype == torch.bfloat16 and torch.equal(out["w16"], expected_main.to(torch.bfloat16))
    torch.testing.assert_close(out["w32"], torch.tensor([3.0 - 0.5]))


def _router_gemm_on_a_cuda_machine_without_te():
    """A CUDA machine without transformer-engine (CUDA faked: only `torch.cuda.is_available` answers True): no CPU
    patches, but megatron's router gating GEMM still needs its `te_general_gemm` fix."""
    torch.cuda.is_available = lambda: True
    from megatron.core.transformer.moe import moe_utils

    from megatron_gspo.parallel import cpu_backend as cb

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    out = {"have_te": moe_utils.HAVE_TE, "cpu_patches": cb.apply()}
    try:
        moe_utils.router_gating_linear(x, w, None, torch.float32)
        out["unpatched"] = "ran"
    except NameError as err:
        out["unpatched"] = f"NameError: {err}"
    out["fixed"] = cb.apply_without_te()
    out["again"] = cb.apply_without_te()  # idempotent
    y = moe_utils.router_gating_linear(x, w, None, torch.float32)
    y.sum().backward()
    out.update(x=x.detach(), w=w.detach(), y=y.detach(), dx=x.grad, dw=w.grad)
    return out


def test_router_gating_without_te_on_a_cuda_machine():
    out = run_distributed(_router_gemm_on_a_cuda_machine_without_te, world_size=1)[0]
    assert out["have_te"] is False and out["cpu_patches"] is False
    assert out["unpatched"] == "NameError: name 'te_general_gemm' is not defined"  # the megatron 0.16 bug
    assert out["fixed"] is True and out["again"] is False
    x, w = out["x"], out["w"]
    torch.testing.assert_close(out["y"], (x @ w.T).float())  # megatron's torch.mm path, in the router dtype
    # d/dx sum(x W^T) = W summed over experts for every token; d/dW = x summed over tokens for every expert.
    # The gradients are computed in the router dtype (fp32) and returned as float64: compare at fp32 precision
    # (float64's default tolerance failed on one random draw by 1.5e-7, a last-bit fp32 rounding difference).
    fp32 = dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(out["dx"], w.sum(0).expand(5, 3), **fp32)
    torch.testing.assert_close(out["dw"], x.sum(0).expand(4, 3), **fp32)


def _thd_rope_both_ways():
    """megatron's THD RoPE (its per-sequence loop) and the patched one on the same packs, values and gradients,
    with this process's real one-rank context-parallel group; plus a pack the patch hands back to megatron."""
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    initialize(ParallelConfig(), seed=3)
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.models.common.embeddings import rope_utils

        patched = rope_utils._apply_rotary_pos_emb_thd
        original = patched.__wrapped_for_cpu__
        cp = ps.get_context_parallel_group()
        g = torch.Generator().manual_seed(0)
        freqs = torch.randn(24, 1, 1, 16, generator=g)
        out = {"is_patched": original is not patched, "cases": []}
        for lengths in ([5, 1, 9, 3], [17], [1, 1, 1]):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            t = torch.randn(sum(lengths), 4, 16, generator=g)
            up = torch.randn_like(t)
            results = []
            for fn in (patched, original):
                x = t.clone().requires_grad_(True)
                y = fn(x, cu, freqs, cp_group=cp)
                (y * up).sum().backward()
                results.append((y.detach(), x.grad))
            out["cases"].append(results)
        # the same cu_seqlens tensor changed in place (same total): the patch's positions follow it
        cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
        t = torch.randn(18, 4, 16, generator=g)
        patched(t, cu, freqs, cp_group=cp)
        cu.copy_(torch.tensor([0, 2, 12, 13, 18], dtype=torch.int32))
        out["in_place"] = (patched(t, cu, freqs, cp_group=cp), original(t, cu, freqs, cp_group=cp))
        # under torch.inference_mode (tensors without a version counter): not cached, still megatron's result
        with torch.inference_mode():
            cu = torch.tensor([0, 4, 18], dtype=torch.int32)
            t = torch.randn(18, 4, 16, generator=g)
            out["inference"] = (patched(t, cu, freqs, cp_group=cp), original(t, cu, freqs, cp_group=cp))
        # freqs over every packed position (megatron's CASE 1) is not the patch's case: megatron's own result
        full = torch.randn(6, 1, 1, 16, generator=g)
        t = torch.randn(6, 4, 16, generator=g)
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        out["case1"] = (patched(t, cu, full, cp_group=cp), original(t, cu, full, cp_group=cp))
    finally:
        shutdown()
    return out


def test_packed_rope_without_the_per_sequence_loop_is_megatrons_bit_for_bit():
    out = run_distributed(_thd_rope_both_ways, world_size=1)[0]
    assert out["is_patched"]
    for (y, gx), (y_ref, gx_ref) in out["cases"]:
        assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
        assert gx_ref.abs().max() > 0
    assert torch.equal(*out["case1"])
    assert torch.equal(*out["in_place"])
    assert torch.equal(*out["inference"])


_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "_coalescing_manager")


def _one_rank_collectives_both_ways():
    """Two distributed-optimizer AdamW steps of the tiny model at DP = TP = PP = 1, with megatron's collectives
    over one-rank groups short-circuited (the patch) and with every one of them handed to gloo (the patch undone
    in this process: megatron's modules get torch.distributed back). gloo's calls are counted in both."""
    import sys

    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from megatron_gspo.parallel import cpu_backend as cb
    from megatron_gspo.parallel import cpu_stand_ins
    from tests.training.distributed_optimizer_ranks import adam_steps

    assert cb.apply() is True
    calls: list[str] = []
    real = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            # megatron's own calls (through the shim when it hands a call on); ours and the test's are not counted
            frame = sys._getframe(1)
            if frame.f_globals.get("__name__") == cpu_stand_ins.__name__:
                frame = frame.f_back
            if frame.f_globals.get("__name__", "").startswith("megatron.core"):
                calls.append(name)
            return real[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counted(name))
    out = {"is_patched": pgb.dist_reduce_scatter_func is not real["reduce_scatter_tensor"]}
    try:
        out["patched"] = adam_steps({}, ["fp32"], distributed=True)["fp32"]
        out["patched_calls"] = list(calls)
        calls.clear()
        stand_ins = [m.torch for n, m in sys.modules.items()
                     if n.startswith("megatron.core") and isinstance(getattr(m, "torch", None), cb._CpuTorch)]
        shims = {s: s.distributed for s in stand_ins}
        kept = (pgb._coalescing_manager, pgb.dist_all_gather_func, pgb.dist_reduce_scatter_func)
        for s in stand_ins:
            object.__setattr__(s, "distributed", dist)
        pgb._coalescing_manager = dist._coalescing_manager
        pgb.dist_all_gather_func, pgb.dist_reduce_scatter_func = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
        try:
            out["gloo"] = adam_steps({}, ["fp32"], distributed=True)["fp32"]
        finally:
            for s, d in shims.items():
                object.__setattr__(s, "distributed", d)
            pgb._coalescing_manager, pgb.dist_all_gather_func, pgb.dist_reduce_scatter_func = kept
        out["gloo_calls"] = list(calls)
    finally:
        for name in _COLLECTIVES:
            setattr(dist, name, real[name])
    return out


def test_one_rank_collectives_skip_gloo_and_change_nothing():
    out = run_distributed(_one_rank_collectives_both_ways, world_size=1)[0]
    assert out["is_patched"]
    # none of megatron's collectives reaches gloo with the patch ...
    assert out["patched_calls"] == []
    # ... its reduce-scatter, all-gather, token-count and grad-norm collectives all do without it
    gloo = out["gloo_calls"]
    assert {"reduce_scatter_tensor", "all_gather_into_tensor", "_coalescing_manager", "all_reduce"} <= set(gloo), gloo
    a, b = out["patched"], out["gloo"]
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert all(n > 0 for n in a["grad_norm"])  # real gradients: the steps moved the weights


def _reset_walk_both_ways():
    """megatron's reset_model_temporary_tensors after apply(): with the global aux loss its walk resets the
    trackers; without it (and without an expert bias) the walk, which would do nothing, does not happen."""
    from types import SimpleNamespace

    import importlib

    from megatron_gspo.parallel import cpu_backend as cb

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    assert cb.apply() is True
    resets, walks = [], []

    class Tracker(torch.nn.Module):
        def reset_global_aux_loss_tracker(self):
            resets.append(1)

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tracker = Tracker()

        def modules(self):
            walks.append(1)
            return super().modules()

    out = {"is_patched": hasattr(fmg.reset_model_temporary_tensors, "__wrapped_for_cpu__")}
    for kind, bias in (("global_aux_loss", False), (["seq_aux_loss", "global_aux_loss"], False), ("aux_loss", True),
                       ("aux_loss", False)):
        resets.clear()
        walks.clear()
        config = SimpleNamespace(moe_router_enable_expert_bias=bias, moe_router_load_balancing_type=kind)
        fmg.reset_model_temporary_tensors(config, [Chunk()])
        out[str(kind), bias] = (len(walks), len(resets))
    return out


def test_reset_of_temporary_tensors_walks_only_when_it_resets_something():
    out = run_distributed(_reset_walk_both_ways, world_size=1)[0]
    assert out["is_patched"]
    assert out["global_aux_loss", False] == (1, 1)
    assert out[str(["seq_aux_loss", "global_aux_loss"]), False] == (1, 1)
    assert out["aux_loss", True] == (1, 0)  # an expert bias: megatron walks (no module here has one)
    assert out["aux_loss", False] == (0, 0)
