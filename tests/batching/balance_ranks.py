"""Rank function: the data-parallel deal of a rollout batch (batching/dp_balance.py) on a gloo group."""

from __future__ import annotations

import torch

MINIBATCHES, PER_RANK, SEQ = 2, 6, 40


def rank_batch(rank: int):
    """Rank 0 holds long responses, rank 1 short ones; every row carries R3-style routes and a distinct id."""
    from megatron_gspo.batching.batch import pack_rollouts
    from megatron_gspo.rollout.types import Rollout

    rollouts = []
    for i in range(PER_RANK):
        response = 30 - 3 * i if rank == 0 else 1 + i
        prompt = [100 + rank, i + 1, 7]  # (rank, row) readable from the prompt
        ids = [50 + (i + j) % 40 for j in range(response)]
        routes = torch.full((len(prompt) + response - 1, 2, 2), 10 * rank + i, dtype=torch.uint8)
        rollouts.append(Rollout(prompt, ids, [-0.1 * rank - 0.01 * i] * response, "stop", routed_experts=routes))
    rewards = torch.arange(PER_RANK, dtype=torch.float32) + 10 * rank
    return pack_rollouts(rollouts, SEQ, 0, rewards, rewards * 0.5)


def balanced_rows() -> dict:
    import torch.distributed as dist

    from megatron_gspo.batching.dp_balance import balance_data_parallel
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    env = initialize(ParallelConfig(), seed=0)
    try:
        from megatron.core import parallel_state as ps

        batch = rank_batch(env.rank)
        out = balance_data_parallel(batch, MINIBATCHES, ps.get_data_parallel_group())
        dist.barrier()
        return {
            "tokens": out.tokens_NL, "mask": out.loss_mask_NS, "engine": out.engine_logprobs_NS,
            "rewards": out.rewards_N, "adv": out.advantages_N, "prompt_lens": out.prompt_lens_N,
            "response_lens": out.response_lens_N, "seq_index": out.seq_index_N,
            "rollouts": out.rollouts, "input_tokens_before": int(batch.input_lens_N.sum()),
        }
    finally:
        shutdown()
