"""GPU check of the device discipline (tools/gpu_smoke.sh part `device-*`): one RL step and one SFT step of the tiny
model on CUDA, failing if any tensor reaches the model from the host.

    python tools/gpu_device_check.py [--run-dir DIR] [key=value ...]              # one GPU
    torchrun --nproc-per-node 2 tools/gpu_device_check.py parallel.tp=2 parallel.sequence_parallel=true

On a GPU most host tensors fail by themselves (the embedding lookup, the log-prob kernel's device check, NCCL);
inputs the model may ignore (position ids under RoPE, the padding mask outside the router) would not, so a
forward pre-hook on every model chunk checks that each tensor argument is on the model's device. Prints
`device check: OK (...)` and exits 0, or lists the offending inputs and exits 1. The CPU counterpart, which
proves the same on CPU-only CI, is tests/training/test_device_placement.py.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/gpu-device-check")
    parser.add_argument("--config", default="examples/tiny_moe_gspo.yaml")
    parser.add_argument("overrides", nargs="*", help="config overrides (key.sub=value)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("device check: needs a CUDA device", file=sys.stderr)
        return 2

    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.sft import sft_loop
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config(args.config, [
        "trainer.steps=1", "trainer.prompts_per_step=8", "trainer.micro_batch_size=8", "trainer.progress=false",
        "trainer.save_final=false", "rollout.group_size=4", "eval.max_prompts=8", "eval.n=1",
        "sft.max_steps=1", "sft.batch_size=16", "sft.eval_every=1", "sft.eval_prompts=8",
        f"trainer.run_dir={args.run_dir}", *args.overrides,
    ])
    trainer = GSPOTrainer(cfg)
    device = trainer.rt.device
    problems: list[str] = []
    calls = [0]

    def check(module, hook_args, hook_kwargs):
        calls[0] += 1
        for t in _tensors((hook_args, hook_kwargs), []):
            if t.device != device:
                problems.append(f"{type(module).__name__}.forward got a {list(t.shape)} {t.dtype} tensor on {t.device}")

    try:
        if device.type != "cuda":
            print(f"device check: FAILED (the model is on {device}, not on CUDA)")
            return 1
        for model in trainer.rt.models:
            model.register_forward_pre_hook(check, with_kwargs=True)
        summary = trainer.train()
        sft = sft_loop(trainer.rt)
    finally:
        trainer.close()
    if problems:
        print(f"device check: FAILED ({len(problems)} host inputs)")
        for p in sorted(set(problems)):
            print("  " + p)
        return 1
    print(
        f"device check: OK ({calls[0]} model forwards on {device}: rollouts, old log-probs, "
        f"{cfg.trainer.minibatches} minibatch updates, eval, one SFT step; held-out accuracy "
        f"{summary['eval_accuracy_after']:.3f}, SFT accuracy {sft['sft_accuracy']:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
