"""Rank function shared by the layout-invariance tests: the same HF weights and data through any layout."""

from __future__ import annotations

import torch

from megatron_gspo.models.config import preset

SEQ = 16
BATCH = 8
MICRO = 4  # micro-batches per step
CHOSEN = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.experts.5.gate_proj.weight",
    "model.layers.3.mlp.experts.2.down_proj.weight",
    "model.layers.3.self_attn.o_proj.weight",
    "lm_head.weight",
)


def tiny_config(**overrides):
    return preset("tiny", **overrides)


def hf_state_dict(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg.to_hf_config()).float()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batch(cfg, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)


def run_layout(
    layout: dict, model_overrides: dict | None = None, recompute: str = "none", dtype: str = "fp32"
) -> dict:
    """Loads HF weights into `layout`, runs one forward/backward over MICRO micro-batches and one optimizer step.

    Returns full (gathered) logits and HF-named gradients / weights so layouts compare directly. `dtype="bf16"`:
    bf16 params with megatron's mixed-precision optimizer (fp32 main params and main grads), as on the cluster.
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import (
        OptimConfig,
        build_ddp_model,
        build_optimizer,
        forward_backward,
        unwrap,
    )

    cfg = tiny_config(**(model_overrides or {}))
    parallel = ParallelConfig(**layout)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    env = initialize(parallel, seed=7)
    try:
        # SGD: an update linear in the gradient, so layouts compare to the tolerance of the gradients (megatron's
        # distributed optimizer is Adam-only; tests/training/test_distributed_optimizer.py compares it by layout).
        sgd = OptimConfig(optimizer="sgd", lr=0.5, clip_grad=0.0, distributed=False)
        chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=torch_dtype, recompute=recompute), sgd)
        opt = build_optimizer(chunks, sgd, torch_dtype)
        load_hf_state_dict([unwrap(c) for c in chunks], hf_state_dict(cfg))
        opt.reload_model_params()  # loaded after the optimizer was built: the fp32 masters follow (bf16)
        exported_before = export_hf_state_dict([unwrap(c) for c in chunks])
        data = batch(cfg)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = data.chunk(dp)[dp_rank]
        micro = list(rows.chunk(MICRO // dp if dp > 1 else MICRO))
        positions = torch.arange(SEQ).unsqueeze(0)

        def forward_step(mb, model):
            ids, labels = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
            out = model(ids, positions.expand(ids.shape[0], -1), None, labels=labels)

            def loss_func(per_token):
                return per_token.sum(), torch.tensor(per_token.numel(), dtype=torch.int), {"loss_sum": per_token.sum().detach()}

            return out, loss_func

        # Two optimizer steps: the second forward/backward runs on updated weights (catches stale-gradient bugs).
        # The loss counts tokens (every label); the load-balancing loss, when on, is weighted per micro-batch.
        def units_of(mb):
            return mb[:, 1:].numel()

        first = forward_backward(chunks, micro, forward_step, seq_length=SEQ, micro_batch_size=micro[0].shape[0],
                                 units_of=units_of)
        opt.step()
        reduced = forward_backward(chunks, micro, forward_step, seq_length=SEQ, micro_batch_size=micro[0].shape[0],
                                   units_of=units_of)
        loss_sum = torch.tensor(sum(float(r["loss_sum"]) for r in first), dtype=torch.float64)
        torch.distributed.all_reduce(loss_sum)  # every rank then knows sum over all tokens (PP non-last add 0)
        loss_sum /= ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size()
        loss = loss_sum / (BATCH * SEQ)
        del reduced

        # Gradients: swap main_grad into the parameters and export them through the HF mapping.
        models = [unwrap(c) for c in chunks]
        saved = []
        for m in models:
            for p in m.parameters():
                saved.append((p, p.data))
                p.data = p.main_grad.to(p.dtype)
        grads = export_hf_state_dict(models)
        for p, d in saved:
            p.data = d

        # Full logits of the whole batch (forward only, no grads), gathered over TP on the last stage.
        logits = None
        with torch.no_grad():
            outs = forward_backward(
                chunks,
                list(data[:, :-1].chunk(MICRO)),
                lambda mb, model: (model(mb, positions.expand(mb.shape[0], -1), None), lambda o: (o.sum() * 0, {"logits": o})),
                seq_length=SEQ,
                micro_batch_size=BATCH // MICRO,
                forward_only=True,
            )
            if outs:
                local = torch.cat([o["logits"] for o in outs], dim=0)
                tp_group = ps.get_tensor_model_parallel_group()
                parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
                torch.distributed.all_gather(parts, local.contiguous(), group=tp_group)
                logits = torch.cat(parts, dim=-1)[..., : cfg.vocab_size]

        ok, grad_norm, _ = opt.step()
        weights = export_hf_state_dict(models)
        return dict(
            rank=env.rank,
            loss=loss,
            logits=logits,
            grads={k: grads[k] for k in CHOSEN},
            weights=weights,
            grad_norm=grad_norm,
            step_ok=ok,
            exported_before=exported_before,
        )
    finally:
        shutdown()
