"""Where prompts, the tokenizer and the reward come from (the `data.*` keys of a run config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.data.prompts import FILE_SUFFIXES, TASK_PREFIX, check_prompt_template
from megatron_gspo.data.tasks import TASKS
from megatron_gspo.rewards.registry import check_reward_spec


@dataclass
class DataConfig:
    """Prompt sources, tokenizer and reward function of a run."""

    train: str = "task:add3"
    """Training prompts: a .jsonl / .parquet file or a synthetic task `task:<name>` (add2/3/4, sub3, mul2,
    chain3x2, chain4x2, chain3x3)."""
    heldout: str | None = "task:add3"
    """Evaluation prompts (same forms as `train`); a task's heldout never shares a train prompt."""
    train_size: int = 8192
    """Prompts generated when `train` is a task (a file always uses all its rows)."""
    heldout_size: int = 256
    """Heldout prompts: generated for a task, or the first rows of a file."""
    tokenizer: str = "char"
    """'char' (built-in arithmetic characters), 'char:<alphabet>', 'qwen3' (Qwen3's vocabulary, offline) or a local
    Hugging Face tokenizer dir."""
    prompt_template: str | None = None
    """Wraps each prompt: the literal {prompt} is replaced (e.g. a chat template); None: unchanged."""
    reward: str = "exact_match"
    """Reward: a registered name (exact_match, boxed_exact_match, math_verify) or `module:function`."""
    seed: int = 0
    """Seed of the synthetic prompts' order and of the sampler's per-epoch shuffle."""

    def __post_init__(self) -> None:
        _check_source("data.train", self.train)
        if self.heldout is not None:
            _check_source("data.heldout", self.heldout)
        for key in ("train_size", "heldout_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"data.{key}={value!r} must be an integer > 0")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(
                f"data.tokenizer={self.tokenizer!r} must be 'char', 'char:<alphabet>' or a directory"
            )
        if self.tokenizer == "char:":
            raise ValueError("data.tokenizer='char:' has an empty alphabet; list characters after 'char:'")
        check_prompt_template(self.prompt_template, key="data.prompt_template")
        check_reward_spec(self.reward, key="data.reward")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"data.seed={self.seed!r} must be an integer >= 0")


def _check_source(key: str, value: str) -> None:
    """Checks the form of a prompt source; whether a file exists is checked when it is loaded."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key}={value!r} must be a .jsonl / .parquet path or task:<name>")
    if value.startswith(TASK_PREFIX):
        name = value[len(TASK_PREFIX) :]
        if name not in TASKS:
            raise ValueError(f"{key}={value!r} names an unknown task; known: {', '.join(sorted(TASKS))}")
    elif Path(value).suffix not in FILE_SUFFIXES:
        raise ValueError(
            f"{key}={value!r} must be a {' or '.join(FILE_SUFFIXES)} file or task:<name> "
            f"(known tasks: {', '.join(sorted(TASKS))})"
        )
