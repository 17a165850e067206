"""Rank function of the overlap + fused-LM-head test: minibatch updates of the trainer's policy forward step on
the fused log-prob path with megatron's overlapped gradient reduce and parameter all-gather, the LM head in its
own bucket (as at V=151936 on the cluster), the distributed optimizer, bf16 params with fp32 masters."""

from __future__ import annotations

import torch

from tests.training.packed_ranks import SEQ, N, rollout_batch

# tiny's padded vocabulary (128 rows) x hidden 128 = 16384 elements: a bucket closes after the LM head alone.
BUCKET = 4096


def overlapped_minibatches(steps: int, rows_per_micro: int = 2, path: str = "fused") -> dict:
    """{"lm_head", "lm_head_master" (full, fp32), "other_max_diff"} after `steps` optimizer steps (one
    per minibatch, no forced gather in between, as within one rollout batch) and `finish_param_gather`; each
    minibatch is this rank's 4 rows in micro-batches of `rows_per_micro`."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.algorithms import PolicyLossConfig, make_policy_loss
    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import (
        OptimConfig,
        build_ddp_model,
        build_optimizer,
        finish_param_gather,
        forward_backward,
        unwrap,
    )
    from megatron_gspo.training.steps import policy_forward_step, policy_units
    from tests.models.parity import hf_state_dict, tiny_config
    from tests.training.optimizer_state import full_optimizer_state

    cfg = tiny_config()
    parallel = ParallelConfig()
    initialize(parallel, seed=3)
    try:
        optim = OptimConfig(
            distributed=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            bucket_size=BUCKET,
            lr=1e-2,
            eps=1e-3,
        )
        chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=torch.bfloat16), optim)
        opt = build_optimizer(chunks, optim, torch.bfloat16)
        models = [unwrap(c) for c in chunks]
        load_hf_state_dict(models, hf_state_dict(cfg))
        opt.reload_model_params()
        head = models[0].output_layer.weight
        assert chunks[0].param_to_bucket_group[head].buckets[0].params == {head}, (
            "the LM head shares a bucket"
        )
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm="gspo", clip_low=0.99, clip_high=100.0))
        batch = rollout_batch(cfg.vocab_size)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        local = batch.rows(slice(dp_rank * N // dp, (dp_rank + 1) * N // dp)).to(head.device)
        local.old_logprobs_NS = -1.0 * local.loss_mask_NS
        micro = [
            local.rows(slice(i, i + rows_per_micro)) for i in range(0, local.num_sequences, rows_per_micro)
        ]
        for _ in range(steps):
            forward_backward(
                chunks,
                micro,
                policy_forward_step(loss_fn, cfg.vocab_size, 1.0, logprob_path=path),
                seq_length=SEQ,
                micro_batch_size=rows_per_micro,
                units_of=policy_units(loss_fn),
            )
            ok, _, _ = opt.step()
            assert ok
        finish_param_gather(chunks)
        masters = full_optimizer_state(chunks, opt)["param"]
        weights = export_hf_state_dict(models)
        other = max(
            (weights[k].float() - masters[k].to(torch.bfloat16).float()).abs().max().item()
            for k in weights
            if k != "lm_head.weight"
        )
        return dict(
            lm_head=weights["lm_head.weight"].float().cpu(),
            lm_head_master=masters["lm_head.weight"].cpu(),
            other_max_diff=other,
        )
    finally:
        shutdown()
