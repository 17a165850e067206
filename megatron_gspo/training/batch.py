"""Rollouts as padded training tensors, and the per-token log-probs of the model's LM-head output.

Legend: N sequences, L = seq_len + 1 token columns (inputs are tokens[:, :-1], labels tokens[:, 1:]), S = seq_len.
A label position t (0-based over S) is a response token when t >= len(prompt) - 1 and t < len(prompt) - 1 +
len(response): every generated token up to and including the first stop token counts; padding never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_gspo.rollout.types import Rollout


@dataclass
class RolloutBatch:
    """A rollout batch (this data-parallel rank's share) in training layout."""

    tokens_NL: torch.Tensor
    """Prompt + response ids, right-padded with pad_id."""
    loss_mask_NS: torch.Tensor
    """True at label positions that are response tokens."""
    engine_logprobs_NS: torch.Tensor
    """The rollout engine's log-probs at response positions (0 elsewhere)."""
    rewards_N: torch.Tensor
    advantages_N: torch.Tensor
    old_logprobs_NS: torch.Tensor | None = None
    """Old-policy per-token log-probs (recomputed or the engine's)."""
    prompt_lens_N: torch.Tensor | None = None
    response_lens_N: torch.Tensor | None = None
    seq_index_N: torch.Tensor | None = None
    """Index of each row in the rollout batch (routing replay looks routes up by it)."""
    extra: dict = field(default_factory=dict)
    rollouts: list | None = None
    """The Rollout objects of the whole batch, in row order (not carried into sub-batches)."""

    @property
    def num_sequences(self) -> int:
        return self.tokens_NL.shape[0]

    def rows(self, idx: torch.Tensor | slice) -> RolloutBatch:
        """The sub-batch of the given rows (a minibatch or micro-batch)."""

        def pick(t):
            return None if t is None else t[idx]

        return RolloutBatch(
            tokens_NL=self.tokens_NL[idx],
            loss_mask_NS=self.loss_mask_NS[idx],
            engine_logprobs_NS=self.engine_logprobs_NS[idx],
            rewards_N=self.rewards_N[idx],
            advantages_N=self.advantages_N[idx],
            old_logprobs_NS=pick(self.old_logprobs_NS),
            prompt_lens_N=pick(self.prompt_lens_N),
            response_lens_N=pick(self.response_lens_N),
            seq_index_N=pick(self.seq_index_N),
            extra={k: v[idx] for k, v in self.extra.items()},
        )

    def split(self, parts: int) -> list[RolloutBatch]:
        """`parts` contiguous, equally sized pieces (N must be divisible)."""
        n = self.num_sequences
        if n % parts:
            raise ValueError(f"{n} sequences do not split into {parts} equal parts")
        size = n // parts
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(parts)]


def pack_rollouts(
    rollouts: list[Rollout], seq_len: int, pad_id: int, rewards: torch.Tensor, advantages: torch.Tensor
) -> RolloutBatch:
    """Pads rollouts to `seq_len` + 1 columns (fixed shapes keep pipeline p2p shapes static on CPU)."""
    n = len(rollouts)
    tokens = torch.full((n, seq_len + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((n, seq_len), dtype=torch.bool)
    engine_lp = torch.zeros((n, seq_len), dtype=torch.float32)
    p_lens = torch.zeros(n, dtype=torch.long)
    r_lens = torch.zeros(n, dtype=torch.long)
    for i, r in enumerate(rollouts):
        seq = list(r.prompt_ids) + list(r.response_ids)
        if len(seq) > seq_len + 1:
            raise ValueError(
                f"rollout {i} has {len(seq)} tokens but the batch holds {seq_len + 1}; raise rollout.max_new_tokens "
                "or shorten prompts"
            )
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        start = len(r.prompt_ids) - 1
        mask[i, start : start + len(r.response_ids)] = True
        engine_lp[i, start : start + len(r.response_ids)] = torch.tensor(r.logprobs, dtype=torch.float32)
        p_lens[i], r_lens[i] = len(r.prompt_ids), len(r.response_ids)
    return RolloutBatch(
        tokens_NL=tokens,
        loss_mask_NS=mask,
        engine_logprobs_NS=engine_lp,
        rewards_N=rewards.float(),
        advantages_N=advantages.float(),
        prompt_lens_N=p_lens,
        response_lens_N=r_lens,
        seq_index_N=torch.arange(n),
        rollouts=list(rollouts),
    )


def token_logprobs_from_logits(
    logits_BSV: torch.Tensor, labels_BS: torch.Tensor, mask_BS: torch.Tensor, vocab_size: int, temperature: float
):
    """Per-token and per-sequence log-probs of `labels` from (vocab-parallel) LM-head logits.

    Uses the log-prob kernel (`megatron_gspo.kernels`): under TP each rank passes its vocabulary slice and the
    kernel combines (lse, target logit) in one collective. Vocabulary padding columns are cut off first so they
    never enter the softmax. Returns the kernel's `SequenceLogprobs` with token_logprobs reshaped to [B, S].
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.kernels import sequence_logprobs

    b, s, v_local = logits_BSV.shape
    tp = ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * v_local
    valid = max(0, min(v_local, vocab_size - start))
    logits_NV = logits_BSV.reshape(b * s, v_local)[:, :valid]
    cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=logits_BSV.device)
    out = sequence_logprobs(
        logits_NV,
        labels_BS.reshape(-1),
        cu_seqlens,
        mask_BS.reshape(-1),
        temperature=temperature,
        tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
        vocab_start_index=start,
    )
    return out._replace(token_logprobs=out.token_logprobs.reshape(b, s))


def policy_units(loss_fn):
    """`units_of(micro_batch)` of a policy loss: its loss tokens (GRPO token-mean) or its sequences (all others)."""
    if getattr(loss_fn, "aggregation", None) == "token-mean":
        return lambda mb: int(mb.loss_mask_NS.sum())
    return lambda mb: mb.num_sequences


def policy_forward_step(loss_fn, vocab_size: int, temperature: float, seq_len: int, before_forward=None):
    """The forward step megatron's schedule calls per micro-batch during a policy update.

    Its loss function returns (sum of per-unit losses, number of units, metrics), the unit being what the
    objective averages over: sequences (GSPO, GSPO-token, GRPO seq-mean-token-mean) or tokens (GRPO token-mean).
    With `calculate_per_token_loss` megatron divides the gradient by the global number of units, so the update is
    exactly that of the full minibatch's mean loss (training/engine.py). `before_forward(mb)` runs right before
    each micro-batch's model forward (routing replay selects that micro-batch's routes there).
    """
    positions = torch.arange(seq_len).unsqueeze(0)
    units_of = policy_units(loss_fn)

    def forward_step(mb: RolloutBatch, model):
        ids, labels = mb.tokens_NL[:, :-1], mb.tokens_NL[:, 1:]
        if before_forward is not None:
            before_forward(mb)
        out = model(ids, positions.expand(ids.shape[0], -1), None)

        def reduce(logits):
            lp = token_logprobs_from_logits(logits, labels, mb.loss_mask_NS, vocab_size, temperature)
            if loss_fn.sequence_level:
                old_sum = (mb.old_logprobs_NS * mb.loss_mask_NS).sum(-1)
                res = loss_fn.from_sums(lp.seq_sum, old_sum, lp.seq_count, mb.advantages_N, num_sequences=1)
            else:
                adv = mb.advantages_N
                if mb.extra.get("token_weights_NS") is not None:
                    adv = adv[:, None] * mb.extra["token_weights_NS"]
                res = loss_fn(
                    lp.token_logprobs, mb.old_logprobs_NS, adv, mb.loss_mask_NS, num_sequences=1, num_tokens=1
                )
            return res.loss, torch.tensor(units_of(mb), dtype=torch.int), {k: v.detach() for k, v in res.metrics.items()}

        return out, reduce

    return forward_step
