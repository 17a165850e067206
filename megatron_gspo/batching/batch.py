"""Rollouts as padded training tensors (a rollout batch, this data-parallel rank's share) and how its groups are
ordered into minibatches: the first stage of the batching package.

Legend: N sequences, L = seq_len + 1 token columns (inputs are tokens[:, :-1], labels tokens[:, 1:]), S = seq_len.
A label position t (0-based over S) is a response token when t >= len(prompt) - 1 and t < len(prompt) - 1 +
len(response): every generated token up to and including the first stop token counts; padding never does; in a
multi-turn trajectory only the model's tokens count (`Rollout.loss_mask`), never the environment's.
Input position t is a real token fed for a prediction when t < len(prompt) + len(response) - 1 (the last sampled
token predicts nothing); later positions are padding, kept out of the router's statistics (`batching/inputs.py` `padding_mask`).

Devices: `pack_rollouts` builds the batch on the host (from Python lists); `RolloutBatch.to(device)` moves it to
the model's device once, and everything the forward passes make from it (position ids, padding mask, labels)
follows the tokens' device.

A micro-batch is a `RolloutBatch` of its sequences (padded [n, L] tensors: what the losses read) plus the model
inputs it is fed as (`inputs`: padded rows or one packed THD row, batching/inputs.py; built by the micro-batcher,
batching/micro_batches.py). The log-probs of its response tokens come from the logits or, fused, from the final
hidden states (batching/logprobs.py), scattered back into [n, S] for the losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_gspo.rollout.types import Rollout

if TYPE_CHECKING:
    from megatron_gspo.batching.inputs import ModelInputs


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
    weight_version_N: torch.Tensor | None = None
    """The weight version that sampled each row (`Rollout.weight_version`); staleness = consuming step - it."""
    truncated_N: torch.Tensor | None = None
    """True for responses cut at max_new_tokens (finish_reason 'length')."""
    extra: dict = field(default_factory=dict)
    rollouts: list | None = None
    """The Rollout objects of the whole batch, in row order (not carried into sub-batches)."""
    inputs: ModelInputs | None = None
    """A micro-batch's model inputs (padded or packed; set by the micro-batcher, not carried into sub-batches).
    None: its padded rows as they are."""

    @property
    def num_sequences(self) -> int:
        return self.tokens_NL.shape[0]

    @property
    def model_lens_N(self) -> torch.Tensor:
        """The model's tokens per row: the response less a multi-turn trajectory's environment tokens (and 0 for a
        sample whose environment failed). What length-based quantities count (DAPO's overlong penalty, the
        response_length metric); `response_lens_N` is the layout's length."""
        return self.loss_mask_NS.sum(-1)

    @property
    def input_lens_N(self) -> torch.Tensor | None:
        """Input positions holding real tokens per row (prompt + response - 1); None when the lengths are unknown
        (every position then counts as a real token)."""
        if self.prompt_lens_N is None or self.response_lens_N is None:
            return None
        return self.prompt_lens_N + self.response_lens_N - 1

    def to(self, device: torch.device) -> RolloutBatch:
        """The batch with every tensor on `device` (the model's: `Runtime.device`); `rollouts` are kept."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return RolloutBatch(
            tokens_NL=move(self.tokens_NL),
            loss_mask_NS=move(self.loss_mask_NS),
            engine_logprobs_NS=move(self.engine_logprobs_NS),
            rewards_N=move(self.rewards_N),
            advantages_N=move(self.advantages_N),
            old_logprobs_NS=move(self.old_logprobs_NS),
            prompt_lens_N=move(self.prompt_lens_N),
            response_lens_N=move(self.response_lens_N),
            seq_index_N=move(self.seq_index_N),
            weight_version_N=move(self.weight_version_N),
            truncated_N=move(self.truncated_N),
            extra={k: move(v) for k, v in self.extra.items()},
            rollouts=self.rollouts,
        )

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
            weight_version_N=pick(self.weight_version_N),
            truncated_N=pick(self.truncated_N),
            extra={k: v[idx] for k, v in self.extra.items()},
        )

    def split(self, parts: int) -> list[RolloutBatch]:
        """`parts` contiguous, equally sized pieces (N must be divisible)."""
        n = self.num_sequences
        if n % parts:
            raise ValueError(f"{n} sequences do not split into {parts} equal parts")
        size = n // parts
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(parts)]


def minibatch_group_order(num_informative: int, num_groups: int, minibatches: int, seed) -> list[int]:
    """The order of a rollout batch's groups, of which the first `num_informative` have reward variance (the rest
    zero advantage), such that the `minibatches` contiguous minibatches hold whole groups in a random order and
    the informative groups are dealt evenly over them (each minibatch gets floor or ceil of num_informative / K).

    Deterministic in `seed` (any value numpy's SeedSequence takes): every rank of a model-parallel group, which
    holds the same groups, gets the same order. When the groups do not divide into the minibatches (a group then
    spans two of them) the order is just a seeded permutation.
    """
    if not 0 <= num_informative <= num_groups:
        raise ValueError(f"num_informative={num_informative} must be in [0, num_groups={num_groups}]")
    perm = [int(i) for i in np.random.default_rng(seed).permutation(num_groups)]
    if num_groups % minibatches:
        return perm
    per = num_groups // minibatches
    slots: list[list[int]] = [[] for _ in range(minibatches)]
    informative = [i for i in perm if i < num_informative]
    for j, i in enumerate(informative):
        slots[j % minibatches].append(i)
    flat = iter(i for i in perm if i >= num_informative)
    for slot in slots:
        slot.extend(next(flat) for _ in range(per - len(slot)))
    return [i for slot in slots for i in slot]


def pack_rollouts(
    rollouts: list[Rollout], seq_len: int, pad_id: int, rewards: torch.Tensor, advantages: torch.Tensor,
    token_advantages: list[list[float]] | None = None,
) -> RolloutBatch:
    """Pads rollouts to `seq_len` + 1 columns (fixed shapes keep pipeline p2p shapes static on CPU).
    `token_advantages` (one per response token; multi-turn per-turn advantages) go to `extra['token_advantages_NS']`
    at the response positions, which the per-token losses then take instead of `advantages_N`."""
    n = len(rollouts)
    # Rows are built as Python lists and become tensors in one call each: a per-row loop of slice assignments
    # cost ~60 us per rollout (30 ms of a 512-answer RL step). Same values: float32 from the same Python floats.
    tokens_rows, mask_rows, lp_rows, adv_rows = [], [], [], []
    p_lens, r_lens = [], []
    for i, r in enumerate(rollouts):
        seq = [*r.prompt_ids, *r.response_ids]
        if len(seq) > seq_len + 1:
            raise ValueError(
                f"rollout {i} has {len(seq)} tokens but the batch holds {seq_len + 1}; raise rollout.max_new_tokens "
                "or shorten prompts"
            )
        p, m = len(r.prompt_ids), len(r.response_ids)
        if p < 1:
            raise ValueError(f"rollout {i} has an empty prompt: the model needs at least one input token")
        start, tail = p - 1, seq_len - (p - 1) - m  # response positions start .. start + m - 1 of seq_len
        tokens_rows.append(seq + [pad_id] * (seq_len + 1 - len(seq)))
        # Multi-turn trajectories: the environment's tokens are inputs, never labels of the loss.
        model_tokens = [True] * m if r.loss_mask is None else [bool(v) for v in r.loss_mask]
        if len(model_tokens) != m or len(r.logprobs) != m:
            raise ValueError(f"rollout {i} has {m} response tokens but {len(model_tokens)} loss-mask entries and "
                             f"{len(r.logprobs)} log-probs")
        mask_rows.append([False] * start + model_tokens + [False] * tail)
        lp_rows.append([0.0] * start + [float(v) for v in r.logprobs] + [0.0] * tail)
        if token_advantages is not None:
            if len(token_advantages[i]) != m:
                raise ValueError(f"rollout {i} has {m} response tokens but {len(token_advantages[i])} token advantages")
            adv_rows.append([0.0] * start + [float(v) for v in token_advantages[i]] + [0.0] * tail)
        p_lens.append(p)
        r_lens.append(m)
    if n:
        tokens = torch.tensor(tokens_rows, dtype=torch.long)
        mask = torch.tensor(mask_rows, dtype=torch.bool)
        engine_lp = torch.tensor(lp_rows, dtype=torch.float32)
    else:
        tokens = torch.full((0, seq_len + 1), pad_id, dtype=torch.long)
        mask = torch.zeros((0, seq_len), dtype=torch.bool)
        engine_lp = torch.zeros((0, seq_len), dtype=torch.float32)
    token_adv = None
    if token_advantages is not None:
        token_adv = torch.tensor(adv_rows, dtype=torch.float32) if n else torch.zeros((0, seq_len), dtype=torch.float32)
    p_lens = torch.tensor(p_lens, dtype=torch.long)
    r_lens = torch.tensor(r_lens, dtype=torch.long)
    return RolloutBatch(
        tokens_NL=tokens,
        loss_mask_NS=mask,
        engine_logprobs_NS=engine_lp,
        rewards_N=rewards.float(),
        advantages_N=advantages.float(),
        prompt_lens_N=p_lens,
        response_lens_N=r_lens,
        seq_index_N=torch.arange(n),
        weight_version_N=torch.tensor([int(r.weight_version) for r in rollouts], dtype=torch.long),
        truncated_N=torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.bool),
        extra={} if token_adv is None else {"token_advantages_NS": token_adv},
        rollouts=list(rollouts),
    )
