"""GSPO-token (Eq.13-14, gradient Eq.17) against the reference, and its equivalence with GSPO."""

import pytest
import torch

from megatron_gspo.algorithms import gspo_loss, gspo_token_loss
from tests.algorithms import reference as ref

LENGTHS = [5, 1, 7, 3, 0, 6]
OFFSETS = [2e-3, -2e-3, 1e-4, -1e-4, 0.0, 5e-4]


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a.to(torch.float64), b.to(torch.float64), rtol=tol, atol=tol)


def test_loss_and_gradient_match_eq14_and_eq17_with_per_token_advantages():
    lp, old, mask = ref.make_batch(LENGTHS, 7, seq_offsets=OFFSETS, seed=11)
    gen = torch.Generator().manual_seed(12)
    adv_BT = torch.randn(len(LENGTHS), 7, generator=gen, dtype=torch.float64)
    adv_BT[~mask] = float("nan")  # padding advantages must not matter

    out = gspo_token_loss(lp, old, adv_BT, mask, num_sequences=9)
    (grad,) = torch.autograd.grad(out.loss, lp)
    lp_ref = lp.detach().clone().requires_grad_(True)
    expected = ref.gspo_token_objective(lp_ref, old, adv_BT, mask, 3e-4, 4e-4, n=9)
    (grad_ref,) = torch.autograd.grad(expected, lp_ref)
    _close(out.loss, expected)
    _close(grad, grad_ref)
    _close(grad, ref.gspo_token_grad(lp, old, adv_BT, mask, 3e-4, 4e-4, n=9))

    # Per-token clip counts, from the reference flags.
    low_tok = high_tok = 0
    per_seq_low, per_seq_high = [], []
    for i, length in enumerate(LENGTHS):
        if not length:
            continue
        s = float(ref.seq_ratio(lp.detach(), old, mask, i))
        flags = [ref.is_clipped(s, float(adv_BT[i, t]), 3e-4, 4e-4) for t in range(length)]
        low_tok += sum(f[0] for f in flags)
        high_tok += sum(f[1] for f in flags)
        per_seq_low.append(sum(f[0] for f in flags) / length)
        per_seq_high.append(sum(f[1] for f in flags) / length)
    assert low_tok and high_tok
    m = out.metrics
    assert m["clip_frac_low_tok"].item() == pytest.approx(low_tok / sum(LENGTHS))
    assert m["clip_frac_high_tok"].item() == pytest.approx(high_tok / sum(LENGTHS))
    assert m["clip_frac_low_seq"].item() == pytest.approx(sum(per_seq_low) / len(per_seq_low))
    assert m["clip_frac_high_seq"].item() == pytest.approx(sum(per_seq_high) / len(per_seq_high))


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.27)])
def test_equals_gspo_when_token_advantages_are_constant_per_sequence(clip):
    lp, old, mask = ref.make_batch(LENGTHS, 7, seq_offsets=[0.3, -0.25, 1e-4, -1e-3, 0.0, 5e-4], seed=13)
    adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 0.7], dtype=torch.float64)
    adv_BT = adv_B[:, None].expand(-1, 7).clone()
    low, high = clip

    seq = gspo_loss(lp, old, adv_B, mask, clip_low=low, clip_high=high)
    (grad_seq,) = torch.autograd.grad(seq.loss, lp)
    tok = gspo_token_loss(lp, old, adv_BT, mask, clip_low=low, clip_high=high)
    (grad_tok,) = torch.autograd.grad(tok.loss, lp)
    _close(tok.loss, seq.loss)
    _close(grad_tok, grad_seq)
    assert grad_seq.abs().sum() > 0
    for key, value in seq.metrics.items():
        _close(tok.metrics[key], value, tol=1e-6)


def test_sequence_advantages_broadcast_over_tokens():
    lp, old, mask = ref.make_batch([3, 2], 3, seq_offsets=[1e-4, -1e-4], seed=14)
    adv_B = torch.tensor([1.0, -2.0], dtype=torch.float64)
    a = gspo_token_loss(lp, old, adv_B, mask).loss
    b = gspo_token_loss(lp, old, adv_B[:, None].expand(2, 3), mask).loss
    _close(a, b)
    with pytest.raises(ValueError, match="advantages"):
        gspo_token_loss(lp, old, torch.zeros(3), mask)
