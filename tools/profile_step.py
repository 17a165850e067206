"""Profile: where one small RL step of the embedded default spends its CPU time, by phase and by layer of the stack.

The step is our trainer's own loop (`GSPOTrainer.train`) on examples/tiny_moe_gspo.yaml with `--prompts` prompts
x G=8 answers of <= 6 tokens, K=4 minibatch updates, old-policy log-probs recomputed, expert drift measured
every step (the defaults), one thread. The first `--warmup` steps are not measured. Then:

1. Phases: process CPU seconds (and wall) of each trainer phase (`collect` = generate + score + pack, the
   old-log-prob pass, the K updates with the drift forward, the weight sync, the rest of the loop: metrics,
   step boundary, logging), median over `--steps` steps without a profiler attached.
2. Layers: the same number of steps again under cProfile. Each function's own time goes to the layer its source
   file belongs to; time inside a C function (a torch op, `tensor.tolist()`, autograd's engine) goes to the
   layer of the Python function that called it, so "megatron MoE experts" includes the expert GEMMs it launches.
   The autograd engine's backward is one row (its C++ ops are called from no Python frame), and the Python it
   calls back (hooks, custom autograd functions) is counted in those functions' layers. cProfile adds a cost per
   Python call, so Python-heavy layers read larger than they are: compare rows with each other, and the phase
   table for absolute figures. cProfile's clock is the wall clock by default (`--timer cpu`: process CPU time,
   immune to other processes' load but dearer per reading, so it inflates Python-heavy rows more).

Usage (a loaded machine: CPU seconds are the steadier figure; `uptime` beside them):
  .venv/bin/python tools/profile_step.py                      # 8 prompts x 8 = 64 answers
  .venv/bin/python tools/profile_step.py --prompts 64         # 512 answers
  .venv/bin/python tools/profile_step.py --top 30             # plus the 30 functions with the most own time
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_moe_gspo.yaml"

# (substring of the source path, layer); the first match wins. Order: most specific first.
LAYERS = [
    ("megatron_gspo/rollout/local/", "ours: in-process engine (rollout/local: decode loop, KV cache, sampler)"),
    ("megatron_gspo/batching/", "ours: batching (pack, micro-batches, model inputs, log-probs)"),
    ("megatron_gspo/kernels/", "ours: log-prob kernels (kernels/)"),
    ("megatron_gspo/models/experts", "ours: MoE experts' GEMMs + GLU (models/experts.py)"),
    ("megatron_gspo/models/", "ours: spec modules (models/: attention, norm, router, GPT head)"),
    ("megatron_gspo/algorithms/", "ours: loss math (algorithms/)"),
    ("megatron_gspo/", "ours: trainer loop, steps, routing, metrics, rewards, data"),
    ("megatron/core/transformer/moe/token_dispatcher", "megatron MoE token dispatcher"),
    ("megatron/core/transformer/moe/moe_utils", "megatron MoE token dispatcher"),
    ("megatron/core/transformer/moe/experts", "megatron MoE experts (SequentialMLP)"),
    ("megatron/core/transformer/mlp", "megatron MoE experts (SequentialMLP)"),
    ("megatron/core/transformer/moe/", "megatron MoE layer + router"),
    ("megatron/core/transformer/attention", "megatron attention (QKV, RoPE, KV cache)"),
    ("megatron/core/models/common/embeddings", "megatron attention (QKV, RoPE, KV cache)"),
    ("megatron/core/tensor_parallel/", "megatron linear layers + embedding"),
    ("megatron/core/pipeline_parallel/", "megatron schedule"),
    ("megatron/core/distributed/", "megatron DDP (grad buffers, finalize)"),
    ("megatron/core/optimizer", "megatron optimizer (distributed optimizer, clip, Adam)"),
    ("megatron/core/inference/", "megatron inference context"),
    ("megatron/core/", "megatron other (GPTModel, transformer block / layer, utils)"),
    ("torch/optim/", "megatron optimizer (distributed optimizer, clip, Adam)"),
    ("torch/autograd/", "autograd backward (C++ engine)"),
    ("torch/", "torch Python (module call, functional wrappers)"),
]


OTHER = "other Python (stdlib, yaml, tokenizer)"
BACKWARD = "autograd backward (C++ engine)"


def layer_of(filename: str) -> str:
    for key, layer in LAYERS:
        if key in filename:
            return layer
    return OTHER


def by_layer(stats: pstats.Stats) -> dict[str, float]:
    """Own time per layer, a C function's time charged to its Python callers' layers (edge by edge)."""
    out: dict[str, float] = defaultdict(float)
    for (filename, _line, name), (_cc, _nc, tt, _ct, callers) in stats.stats.items():
        if filename != "~":
            out[layer_of(filename)] += tt
            continue
        if "run_backward" in name:
            out[BACKWARD] += tt
            continue
        if not callers:
            out[OTHER] += tt
            continue
        for (cfile, _cl, _cn), edge in callers.items():
            out[layer_of(cfile) if cfile != "~" else OTHER] += edge[2]  # the callee's own time on that edge
    return out


def build_trainer(args, run_dir: str):
    import torch

    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    torch.set_num_threads(args.threads)
    total = args.warmup + (1 if args.no_profile else 2) * args.steps
    overrides = [
        f"trainer.prompts_per_step={args.prompts}",
        f"trainer.steps={total}",
        f"trainer.run_dir={run_dir}/run",
        "trainer.progress=false",
        "trainer.save_final=false",
        "trainer.ckpt_every=0",
        "eval.every=0",
        "eval.max_prompts=8",
        *args.overrides,
    ]
    return GSPOTrainer(load_run_config(CONFIG, overrides))


PHASES = ("collect", "old_logprobs", "update", "sync_weights")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per RL step (x G=8 answers)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured RL steps first")
    parser.add_argument("--steps", type=int, default=4, help="steps timed by phase, then as many profiled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=0, help="also list the N functions with the most own time")
    parser.add_argument(
        "--timer",
        choices=["wall", "cpu"],
        default="wall",
        help="cProfile's clock: wall (perf_counter, cheap) or cpu (process_time: immune to other processes, but "
        "each reading costs ~1 us, which inflates Python-heavy layers)",
    )
    parser.add_argument("--no-profile", action="store_true", help="only the phase table")
    parser.add_argument("--dump", help="also write the cProfile stats to this file (pstats / snakeviz)")
    parser.add_argument("--overrides", nargs="*", default=[], help="extra dot-list config overrides")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="profile_step.") as tmp:
        trainer = build_trainer(args, tmp)
        cpu: dict[str, list[float]] = defaultdict(list)
        wall: dict[str, list[float]] = defaultdict(list)
        state = dict(step=0, t_cpu=None, t_wall=None, inside=0.0, inside_wall=0.0)
        profiler = cProfile.Profile(time.process_time if args.timer == "cpu" else time.perf_counter)

        def timed(name, fn):
            def wrapper(*a, **kw):
                c0, w0 = time.process_time(), time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    dc, dw = time.process_time() - c0, time.perf_counter() - w0
                    if args.warmup <= state["step"] < args.warmup + args.steps:
                        cpu[name].append(dc)
                        wall[name].append(dw)
                    state["inside"] += dc
                    state["inside_wall"] += dw

            return wrapper

        for name in PHASES:
            setattr(trainer, name, timed(name, getattr(trainer, name)))
        log_step = trainer.logger.log_step

        def stamped(step, metrics):
            log_step(step, metrics)
            c, w = time.process_time(), time.perf_counter()
            if state["t_cpu"] is not None and args.warmup <= state["step"] < args.warmup + args.steps:
                cpu["step"].append(c - state["t_cpu"])
                wall["step"].append(w - state["t_wall"])
                cpu["rest of the loop"].append(c - state["t_cpu"] - state["inside"])
                wall["rest of the loop"].append(w - state["t_wall"] - state["inside_wall"])
            state["step"] += 1
            if state["step"] == args.warmup + args.steps and not args.no_profile:
                profiler.enable()
            state["t_cpu"], state["t_wall"], state["inside"], state["inside_wall"] = c, w, 0.0, 0.0

        trainer.logger.log_step = stamped
        # the final evaluation after the last step is not profiled
        evaluate = trainer.evaluate

        def evaluate_unprofiled():
            profiler.disable()
            return evaluate()

        trainer.evaluate = evaluate_unprofiled
        try:
            trainer.train()
        finally:
            profiler.disable()
            trainer.close()

    load = os.getloadavg()
    answers = args.prompts * 8
    print(
        f"\nRL step of the tiny default: {args.prompts} prompts x 8 = {answers} answers (<= 6 tokens), K=4, "
        f"{args.threads} thread(s); {args.steps} steps per table after {args.warmup} warm-up"
    )
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    if args.overrides:
        print(f"overrides: {' '.join(args.overrides)}")
    print("\n| phase | median CPU s | median wall s |\n|---|---|---|")
    for name in (*PHASES, "rest of the loop", "step"):
        if cpu[name]:
            print(f"| {name} | {statistics.median(cpu[name]):.3f} | {statistics.median(wall[name]):.3f} |")

    if args.no_profile:
        return
    stats = pstats.Stats(profiler)
    layers = by_layer(stats)
    total = sum(layers.values())
    print(f"\n| layer of the stack (cProfile, {args.steps} steps) | CPU s per step | share |\n|---|---|---|")
    for layer, t in sorted(layers.items(), key=lambda kv: -kv[1]):
        print(f"| {layer} | {t / args.steps:.3f} | {100 * t / total:.1f}% |")
    print(f"| all (profiled; cProfile adds its own cost) | {total / args.steps:.3f} | 100% |")
    if args.dump:
        stats.dump_stats(args.dump)
    if args.top:
        print()
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
