"""Rank function of the checkpoint-before-the-first-step test with a lazily-initialising fused Adam (issue 25,
item 3): TE's / apex's FusedAdam, as megatron-core 0.16.1 sees it, keeps its step count in the param groups and
creates exp_avg / exp_avg_sq inside `step()`. The CPU has neither, so the rank puts a stand-in with that behaviour
inside megatron's DistributedOptimizer and sets megatron's module flags as an installed TE sets them
(distrib_optimizer.py: HAVE_APEX_OR_TE, USING_TE_OPTIMIZER), restored on the way out."""

from __future__ import annotations

import torch


class LazyFusedAdam(torch.optim.Optimizer):
    """AdamW whose moments appear at the first `step()` and whose step count lives in each param group."""

    def __init__(self, param_groups, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t = group["betas"], group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1**t))


def _swap_in_fused_adam(optimizer) -> None:
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        cfg = sub.config
        sub.optimizer = LazyFusedAdam(
            sub.optimizer.param_groups,
            cfg.lr,
            (cfg.adam_beta1, cfg.adam_beta2),
            cfg.adam_eps,
            cfg.weight_decay,
        )


def save_and_load_before_first_step(root: str, fused: bool = True) -> dict:
    """Saves the optimizer checkpoint of a never-stepped DP=2 distributed optimizer (bf16 params, fp32 masters)
    with the fused-Adam stand-in (`fused`, else megatron's CPU choice, torch's AdamW), loads it into a second one, and takes a step there. Returns the loaded state's
    moment maxima, whether the masters equal the model weights, and the step count after the step."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_gspo.checkpoint.optimizer_io import load_optimizer_checkpoint, write_optimizer_checkpoint
    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, build_optimizer, unwrap
    from tests.models.parity import tiny_config
    from tests.training.optimizer_state import full_optimizer_state

    flags = {k: getattr(distrib_optimizer, k) for k in ("HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER")}
    if fused:
        distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = True, True
    cfg, parallel = tiny_config(), ParallelConfig()
    initialize(parallel, seed=2)
    try:
        optim = OptimConfig(distributed=True, lr=1e-2)
        built = []
        for _ in range(2):
            chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=torch.bfloat16), optim)
            opt = build_optimizer(chunks, optim, torch.bfloat16)
            if fused:
                _swap_in_fused_adam(opt)
            sched = OptimizerParamScheduler(
                opt,
                init_lr=1e-2,
                max_lr=1e-2,
                min_lr=0.0,
                lr_warmup_steps=0,
                lr_decay_steps=10,
                lr_decay_style="constant",
                start_wd=0.0,
                end_wd=0.0,
                wd_incr_steps=10,
                wd_incr_style="constant",
            )
            built.append((chunks, opt, sched))
        (chunks, opt, sched), (chunks2, opt2, sched2) = built
        write_optimizer_checkpoint(chunks, opt, sched, root)
        for m2, m in zip(chunks2, chunks):  # the model load a resume does first
            unwrap(m2).load_state_dict(unwrap(m).state_dict())
        load_optimizer_checkpoint(chunks2, opt2, sched2, root)
        state = full_optimizer_state(chunks2, opt2)
        weights = {n: p.detach().float().clone() for n, p in unwrap(chunks2[0]).named_parameters()}
        masters_match = all(
            torch.equal(state["param"][k].to(torch.bfloat16), v.to(torch.bfloat16))
            for k, v in _hf(chunks2).items()
        )
        for p in unwrap(chunks2[0]).parameters():
            p.main_grad.fill_(1e-3)
        ok, _, _ = opt2.step()
        moved = max(
            (p.detach().float() - weights[n]).abs().max().item()
            for n, p in unwrap(chunks2[0]).named_parameters()
        )
        return dict(
            moments=max(v.abs().max().item() for k in ("exp_avg", "exp_avg_sq") for v in state[k].values()),
            masters_match=masters_match,
            ok=bool(ok),
            moved=moved,
            steps=sorted(
                {
                    int(_step(sub.optimizer, g))
                    for sub in getattr(opt2, "chained_optimizers", [opt2])
                    for g in sub.optimizer.param_groups
                    if g["params"]
                }
            ),
        )
    finally:
        for k, v in flags.items():
            setattr(distrib_optimizer, k, v)
        shutdown()


def _step(inner, group) -> float:
    """The step count of a param group: in its params' state (torch Adam; megatron also leaves a stale copy in the
    group) or in the group (fused Adam)."""
    state = inner.state[group["params"][0]]
    return float(state["step"]) if "step" in state else group["step"]


def _hf(chunks) -> dict:
    from megatron_gspo.models.hf_state import export_hf_state_dict
    from megatron_gspo.training.engine import unwrap

    return export_hf_state_dict([unwrap(c) for c in chunks])
