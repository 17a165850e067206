"""Multi-turn rollouts: model turn -> environment / tool -> model turn ..., token ids end to end.

Each trajectory is one `Rollout`: `response_ids` are the model's and the environment's tokens in order, as the
model saw them; `loss_mask` marks the model's (1) apart from the environment's (0), so the loss, its token
counts and GSPO's length normalisation (Eq. 7: |y_i| = the model's tokens of the whole trajectory) see the model's
tokens only. A later turn is generated from the ids of everything before it, never from re-rendered text: the
only text ever tokenised is an environment's new observation, once, when it is appended.

Per trajectory: at most `multiturn.max_turns` model turns and `multiturn.max_total_tokens` response tokens (each
turn's generation is capped by what is left); a trajectory cut by either ends with finish_reason 'length' and the
reward its environment gave so far, and `extra['limit']` says which limit ('turns' or 'tokens'). An environment that
raises, hangs or returns garbage fails its sample: reward 0, no token of it trained on (loss mask all 0),
`extra['env_error']` says why, one warning line per batch in the log; the trainer counts it as a failed reward call
(`scoring.max_error_frac`, metric reward_errors). `extra['turn_rewards']` holds the reward of each model turn's
environment step (their sum is the trajectory's reward) and `extra['turn_starts']` the response position of each
model turn's first token: per-turn advantages (`multiturn.advantage`, algorithms/advantages.py) read them.

Routed experts (R3), per turn: row r of a trajectory's `routed_experts` is the routing of the forward whose logits
scored the token at position r + 1, taken from the turn that first computed that forward. Turn k's record covers
rows [0, len(its prompt) + len(its tokens) - 1); the rows before `start_k` (= the previous turn's end) were already
taken from earlier turns, so only its delta [start_k, end_k) is kept: its prefill rows of the environment's tokens
(and of the previous turn's last sampled token, never fed before) and the rows that sampled its own tokens. The
prefix is never taken from a later turn, whose prefill recomputed it under newer weights if an update fell between
turns (the bug of verl #6054). Each environment token carries the version of the model turn after it (the forward
that scored it ran there), so `Rollout.route_versions` gives every stitched row its version, and within a turn the
engine's own per-row versions (partial rollouts) carry over. `extra['route_turns']` lists each turn's
(start row, end row, oldest version) so a replay or a resumed episode can check the stitching.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_gspo.rollout.multiturn.config import MultiTurnConfig
from megatron_gspo.rollout.multiturn.environment import EnvFailure, call_all, checked_reset, checked_step
from megatron_gspo.rollout.types import Rollout, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Trajectory:
    prompt: list[int]
    group: int
    env: Any
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    limit: str | None = None
    finish: str = "stop"
    done: bool = False
    error: str | None = None
    versions: list[int] = field(default_factory=list)
    turn_start: int = 0
    token_versions: list[int] = field(default_factory=list)
    route_rows: list[Any] | None = field(default_factory=list)
    route_turns: list[tuple[int, int, int]] = field(default_factory=list)

    def fail(self, what: str, err: Exception) -> None:
        self.error, self.done = f"{what}: {err}", True


class MultiTurnRollouts:
    """Generates trajectories with `engine` (any RolloutEngine: token ids in, token ids out) against fresh
    environments from `make_env` (rollout/multiturn/environment.py)."""

    def __init__(self, engine: RolloutEngine, tokenizer, make_env: Callable[[], Any], cfg: MultiTurnConfig):
        self.engine, self.tokenizer, self.make_env, self.cfg = engine, tokenizer, make_env, cfg
        probe = make_env()
        extra = []
        for text in probe.metadata.get("stop_texts", ()):
            ids = tokenizer.encode(text)
            if len(ids) != 1:
                raise ValueError(f"multiturn.env={cfg.env!r}: stop text {text!r} is {len(ids)} tokens for the "
                                 "tokenizer; a turn's stop text must be one token (add it to data.tokenizer)")
            extra += ids
        self.stop_ids = tuple(dict.fromkeys([*tokenizer.stop_ids, *extra]))
        self.last_metrics: dict[str, float] = {}

    def generate(self, items: list, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` trajectories per prompt (grouped contiguously, as engine.generate), `items[i]` the
        PromptItem of `prompts[i]` (its prompt, answer and meta go to the environment's reset)."""
        n = sampling.n
        trajs = [_Trajectory(list(prompts[i // n]), i // n, self.make_env()) for i in range(len(prompts) * n)]
        self._reset(trajs, items, sampling.seed)
        budget = self.cfg.max_total_tokens
        for turn in range(self.cfg.max_turns):
            live = [t for t in trajs if not t.done]
            if turn == 0:  # the first turn of every group in one call, n samples per prompt
                first = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget),
                                            stop_token_ids=self.stop_ids)
                for t, out in zip(trajs, self.engine.generate(prompts, first)):
                    self._append_turn(t, out)
            else:
                if not live:
                    break
                self._next_turns(live, sampling, turn)
            self._step([t for t in live if not t.done], last_turn=turn + 1 == self.cfg.max_turns)
        return self._rollouts(trajs)

    # ---- phases of a turn -------------------------------------------------------------------------------------
    def _reset(self, trajs: list[_Trajectory], items: list, seed: int | None) -> None:
        def reset(t: _Trajectory, k: int):
            item = items[t.group]
            options = {"prompt": item.prompt, "answer": item.answer, "meta": dict(item.meta)}
            return t.env.reset(seed=None if seed is None else seed + k, options=options)

        for t, res in zip(trajs, call_all([lambda t=t, k=k: reset(t, k) for k, t in enumerate(trajs)],
                                          self.cfg.env_timeout_s)):
            try:
                checked_reset(res)
            except EnvFailure as err:
                t.fail("reset", err)

    def _next_turns(self, live: list[_Trajectory], sampling: SamplingParams, turn: int) -> None:
        """One generate call per distinct token cap (what is left of each trajectory's budget)."""
        by_cap: dict[int, list[_Trajectory]] = {}
        for t in live:
            cap = min(sampling.max_new_tokens, self.cfg.max_total_tokens - len(t.ids))
            by_cap.setdefault(cap, []).append(t)
        for cap, group in by_cap.items():
            seed = None if sampling.seed is None else sampling.seed + 7919 * turn + cap
            params = dataclasses.replace(sampling, n=1, max_new_tokens=cap, stop_token_ids=self.stop_ids, seed=seed)
            outs = self.engine.generate([t.prompt + t.ids for t in group], params)
            for t, out in zip(group, outs):
                self._append_turn(t, out)

    def _append_turn(self, t: _Trajectory, out: Rollout) -> None:
        versions = out.versions
        # The environment's tokens since the last turn were first scored by this turn's first forward.
        t.token_versions += [versions[0] if versions else out.weight_version] * (len(t.ids) - len(t.token_versions))
        self._append_routes(t, out)
        t.turn_start = len(t.ids)
        t.turn_starts.append(t.turn_start)
        t.turn_rewards.append(0.0)
        t.ids += out.response_ids
        t.logprobs += list(out.logprobs)
        t.token_versions += versions
        t.mask += [1] * len(out.response_ids)
        t.turns += 1
        t.finish = out.finish_reason
        t.versions.append(out.weight_version)

    @staticmethod
    def _append_routes(t: _Trajectory, out: Rollout) -> None:
        """This turn's delta of route rows (module docstring): [rows stitched so far, its record's end)."""
        if t.route_rows is None:
            return
        if out.routed_experts is None:  # an engine without routes for some turn: no record for the trajectory
            t.route_rows = None
            return
        start = t.route_turns[-1][1] if t.route_turns else 0
        end = len(t.prompt) + len(t.ids) + len(out.response_ids) - 1
        if out.routed_experts.shape[0] != end:
            raise ValueError(f"the engine returned {out.routed_experts.shape[0]} route rows for a turn of "
                             f"{len(t.prompt) + len(t.ids)} + {len(out.response_ids)} tokens, expected {end}")
        t.route_rows.append(out.routed_experts[start:end])
        t.route_turns.append((start, end, out.weight_version))

    def _step(self, trajs: list[_Trajectory], last_turn: bool) -> None:
        """The model's last turn of each trajectory to its environment; its observation appended, unless the episode
        ends there or no model turn may follow it (then the trajectory is truncated: finish_reason 'length')."""
        turns = []
        for t in trajs:
            try:
                turns.append(self.tokenizer.decode(t.ids[t.turn_start :]))
            except ValueError as err:  # e.g. an id of the model's padded vocabulary that no token has
                t.fail("not called", EnvFailure(f"the model's turn does not decode ({err})"))
        trajs = [t for t in trajs if t.error is None]
        results = call_all([lambda t=t, a=a: t.env.step(a) for t, a in zip(trajs, turns)], self.cfg.env_timeout_s)
        for t, res in zip(trajs, results):
            try:
                obs, reward, done = checked_step(res)
            except EnvFailure as err:
                t.fail("step", err)
                continue
            t.reward += reward
            t.turn_rewards[-1] = reward
            if done:
                t.done = True
                continue
            t.tool_calls += 1
            obs_ids = self.tokenizer.encode(obs)
            if last_turn or len(t.ids) + len(obs_ids) >= self.cfg.max_total_tokens:  # no model turn can follow
                t.done, t.finish = True, "length"
                t.limit = "turns" if last_turn else "tokens"
                continue
            t.ids += obs_ids
            t.logprobs += [0.0] * len(obs_ids)
            t.mask += [0] * len(obs_ids)

    def _rollouts(self, trajs: list[_Trajectory]) -> list[Rollout]:
        failed = [(k, t) for k, t in enumerate(trajs) if t.error is not None]
        if failed:  # one line per batch, not per sample: an environment that is down fails them all
            k, t = failed[0]
            log.warning("multi-turn: %d of %d trajectories failed in their environment (reward 0, not trained on); "
                        "the first, sample %d (prompt %d): environment %s", len(failed), len(trajs), k, t.group,
                        t.error)
        out = []
        for t in trajs:
            mask = t.mask if t.error is None else [0] * len(t.mask)
            # A failed sample's rewards are 0, every turn's too (the environment's word is not trusted).
            turn_rewards = [0.0] * len(t.turn_rewards) if t.error else list(t.turn_rewards)
            extra = {"turns": t.turns, "tool_calls": t.tool_calls, "env_reward": 0.0 if t.error else t.reward,
                     "turn_rewards": turn_rewards, "turn_starts": list(t.turn_starts)}
            if t.error is not None:
                extra["env_error"] = t.error
            if t.limit is None and t.finish == "length" and len(t.ids) >= self.cfg.max_total_tokens:
                t.limit = "tokens"  # the model's last turn filled what was left of the budget
            if t.limit is not None:
                extra["limit"] = t.limit
            routed = None
            if t.route_rows:
                routed = torch.cat(t.route_rows)
                extra["route_turns"] = list(t.route_turns)
            versions = t.token_versions
            out.append(Rollout(prompt_ids=t.prompt, response_ids=t.ids, logprobs=t.logprobs, finish_reason=t.finish,
                               prompt_index=t.group, routed_experts=routed,
                               weight_version=min(versions) if versions else min(t.versions),
                               token_versions=list(versions) if len(set(versions)) > 1 else None,
                               extra=extra, loss_mask=mask))
        self.last_metrics = m = trajectory_stats(out)
        log.info("multi-turn: %d trajectories, %.2f model turns on average (at most %d), tool-call rate %.3f, %d "
                 "environment failures, %d at the turn limit, %d at the token limit", len(out),
                 m["multiturn_turns_mean"], m["multiturn_turns_max"], m["multiturn_tool_call_rate"],
                 m["multiturn_env_errors"], m["multiturn_turn_limit"], m["multiturn_token_limit"])
        return out

    def rewards(self, rollouts: list[Rollout]) -> list[float]:
        """The environments' rewards of `rollouts` (0 for a failed sample)."""
        return [float(r.extra["env_reward"]) for r in rollouts]


def trajectory_stats(rollouts: list[Rollout]) -> dict[str, float]:
    """The multi-turn counts of a batch of trajectories (the step's metrics.jsonl row; metrics/log.py sums the
    counts and takes the largest maximum over data-parallel replicas): model turns per trajectory (mean, max),
    tool calls (all, and the share of trajectories with one), environment failures, and trajectories that hit
    `multiturn.max_turns` / `multiturn.max_total_tokens`."""
    n = max(1, len(rollouts))
    turns = [r.extra.get("turns", 1) for r in rollouts]
    return {
        "multiturn_turns_mean": sum(turns) / n,
        "multiturn_turns_max": float(max(turns, default=0)),
        "multiturn_tool_calls": float(sum(r.extra.get("tool_calls", 0) for r in rollouts)),
        "multiturn_tool_call_rate": sum(r.extra.get("tool_calls", 0) > 0 for r in rollouts) / n,
        "multiturn_env_errors": float(sum("env_error" in r.extra for r in rollouts)),
        "multiturn_turn_limit": float(sum(r.extra.get("limit") == "turns" for r in rollouts)),
        "multiturn_token_limit": float(sum(r.extra.get("limit") == "tokens" for r in rollouts)),
    }


def make_multiturn(cfg: MultiTurnConfig, engine: RolloutEngine, tokenizer) -> MultiTurnRollouts | None:
    """The multi-turn driver a run config asks for (`multiturn.env`), or None for single-turn rollouts."""
    if not cfg.enabled:
        return None
    from megatron_gspo.rollout.multiturn.environment import env_factory

    return MultiTurnRollouts(engine, tokenizer, env_factory(cfg.env), cfg)
