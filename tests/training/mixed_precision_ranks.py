"""Rank function of the bf16 mixed-precision tests: a checkpoint loaded into a bf16 run (bf16 params, fp32 main
params, fp32 main grads) survives an optimizer step at a tiny learning rate, in SFT and RL, and a bf16 trainer
checkpoint resumes with the exact fp32 master weights."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.training.optimizer_state import full_optimizer_state, local_masters
from tests.training.test_end_to_end import MINI

EXAMPLE = "examples/tiny_moe_gspo.yaml"
TINY_LR = 1e-7
"""Adam's first step moves every weight by about the learning rate: far below bf16 resolution of the loaded
values, far above the fp32 resolution of the master weights."""


def _masters(chunks, optimizer) -> dict[str, torch.Tensor]:
    """fp32 main (master) params by HF name, gathered from the optimizer's shards (tests/training/optimizer_state)."""
    return full_optimizer_state(chunks, optimizer)["param"]


def _cpu(tensors: dict) -> dict:
    return {k: v.detach().cpu() for k, v in tensors.items()}


def _precision(models, optimizer) -> dict[str, set[str]]:
    """dtypes of the params, of their main params (the optimizer's masters, a shard of them per rank with the
    distributed optimizer) and of their main grads."""
    found, _ = local_masters(optimizer)
    params = [p for m in models for p in m.parameters()]
    return {
        "device": {p.device.type for p in params},
        "params": {str(p.dtype) for p in params},
        "main_params": {str(master.dtype) for master, *_ in found.values()},
        "main_grads": {str(p.main_grad.dtype) for p in params},
    }


def _adam_state_is_set(optimizer) -> bool:
    states = [s for opt in getattr(optimizer, "chained_optimizers", [optimizer]) for s in opt.optimizer.state.values()]
    return any(s["exp_avg"].abs().sum() > 0 for s in states if "exp_avg" in s)


def bf16_load_step_resume(work: str) -> dict:
    """fp32 checkpoint -> (a) bf16 SFT runtime: model.load + 1 step, (b) bf16 GSPO trainer: model.load + 1 RL step
    + final checkpoint, (c) a trainer resumed from that checkpoint. Everything in one process, one after another,
    on the machine's device (CUDA on a GPU node: tools/gpu_smoke.sh runs the `gpu`-marked test)."""
    from megatron_gspo.checkpoint.model_io import save_model_checkpoint
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.sft import sft_loop, sft_runtime
    from megatron_gspo.training.trainer import GSPOTrainer
    from tests.models.parity import hf_state_dict

    work_dir = Path(work)
    # The shipped configuration: bf16 with the Qwen3-30B recipes' load-balancing loss (aux 0.001).
    common = [*MINI, "model.dtype=bf16", "model.overrides.router_aux_loss_coef=0.001", "optim.warmup_steps=0"]
    model_cfg = load_run_config(EXAMPLE, common).model.model_config()
    out: dict = {}

    # The checkpoint: fp32 weights that differ from any random init of the run (another seed, HF's init).
    initialize(ParallelConfig(), seed=11)
    try:
        chunks = build_model(model_cfg, ParallelConfig())
        load_hf_state_dict(chunks, hf_state_dict(model_cfg, seed=5))
        out["checkpoint"] = _cpu(export_hf_state_dict(chunks))
        save_model_checkpoint(chunks, work_dir / "ckpt", model_cfg)
    finally:
        shutdown()
    load = f"model.load={work_dir / 'ckpt'}"

    # (a) SFT: one step at a tiny learning rate.
    cfg = load_run_config(EXAMPLE, [*common, load, f"sft.lr={TINY_LR}", "sft.warmup_steps=0", "sft.max_steps=1",
                                    "sft.eval_every=1", "sft.eval_prompts=4", "sft.batch_size=8",
                                    "trainer.micro_batch_size=4", f"trainer.run_dir={work_dir / 'sft'}"])
    rt = sft_runtime(cfg)
    try:
        # Right after model.load the fp32 masters hold the loaded (bf16) weights.
        masters = _masters(rt.chunks, rt.optimizer)
        out["sft_masters_equal_model_before"] = all(
            torch.equal(masters[k], v.float()) for k, v in _cpu(export_hf_state_dict(rt.models)).items()
        )
        result = sft_loop(rt)
        out["sft"] = dict(steps=result["sft_steps"], weights=_cpu(export_hf_state_dict(rt.models)),
                          masters=_masters(rt.chunks, rt.optimizer), precision=_precision(rt.models, rt.optimizer),
                          adam=_adam_state_is_set(rt.optimizer))
    finally:
        rt.close()

    # (b) RL: one GSPO step (one minibatch) at a tiny learning rate, then the final trainer checkpoint.
    rl = [*common, load, f"optim.lr={TINY_LR}", "trainer.steps=1", "trainer.minibatches=1",
          "data.reward=tests.training.rewards:contains_one",  # a reward the untrained model gets sometimes
          f"trainer.run_dir={work_dir / 'rl'}"]
    trainer = GSPOTrainer(load_run_config(EXAMPLE, rl))
    try:
        summary = trainer.train()
        models = trainer.rt.models
        out["rl"] = dict(steps=summary["steps"], history=trainer.history, weights=_cpu(export_hf_state_dict(models)),
                         masters=_masters(trainer.rt.chunks, trainer.rt.optimizer),
                         precision=_precision(models, trainer.rt.optimizer), adam=_adam_state_is_set(trainer.rt.optimizer))
    finally:
        trainer.close()

    # (c) Resume from the final checkpoint (no step left to run): weights and fp32 masters as they were saved.
    trainer = GSPOTrainer(load_run_config(EXAMPLE, rl), resume=True)
    try:
        out["resumed"] = dict(step=trainer.step, weights=_cpu(export_hf_state_dict(trainer.rt.models)),
                              masters=_masters(trainer.rt.chunks, trainer.rt.optimizer))
    finally:
        trainer.close()
    return out
