"""Rank function: gradients and router aux losses of the trainer's policy / SFT forward steps on the same sequences,
padded to a longer batch or not padded at all (router aux loss > 0)."""

from __future__ import annotations

import torch

from tests.models.parity import hf_state_dict, tiny_config

N, PROMPT, RESPONSE = 4, 3, 6
INPUT = PROMPT + RESPONSE - 1  # tokens fed for a prediction per sequence
AUX = 0.05


def _tokens(vocab: int, seq_len: int, pad_id: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    real = torch.randint(1, vocab, (N, PROMPT + RESPONSE), generator=g)
    tokens = torch.full((N, seq_len + 1), pad_id, dtype=torch.long)
    tokens[:, : PROMPT + RESPONSE] = real
    return tokens


def aux_grads(layout: dict, seq_len: int, kind: str, aux: float = AUX) -> dict:
    """HF-named gradients and megatron's logged load-balancing loss per layer after one forward/backward of N
    sequences (PROMPT + RESPONSE tokens each) right-padded to `seq_len` (>= INPUT) through the trainer's
    `policy_forward_step` (kind "policy") or SFT's forward step (kind "sft")."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    from megatron_gspo.algorithms import PolicyLossConfig, make_policy_loss
    from megatron_gspo.batching.batch import RolloutBatch
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, forward_backward, unwrap
    from megatron_gspo.training.sft import sft_forward_step
    from megatron_gspo.training.steps import policy_forward_step, policy_units

    cfg = tiny_config(router_aux_loss_coef=aux)
    initialize(ParallelConfig(**layout), seed=5)
    try:
        # main_grad = the full reduced gradient: all-reduce DDP (not the distributed optimizer's shards)
        chunks = build_ddp_model(cfg, ParallelConfig(**layout), optim=OptimConfig(distributed=False))
        models = [unwrap(c) for c in chunks]
        load_hf_state_dict(models, hf_state_dict(cfg))
        tokens = _tokens(cfg.vocab_size, seq_len, pad_id=0)
        mask = torch.zeros(N, seq_len, dtype=torch.bool)
        mask[:, PROMPT - 1 : PROMPT - 1 + RESPONSE] = True
        lens = torch.full((N,), INPUT)
        if kind == "policy":
            batch = RolloutBatch(
                tokens_NL=tokens, loss_mask_NS=mask, engine_logprobs_NS=torch.zeros(N, seq_len),
                rewards_N=torch.zeros(N), advantages_N=torch.tensor([1.0, -0.5, 0.25, -1.0]),
                old_logprobs_NS=torch.full((N, seq_len), -2.5) * mask,
                prompt_lens_N=torch.full((N,), PROMPT), response_lens_N=torch.full((N,), RESPONSE),
            )
            # A clip range no ratio here reaches: the policy gradient flows for every sequence.
            loss_fn = make_policy_loss(PolicyLossConfig(algorithm="gspo", clip_low=0.99, clip_high=100.0))
            micro, step = batch.split(2), policy_forward_step(loss_fn, cfg.vocab_size, 1.0)
            units_of = policy_units(loss_fn)
        else:
            micro = list(zip(tokens.split(2), mask.split(2), lens.split(2)))
            step = sft_forward_step(cfg.vocab_size)
            units_of = lambda mb: int(mb[1].sum())  # noqa: E731 - SFT counts answer tokens
        clear_aux_losses_tracker()
        forward_backward(chunks, micro, step, seq_length=seq_len, micro_batch_size=2, units_of=units_of)
        tracker = get_moe_layer_wise_logging_tracker()
        aux_values = tracker["load_balancing_loss"]["values"].clone() if "load_balancing_loss" in tracker else None
        saved = []
        for m in models:
            for p in m.parameters():
                saved.append((p, p.data))
                p.data = p.main_grad.to(p.dtype)
        grads = export_hf_state_dict(models)
        for p, d in saved:
            p.data = d
        return {"grads": grads, "aux": aux_values}
    finally:
        shutdown()
