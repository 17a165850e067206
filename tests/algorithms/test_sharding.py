"""Micro-batch / data-parallel invariance: per-part losses computed with the GLOBAL normalisers
(num_sequences, num_tokens: known up front for the minibatch) and summed, as the trainer does, reproduce the
full-batch loss and gradient; combine_metrics of the parts' metrics reproduces the full-batch metrics.
"""

import pytest
import torch

from megatron_gspo.algorithms import (
    combine_metrics,
    grpo_loss,
    gspo_loss,
    gspo_loss_from_sums,
    gspo_token_loss,
    rollout_correction,
)
from tests.algorithms import reference as ref

LENGTHS = [5, 2, 8, 3, 0, 6, 1, 7]
OFFSETS = [2e-3, -2e-3, 1e-4, -1e-4, 0.0, 0.3, -0.2, 5e-4]
T = 8
# Two data-parallel ranks, each with two micro-batches of uneven size (rows of the minibatch).
SHARDS = [[[0, 1, 2], [3]], [[4, 5], [6, 7]]]


def _loss_fn(name):
    if name == "gspo":
        return lambda lp, old, adv, mask, n_seq, n_tok: gspo_loss(lp, old, adv, mask, num_sequences=n_seq)
    if name == "gspo_token":
        return lambda lp, old, adv, mask, n_seq, n_tok: gspo_token_loss(
            lp, old, adv[:, None].expand_as(lp) if adv.dim() == 1 else adv, mask, num_sequences=n_seq
        )
    if name == "gspo_from_sums":
        def from_sums(lp, old, adv, mask, n_seq, n_tok):
            return gspo_loss_from_sums(
                torch.where(mask, lp, 0.0).sum(-1), torch.where(mask, old, 0.0).sum(-1), mask.sum(-1), adv,
                num_sequences=n_seq,
            )
        return from_sums
    aggregation = name.removeprefix("grpo_")
    return lambda lp, old, adv, mask, n_seq, n_tok: grpo_loss(
        lp, old, adv, mask, clip_low=0.05, clip_high=0.05, aggregation=aggregation, num_sequences=n_seq,
        num_tokens=n_tok,
    )


@pytest.mark.parametrize(
    "name", ["gspo", "gspo_token", "gspo_from_sums", "grpo_seq-mean-token-mean", "grpo_token-mean"]
)
def test_summed_micro_batch_and_rank_losses_equal_the_full_batch(name):
    lp, old, mask = ref.make_batch(LENGTHS, T, seq_offsets=OFFSETS, token_noise=0.05, seed=31)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -0.7, 0.9, 1.1], dtype=torch.float64)
    fn = _loss_fn(name)
    n_seq, n_tok = len(LENGTHS), sum(LENGTHS)

    full = fn(lp, old, adv, mask, None, None)
    (grad_full,) = torch.autograd.grad(full.loss, lp)

    total = torch.zeros((), dtype=torch.float64)
    parts = []
    for rank in SHARDS:
        for rows in rank:
            rows_t = torch.tensor(rows)
            width = max(max(LENGTHS[r] for r in rows), 1)  # each micro-batch is padded to its own length
            out = fn(lp[rows_t, :width], old[rows_t, :width], adv[rows_t], mask[rows_t, :width], n_seq, n_tok)
            total = total + out.loss
            parts.append(out.metrics)
    (grad_parts,) = torch.autograd.grad(total, lp)

    torch.testing.assert_close(total, full.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_parts, grad_full, rtol=1e-12, atol=1e-12)
    assert grad_full.abs().sum() > 0
    combined = combine_metrics(parts)
    assert combined.keys() == full.metrics.keys()
    for key, value in full.metrics.items():
        torch.testing.assert_close(combined[key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_local_default_divisor_does_not_sum_to_the_full_batch():
    # Guards the test above: without the global normaliser the parts would be averaged per part.
    lp, old, mask = ref.make_batch([3, 3, 3, 3], 3, seq_offsets=[1e-4, 1e-4, -1e-4, 1e-4], seed=32)
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    full = gspo_loss(lp, old, adv, mask).loss
    halves = sum(gspo_loss(lp[r], old[r], adv[r], mask[r]).loss for r in (slice(0, 2), slice(2, 4)))
    globally = sum(
        gspo_loss(lp[r], old[r], adv[r], mask[r], num_sequences=4).loss for r in (slice(0, 2), slice(2, 4))
    )
    assert not torch.allclose(halves, full)
    torch.testing.assert_close(globally, full)


def test_rollout_correction_metrics_combine_across_parts():
    lp, old, mask = ref.make_batch(LENGTHS, T, token_noise=0.5, seed=33)
    for level in ("token", "sequence"):
        _, full = rollout_correction(old, lp.detach(), mask, level=level, threshold=1.2)
        parts = [
            rollout_correction(old[r], lp.detach()[r], mask[r], level=level, threshold=1.2)[1]
            for r in (slice(0, 3), slice(3, 8))
        ]
        combined = combine_metrics(parts)
        for key, value in full.items():
            torch.testing.assert_close(combined[key], value, rtol=1e-5, atol=1e-7, msg=f"{level} {key}")


def test_combine_metrics_rejects_unknown_keys():
    with pytest.raises(ValueError, match="no reduction rule"):
        combine_metrics([{"mystery": torch.tensor(1.0)}])
