"""Multi-turn rollouts with the real in-process engine (tiny Qwen3-MoE, random HF weights) and real gymnasium
environments: token ids end to end across turns, the loss mask, limits, and environments that fail, hang or
return garbage.

The engine runs in a spawned process (megatron's parallel state is process-global). A recording wrapper around the
real engine keeps what each generate call was given and returned, so the test can rebuild every trajectory from
those calls and the environments' observations, independently of the driver's own bookkeeping.
"""

import time

import gymnasium
import pytest
import torch

from megatron_gspo.data import CharTokenizer, PromptItem
from megatron_gspo.rollout.multiturn import MultiTurnConfig, MultiTurnRollouts
from megatron_gspo.rollout.multiturn.environment import env_factory
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import run_distributed

ALPHABET = "0123456789+-*=?"
OBS = "77="  # what EchoEnv answers every turn


class EchoEnv(gymnasium.Env):
    """Answers every turn with OBS and ends the episode after `turns` model turns (reward = turns seen)."""

    metadata = {"stop_texts": ("?",)}

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen, self.actions = turns, 0, []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.seen = 0
        return "", {}

    def step(self, action):
        self.seen += 1
        self.actions.append(action)
        return OBS, 1.0, self.seen >= self.turns, False, {}


class RaisingEnv(EchoEnv):
    def step(self, action):
        raise RuntimeError("tool crashed")


class HangingEnv(EchoEnv):
    def step(self, action):
        time.sleep(60)


class GarbageEnv(EchoEnv):
    def step(self, action):
        return 123, "lots", False, False, {}  # not text, not a number


class BadResetEnv(EchoEnv):
    def reset(self, *, seed=None, options=None):
        return None


class RecordingEngine:
    """Passes every call to the real engine and records (prompts, sampling, outputs)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.weight_version = engine.weight_version

    def generate(self, prompts, sampling):
        outs = self.engine.generate(prompts, sampling)
        self.calls.append(([list(p) for p in prompts], sampling, outs))
        return outs


def teacher_forced_logprobs(model, rollouts, vocab_size: int) -> list[torch.Tensor]:
    """The model's fp64 log-probs of each trajectory's response tokens, teacher-forced on the whole trajectory in
    one forward (no inference context): what the engine's per-turn log-probs must equal."""
    model.eval()
    forced = []
    with torch.no_grad():
        for r in rollouts:
            ids = r.prompt_ids + r.response_ids[:-1]
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0, :, :vocab_size]
            logp = torch.log_softmax(logits.double(), -1)[len(r.prompt_ids) - 1 :]
            forced.append(logp.gather(-1, torch.tensor(r.response_ids)[:, None]).squeeze(-1))
    return forced


def _as_data(rollouts):
    return [dict(prompt_ids=r.prompt_ids, response_ids=r.response_ids, logprobs=r.logprobs, loss_mask=r.loss_mask,
                 finish_reason=r.finish_reason, extra=dict(r.extra), routed=r.routed_experts) for r in rollouts]


def _engine_rank():
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.rollout.local import LocalEngine
    from tests.models.parity import hf_state_dict, tiny_config

    cfg = tiny_config(vocab_size=len(ALPHABET) + 2)  # the character tokenizer's ids, no more
    initialize(ParallelConfig(), seed=5)
    chunks = build_model(cfg, ParallelConfig())
    load_hf_state_dict(chunks, hf_state_dict(cfg))
    model = chunks[0]
    tok = CharTokenizer(ALPHABET)
    items = [PromptItem("12*34=", "408"), PromptItem("05+07=", "12")]
    prompts = [tok.encode(it.prompt) for it in items]
    out = {}
    try:
        engine = RecordingEngine(LocalEngine(chunks, cfg, pad_id=tok.pad_id))
        envs = []  # every environment the driver made, to count its steps independently of the driver

        def echo():
            envs.append(EchoEnv())
            return envs[-1]

        mt = MultiTurnRollouts(engine, tok, echo, MultiTurnConfig(env="echo", max_turns=3, max_total_tokens=24))
        sampling = SamplingParams(max_new_tokens=5, temperature=1.0, n=3, seed=7)
        rollouts = mt.generate(items, prompts, sampling)
        out["env_steps"] = [e.seen for e in envs[1:]]  # the first: the driver's probe of the stop texts
        out["rollouts"] = _as_data(rollouts)
        out["calls"] = [(p, s.n, s.max_new_tokens, s.stop_token_ids, _as_data(o)) for p, s, o in engine.calls]
        out["metrics"] = dict(mt.last_metrics)
        # The training model's log-probs of each whole trajectory, teacher-forced (no inference context).
        out["forced"] = teacher_forced_logprobs(model, rollouts, cfg.vocab_size)

        # Limits: one turn at most, and a token budget a second turn cannot fit into.
        one = MultiTurnRollouts(engine, tok, EchoEnv, MultiTurnConfig(env="echo", max_turns=1, max_total_tokens=24))
        out["one_turn"] = _as_data(one.generate(items, prompts, sampling))
        out["one_turn_metrics"] = dict(one.last_metrics)
        tight = MultiTurnRollouts(engine, tok, EchoEnv, MultiTurnConfig(env="echo", max_turns=5, max_total_tokens=9))
        out["tight"] = _as_data(tight.generate(items, prompts, sampling))
        out["tight_metrics"] = dict(tight.last_metrics)

        # Failing environments: each sample fails alone, the call returns, nothing raises.
        kinds = {"raising": RaisingEnv, "hanging": HangingEnv, "garbage": GarbageEnv, "bad_reset": BadResetEnv}
        for name, env in kinds.items():
            bad = MultiTurnRollouts(engine, tok, env, MultiTurnConfig(env=name, max_turns=3, env_timeout_s=0.5))
            out[name] = (_as_data(bad.generate(items, prompts, sampling)), dict(bad.last_metrics))
        # Mixed: the first prompt's environments fail, the second's work.
        mixed_envs = iter([RaisingEnv] + [RaisingEnv] * 3 + [EchoEnv] * 3)
        mixed = MultiTurnRollouts(engine, tok, lambda: next(mixed_envs)(), MultiTurnConfig(env="mixed", max_turns=3))
        out["mixed"] = _as_data(mixed.generate(items, prompts, sampling))
    finally:
        shutdown()
    return out


@pytest.fixture(scope="module")
def result():
    return run_distributed(_engine_rank, world_size=1, timeout=600)[0]


def _segments(r, obs_ids):
    """Model turns and observations of a trajectory, split at the loss mask."""
    segs, cur, kind = [], [], None
    for tok, m in zip(r["response_ids"], r["loss_mask"]):
        if kind is not None and m != kind:
            segs.append((kind, cur))
            cur = []
        kind = m
        cur.append(tok)
    segs.append((kind, cur))
    return segs


def test_token_ids_end_to_end_across_turns(result):
    tok = CharTokenizer(ALPHABET)
    obs_ids = tok.encode(OBS)
    rollouts, calls = result["rollouts"], result["calls"]
    assert len(rollouts) == 6 and [r["prompt_ids"] for r in rollouts[::3]] == [tok.encode("12*34="),
                                                                              tok.encode("05+07=")]
    # The first call samples 3 per prompt; later calls continue single trajectories from their whole prefix.
    assert calls[0][1] == 3 and all(c[1] == 1 for c in calls[1:])
    assert tok.encode("?")[0] in calls[0][3] and tok.eos_id in calls[0][3]
    multi = 0
    for k, r in enumerate(rollouts):
        segs = _segments(r, obs_ids)
        model_turns = [ids for m, ids in segs if m == 1]
        assert all(ids == obs_ids for m, ids in segs if m == 0)  # observations appended as encoded, once
        assert segs[-1][0] == 1  # a trajectory ends with a model turn
        assert r["extra"]["turns"] == len(model_turns)
        multi += len(model_turns) > 1
        # Each model turn's first response position, and its step's reward (EchoEnv: 1 per step).
        starts, pos = [], 0
        for m, ids in segs:
            if m == 1:
                starts.append(pos)
            pos += len(ids)
        assert r["extra"]["turn_starts"] == starts
        assert r["extra"]["turn_rewards"] == [1.0] * len(model_turns)
        assert sum(r["extra"]["turn_rewards"]) == r["extra"]["env_reward"]
        # Rebuild the trajectory from the engine calls: each turn's prompt is exactly the ids before it.
        prefix = list(r["prompt_ids"])
        logprobs = []
        for t, (m, ids) in enumerate(segs):
            if m == 0:
                prefix += ids
                logprobs += [0.0] * len(ids)
                continue
            hits = [o for p, n, _, _, outs in calls for i, o in enumerate(outs)
                    if o["response_ids"] == ids and (p[i // n] if n > 1 else p[i]) == prefix]
            assert hits, f"trajectory {k} turn {t}: no generate call was given exactly the ids before it"
            logprobs += hits[0]["logprobs"]
            prefix += ids
        assert prefix == r["prompt_ids"] + r["response_ids"]
        assert r["logprobs"] == pytest.approx(logprobs)
        # The ids the model saw are the ids it is trained on: teacher-forced log-probs of the whole trajectory
        # equal the engine's at every model token.
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
        forced = result["forced"][k]
        torch.testing.assert_close(forced[mask], torch.tensor(r["logprobs"], dtype=torch.float64)[mask],
                                   atol=2e-4, rtol=0)
        # R3: the turns' stitched routes cover every input position of the trajectory.
        assert r["routed"].shape[0] == len(r["prompt_ids"]) + len(r["response_ids"]) - 1
    assert multi >= 2, "too few multi-turn trajectories to test anything; change the seed"
    turns = [sum(1 for m, _ in _segments(r, obs_ids) if m == 1) for r in rollouts]
    calls = [sum(1 for m, _ in _segments(r, obs_ids) if m == 0) for r in rollouts]
    m = result["metrics"]
    assert m["multiturn_turns_mean"] == pytest.approx(sum(turns) / 6) and m["multiturn_turns_max"] == max(turns)
    # A tool call is a step the environment answered without ending the episode (EchoEnv ends it at its 3rd):
    # each one's observation is in the trajectory unless a limit cut it there.
    steps = result["env_steps"]
    assert len(steps) == 6 and sorted(steps) == sorted(turns)  # one step per model turn
    answered = [min(n, 2) for n in steps]
    assert m["multiturn_tool_calls"] == sum(answered) >= sum(calls)
    assert m["multiturn_tool_call_rate"] == pytest.approx(sum(a > 0 for a in answered) / 6)
    assert sum(answered) > 0
    assert m["multiturn_env_errors"] == 0


def test_limits_on_turns_and_tokens(result):
    for r in result["one_turn"]:
        assert 0 not in r["loss_mask"] and r["extra"]["turns"] == 1
        # Echo never ends a 1-turn episode: every trajectory hit the turn limit.
        assert r["extra"]["limit"] == "turns" and r["finish_reason"] == "length"
    for r in result["tight"]:
        assert len(r["response_ids"]) <= 9 and r["loss_mask"][-1] == 1
        # Echo's episode needs 3 turns and 2 observations of 3 tokens: 9 tokens leave the model 3 for its 3 turns,
        # which (with this seed) no trajectory fits into.
        assert r["extra"]["limit"] == "tokens" and r["finish_reason"] == "length"
    assert result["one_turn_metrics"]["multiturn_turn_limit"] == 6
    assert result["one_turn_metrics"]["multiturn_token_limit"] == 0
    assert result["tight_metrics"]["multiturn_token_limit"] == 6
    assert result["tight_metrics"]["multiturn_turn_limit"] == 0
    # Echo's episode needs 3 turns: a trajectory cut earlier by a limit is truncated ('length').
    cut = result["tight"] + result["one_turn"]
    assert any(r["finish_reason"] == "length" and r["extra"]["turns"] < 3 for r in cut)
    for r in result["rollouts"]:
        assert len(r["response_ids"]) <= 24 and r["extra"]["turns"] <= 3


@pytest.mark.parametrize("kind,reason", [("raising", "raised RuntimeError: tool crashed"),
                                         ("hanging", "no answer within multiturn.env_timeout_s=0.5 s"),
                                         ("garbage", "observation is int, not text"),
                                         ("bad_reset", "reset returned NoneType")])
def test_failing_environments_fail_their_samples_only(result, kind, reason):
    rollouts, metrics = result[kind]
    assert len(rollouts) == 6 and metrics["multiturn_env_errors"] == 6
    for r in rollouts:
        assert reason in r["extra"]["env_error"]
        assert r["extra"]["env_reward"] == 0.0 and set(r["loss_mask"]) == {0}
        assert set(r["extra"]["turn_rewards"]) == {0.0}  # nothing a failed environment said is trusted


def test_mixed_failures_leave_the_other_samples_alone(result):
    rollouts = result["mixed"]
    assert all("env_error" in r["extra"] for r in rollouts[:3])
    assert not any("env_error" in r["extra"] for r in rollouts[3:])
    assert all(1 in r["loss_mask"] for r in rollouts[3:])


def test_env_factory_names_and_errors():
    assert env_factory("calculator")().spelling == "chars"
    assert env_factory("tests.rollout.multiturn.test_driver:EchoEnv") is EchoEnv
    with pytest.raises(ValueError, match="multiturn.env='nope' is not a registered environment"):
        env_factory("nope")
    with pytest.raises(ValueError, match="cannot load 'Missing'"):
        env_factory("tests.rollout.multiturn.test_driver:Missing")
    with pytest.raises(ValueError, match="multiturn.max_turns=0"):
        MultiTurnConfig(env="calculator", max_turns=0)
    with pytest.raises(ValueError, match="multiturn.advantage=turn_return needs multi-turn rollouts"):
        MultiTurnConfig(advantage="turn_return")


def test_stop_text_must_be_one_token():
    class TwoTokenStop(EchoEnv):
        metadata = {"stop_texts": ("??",)}

    with pytest.raises(ValueError, match="stop text '\\?\\?' is 2 tokens"):
        MultiTurnRollouts(None, CharTokenizer(ALPHABET), TwoTokenStop, MultiTurnConfig(env="x"))
