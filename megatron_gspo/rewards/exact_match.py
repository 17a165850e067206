"""String-comparison rewards: the whole response (synthetic tasks) or its last \\boxed{} answer.

Responses arrive decoded without special tokens, so the arithmetic task's "168<eos>" is "168" here. A response
that keeps going after the answer ("1681") is wrong: the policy has to learn to stop.
"""

from __future__ import annotations

from megatron_gspo.rewards.registry import register_reward

BOXED = "\\boxed"


@register_reward("exact_match")
def exact_match(response: str, answer: str, meta: dict) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace on both, else 0.0."""
    return float(response.strip() == answer.strip())


@register_reward("prefix_match")
def prefix_match(response: str, answer: str, meta: dict) -> float:
    """Partial credit for long answers: the share of the answer's characters the response gets right before its
    first mistake, times the length ratio min(1, len(answer) / len(response)) (running on past the answer costs
    as much as stopping short). 1.0 exactly when the response equals the answer (whitespace stripped)."""
    response, answer = response.strip(), answer.strip()
    if not answer:
        return float(not response)
    matched = next((i for i, (r, a) in enumerate(zip(response, answer)) if r != a), min(len(response), len(answer)))
    return matched / len(answer) * min(1.0, len(answer) / max(len(response), 1))


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (nested braces kept), or None when there is none or it is
    not closed."""
    start = text.rfind(BOXED + "{")
    if start < 0:
        return None
    depth = 0
    begin = start + len(BOXED)
    for pos in range(begin, len(text)):
        char = text[pos]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin + 1 : pos]
    return None


@register_reward("boxed_exact_match")
def boxed_exact_match(response: str, answer: str, meta: dict) -> float:
    """1.0 when the last \\boxed{} of the response equals the answer (itself unboxed if boxed), whitespace
    stripped; 0.0 otherwise, including when the response has no complete \\boxed{}."""
    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    gold = last_boxed(answer)
    gold = answer if gold is None else gold
    return float(predicted.strip() == gold.strip())
