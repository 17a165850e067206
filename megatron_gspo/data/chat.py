"""Qwen3's chat format (the ChatML markers and the Hermes-style tool calls of its chat template), as text.

A conversation renders as

    <|im_start|>system\\n{system}\\n\\n# Tools\\n...<tools>\\n{tool json}\\n</tools>...<|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n
    <|im_start|>assistant\\n{text}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n

Tool results are user turns (consecutive results share one), as in Qwen3's template. The template's one rewrite of
history (it drops the `<think>` part of assistant turns before the last user query) is what a trainer must not do:
multi-turn rollouts append the model's own ids turn by turn (rollout/multiturn/) and render only the new turns with
`turn_text`/`tool_results_text` here, so no earlier turn is ever re-tokenised.
"""

from __future__ import annotations

import json
import re
from typing import Any

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
ROLES = ("system", "user", "assistant", "tool")

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)
_CALL_RE = re.compile(re.escape(TOOL_CALL) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.DOTALL)


def _json(value: Any) -> str:
    # The template's `tojson` filter: json.dumps with non-ASCII kept and default separators.
    return json.dumps(value, ensure_ascii=False)


def tool_call_text(name: str, arguments: dict) -> str:
    """One `<tool_call>` block as the template writes it (and a Qwen3 model emits it)."""
    return f"{TOOL_CALL}\n{_json({'name': name, 'arguments': arguments})}\n{TOOL_CALL_END}"


def parse_tool_calls(text: str) -> list[dict]:
    """The tool calls of an assistant turn's text, [{'name': str, 'arguments': dict}, ...] in order. A block that
    is not a JSON object with a string `name` and an object `arguments` becomes {'error': reason, 'text': raw}."""
    calls = []
    for raw in _CALL_RE.findall(text):
        try:
            call = json.loads(raw)
        except ValueError as exc:
            calls.append({"error": f"tool call is not JSON ({exc})", "text": raw})
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append({"error": "tool call has no string 'name'", "text": raw})
        elif not isinstance(call.get("arguments", {}), dict):
            calls.append({"error": "tool call 'arguments' is not an object", "text": raw})
        else:
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return calls


def _calls_of(message: dict) -> list[dict]:
    """tool_calls as {'name', 'arguments'}; OpenAI's {'function': {...}} form and JSON-string arguments accepted."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        calls.append({"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else args})
    return calls


def turn_text(role: str, content: str = "", tool_calls: list[dict] | None = None) -> str:
    """One complete system / user / assistant turn, `<|im_start|>` to `<|im_end|>\\n` included."""
    if role not in ("system", "user", "assistant"):
        raise ValueError(f"chat role {role!r} must be 'system', 'user' or 'assistant' (tool results: "
                         "tool_results_text)")
    body = content
    for i, call in enumerate(_calls_of({"tool_calls": tool_calls})):
        if i > 0 or content:
            body += "\n"
        body += tool_call_text(call["name"], call["arguments"])
    return f"{IM_START}{role}\n{body}{IM_END}\n"


def tool_results_text(results: list[str]) -> str:
    """Consecutive tool results as the one user turn Qwen3's template makes of them."""
    parts = "".join(f"\n{TOOL_RESPONSE}\n{r}\n{TOOL_RESPONSE_END}" for r in results)
    return f"{IM_START}user{parts}{IM_END}\n"


def generation_prompt(enable_thinking: bool = True) -> str:
    """What opens the model's turn; with thinking off Qwen3's template adds an empty think block."""
    return f"{IM_START}assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")


def render_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
    enable_thinking: bool = True,
) -> str:
    """The conversation `messages` ({'role', 'content', optional 'tool_calls'}) as Qwen3's template renders it,
    the tool signatures `tools` listed in the system turn. Assistant turns are rendered as given (no thinking
    is stripped: see the module docstring)."""
    out = []
    rest = list(messages)
    system = rest.pop(0)["content"] if rest and rest[0].get("role") == "system" else None
    if tools:
        head = f"{system}\n\n" if system else ""
        listed = "".join(f"\n{_json(t)}" for t in tools)
        out.append(f"{IM_START}system\n{head}{_TOOLS_HEADER}{listed}{_TOOLS_FOOTER}{IM_END}\n")
    elif system is not None:
        out.append(turn_text("system", system))
    pending: list[str] = []
    for i, m in enumerate(rest):
        role = m.get("role")
        if role not in ROLES or role == "system":
            raise ValueError(f"message {i}: role {role!r} must be one of user / assistant / tool (a system message "
                             "comes first)")
        if role == "tool":
            pending.append(str(m.get("content", "")))
            continue
        if pending:
            out.append(tool_results_text(pending))
            pending = []
        out.append(turn_text(role, m.get("content") or "", m.get("tool_calls")))
    if pending:
        out.append(tool_results_text(pending))
    if add_generation_prompt:
        out.append(generation_prompt(enable_thinking))
    return "".join(out)
