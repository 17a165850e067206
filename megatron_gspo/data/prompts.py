"""Where prompts come from (a file of one of FILE_SUFFIXES, or a synthetic task `task:<name>`) and the template
that wraps each prompt: the forms a `DataConfig` checks (data/config.py) and the datasets use (data/dataset.py)."""

from __future__ import annotations

from megatron_gspo.data.types import PromptItem

TASK_PREFIX = "task:"
FILE_SUFFIXES = (".jsonl", ".parquet")
TEMPLATE_FIELD = "{prompt}"


def check_prompt_template(template: str | None, key: str = "prompt_template") -> None:
    """Raises ValueError unless `template` is None or contains the `{prompt}` field."""
    if template is not None and TEMPLATE_FIELD not in template:
        raise ValueError(f"{key}={template!r} must contain {TEMPLATE_FIELD} where the prompt goes")


def apply_prompt_template(item: PromptItem, template: str | None) -> PromptItem:
    """`item` with its prompt wrapped in `template`; the original prompt is kept as meta['raw_prompt'].

    Only the literal `{prompt}` is replaced (not `str.format`), so templates may contain LaTeX braces such as
    "Put the final answer in \\boxed{}." without escaping.
    """
    if template is None:
        return item
    check_prompt_template(template)
    wrapped = template.replace(TEMPLATE_FIELD, item.prompt)
    return PromptItem(wrapped, item.answer, {**item.meta, "raw_prompt": item.prompt})
