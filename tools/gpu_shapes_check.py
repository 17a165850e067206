"""GPU check at the 30B recipe's shapes: Qwen3-30B-A3B's layer (hidden 2048, 128 experts top-8, head_dim 128, GQA
32/4 heads, V=151936) with 2 layers, bf16 params with fp32 masters in megatron's distributed optimizer, routing
replay R2, packed micro-batches under a token budget -- the per-layer shapes, the LM head and the optimizer of the
recipe on one GPU.

1. old-policy log-probs (R2 recording), fused LM-head path vs materialised logits: norm-wise within LOGPROB_TOL;
2. one packed R2 policy update on each path: gradients norm-wise within GRAD_TOL, finite;
3. an optimizer step after the fused update;
and the figures: peak device memory of the fused and the logits update, tokens/s of the fused update.
Prints `shapes check: OK (...)` or `shapes check: FAILED (...)` (exit 1). Used by tools/gpu_smoke.sh (part
`shapes`); `--preset tiny` runs the same plumbing on a CPU in seconds (the 30B shapes need ~25 GB of GPU memory
for params, masters and Adam state alone).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch

from megatron_gspo.algorithms import PolicyLossConfig, make_policy_loss
from megatron_gspo.batching.batch import pack_rollouts
from megatron_gspo.batching.micro_batches import MicroBatcher
from megatron_gspo.models.build import BuildOptions, resolve_use_te
from megatron_gspo.models.config import preset
from megatron_gspo.moe import MoEConfig
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
from megatron_gspo.training.routing import RoutingControl
from megatron_gspo.training.steps import logprob_forward_step, policy_forward_step, policy_units

LOGPROB_TOL = 3e-3
"""Norm-wise relative difference of the log-probs, fused vs logits (both from the same bf16 hidden states)."""
GRAD_TOL = 5e-2
"""Norm-wise relative difference of the gradients of one update, fused vs logits (bf16 activations)."""


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (host RSS on CPU)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="model shapes (tiny: the CPU plumbing run)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget per packed micro-batch")
    args = parser.parse_args(argv)
    initialize(ParallelConfig(), seed=0)
    problems: list[str] = []
    routing = None
    try:
        dtype = torch.bfloat16
        seq = args.prompt + args.max_response
        cfg = preset(
            args.preset,
            num_hidden_layers=args.layers,
            router_aux_loss_coef=0.001,
            max_position_embeddings=max(seq + 1, 256),
        )
        options = BuildOptions(dtype=dtype, routing_replay=True)
        spec = "TE" if resolve_use_te(options) else "local"
        optim = OptimConfig(distributed=True, lr=1e-6, clip_grad=1.0)
        chunks = build_ddp_model(cfg, ParallelConfig(), options, optim)
        optimizer = build_optimizer(chunks, optim, dtype)
        model = unwrap(chunks[0])
        device = next(model.parameters()).device
        routing = RoutingControl(MoEConfig(routing_replay="r2"), chunks, cfg.num_experts, seq, "recompute")
        gen = torch.Generator().manual_seed(0)
        n = args.sequences
        lengths = [max(1, round(args.max_response * 16 ** (-(i + 0.5) / n))) for i in range(n)]
        vocab = cfg.vocab_size
        rollouts = [
            Rollout(
                torch.randint(1, vocab, (args.prompt,), generator=gen).tolist(),
                torch.randint(1, vocab, (r,), generator=gen).tolist(),
                [-1.0] * r,
                "stop",
            )
            for r in lengths
        ]
        batch = pack_rollouts(rollouts, seq, 0, torch.zeros(n), torch.randn(n, generator=gen)).to(device)
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm="gspo", clip_low=0.99, clip_high=100.0))
        batcher = MicroBatcher.for_model(
            model.config, layout="packed", micro_batch_size=n, max_tokens=args.max_tokens
        )
        groups = batcher.plan(batch)
        micro = batcher.build(batch, groups)
        length, mbs = schedule_shape(micro)
        tokens = sum(mb.inputs.seq_length * mb.inputs.micro_batch_size for mb in micro)
        rows = torch.tensor([i for g in groups for i in g], device=device)
        old = {}
        for path in ("logits", "fused"):
            with routing.old_policy_pass(None, batch), torch.no_grad():
                outs = forward_backward(
                    chunks,
                    micro,
                    logprob_forward_step(vocab, 1.0, routing.before_forward, logprob_path=path),
                    seq_length=length,
                    micro_batch_size=mbs,
                    forward_only=True,
                )
            old[path] = torch.zeros(n, seq, device=device)
            old[path][rows] = torch.cat([o["token_logprobs"] for o in outs])
        mask = batch.loss_mask_NS
        lp_err = float((old["fused"] - old["logits"])[mask].norm() / old["logits"][mask].norm())
        batch.old_logprobs_NS = old["logits"] + 0.01 * mask
        grads, seconds, peak = {}, {}, {}
        for path in ("logits", "fused"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            with routing.training_pass():
                forward_backward(
                    chunks,
                    batcher.build(batch, groups),
                    policy_forward_step(loss_fn, vocab, 1.0, routing.before_forward, logprob_path=path),
                    seq_length=length,
                    micro_batch_size=mbs,
                    units_of=policy_units(loss_fn),
                )
            _sync(device)
            seconds[path] = time.perf_counter() - t0
            peak[path] = _peak_gib(device)
            grads[path] = torch.cat([p.main_grad.flatten().float() for p in model.parameters()])
        g_err = float((grads["fused"] - grads["logits"]).norm() / grads["logits"].norm())
        if not lp_err < LOGPROB_TOL:
            problems.append(
                f"log-probs fused vs logits differ by {lp_err:.3g} (norm-wise; tolerance {LOGPROB_TOL:g})"
            )
        if not (g_err < GRAD_TOL and torch.isfinite(grads["fused"]).all()):
            problems.append(
                f"gradients fused vs logits differ by {g_err:.3g} (tolerance {GRAD_TOL:g}) or are not finite"
            )
        ok, grad_norm, _ = optimizer.step()
        if not ok or grad_norm is None or not torch.isfinite(torch.tensor(grad_norm)):
            problems.append(f"the optimizer step after the fused update failed (grad norm {grad_norm})")
        params = sum(p.numel() for p in model.parameters())
        # The figures first: the smoke summary shows the first 200 characters.
        detail = (
            f"fused update {tokens / seconds['fused']:.0f} tokens/s (logits {tokens / seconds['logits']:.0f}), "
            f"peak {'device' if device.type == 'cuda' else 'host RSS'} memory {peak['fused']:.2f} GiB "
            f"(logits {peak['logits']:.2f}), log-prob error {lp_err:.2e}, gradient error {g_err:.2e}; "
            f"{args.preset} x{args.layers} layers ({params / 1e9:.2f}B params), {spec} spec on {device}, "
            f"{len(micro)} packs / {tokens} tokens"
        )
        if problems:
            print(f"shapes check: FAILED ({detail}): " + "; ".join(problems))
            return 1
        print(f"shapes check: OK ({detail})")
        return 0
    finally:
        if routing is not None:
            routing.close()
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
