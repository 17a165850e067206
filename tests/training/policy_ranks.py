"""Rank function: one GSPO / GRPO policy-gradient pass through the trainer's forward step in any layout."""

from __future__ import annotations

import torch

from tests.models.parity import hf_state_dict, tiny_config

N, SEQ = 8, 12


def synthetic_batch(vocab: int):
    from megatron_gspo.batching.batch import RolloutBatch

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (N, SEQ + 1), generator=g)
    mask = torch.zeros(N, SEQ, dtype=torch.bool)
    for i in range(N):
        start = 2 + i % 3
        mask[i, start : start + 2 + (i * 5) % 7] = True  # responses of different lengths
    adv = torch.randn(N, generator=g)
    return RolloutBatch(tokens_NL=tokens, loss_mask_NS=mask, engine_logprobs_NS=torch.zeros(N, SEQ),
                        rewards_N=torch.zeros(N), advantages_N=adv)


def _loss(algorithm: str):
    from megatron_gspo.algorithms import PolicyLossConfig, make_policy_loss

    # GSPO and GSPO-token keep the paper's clip range; GRPO gets one its token ratios can reach here.
    if algorithm == "grpo":
        return make_policy_loss(PolicyLossConfig(algorithm="grpo", clip_low=0.2, clip_high=0.2))
    if algorithm == "grpo_token_mean":  # the loss counts tokens
        return make_policy_loss(PolicyLossConfig(algorithm="grpo", clip_low=0.2, clip_high=0.2,
                                                 grpo_aggregation="token-mean"))
    if algorithm == "gspo_token_turns":  # per-token advantages in the batch (multi-turn per-turn advantages)
        return make_policy_loss(PolicyLossConfig(algorithm="gspo_token"))
    return make_policy_loss(PolicyLossConfig(algorithm=algorithm))


def policy_grads(layout: dict, cases: list[tuple[str, int, float]]) -> dict:
    """{(algorithm, micro_batch_size, router_aux_loss_coef): {"grads", "metrics"}} for this layout (one model
    build per aux coefficient; every case starts from the same HF weights, no optimizer step).

    With the aux loss on, every row holds the same tokens (masks, advantages and old log-probs still differ): each
    micro-batch then has the same routing statistics, so the per-micro-batch load-balancing loss averaged over
    micro-batches does not depend on how the batch is split, and the full gradient must not either.
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.algorithms import combine_metrics
    from megatron_gspo.batching.logprobs import token_logprobs_from_logits
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, forward_backward, unwrap
    from megatron_gspo.training.steps import policy_forward_step, policy_units

    parallel = ParallelConfig(**layout)
    initialize(parallel, seed=5)
    out = {}
    try:
        for aux in sorted({c[2] for c in cases}):
            cfg = tiny_config(router_aux_loss_coef=aux)
            # main_grad = the full reduced gradient: all-reduce DDP (not the distributed optimizer's shards)
            chunks = build_ddp_model(cfg, parallel, optim=OptimConfig(distributed=False))
            models = [unwrap(c) for c in chunks]
            load_hf_state_dict(models, hf_state_dict(cfg))
            for algorithm, micro_batch_size, case_aux in cases:
                if case_aux != aux:
                    continue
                batch = synthetic_batch(cfg.vocab_size)
                if algorithm == "gspo_token_turns":
                    # The advantages only as the per-token tensor the trainer packs for per-turn advantages; the
                    # row advantages zeroed, so a forward step that ignored the tensor would give no gradient.
                    batch.extra["token_advantages_NS"] = batch.advantages_N[:, None] * batch.loss_mask_NS
                    batch.advantages_N = torch.zeros(N)
                if aux > 0:
                    batch.tokens_NL = batch.tokens_NL[:1].expand(N, -1).clone()
                # Old policy: the current log-probs shifted per sequence, so some GSPO sequences clip and some do not.
                shift = torch.linspace(-2e-3, 2e-3, N)[:, None]
                batch.old_logprobs_NS = torch.zeros(N, SEQ) + shift * batch.loss_mask_NS
                loss_fn = _loss(algorithm)

                # Old log-probs = exact current log-probs (+ shift): a forward-only pass of the same model.
                def lp_step(mb, model, cfg=cfg):
                    out = model(mb.tokens_NL[:, :-1], torch.arange(SEQ).unsqueeze(0).expand(mb.num_sequences, -1), None)
                    return out, lambda logits: (logits.sum() * 0, {"lp": token_logprobs_from_logits(
                        logits, mb.tokens_NL[:, 1:], mb.loss_mask_NS, cfg.vocab_size, 1.0).token_logprobs.detach()})

                dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
                local = batch.rows(slice(dp_rank * N // dp, (dp_rank + 1) * N // dp))
                micro = local.split(local.num_sequences // micro_batch_size)
                with torch.no_grad():
                    outs = forward_backward(chunks, micro, lp_step, seq_length=SEQ, micro_batch_size=micro_batch_size,
                                            forward_only=True)
                if outs:
                    local.old_logprobs_NS = torch.cat([o["lp"] for o in outs]) + local.old_logprobs_NS
                micro = local.split(local.num_sequences // micro_batch_size)
                parts = forward_backward(chunks, micro, policy_forward_step(loss_fn, cfg.vocab_size, 1.0),
                                         seq_length=SEQ, micro_batch_size=micro_batch_size,
                                         units_of=policy_units(loss_fn))
                metrics = {k: float(v) for k, v in combine_metrics(parts).items()} if parts else None
                saved = []
                for m in models:
                    for p in m.parameters():
                        saved.append((p, p.data))
                        p.data = p.main_grad.to(p.dtype)
                grads = export_hf_state_dict(models)
                for p, d in saved:
                    p.data = d
                out[(algorithm, micro_batch_size, aux)] = {"grads": grads, "metrics": metrics}
        return out
    finally:
        shutdown()
