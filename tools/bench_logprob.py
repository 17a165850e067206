"""Benchmark: LM head + per-sequence log-probs, forward + backward, fused vs naive (REFERENCE.md §5).

Every variant runs in its own fresh subprocess, so each peak-memory number belongs to that variant alone:
- CPU: peak RSS from `resource.getrusage(RUSAGE_SELF).ru_maxrss` (it sees torch's allocator, tracemalloc
  does not); "working" = peak minus the RSS after imports, inputs and a tiny warm-up of the same variant.
- CUDA: `torch.cuda.max_memory_allocated()`; "working" = peak minus the inputs.
All variants start from the same hidden [N, H] and LM-head weight [V, H] and produce d hidden and d weight.

Variants (the kernels' backend is triton on CUDA, torch on CPU):
  fused         linear_sequence_logprobs: chunked, never [N, V]
  logits        hidden @ weight.T materialised, then sequence_logprobs; its backward writes d logits over the
                logits (in place: one [N, V] buffer)
  logits_copy   the same with inplace_backward=False: d logits in a second [N, V] buffer (the behaviour before
                the in-place backward; the baseline of its memory saving)
  naive         log_softmax((hidden @ weight.T).float()) + gather, plain autograd
  megatron      hidden @ weight.T, then megatron-core's vocab_parallel_cross_entropy (TP=1)

Prints a table and ratios measured in the same run; asserts nothing. Usage:
  python tools/bench_logprob.py                       # CPU: N=4096, H=1024, V=151936, fp32
  python tools/bench_logprob.py --device cuda         # GPU: N=32768, H=2048, V=151936, bf16, all variants
TFLOP/s is quoted against the 8*N*H*V FLOPs of a fused forward + backward (2NHV forward GEMM, 2NHV recompute,
4NHV for the two gradient GEMMs), whatever each variant really executes.
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
    tokens=4096, hidden=1024, vocab=151936, dtype="float32", variants="naive,fused,logits,logits_copy"
)
GPU_DEFAULTS = dict(
    tokens=32768,
    hidden=2048,
    vocab=151936,
    dtype="bfloat16",
    variants="fused,logits,logits_copy,naive,megatron",
)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _inputs(torch, device, tokens, hidden, vocab, dtype, seed=0):
    """Made in their final dtype, scaled in place: no transient copy lifts the RSS high-water mark early."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, device=device, dtype=dtype).mul_(hidden**-0.5)
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    n_seqs = 8
    cu = torch.linspace(0, tokens, n_seqs + 1, device=device).round().to(torch.int32)
    return h.requires_grad_(), w.requires_grad_(), targets, cu


def _naive(h, w, targets, cu):
    """The textbook path: fp32 log_softmax over materialised logits, gather, per-sequence sums."""
    import torch

    logprobs = torch.log_softmax((h @ w.t()).float(), dim=-1)
    token = logprobs.gather(1, targets[:, None]).squeeze(1)
    bounds = cu.tolist()
    return torch.stack([token[s:e].sum() for s, e in zip(bounds[:-1], bounds[1:])]).sum()


def _variant_fn(name, device):
    """fn(hidden, weight, targets, cu) -> scalar loss (the sum of the per-sequence log-prob sums)."""
    import torch

    from megatron_gspo.kernels import linear_sequence_logprobs, sequence_logprobs

    backend = "triton" if device == "cuda" else "torch"
    if name == "fused":
        return lambda h, w, t, cu: linear_sequence_logprobs(h, w, t, cu, backend=backend).seq_sum.sum()
    if name in ("logits", "logits_copy"):
        inplace = name == "logits"

        def materialised(h, w, t, cu):
            out = sequence_logprobs(h @ w.t(), t, cu, backend=backend, inplace_backward=inplace)
            return out.seq_sum.sum()

        return materialised
    if name == "naive":
        return _naive
    if name == "megatron":
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if not torch.distributed.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
            parallel_state.initialize_model_parallel(1, 1)

        def megatron_loss(h, w, t, cu):
            logits = (h @ w.t())[:, None, :]  # [s, b=1, V]
            return -vocab_parallel_cross_entropy(logits, t[:, None]).sum()

        return megatron_loss
    raise ValueError(f"unknown variant {name!r}")


def _worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    fn = _variant_fn(args.worker, device)
    # Warm-up at a tiny shape: libraries, kernels (Triton compile) and allocator pools enter the baseline.
    small = _inputs(torch, device, 64, args.hidden, 1024, dtype, seed=1)
    fn(*small).backward()
    del small
    h, w, targets, cu = _inputs(torch, device, args.tokens, args.hidden, args.vocab, dtype)
    result = dict(variant=args.worker)
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(args.warmup):
            fn(h, w, targets, cu).backward()
            h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    fwd = bwd = 0.0
    for _ in range(args.iters):
        h.grad = w.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = fn(h, w, targets, cu)
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        fwd, bwd = fwd + (t1 - t0) / args.iters, bwd + (t2 - t1) / args.iters
        del loss
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss_bytes()
    result.update(fwd_s=fwd, bwd_s=bwd, peak_bytes=peak, base_bytes=base)
    return result


def _run_variant(args, variant: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant]
    for key in ("device", "tokens", "hidden", "vocab", "dtype", "iters", "warmup", "threads"):
        cmd += [f"--{key}", str(getattr(args, key))]
    return run_worker(cmd, variant)


def _report(args, results: list[dict]) -> None:
    flops = 8 * args.tokens * args.hidden * args.vocab
    mem = "peak RSS" if args.device == "cpu" else "peak alloc"
    print(
        f"\nN={args.tokens} H={args.hidden} V={args.vocab} {args.dtype} on {args.device} "
        f"({args.threads} threads, {args.iters} iter(s)), forward + backward, one subprocess per variant"
    )
    header = f"| variant | fwd s | bwd s | total s | TFLOP/s (8NHV) | {mem} GiB | working GiB |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error']} |")
            continue
        total = r["fwd_s"] + r["bwd_s"]
        working = r["peak_bytes"] - r["base_bytes"]
        cells = [r["variant"], f"{r['fwd_s']:.3f}", f"{r['bwd_s']:.3f}", f"{total:.3f}"]
        cells += [f"{flops / total / 1e12:.2f}", gib(r["peak_bytes"]), gib(working)]
        print("| " + " | ".join(cells) + " |")
    base = next((r for r in ok if r["variant"] == "naive"), None)
    if base is None:
        return
    print("\nratios against naive (same run):")
    for r in ok:
        if r is base:
            continue
        t = (r["fwd_s"] + r["bwd_s"]) / (base["fwd_s"] + base["bwd_s"])
        peak = r["peak_bytes"] / base["peak_bytes"]
        working = (r["peak_bytes"] - r["base_bytes"]) / max(1, base["peak_bytes"] - base["base_bytes"])
        shares = f"{mem} x{peak:.3f} (1/{1 / peak:.1f}), working memory x{working:.3f}"
        print(f"  {r['variant']}: time x{t:.2f}, {shares}")


def main(argv=None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--variants", help="comma-separated subset of fused,logits,logits_copy,naive,megatron"
    )
    parser.add_argument("--iters", type=int, help="timed iterations (default: 1 on CPU, 3 on CUDA)")
    parser.add_argument("--warmup", type=int, default=1, help="full-size warm-up iterations (CUDA only)")
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
    if args.iters is None:
        args.iters = 3 if args.device == "cuda" else 1
    if args.worker:
        print(json.dumps(_worker(args)), flush=True)
        return
    results = []
    for variant in args.variants.split(","):
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        results.append(_run_variant(args, variant))
    _report(args, results)


if __name__ == "__main__":
    main()
