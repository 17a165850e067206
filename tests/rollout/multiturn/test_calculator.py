"""The calculator tool environment in both spellings: the character tokenizer's '?' calls and Qwen3's
<tool_call> / <tool_response> chat turns (with Qwen3's real tokenizer)."""

import json

import gymnasium
import pytest

from megatron_gspo.data import load_tokenizer
from megatron_gspo.data.chat import generation_prompt, tool_call_text
from megatron_gspo.rollout.multiturn.calculator import CalculatorEnv, evaluate_expression


def test_expressions():
    assert [evaluate_expression(e) for e in ("12*34", "500-7", "1+1", " 3*0 ")] == ["408", "493", "2", "0"]
    assert [evaluate_expression(e) for e in ("12**3", "1+", "x", "1+2+3", "")] == [None] * 5


def test_character_spelling_episode():
    env = CalculatorEnv()
    assert isinstance(env, gymnasium.Env) and env.metadata["stop_texts"] == ("?",)
    assert env.reset(seed=1, options={"answer": "408"}) == ("", {})
    assert env.step("12*34?") == ("408=", 0.0, False, False, {"tool_calls": 1})
    assert env.step("1*?") == ("=", 0.0, False, False, {"tool_calls": 2})  # a malformed call gets no result
    assert env.step("408") == ("", 1.0, True, False, {"tool_calls": 2})
    env.reset(options={"answer": "408"})
    assert env.step("407")[:3] == ("", 0.0, True)
    assert env.action_space.contains("12*34?") and not env.action_space.contains("12x")
    with pytest.raises(ValueError, match="needs options=\\{'answer'"):
        env.reset()


def test_qwen3_spelling_round_trips_through_qwens_tokenizer():
    tok = load_tokenizer("qwen3")
    env = CalculatorEnv("qwen3")
    env.reset(options={"answer": "408"})
    turn = tool_call_text("calc", {"expr": "12*34"}) + "<|im_end|>"
    ids = tok.encode(turn)
    assert ids[0] == 151657 and ids[-2:] == [151658, 151645]
    obs, reward, done, _, _ = env.step(tok.decode(ids))  # the driver decodes the model's ids
    assert (reward, done) == (0.0, False)
    assert obs == "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" + generation_prompt(False)
    obs_ids = tok.encode(obs)
    assert obs_ids[:3] == [151644, tok.encode("user")[0], 198] and 151665 in obs_ids and 151666 in obs_ids
    assert tok.decode(obs_ids, skip_special_tokens=False) == obs
    assert obs_ids[-4:] == [151667, 271, 151668, 271]  # "\n\n" is one token (271)
    assert env.step(tok.decode(tok.encode("408<|im_end|>")))[:3] == ("", 1.0, True)
    env.reset(options={"answer": "1"})
    bad = env.step('<tool_call>\n{"name": "calc", "arguments": {"expr": "2^3"}}\n</tool_call>')[0]
    assert "error: '2^3' is not a+b" in bad
    assert json.loads(tool_call_text("calc", {"expr": "1+2"})[len("<tool_call>\n"):-len("\n</tool_call>")]) == {
        "name": "calc", "arguments": {"expr": "1+2"}}
