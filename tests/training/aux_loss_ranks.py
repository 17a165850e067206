"""Rank function of the load-balancing-loss tests: the aux-loss gradient of the trainer's policy pass, isolated.

The aux loss does not change the forward, so with coefficients c and 2c (same weights, same data) the gradient
difference is exactly the gradient of the aux loss at coefficient c, on every parameter.
"""

from __future__ import annotations

import torch

from tests.models.parity import hf_state_dict, tiny_config
from tests.training.policy_ranks import SEQ, N, synthetic_batch

COEF = 0.1
LAST_ROUTER = "decoder.layers.3.mlp.router.weight"


def _algorithm(name: str):
    from megatron_gspo.algorithms import PolicyLossConfig, make_policy_loss

    if name == "grpo_token_mean":  # loss units: tokens
        return make_policy_loss(PolicyLossConfig(algorithm="grpo", grpo_aggregation="token-mean"))
    return make_policy_loss(PolicyLossConfig(algorithm=name))  # gspo: loss units are sequences


def aux_gradients(cases: list[tuple[str, int]], identical_rows: bool = False) -> dict:
    """For each (algorithm, micro_batch_size): the aux-loss gradient of every router weight (grad at 2c minus grad at
    c) and the last router's input of every micro-batch (captured at c)."""
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, forward_backward, unwrap
    from megatron_gspo.training.steps import policy_forward_step, policy_units

    parallel = ParallelConfig()
    initialize(parallel, seed=5)
    try:
        batch = synthetic_batch(tiny_config().vocab_size)
        if identical_rows:  # every micro-batch then has the same routing statistics, whatever its size
            batch.tokens_NL = batch.tokens_NL[:1].expand(N, -1).clone()
        batch.old_logprobs_NS = torch.zeros(N, SEQ)  # any pi_old: the aux loss does not depend on it
        grads: dict = {}
        inputs: dict = {}
        for coef in (COEF, 2 * COEF):
            cfg = tiny_config(router_aux_loss_coef=coef)
            # main_grad = the full reduced gradient: all-reduce DDP (not the distributed optimizer's shards)
            chunks = build_ddp_model(cfg, parallel, optim=OptimConfig(distributed=False))
            model = unwrap(chunks[0])
            load_hf_state_dict([model], hf_state_dict(cfg))
            captured: list = []
            hook = model.decoder.layers[3].mlp.router.register_forward_hook(
                lambda mod, args, out, captured=captured: captured.append(
                    args[0].detach().reshape(-1, args[0].shape[-1]).clone()
                )
            )
            for algorithm, mbs in cases:
                loss_fn = _algorithm(algorithm)
                captured.clear()
                forward_backward(chunks, batch.split(N // mbs), policy_forward_step(loss_fn, cfg.vocab_size, 1.0),
                                 seq_length=SEQ, micro_batch_size=mbs, units_of=policy_units(loss_fn))
                grads[(coef, algorithm, mbs)] = {
                    n: p.main_grad.detach().clone() for n, p in model.named_parameters() if "router" in n
                }
                if coef == COEF:
                    inputs[(algorithm, mbs)] = list(captured)
            hook.remove()
        aux = {case: {n: grads[(2 * COEF, *case)][n] - grads[(COEF, *case)][n] for n in grads[(COEF, *case)]}
               for case in cases}
        weight = dict(unwrap(chunks[0]).named_parameters())[LAST_ROUTER].detach().clone()
        return {"aux": aux, "inputs": inputs, "router_weight": weight, "topk": cfg.num_experts_per_tok}
    finally:
        shutdown()
