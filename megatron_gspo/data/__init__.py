"""Prompt data for RL: jsonl / parquet datasets, synthetic verifiable tasks, tokenizers, prompt sampler."""

from megatron_gspo.data.config import DataConfig
from megatron_gspo.data.dataset import (
    PromptDataset,
    PromptSampler,
    load_datasets,
    load_prompt_dataset,
)
from megatron_gspo.data.prompts import apply_prompt_template
from megatron_gspo.data.tasks import TASKS, ArithmeticTask, ChainTask, make_task
from megatron_gspo.data.tokenizer import (
    ARITHMETIC_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from megatron_gspo.data.types import DatasetError, PromptItem

__all__ = [
    "ARITHMETIC_ALPHABET",
    "TASKS",
    "ArithmeticTask",
    "ChainTask",
    "CharTokenizer",
    "DataConfig",
    "DatasetError",
    "HFTokenizer",
    "PromptDataset",
    "PromptItem",
    "PromptSampler",
    "Tokenizer",
    "apply_prompt_template",
    "load_datasets",
    "load_prompt_dataset",
    "load_tokenizer",
    "make_task",
]
