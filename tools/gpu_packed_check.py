"""GPU check of packed (THD) micro-batches: the layer spec of the machine (TE when transformer-engine imports:
TEDotProductAttention's THD path; else the local spec's packed attention on CUDA) against padded rows.

On one GPU, bf16 params with fp32 masters, routing replay R2, router aux loss on:
1. the THD contract the model receives: cu_seqlens int32 on the GPU covering every token of the pack, max_seqlen a
   Python int, pack lengths multiples of the sequence-parallel size;
2. old-policy log-probs of a length-skewed batch: packed + fused vs padded + materialised logits, norm-wise within
   LOGPROB_TOL (3e-3: bf16 rounding of two summation orders measured ~1e-3 on CPU);
3. a negative control that must FAIL that tolerance: the same packs declared as one segment each (cu_seqlens
   [0, T]), so every sequence attends to the ones packed before it -- the bug a broken THD path would have. The
   old 2% tolerance accepted it (1.7% measured at this shape): a check that cannot fail checks nothing;
4. one RL minibatch update (R2 replay of the recorded routes, packed + fused) vs padded + logits: finite loss,
   gradients agreeing norm-wise, an optimizer step.
Prints `packed check: OK (...)` or `packed check: FAILED (...)` (exit 1). Used by tools/gpu_smoke.sh (part
`packed`); runs on CPU too (local spec), which is how it is kept working without a GPU.
"""

from __future__ import annotations

import dataclasses
import sys

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

N, PROMPT, MAX_RESPONSE = 16, 8, 120
LOGPROB_TOL = 3e-3
"""Norm-wise relative difference of the old log-probs, packed vs padded, that passes (and the control must exceed)."""


def one_segment(micro: list) -> list:
    """The packed micro-batches with each pack declared as a single sequence (cross-sequence attention); positions
    and everything else unchanged."""
    out = []
    for mb in micro:
        p = mb.inputs.packed_seq_params
        total = int(p.cu_seqlens_q[-1])
        cu = torch.tensor([0, total], dtype=p.cu_seqlens_q.dtype, device=p.cu_seqlens_q.device)
        fields = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=total, max_seqlen_kv=total)
        if p.cu_seqlens_q_padded is not None:
            fields.update(cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
        if hasattr(p, "cu_seqlens_host"):  # the local spec's packed attention (models/attention.py)
            fields.update(cu_seqlens_host=(0, total))  # its group cache is not copied (init=False)
        params = dataclasses.replace(p, **fields)
        out.append(dataclasses.replace(mb, inputs=dataclasses.replace(mb.inputs, packed_seq_params=params)))
    return out


def main() -> int:
    initialize(ParallelConfig(), seed=0)
    problems: list[str] = []
    routing = None
    try:
        dtype = torch.bfloat16
        cfg = preset("tiny", vocab_size=512, max_position_embeddings=PROMPT + MAX_RESPONSE + 1,
                     router_aux_loss_coef=0.001)
        options = BuildOptions(dtype=dtype, routing_replay=True)
        spec = "TE" if resolve_use_te(options) else "local"
        chunks = build_ddp_model(cfg, ParallelConfig(), options)
        optimizer = build_optimizer(chunks, OptimConfig(lr=1e-5, clip_grad=1.0), dtype)
        model = unwrap(chunks[0])
        device = next(model.parameters()).device
        routing = RoutingControl(MoEConfig(routing_replay="r2"), chunks, cfg.num_experts, PROMPT + MAX_RESPONSE,
                                 "recompute")
        gen = torch.Generator().manual_seed(0)
        lengths = [max(1, round(MAX_RESPONSE * 16 ** (-(i + 0.5) / N))) for i in range(N)]
        rollouts = [
            Rollout(torch.randint(1, 512, (PROMPT,), generator=gen).tolist(),
                    torch.randint(1, 512, (r,), generator=gen).tolist(), [-1.0] * r, "stop")
            for r in lengths
        ]
        batch = pack_rollouts(rollouts, PROMPT + MAX_RESPONSE, 0, torch.zeros(N), torch.randn(N, generator=gen))
        batch = batch.to(device)
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm="gspo", clip_low=0.99, clip_high=100.0))
        results = {}
        control = None
        for layout, path in (("padded", "logits"), ("packed", "fused")):
            batcher = MicroBatcher.for_model(model.config, layout=layout, micro_batch_size=4)
            groups = batcher.plan(batch)
            micro = batcher.build(batch, groups)
            if layout == "packed":
                for mb in micro:
                    p = mb.inputs.packed_seq_params
                    cu = p.cu_seqlens_q
                    if cu.dtype != torch.int32 or cu.device != device or int(cu[-1]) != mb.inputs.seq_length:
                        problems.append(f"cu_seqlens {cu.dtype} on {cu.device} ending at {int(cu[-1])} for a pack "
                                        f"of {mb.inputs.seq_length} tokens")
                    if not isinstance(p.max_seqlen_q, int):
                        problems.append(f"max_seqlen_q is {type(p.max_seqlen_q).__name__}, not a Python int")
            length, mbs = schedule_shape(micro)
            if layout == "packed":  # the negative control first: the recorded routes are then the real packs'
                with routing.old_policy_pass(None, batch), torch.no_grad():
                    outs = forward_backward(chunks, one_segment(micro),
                                            logprob_forward_step(cfg.vocab_size, 1.0, routing.before_forward,
                                                                 logprob_path=path),
                                            seq_length=length, micro_batch_size=mbs, forward_only=True)
                control = torch.zeros(N, PROMPT + MAX_RESPONSE, device=device)
                control[torch.tensor([i for g in groups for i in g], device=device)] = torch.cat(
                    [o["token_logprobs"] for o in outs])
            with routing.old_policy_pass(None, batch), torch.no_grad():
                outs = forward_backward(chunks, micro, logprob_forward_step(cfg.vocab_size, 1.0,
                                                                            routing.before_forward,
                                                                            logprob_path=path),
                                        seq_length=length, micro_batch_size=mbs, forward_only=True)
            old = torch.zeros(N, PROMPT + MAX_RESPONSE, device=device)
            old[torch.tensor([i for g in groups for i in g], device=device)] = torch.cat(
                [o["token_logprobs"] for o in outs])
            batch.old_logprobs_NS = old + 0.01 * batch.loss_mask_NS
            with routing.training_pass():
                parts = forward_backward(chunks, batcher.build(batch, groups),
                                         policy_forward_step(loss_fn, cfg.vocab_size, 1.0, routing.before_forward,
                                                             logprob_path=path),
                                         seq_length=length, micro_batch_size=mbs, units_of=policy_units(loss_fn))
            grads = torch.cat([p.main_grad.flatten().float() for p in model.parameters()])
            ratio = sum(float(p["seq_ratio_mean"]) for p in parts) / len(parts)
            results[layout] = (old, grads, ratio)
        (old_ref, g_ref, _), (old_pk, g_pk, ratio_pk) = results["padded"], results["packed"]
        mask = batch.loss_mask_NS
        lp_err = float((old_pk - old_ref)[mask].norm() / old_ref[mask].norm())
        control_err = float((control - old_ref)[mask].norm() / old_ref[mask].norm())
        g_err = float((g_pk - g_ref).norm() / g_ref.norm())
        if not lp_err < LOGPROB_TOL:
            problems.append(f"old log-probs packed vs padded differ by {lp_err:.3g} (norm-wise; tolerance {LOGPROB_TOL:g})")
        if not control_err >= LOGPROB_TOL:
            problems.append(f"the negative control (one segment per pack: cross-sequence attention) differs by only "
                            f"{control_err:.3g} < {LOGPROB_TOL:g}: the check cannot tell packing bugs apart")
        if not 0.9 < ratio_pk < 1.1:
            problems.append(f"packed sequence ratio {ratio_pk} (old log-probs were shifted by 0.01 per token)")
        if not g_err < 0.1 or not torch.isfinite(g_pk).all():
            problems.append(f"gradients packed vs padded differ by {g_err:.3g} (norm-wise) or are not finite")
        ok, grad_norm, _ = optimizer.step()
        if not ok or grad_norm is None or not torch.isfinite(torch.tensor(grad_norm)):
            problems.append(f"the optimizer step after the packed update failed (grad norm {grad_norm})")
        detail = (f"{spec} spec on {device}, old log-prob error {lp_err:.2e} (tolerance {LOGPROB_TOL:g}), "
                  f"negative control error {control_err:.2e} (must exceed it), gradient error {g_err:.2e}, "
                  f"grad norm {grad_norm}")
        if problems:
            print(f"packed check: FAILED ({detail}): " + "; ".join(problems))
            return 1
        print(f"packed check: OK ({detail})")
        return 0
    finally:
        if routing is not None:
            routing.close()
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
