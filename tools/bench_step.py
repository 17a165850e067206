"""Benchmark: one RL update (old-log-prob pass + K minibatch updates with optimizer steps) on a length-skewed
rollout batch, padded + materialised logits vs packed (THD) + fused response-only log-probs.

Every variant runs in its own fresh subprocess (peak memory is that variant's alone):
- CPU: peak RSS from `resource.getrusage(RUSAGE_SELF).ru_maxrss`; "working" = peak minus the RSS after the model,
  optimizer and batch were built (before any forward).
- CUDA: `torch.cuda.max_memory_allocated()`; "working" = peak minus the allocation before the first forward.
Each variant runs one untimed warm-up update, then `--iters` timed ones, on the same weights and batch (the
training code of the trainer: batching/micro_batches.py, training/steps.py forward steps, engine.forward_backward,
megatron's optimizer). The variants take turns for `--rounds` rounds (a fresh subprocess each time) and each
keeps its best update time: on a shared machine the load drifts, and turns expose every variant to it alike. The batch: `--sequences` rollouts of a `--prompt`-token prompt and a response whose length
is spread log-uniformly between 1/16 and 1 of `--max-response` (mean about 0.3 of it), random token ids.
tokens/s counts the batch's real tokens (prompt + response) once per update, per second of wall time and per
second of the process's CPU time (user + system, all threads: `time.process_time()`), which a loaded machine
disturbs far less than wall time.

Variants (`--variants`, comma-separated):
  padded         rows padded to prompt + max response, megatron's output layer (logits), the reference
  packed         packed THD micro-batches under a token budget of micro_batch_size * row length, fused log-probs
  packed_logits  packed, logits path         padded_fused  padded, fused log-probs
Prints a table and ratios against `padded` measured in the same run; asserts nothing. Usage:
  python tools/bench_step.py                    # CPU defaults (2 threads; check `uptime`: the cores are shared)
  python tools/bench_step.py --device cuda      # GPU defaults: bf16, larger model and batch
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from bench_worker import gib, run_worker  # tools/ is sys.path[0] when this runs as a script

CPU_DEFAULTS = dict(
    hidden=128,
    layers=4,
    experts=8,
    topk=2,
    vocab=8192,
    sequences=32,
    prompt=32,
    max_response=480,
    minibatches=4,
    micro_batch_size=8,
    dtype="fp32",
)
GPU_DEFAULTS = dict(
    hidden=1024,
    layers=8,
    experts=32,
    topk=4,
    vocab=151936,
    sequences=128,
    prompt=256,
    max_response=3840,
    minibatches=4,
    micro_batch_size=8,
    dtype="bf16",
)
VARIANTS = {
    "padded": ("padded", "logits"),
    "packed": ("packed", "fused"),
    "packed_logits": ("packed", "logits"),
    "padded_fused": ("padded", "fused"),
}


def response_lengths(n: int, max_response: int) -> list[int]:
    """Log-uniform quantiles between max/16 and max, in a shuffled (seeded) order."""
    import random

    lengths = [max(1, round(max_response * 16 ** (-(((i + 0.5) / n) ** 0.85)))) for i in range(n)]
    random.Random(0).shuffle(lengths)
    return lengths


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _worker(args) -> dict:
    import torch

    from megatron_gspo.algorithms import PolicyLossConfig, make_policy_loss
    from megatron_gspo.batching.batch import pack_rollouts
    from megatron_gspo.batching.micro_batches import MicroBatcher
    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.config import preset
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.rollout.types import Rollout
    from megatron_gspo.training.engine import (
        OptimConfig,
        build_ddp_model,
        build_optimizer,
        forward_backward,
        schedule_shape,
        unwrap,
    )
    from megatron_gspo.training.steps import logprob_forward_step, policy_forward_step, policy_units

    torch.set_num_threads(args.threads)
    layout, path = VARIANTS[args.worker]
    seq_len = args.prompt + args.max_response
    cfg = preset(
        "tiny",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        moe_intermediate_size=args.hidden,
        head_dim=args.hidden // 4,
        max_position_embeddings=seq_len + 1,
        router_aux_loss_coef=0.001,
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    initialize(ParallelConfig(), seed=0)
    try:
        chunks = build_ddp_model(cfg, ParallelConfig(), BuildOptions(dtype=dtype))
        optimizer = build_optimizer(chunks, OptimConfig(lr=1e-6, clip_grad=1.0), dtype)
        device = next(unwrap(chunks[0]).parameters()).device
        gen = torch.Generator().manual_seed(1)
        rollouts = [
            Rollout(
                prompt_ids=torch.randint(1, args.vocab, (args.prompt,), generator=gen).tolist(),
                response_ids=torch.randint(1, args.vocab, (r,), generator=gen).tolist(),
                logprobs=[-1.0] * r,
                finish_reason="stop",
            )
            for r in response_lengths(args.sequences, args.max_response)
        ]
        adv = torch.randn(args.sequences, generator=gen)
        batch = pack_rollouts(rollouts, seq_len, 0, torch.zeros(args.sequences), adv).to(device)
        batcher = MicroBatcher.for_model(
            unwrap(chunks[0]).config,
            layout=layout,
            micro_batch_size=args.micro_batch_size,
            max_tokens=args.micro_batch_size * seq_len if layout == "packed" else 0,
        )
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm="gspo"))
        old_step = logprob_forward_step(cfg.vocab_size, 1.0, logprob_path=path)
        train_step = policy_forward_step(loss_fn, cfg.vocab_size, 1.0, logprob_path=path)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        def update() -> None:
            groups = batcher.plan(batch)
            micro = batcher.build(batch, groups)
            length, mbs = schedule_shape(micro)
            with torch.no_grad():
                outs = forward_backward(
                    chunks, micro, old_step, seq_length=length, micro_batch_size=mbs, forward_only=True
                )
            old = torch.zeros(batch.num_sequences, seq_len, device=device)
            old[torch.tensor([i for g in groups for i in g], device=device)] = torch.cat(
                [o["token_logprobs"] for o in outs]
            )
            batch.old_logprobs_NS = old
            for minibatch in batch.split(args.minibatches):
                micro = batcher(minibatch)
                length, mbs = schedule_shape(micro)
                forward_backward(
                    chunks,
                    micro,
                    train_step,
                    seq_length=length,
                    micro_batch_size=mbs,
                    units_of=policy_units(loss_fn),
                )
                optimizer.step()
            sync()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _rss_bytes()
        update()  # warm-up
        times, cpu = [], []
        for _ in range(args.iters):
            t0, c0 = time.perf_counter(), time.process_time()
            update()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_bytes()
        tokens = int((batch.prompt_lens_N + batch.response_lens_N).sum())
        return dict(
            variant=args.worker,
            seconds=min(times),
            cpu_seconds=min(cpu),
            tokens=tokens,
            peak_bytes=peak,
            base_bytes=base,
            micro_batches=len(batcher.plan(batch.split(args.minibatches)[0])),
        )
    finally:
        shutdown()


def _run_variant(args, variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant]
    for key in ("device", *CPU_DEFAULTS, "iters", "threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return run_worker(cmd, variant, env=env)


def _report(args, results: list[dict]) -> None:
    lengths = response_lengths(args.sequences, args.max_response)
    mem = "peak RSS" if args.device == "cpu" else "peak alloc"
    print(
        f"\n{args.sequences} sequences: prompt {args.prompt} + response {min(lengths)}..{max(lengths)} tokens (mean "
        f"{sum(lengths) / len(lengths) / args.max_response:.2f} of the max {args.max_response}); K={args.minibatches} "
        f"minibatches, micro-batch {args.micro_batch_size} rows (packed: a budget of as many tokens); model hidden "
        f"{args.hidden}, {args.layers} layers, {args.experts} experts top-{args.topk}, vocab {args.vocab}, "
        f"{args.dtype} on {args.device} ({args.threads} threads); best of {args.rounds} round(s) x {args.iters} "
        "update(s), each after a warm-up"
    )
    header = (
        f"| variant | update s (best) | update s (every round) | tokens/s | CPU s | tokens per CPU s | "
        f"micro-batches per minibatch | {mem} GiB | working GiB |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error']} |")
            continue
        every = " / ".join(f"{x:.1f}" for x in r.get("all_seconds", [r["seconds"]]))
        cells = [
            r["variant"],
            f"{r['seconds']:.2f}",
            every,
            f"{r['tokens'] / r['seconds']:.0f}",
            f"{r['cpu_seconds']:.1f}",
            f"{r['tokens'] / r['cpu_seconds']:.0f}",
            str(r["micro_batches"]),
            gib(r["peak_bytes"]),
            gib(r["peak_bytes"] - r["base_bytes"]),
        ]
        print("| " + " | ".join(cells) + " |")
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["variant"] == "padded"), None)
    if base is None:
        return
    print("\nratios against padded (same run):")
    for r in ok:
        if r is base:
            continue
        speed = base["seconds"] / r["seconds"]
        per_cpu = base["cpu_seconds"] / r["cpu_seconds"]
        peak = r["peak_bytes"] / base["peak_bytes"]
        working = (r["peak_bytes"] - r["base_bytes"]) / max(1, base["peak_bytes"] - base["base_bytes"])
        print(
            f"  {r['variant']}: tokens/s x{speed:.2f} (wall), x{per_cpu:.2f} (per CPU second), {mem} x{peak:.2f}, "
            f"working memory x{working:.2f}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    for key, value in CPU_DEFAULTS.items():
        kind = str if isinstance(value, str) else int
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind)
    parser.add_argument(
        "--variants", default="padded,packed", help=f"comma-separated subset of {list(VARIANTS)}"
    )
    parser.add_argument(
        "--iters", type=int, default=1, help="timed updates after the warm-up (the best counts)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant (fresh subprocesses)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker:
        print(json.dumps(_worker(args)), flush=True)
        return
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"--variants: {variant!r} is not one of {list(VARIANTS)}")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants:
            print(f"round {r + 1}/{args.rounds}: {variant} ...", file=sys.stderr, flush=True)
            runs[variant].append(_run_variant(args, variant))
    best = {}
    for variant, got in runs.items():
        ok = [g for g in got if "error" not in g]
        if not ok:
            best[variant] = got[-1]
            continue
        best[variant] = dict(
            min(ok, key=lambda g: g["seconds"]),
            all_seconds=[g["seconds"] for g in ok],
            cpu_seconds=min(g["cpu_seconds"] for g in ok),
            peak_bytes=max(g["peak_bytes"] for g in ok),
        )
    _report(args, [best[v] for v in variants])


if __name__ == "__main__":
    main()
