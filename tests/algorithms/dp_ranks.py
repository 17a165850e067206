"""Rank function: the corrected policy losses of a batch split over data-parallel ranks (gloo), gradients and
losses all-reduced, metrics (per staleness bucket too) gathered and combined, as the trainer does."""

from __future__ import annotations

import torch

from tests.algorithms import reference as ref

LENGTHS = [5, 2, 8, 3, 0, 6, 1, 7]
OFFSETS = [2e-3, -2e-3, 1e-4, -1e-4, 0.0, 0.3, -0.2, 5e-4]
STALENESS = [0, 2, 0, 1, 2, 0, 1, 2]
TRUNCATED = [False, True, False, False, False, True, False, False]
T = 8
SHARDS = [[0, 1, 2, 4], [3, 5, 6, 7]]
CASES = [  # (loss, correction preset, loss.mask_truncated, engine gap per token)
    ("gspo", "gspo_decoupled", False, 0.4),
    ("gspo", "gspo_geo_band", True, 0.01),
    ("grpo", "grpo_icepop", False, 0.4),
    ("grpo_token_mean", "grpo_token_tis", True, 0.4),
    ("gspo_token", "grpo_decoupled", False, 0.4),
]


def batch(gap: float):
    """(theta leaf, prox, behav, mask, advantages): the same on every rank; `gap` scales prox - behav."""
    theta, prox, mask = ref.make_batch(LENGTHS, T, seq_offsets=OFFSETS, token_noise=0.05, seed=121)
    gen = torch.Generator().manual_seed(122)
    behav = torch.where(mask, prox - gap * torch.randn(prox.shape, generator=gen, dtype=torch.float64), prox)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -0.7, 0.9, 1.1], dtype=torch.float64)
    return theta, prox, behav, mask, adv


def loss_and_metrics(algorithm, preset, mask_truncated, gap, rows, theta, prox, behav, mask, adv):
    """The loss of `rows` with the global divisors, and its metrics (with staleness buckets)."""
    from megatron_gspo.algorithms import (
        PolicyLossConfig,
        RolloutCorrectionConfig,
        by_staleness,
        corrected_advantages,
        make_policy_loss,
        mask_truncated_advantages,
    )

    if algorithm == "grpo_token_mean":
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm="grpo", clip_low=0.1, clip_high=0.1,
                                                    grpo_aggregation="token-mean"))
    elif algorithm == "grpo":
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm="grpo", clip_low=0.1, clip_high=0.1))
    else:
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm=algorithm))
    r = torch.tensor(rows)
    out = corrected_advantages(adv[r], prox[r], behav[r], mask[r], RolloutCorrectionConfig(preset=preset))
    a = out.advantages_B
    if mask_truncated:
        a = mask_truncated_advantages(a, torch.tensor(TRUNCATED)[r])
    if out.token_weights_BT is not None:
        a = a[:, None] * out.token_weights_BT
    n_seq, n_tok = len(LENGTHS), sum(LENGTHS)

    def call(sel):
        return loss_fn(theta[r][sel], prox[r][sel], a[sel], mask[r][sel], num_sequences=n_seq, num_tokens=n_tok)

    res = call(slice(None))
    metrics = dict(res.metrics)
    metrics.update(by_staleness(torch.tensor(STALENESS)[r], lambda sel: call(sel).metrics))
    return res.loss, metrics, out.metrics


def data_parallel_losses() -> dict:
    """Per case: the all-reduced loss and gradient, and the combined metrics, of the batch split over the ranks."""
    import torch.distributed as dist

    from megatron_gspo.algorithms import combine_metrics

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for case in CASES:
        theta, prox, behav, mask, adv = batch(case[3])
        loss, metrics, correction = loss_and_metrics(*case, SHARDS[rank], theta, prox, behav, mask, adv)
        (grad,) = torch.autograd.grad(loss, theta)
        total = loss.detach().clone()
        dist.all_reduce(total)
        dist.all_reduce(grad)
        gathered = [None, None]
        dist.all_gather_object(gathered, ({k: v.clone() for k, v in metrics.items()}, correction))
        out[case] = {
            "loss": total,
            "grad": grad,
            "metrics": combine_metrics([g[0] for g in gathered]),
            "correction": combine_metrics([g[1] for g in gathered]),
        }
    return out
