"""Synthetic verifiable tasks shipped with the package: fixed-width integer arithmetic (`123+045=` -> `168`)
and chained addition worked step by step (`12+34+56=` -> `046+56=102`), whose longer responses suit the MoE
stability benchmark (examples/stability_moe.yaml).

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


def _split_of(prompt: str, heldout_fraction: float) -> str:
    """'train' or 'heldout' from a hash of the prompt text (independent of any seed)."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") < heldout_fraction * 2**64 else "train"


def _check_request(split: str, size: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} must be one of {SPLITS}")
    if size <= 0:
        raise ValueError(f"size={size} must be > 0")


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
        return _split_of(prompt, self.heldout_fraction)

    def items(self, split: str, size: int) -> list[PromptItem]:
        """`size` distinct prompts of `split` in seeded order; a larger size extends a smaller one."""
        _check_request(split, size)
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


@dataclass(frozen=True)
class ChainTask:
    """Chained addition of `terms` zero-padded `digits`-digit operands, answered step by step: each step adds
    the first two numbers and rewrites the rest, e.g. `12+34+56=` -> `046+56=102`. Partial sums are zero-padded
    to the width of the largest possible total, so every response has the same length,
    (terms - 2) * (width + digits + 2) + width characters plus eos (11 tokens for 3 two-digit terms). The
    reward compares the whole response, so every step has to be right."""

    terms: int = 3
    """Operands in the prompt (>= 3; two would be plain addition)."""
    digits: int = 2
    """Operand width; operands range over 0 .. 10**digits - 1."""
    seed: int = 0
    """Seed of the prompt order; the split of a prompt does not depend on it."""
    heldout_fraction: float = 0.1
    """Share of all prompts that belongs to the heldout split."""

    def __post_init__(self) -> None:
        if not 3 <= self.terms <= 6:
            raise ValueError(f"chain terms={self.terms} must be in 3..6")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"chain digits={self.digits} must be in 1..6")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")

    op = "+"  # class attribute, not a field: the only operator of a chain

    @property
    def name(self) -> str:
        """Short name such as 'chain3x2' (3 terms of 2 digits)."""
        return f"chain{self.terms}x{self.digits}"

    @property
    def alphabet(self) -> str:
        """Every character a prompt or an answer of this task can contain."""
        return "0123456789+="

    @property
    def width(self) -> int:
        """Digits of every partial sum (that of the largest total, terms * (10**digits - 1))."""
        return len(str(self.terms * (10**self.digits - 1)))

    def prompt(self, operands: tuple[int, ...]) -> str:
        """Prompt text, e.g. '12+34+56='."""
        return "+".join(f"{x:0{self.digits}d}" for x in operands) + "="

    def answer(self, operands: tuple[int, ...]) -> str:
        """The worked steps, e.g. '046+56=102' for (12, 34, 56)."""
        total, steps = operands[0], []
        for i, x in enumerate(operands[1:], start=2):
            total += x
            rest = "".join(f"+{y:0{self.digits}d}" for y in operands[i:])
            steps.append(f"{total:0{self.width}d}{rest}")
        return "=".join(steps)

    def split_of(self, prompt: str) -> str:
        """'train' or 'heldout': a fixed function of the prompt text."""
        return _split_of(prompt, self.heldout_fraction)

    def items(self, split: str, size: int) -> list[PromptItem]:
        """`size` distinct prompts of `split` in seeded order (drawn with rejection: the space has
        10**(terms * digits) prompts); a larger size extends a smaller one."""
        _check_request(split, size)
        rng = random.Random(f"{self.name}/{self.seed}/{split}")
        n = 10**self.digits
        seen: set[tuple[int, ...]] = set()
        items: list[PromptItem] = []
        for _ in range(int(50 * size / self.heldout_fraction) + 1000):
            operands = tuple(rng.randrange(n) for _ in range(self.terms))
            prompt = self.prompt(operands)
            if operands in seen or self.split_of(prompt) != split:
                continue
            seen.add(operands)
            items.append(PromptItem(prompt, self.answer(operands), {"task": self.name, "split": split}))
            if len(items) == size:
                return items
        raise ValueError(f"task {self.name}: could not draw {size} distinct {split} prompts; lower the size")


@dataclass(frozen=True)
class CountTask:
    """Count from a to b: `07-23=` -> `07+08+...+23`, with b - a + 1 between `min_terms` and `max_terms`, so the
    answer length varies by prompt (count2: 17 to 254 characters, uniform over the number of terms): the
    length-skewed task of the asynchronous-RL benchmark (tools/bench_async.py), where a synchronous step waits
    for its longest answer."""

    digits: int = 2
    """Width of every number (zero-padded)."""
    min_terms: int = 6
    """Fewest numbers in an answer."""
    max_terms: int = 85
    """Most numbers in an answer (<= 10**digits)."""
    seed: int = 0
    """Seed of the prompt order; the split of a prompt does not depend on it."""
    heldout_fraction: float = 0.1
    """Share of all prompts that belongs to the heldout split."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms <= 10**self.digits:
            raise ValueError(f"count task terms {self.min_terms}..{self.max_terms} must satisfy 2 <= min_terms <= "
                             f"max_terms <= {10**self.digits}")

    op = "-"  # class attribute: the prompt's range sign

    @property
    def name(self) -> str:
        """Short name such as 'count2'."""
        return f"count{self.digits}"

    @property
    def alphabet(self) -> str:
        """Every character a prompt or an answer of this task can contain."""
        return "0123456789+-="

    def prompt(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}-{b:0{self.digits}d}="

    def answer(self, a: int, b: int) -> str:
        return "+".join(f"{x:0{self.digits}d}" for x in range(a, b + 1))

    def split_of(self, prompt: str) -> str:
        """'train' or 'heldout': a fixed function of the prompt text."""
        return _split_of(prompt, self.heldout_fraction)

    def items(self, split: str, size: int) -> list[PromptItem]:
        """`size` distinct prompts of `split` in seeded order: the number of terms uniform over min..max, then
        the start uniform over what fits; a larger size extends a smaller one."""
        _check_request(split, size)
        rng = random.Random(f"{self.name}/{self.seed}/{split}")
        top = 10**self.digits
        seen: set[tuple[int, int]] = set()
        items: list[PromptItem] = []
        for _ in range(50 * size + 1000):
            terms = rng.randint(self.min_terms, self.max_terms)
            a = rng.randrange(top - terms + 1)
            b = a + terms - 1
            if (a, b) in seen or self.split_of(self.prompt(a, b)) != split:
                continue
            seen.add((a, b))
            items.append(PromptItem(self.prompt(a, b), self.answer(a, b), {"task": self.name, "split": split}))
            if len(items) == size:
                return items
        raise ValueError(f"task {self.name}: could not draw {size} distinct {split} prompts; lower the size")


TASKS: dict[str, Callable[..., ArithmeticTask | ChainTask | CountTask]] = {
    "add2": partial(ArithmeticTask, digits=2, op="+"),
    "add3": partial(ArithmeticTask, digits=3, op="+"),
    "add4": partial(ArithmeticTask, digits=4, op="+"),
    "sub3": partial(ArithmeticTask, digits=3, op="-"),
    "mul2": partial(ArithmeticTask, digits=2, op="*"),
    "chain3x2": partial(ChainTask, terms=3, digits=2),
    "chain4x2": partial(ChainTask, terms=4, digits=2),
    "chain3x3": partial(ChainTask, terms=3, digits=3),
    "count2": partial(CountTask, digits=2),
}
"""Registered task variants by difficulty; each factory takes `seed=`."""


def make_task(name: str, seed: int = 0) -> ArithmeticTask | ChainTask | CountTask:
    """The registered task `name` (see TASKS) with prompt order `seed`."""
    factory = TASKS.get(name)
    if factory is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return factory(seed=seed)
