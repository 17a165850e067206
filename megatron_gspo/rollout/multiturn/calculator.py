"""A calculator tool as a gymnasium environment: the task is an arithmetic prompt (data/tasks.py, e.g. `12*34=`),
the model may call the calculator on an expression and then gives its answer; reward 1 for the exact answer.

Two spellings of the same tool:
- `chars` (the built-in character tokenizer, alphabet '0123456789+-*=?'): a turn ending in '?' is a call of the
  expression before it; the result comes back followed by '=' and the model answers in its next turn:
  `12*34=` | model `12*34?` | tool `408=` | model `408<eos>`.
- `qwen3` (Qwen3's tokenizer and chat format, data/chat.py): a `<tool_call>` to `calc` with {"expr": ...}; the
  result comes back as a `<tool_response>` in a user turn followed by the opening of the next assistant turn.
"""

from __future__ import annotations

import re
from typing import Any

import gymnasium
from gymnasium import spaces

from megatron_gspo.data.chat import IM_END, generation_prompt, parse_tool_calls, tool_results_text

_EXPR = re.compile(r"(\d{1,9})([+\-*])(\d{1,9})")
_CHAR_SET = frozenset("0123456789+-*=?")

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluates one integer operation a+b, a-b or a*b.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}
"""The tool's signature, for a system turn that lists it (data/chat.render_chat(tools=[CALC_TOOL]))."""


def evaluate_expression(expr: str) -> str | None:
    """The integer result of 'a+b', 'a-b' or 'a*b' (non-negative integer operands), else None."""
    m = _EXPR.fullmatch(expr.strip())
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


class CalculatorEnv(gymnasium.Env):
    """One episode per prompt; at most one answer. `spelling`: 'chars' or 'qwen3' (module docstring)."""

    metadata: dict[str, Any] = {"stop_texts": ("?",)}

    def __init__(self, spelling: str = "chars") -> None:
        if spelling not in ("chars", "qwen3"):
            raise ValueError(f"calculator spelling {spelling!r} must be 'chars' or 'qwen3'")
        self.spelling = spelling
        # Turns end at the tokenizer's stop ids (Qwen3: <|im_end|>); the character spelling adds '?'.
        self.metadata = {"stop_texts": ("?",) if spelling == "chars" else ()}
        charset = _CHAR_SET if spelling == "chars" else None
        self.action_space = spaces.Text(max_length=4096, charset=charset) if charset else spaces.Text(4096)
        self.observation_space = self.action_space
        self.answer: str | None = None
        self.calls = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        options = options or {}
        if "answer" not in options:
            raise ValueError("CalculatorEnv.reset needs options={'answer': ...} (the task's reference answer)")
        self.answer, self.calls = str(options["answer"]), 0
        return "", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.answer is None:
            raise RuntimeError("CalculatorEnv.step before reset")
        call = self._call_of(action)
        if call is None:  # an answer: the episode ends with its reward
            answer = action.replace(IM_END, "").strip()
            return "", float(answer == self.answer), True, False, {"tool_calls": self.calls}
        self.calls += 1
        result = evaluate_expression(call) or ""
        if self.spelling == "chars":
            return f"{result}=", 0.0, False, False, {"tool_calls": self.calls}
        text = result or f"error: {call!r} is not a+b, a-b or a*b"
        return tool_results_text([text]) + generation_prompt(enable_thinking=False), 0.0, False, False, {
            "tool_calls": self.calls}

    def _call_of(self, action: str) -> str | None:
        """The expression the turn asks the calculator for, or None when the turn is an answer."""
        if self.spelling == "chars":
            return action[:-1] if action.endswith("?") else None
        calls = parse_tool_calls(action)
        if not calls:
            return None
        first = calls[0]
        return str(first.get("arguments", {}).get("expr", "")) if "name" in first else ""


ENVIRONMENTS = {
    "calculator": CalculatorEnv,
    "calculator_qwen3": lambda: CalculatorEnv("qwen3"),
}
"""Registered environments (multiturn.env); each value makes a fresh environment."""
