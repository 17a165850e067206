"""Held-out evaluation: n samples per prompt, avg@n (the paper's AIME'24 metric averages 32 samples) and pass@k."""

from __future__ import annotations

import math

import torch

from megatron_gspo.rewards.registry import RewardScorer


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(
    rt,
    seed: int,
    *,
    temperature: float | None = None,
    max_prompts: int | None = None,
    scorer: RewardScorer | None = None,
    multiturn=None,
) -> dict:
    """avg@n and pass@k (k in 1, n) over held-out prompts, split over data-parallel ranks.

    `scorer`: the reward scorer to use (the trainer shares its worker pool); None makes one for this call.
    `multiturn`: the run's multi-turn driver (rollout/multiturn/): trajectories scored by their environments,
    with `eval_tool_call_rate` (share of trajectories with a tool call) beside the accuracy."""
    cfg = rt.cfg
    if rt.heldout_data is None:
        return {"eval_accuracy": float("nan")}
    temperature = cfg.eval.temperature if temperature is None else temperature
    items = list(rt.heldout_data[: max_prompts or cfg.eval.max_prompts])
    items = items[: len(items) - len(items) % rt.dp.size] or items
    local = rt.shard(items) if len(items) % rt.dp.size == 0 else items
    greedy = temperature == 0
    n = 1 if greedy else cfg.eval.n
    prompts, sampling = [rt.encode_prompt(it.prompt) for it in local], rt.sampling(n, temperature, seed)
    if multiturn is not None:
        rollouts = multiturn.generate(local, prompts, sampling)
        return _summary(rt, torch.tensor(multiturn.rewards(rollouts)), items, local, n,
                        tool_call_rate=multiturn.last_metrics["multiturn_tool_call_rate"])
    rollouts = rt.engine.generate(prompts, sampling)
    responses = [rt.tokenizer.decode(r.response_ids) for r in rollouts]
    answers = [local[i // n].answer for i in range(len(rollouts))]
    metas = [local[i // n].meta for i in range(len(rollouts))]
    own = scorer is None
    if own:
        scorer = RewardScorer(cfg.data.reward, scoring=cfg.scoring)
    try:
        rewards = scorer.score(responses, answers, metas)
    finally:
        if own:
            scorer.close()
    return _summary(rt, rewards, items, local, n)


def _summary(rt, rewards, items: list, local: list, n: int, **rates: float) -> dict:
    """avg@n, pass@k and `rates` (each rank's share of its samples, averaged over ranks) from this rank's rewards."""
    correct = (rewards > 0.5).view(len(local), n)
    counts = correct.sum(-1).tolist()
    gathered = rt.gather_objects((counts, rates))
    if len(items) % rt.dp.size == 0:
        counts = [c for part, _ in gathered for c in part]
    total = len(counts)
    out = {
        "eval_accuracy": sum(counts) / (total * n),
        "eval_prompts": float(total),
        "eval_samples_per_prompt": float(n),
    }
    for k in sorted({1, n}):
        out[f"eval_pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / total
    for name, _ in rates.items():
        out[f"eval_{name}"] = sum(r[name] for _, r in gathered) / len(gathered)
    return out
