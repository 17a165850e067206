"""Multi-turn trajectories in Qwen3's real vocabulary: Qwen3's tokenizer (data/qwen3.py) and chat format, a tiny
Qwen3-MoE with Qwen3's padded embedding (151,936 rows, random HF weights) in the real in-process engine, and a
gymnasium environment answering in `<tool_response>` user turns. The ids each turn was generated from are the ids
of everything before it, the observations appear exactly as Qwen's tokenizer encodes them, and the training
model's teacher-forced log-probs of the whole trajectory equal the engine's at the model's tokens."""

import gymnasium
import pytest
import torch

from megatron_gspo.data import PromptItem, load_tokenizer
from megatron_gspo.data.chat import generation_prompt, render_chat, tool_results_text
from megatron_gspo.rollout.multiturn import MultiTurnConfig, MultiTurnRollouts
from megatron_gspo.rollout.multiturn.calculator import CALC_TOOL
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import run_distributed
from tests.rollout.multiturn.test_driver import RecordingEngine, teacher_forced_logprobs

OBS = tool_results_text(["408"]) + generation_prompt(enable_thinking=False)


class ToolResponseEnv(gymnasium.Env):
    """Answers every model turn with one tool response; the episode ends after 3 model turns."""

    metadata = {"stop_texts": ()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turns = 0
        return "", {}

    def step(self, action):
        self.turns += 1
        return OBS, 0.0, self.turns >= 3, False, {}


def _rank():
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.rollout.local import LocalEngine
    from tests.models.parity import hf_state_dict, tiny_config

    tok = load_tokenizer("qwen3")
    cfg = tiny_config(vocab_size=tok.padded_vocab_size, max_position_embeddings=512)
    initialize(ParallelConfig(), seed=5)
    chunks = build_model(cfg, ParallelConfig())
    load_hf_state_dict(chunks, hf_state_dict(cfg))
    model = chunks[0]
    item = PromptItem("What is 12*34?", "408")
    text = render_chat([{"role": "user", "content": item.prompt}], tools=[CALC_TOOL], add_generation_prompt=True,
                       enable_thinking=False)
    prompts = [tok.encode(text)]
    try:
        engine = RecordingEngine(LocalEngine(chunks, cfg, pad_id=tok.pad_id))
        mt = MultiTurnRollouts(engine, tok, ToolResponseEnv, MultiTurnConfig(env="x", max_turns=3,
                                                                            max_total_tokens=60))
        rollouts = mt.generate([item], prompts, SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3))
        forced = teacher_forced_logprobs(model, rollouts, cfg.vocab_size)
        calls = [([list(p) for p in ps], [(o.response_ids, o.logprobs) for o in outs]) for ps, _, outs in engine.calls]
        return dict(prompt=prompts[0], calls=calls, forced=forced, stop_ids=engine.calls[0][1].stop_token_ids,
                    rollouts=[(r.response_ids, r.logprobs, r.loss_mask, r.extra) for r in rollouts])
    finally:
        shutdown()


@pytest.fixture(scope="module")
def result():
    return run_distributed(_rank, world_size=1, timeout=600)[0]


def test_qwen_vocabulary_trajectories_are_token_in_token_out(result):
    tok = load_tokenizer("qwen3")
    obs_ids = tok.encode(OBS)
    assert obs_ids[0] == 151644 and 151665 in obs_ids and obs_ids[-4:] == [151667, 271, 151668, 271]
    assert result["stop_ids"] == (151645, 151643)
    assert result["prompt"][-7:] == [151644, *tok.encode("assistant\n"), 151667, 271, 151668, 271]
    calls = result["calls"]
    assert len(calls) == 3  # one call per turn: 2 samples, then each continued from its own ids
    for k, (response, logprobs, mask, extra) in enumerate(result["rollouts"]):
        assert extra["turns"] == 3 and "env_error" not in extra
        # model turn, observation, model turn, observation, model turn
        prefix, engine_lps, pos = list(result["prompt"]), [], 0
        for turn in range(3):
            prompts, outs = calls[turn]
            # The first call samples both from the one prompt; each later call continues both trajectories.
            source = prompts[0] if turn == 0 else prompts[k]
            assert source == prefix, f"sample {k} turn {turn} was not generated from the ids before it"
            ids, lps = outs[k]
            assert response[pos : pos + len(ids)] == ids and mask[pos : pos + len(ids)] == [1] * len(ids)
            engine_lps += lps
            prefix += ids
            pos += len(ids)
            if turn < 2:
                assert response[pos : pos + len(obs_ids)] == obs_ids and set(mask[pos : pos + len(obs_ids)]) == {0}
                prefix += obs_ids
                pos += len(obs_ids)
        assert pos == len(response)
        assert [lp for lp, on in zip(logprobs, mask) if on] == pytest.approx(engine_lps)
        m = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(result["forced"][k][m], torch.tensor(engine_lps, dtype=torch.float64),
                                   atol=2e-4, rtol=0)
