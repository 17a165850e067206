"""Synthetic verifiable tasks shipped with the package: fixed-width integer arithmetic (`123+045=` -> `168`).

Operands are zero-padded to a fixed width so that a tiny model can learn the task by position
(REFERENCE.md §8). The train / heldout split is decided by a hash of the prompt text alone, never by the
seed: two datasets of the same task built with any seeds never share a prompt across splits.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from megatron_gspo.data.types import PromptItem

SPLITS = ("train", "heldout")

_OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "+": ("add", lambda a, b: a + b),
    "-": ("sub", lambda a, b: a - b),
    "*": ("mul", lambda a, b: a * b),
}

# Operand spaces up to this many pairs are enumerated, so that sampling is exact and the split's size is
# known; larger ones are sampled with rejection (their splits are far bigger than any dataset asked of them).
_ENUMERATE_LIMIT = 200_000


@dataclass(frozen=True)
class ArithmeticTask:
    """`digits`-digit operands (zero-padded), one operator; the answer is the exact integer result."""

    digits: int = 3
    """Operand width; operands range over 0 .. 10**digits - 1."""
    op: str = "+"
    """Operator: '+', '-' or '*'."""
    seed: int = 0
    """Seed of the prompt order; the split of a prompt does not depend on it."""
    allow_negative: bool = False
    """For '-': allow b > a (negative answers); otherwise operands are ordered so that a >= b."""
    heldout_fraction: float = 0.1
    """Share of all prompts that belongs to the heldout split."""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"arithmetic op {self.op!r} is not supported; use one of {sorted(_OPS)}")
        if not 1 <= self.digits <= 9:
            raise ValueError(f"arithmetic digits={self.digits} must be in 1..9")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")

    @property
    def name(self) -> str:
        """Short name such as 'add3' (the TASKS key for the registered variants)."""
        return f"{_OPS[self.op][0]}{self.digits}"

    @property
    def alphabet(self) -> str:
        """Every character a prompt or an answer of this task can contain."""
        return "0123456789" + self.op + "="

    def prompt(self, a: int, b: int) -> str:
        """Prompt text for operands a, b, e.g. '123+045='."""
        return f"{a:0{self.digits}d}{self.op}{b:0{self.digits}d}="

    def answer(self, a: int, b: int) -> str:
        """Reference answer for operands a, b (plain integer, no padding)."""
        return str(_OPS[self.op][1](a, b))

    def split_of(self, prompt: str) -> str:
        """'train' or 'heldout': a fixed function of the prompt text."""
        digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
        return "heldout" if int.from_bytes(digest, "big") < self.heldout_fraction * 2**64 else "train"

    def items(self, split: str, size: int) -> list[PromptItem]:
        """`size` distinct prompts of `split` in seeded order; a larger size extends a smaller one."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r} must be one of {SPLITS}")
        if size <= 0:
            raise ValueError(f"size={size} must be > 0")
        rng = random.Random(f"{self.name}/{self.seed}/{split}")
        if (10**self.digits) ** 2 <= _ENUMERATE_LIMIT:
            pairs = self._enumerated_pairs(split, size, rng)
        else:
            pairs = self._sampled_pairs(split, size, rng)
        return [self._item(a, b, split) for a, b in pairs]

    def _canonical(self, a: int, b: int) -> tuple[int, int]:
        if self.op == "-" and not self.allow_negative and b > a:
            return b, a
        return a, b

    def _enumerated_pairs(self, split: str, size: int, rng: random.Random) -> list[tuple[int, int]]:
        n = 10**self.digits
        pairs = sorted({self._canonical(a, b) for a in range(n) for b in range(n)})
        pairs = [p for p in pairs if self.split_of(self.prompt(*p)) == split]
        if size > len(pairs):
            raise ValueError(
                f"task {self.name} has {len(pairs)} distinct {split} prompts, fewer than the {size} asked "
                f"for; lower data.{split}_size or use a task with more digits"
            )
        rng.shuffle(pairs)
        return pairs[:size]

    def _sampled_pairs(self, split: str, size: int, rng: random.Random) -> list[tuple[int, int]]:
        n = 10**self.digits
        seen: set[tuple[int, int]] = set()
        pairs: list[tuple[int, int]] = []
        # Bounded so an impossible request fails instead of spinning; real ones need ~size / fraction draws.
        for _ in range(int(50 * size / self.heldout_fraction) + 1000):
            pair = self._canonical(rng.randrange(n), rng.randrange(n))
            if pair in seen or self.split_of(self.prompt(*pair)) != split:
                continue
            seen.add(pair)
            pairs.append(pair)
            if len(pairs) == size:
                return pairs
        raise ValueError(f"task {self.name}: could not draw {size} distinct {split} prompts; lower the size")

    def _item(self, a: int, b: int, split: str) -> PromptItem:
        return PromptItem(self.prompt(a, b), self.answer(a, b), {"task": self.name, "split": split})


TASKS: dict[str, Callable[..., ArithmeticTask]] = {
    "add2": partial(ArithmeticTask, digits=2, op="+"),
    "add3": partial(ArithmeticTask, digits=3, op="+"),
    "add4": partial(ArithmeticTask, digits=4, op="+"),
    "sub3": partial(ArithmeticTask, digits=3, op="-"),
    "mul2": partial(ArithmeticTask, digits=2, op="*"),
}
"""Registered task variants by difficulty; each factory takes `seed=`."""


def make_task(name: str, seed: int = 0) -> ArithmeticTask:
    """The registered task `name` (see TASKS) with prompt order `seed`."""
    factory = TASKS.get(name)
    if factory is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return factory(seed=seed)
