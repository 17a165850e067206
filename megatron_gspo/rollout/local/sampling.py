"""Logits -> next token: temperature, top-k and top-p (nucleus) sampling, batched, in fp32. Pure tensor math.

Shapes: B = rows (samples) of a decode step, V = vocabulary.

Conventions (they match SGLang's sampler, so local and SGLang rollouts mean the same thing):
- temperature 0 is greedy decoding (argmax; the first maximal id on exact ties).
- top-k and top-p both select from the *full* temperature-scaled distribution: a token is kept when it is among
  the k most likely (ties with the k-th logit are kept too) and the probability mass of the tokens ranked strictly
  above it is <= top_p. So the most likely token always survives; top_k = 0 and top_p = 1 switch the filters off.
- The reported log-prob of a sampled token is log_softmax(logits / T) at that token: the sampling distribution
  after temperature but *before* top-k / top-p truncation. That is what the trainer recomputes with
  temperature-scaled logits, so engine log-probs can serve as old-policy log-probs (GSPO, REFERENCE.md §1
  "Infrastructure"). Under greedy decoding (T = 0) it is log_softmax(logits) (T taken as 1).
"""

from __future__ import annotations

import torch


def filter_logits(scaled_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """`scaled_BV` with every token outside the top-k / top-p set replaced by -inf (a new tensor)."""
    vocab = scaled_BV.shape[-1]
    out = scaled_BV.clone()
    if 0 < top_k < vocab:
        kth_B1 = torch.topk(scaled_BV, top_k, dim=-1).values[..., -1:]
        out.masked_fill_(scaled_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_above_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
        drop_sorted_BV = mass_above_BV > top_p
        drop_sorted_BV[..., 0] = False  # the most likely token always survives, whatever the rounding
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter_(-1, order_BV, drop_sorted_BV)
        out.masked_fill_(drop_BV, float("-inf"))
    return out


def sample_tokens(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row. Returns (token ids [B] int64, log-probs [B] fp32) — see the module docstring.

    Randomness comes only from `generator` (torch.multinomial), never from the global RNG when one is given.
    """
    if logits_BV.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits_BV.shape)}")
    logits_BV = logits_BV.float()
    if temperature == 0:
        tokens_B = logits_BV.argmax(dim=-1)
        logprobs_B = torch.log_softmax(logits_BV, dim=-1).gather(-1, tokens_B[:, None]).squeeze(-1)
        return tokens_B, logprobs_B
    scaled_BV = logits_BV / temperature
    logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
    if top_k > 0 or top_p < 1.0:
        probs_BV = torch.softmax(filter_logits(scaled_BV, top_k, top_p), dim=-1)
    else:
        probs_BV = logprobs_BV.exp()
    tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)

