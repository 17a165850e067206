"""Rank function: the local spec's experts (models/experts.py `ExpertLoop`) against megatron's own SequentialMLP
loop on the same module and inputs, forward and every gradient, and a whole model's forward / backward both ways."""

from __future__ import annotations

import torch

from tests.models.parity import hf_state_dict, tiny_config


def _layer_experts(model):
    return model.decoder.layers[0].mlp.experts


def compare(dtype_name: str, layout: dict | None = None) -> dict:
    """{name: (lean value, megatron's value)} of the experts' output and gradients on hand-made routings (an expert
    with no token among them), and of a whole policy forward / backward's loss and parameter gradients; plus
    whether the lean path ran and how many megatron MLP calls it made."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_gspo.models.build import BuildOptions, build_model
    from megatron_gspo.models.experts import ExpertLoop
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    dtype = getattr(torch, dtype_name)
    cfg = tiny_config()
    parallel = ParallelConfig(**(layout or {}))
    initialize(parallel, seed=5)
    out: dict = {}
    mlp_calls = [0]
    original_mlp_forward = MLP.forward

    def counting(self, *a, **kw):
        mlp_calls[0] += 1
        return original_mlp_forward(self, *a, **kw)

    MLP.forward = counting
    try:
        model = build_model(cfg, parallel, BuildOptions(dtype=dtype))[0]
        load_hf_state_dict([model], hf_state_dict(cfg))
        experts = _layer_experts(model)
        out["is_expert_loop"] = isinstance(experts, ExpertLoop)
        out["lean"] = experts._lean()
        g = torch.Generator().manual_seed(3)
        for name, counts in (("spread", [3, 0, 7, 1, 12, 2, 0, 5]), ("one_expert", [0, 0, 0, 9, 0, 0, 0, 0])):
            tokens = torch.tensor(counts)
            rows = int(tokens.sum())
            x = torch.randn(rows, cfg.hidden_size, generator=g).to(dtype)
            probs = torch.rand(rows, generator=g)
            upstream = torch.randn(rows, cfg.hidden_size, generator=g).to(dtype)
            results = []
            for forward in (ExpertLoop.forward, SequentialMLP.forward):
                model.zero_grad(set_to_none=True)
                xi, pi = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
                before = mlp_calls[0]
                y, bias = forward(experts, xi, tokens, pi)
                (y.float() * upstream.float()).sum().backward()
                grads = {f"w.{n}": p.grad.clone() for n, p in experts.named_parameters()}
                results.append(dict(y=y.detach(), bias=bias, x=xi.grad, probs=pi.grad, **grads,
                                    mlp_calls=mlp_calls[0] - before))
            out[name] = results
        # A whole model: its loss and every parameter gradient with the lean experts and with megatron's loop.
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
        positions = torch.arange(12).expand(2, 12)
        whole = []
        for lean in (True, False):
            if not lean:
                ExpertLoop._lean = lambda self: False
            model.zero_grad(set_to_none=True)
            logits = model(ids, positions, None)
            loss = torch.log_softmax(logits.float(), -1)[..., 1].sum()
            loss.backward()
            whole.append(dict(loss=loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}))
        out["model"] = whole
    finally:
        MLP.forward = original_mlp_forward
        shutdown()
    return out
