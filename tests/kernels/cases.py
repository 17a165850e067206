"""Small packed-sequence inputs shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    """A packed batch: logits [N, V], targets [N], cu_seqlens [B+1], loss_mask [N] | None, temperature."""

    logits: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor | None
    temperature: float
    weight_token: torch.Tensor
    weight_seq: torch.Tensor


def make_case(
    seq_lens: list[int],
    vocab: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    mask_prob: float | None = 0.3,
    temperature: float = 1.0,
    pad_tokens: int = 0,
    scale: float = 3.0,
) -> Case:
    """Random logits (std `scale`), targets, a loss mask (None when mask_prob is None) and upstream weights.

    `pad_tokens` extra tokens follow the last sequence (they belong to none).
    """
    gen = torch.Generator().manual_seed(seed)
    n_tokens = sum(seq_lens) + pad_tokens
    logits = (torch.randn(n_tokens, vocab, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, vocab, (n_tokens,), generator=gen)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seq_lens).cumsum(0)
    mask = None if mask_prob is None else torch.rand(n_tokens, generator=gen) >= mask_prob
    weight_token = torch.randn(n_tokens, generator=gen)
    weight_seq = torch.randn(len(seq_lens), generator=gen)
    return Case(logits, targets, cu, mask, temperature, weight_token, weight_seq)


def weighted_loss(token_logprobs: torch.Tensor, seq_sum: torch.Tensor, case: Case) -> torch.Tensor:
    """A scalar that sends distinct upstream gradients into both outputs."""
    return (token_logprobs * case.weight_token).sum() + (seq_sum * case.weight_seq).sum()
