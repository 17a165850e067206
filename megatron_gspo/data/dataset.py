"""Prompt datasets (jsonl, parquet, synthetic tasks) and the resumable sampler that feeds the RL loop.

Row format, in both jsonl (one JSON object per line) and parquet (one row per prompt):
    prompt  str            required, non-empty
    answer  str | number   required; numbers are converted with `str` (3 -> "3", 0.5 -> "0.5")
    ...                    any other field is kept in `PromptItem.meta`
Every malformed row raises `DatasetError` naming the place: `train.jsonl:17: missing required field 'answer'`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from megatron_gspo.data.config import DataConfig
from megatron_gspo.data.prompts import (
    FILE_SUFFIXES,
    TASK_PREFIX,
    apply_prompt_template,
    check_prompt_template,
)
from megatron_gspo.data.tasks import make_task
from megatron_gspo.data.types import DatasetError, PromptItem


class PromptDataset(Sequence[PromptItem]):
    """An in-memory, ordered list of prompts with the name of where they came from."""

    def __init__(self, items: list[PromptItem], source: str) -> None:
        if not items:
            raise DatasetError(f"{source}: no prompts")
        self._items = list(items)
        self.source = source

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> PromptItem: ...
    @overload
    def __getitem__(self, index: slice) -> list[PromptItem]: ...
    def __getitem__(self, index):
        return self._items[index]

    def __repr__(self) -> str:
        return f"PromptDataset(source={self.source!r}, size={len(self)})"


def load_prompt_dataset(
    spec: str | Path,
    *,
    split: str = "train",
    size: int | None = None,
    seed: int = 0,
    prompt_template: str | None = None,
) -> PromptDataset:
    """Prompts from a `.jsonl` / `.parquet` file or a synthetic task (`task:<name>`, see data.tasks.TASKS).

    Tasks: `size` prompts of `split` ('train' / 'heldout') in the order given by `seed`; `size` is required.
    Files: the rows in file order, at most `size` of them when given; `split` and `seed` are not used.
    """
    check_prompt_template(prompt_template)
    if size is not None and size <= 0:
        raise ValueError(f"dataset size={size} must be > 0")
    spec = str(spec)
    if spec.startswith(TASK_PREFIX):
        if size is None:
            raise ValueError(f"{spec}: a synthetic task needs a size (how many prompts to generate)")
        items = make_task(spec[len(TASK_PREFIX) :], seed=seed).items(split, size)
    else:
        path = Path(spec)
        if path.suffix not in FILE_SUFFIXES:
            kinds = " or ".join(FILE_SUFFIXES)
            raise DatasetError(f"{spec}: unsupported dataset; use a {kinds} file or task:<name>")
        if not path.is_file():
            raise DatasetError(f"{spec}: file not found")
        items = _read_jsonl(path, spec) if path.suffix == ".jsonl" else _read_parquet(path, spec)
        if size is not None:
            items = items[:size]
    return PromptDataset([apply_prompt_template(item, prompt_template) for item in items], source=spec)


def load_datasets(config: DataConfig) -> tuple[PromptDataset, PromptDataset | None]:
    """The train and (optional) heldout datasets a `DataConfig` describes."""
    train = load_prompt_dataset(
        config.train,
        split="train",
        size=config.train_size if config.train.startswith(TASK_PREFIX) else None,
        seed=config.seed,
        prompt_template=config.prompt_template,
    )
    heldout = None
    if config.heldout is not None:
        heldout = load_prompt_dataset(
            config.heldout,
            split="heldout",
            size=config.heldout_size,
            seed=config.seed,
            prompt_template=config.prompt_template,
        )
    return train, heldout


def _read_jsonl(path: Path, name: str) -> list[PromptItem]:
    items = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{name}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {_type_name(row)}")
            items.append(_item_from_row(row, where))
    return items


def _read_parquet(path: Path, name: str) -> list[PromptItem]:
    import pyarrow.parquet as pq  # only needed for parquet input

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for damaged or non-parquet files
        raise DatasetError(f"{name}: not a readable parquet file ({exc})") from None
    for column in ("prompt", "answer"):
        if column not in table.column_names:
            raise DatasetError(
                f"{name}: missing required column {column!r} (columns: {', '.join(table.column_names)})"
            )
    return [_item_from_row(row, f"{name}: row {i}") for i, row in enumerate(table.to_pylist())]


def _item_from_row(row: dict[str, Any], where: str) -> PromptItem:
    for key in ("prompt", "answer"):
        if key not in row:
            raise DatasetError(f"{where}: missing required field {key!r}")
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: field 'prompt' must be a string, got {_type_name(prompt)}")
    if not prompt:
        raise DatasetError(f"{where}: field 'prompt' is empty")
    # bool is an int subclass, but `true` as an answer is almost certainly a data bug.
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        if not math.isfinite(answer):
            raise DatasetError(f"{where}: field 'answer' is {answer}, not a finite number")
        answer = str(answer)
    if not isinstance(answer, str):
        raise DatasetError(f"{where}: field 'answer' must be a string or number, got {_type_name(answer)}")
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
    return PromptItem(prompt, answer, meta)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class PromptSampler(Iterator[list[PromptItem]]):
    """Endless stream of prompt batches: epoch after epoch, each a fixed permutation of the dataset.

    The stream is one sequence (epoch 0's order, then epoch 1's, ...), so batches may straddle an epoch
    boundary and `next_items(k)` (dynamic-sampling top-up) draws from the same sequence as full batches. The
    position in it is the whole state: `load_state_dict(state_dict())` on a fresh sampler continues with
    exactly the same prompts.
    """

    def __init__(
        self, dataset: Sequence[PromptItem], batch_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("PromptSampler needs a non-empty dataset")
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be > 0")
        if seed < 0:
            raise ValueError(f"sampler seed={seed} must be >= 0")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        """Epochs completed so far (the epoch the next prompt comes from)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Index of the next prompt within the current epoch's order."""
        return self._position

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            n = len(self.dataset)
            if self.shuffle:
                # SeedSequence([seed, epoch]) gives independent, platform-stable permutations per epoch.
                self._order = np.random.default_rng([self.seed, self._epoch]).permutation(n)
            else:
                self._order = np.arange(n)
        return self._order

    def next_items(self, k: int) -> list[PromptItem]:
        """The next `k` prompts of the stream (k >= 0), crossing into the next epoch when needed."""
        if k < 0:
            raise ValueError(f"next_items(k={k}) needs k >= 0")
        out: list[PromptItem] = []
        while len(out) < k:
            order = self._epoch_order()
            take = min(k - len(out), len(order) - self._position)
            out.extend(self.dataset[int(i)] for i in order[self._position : self._position + take])
            self._position += take
            if self._position == len(order):
                self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return out

    def __next__(self) -> list[PromptItem]:
        return self.next_items(self.batch_size)

    def __iter__(self) -> PromptSampler:
        return self

    def state_dict(self) -> dict[str, int | bool]:
        """Position in the stream, plus what it was computed for (checked on load)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continues from `state`; refuses a state saved for another dataset size, seed or shuffle setting."""
        expected = {"seed": self.seed, "shuffle": self.shuffle, "dataset_size": len(self.dataset)}
        for key, value in expected.items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={value!r}; "
                    "resume with the same data and seed (or start a new run)"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.dataset):
            raise ValueError(f"sampler state epoch={epoch}, position={position} is out of range")
        self._epoch, self._position, self._order = epoch, position, None
