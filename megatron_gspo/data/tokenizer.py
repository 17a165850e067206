"""Tokenizers: the protocol the trainer and rollout engines use, a built-in character tokenizer for the
synthetic tasks, and a wrapper around a Hugging Face tokenizer stored in a local directory.

Conventions shared by every implementation:
- `encode` never adds special tokens; callers prepend `bos_id` themselves when it is not None.
- `decode` drops special tokens (pad, eos, ...): a response "168<eos>" decodes to "168" for the rewards.
- `stop_ids` are the ids that end a response; `eos_id` is always among them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

ARITHMETIC_ALPHABET = "0123456789+-*="
"""Characters of the built-in arithmetic tasks: with pad and eos a 16-token vocabulary (REFERENCE.md §8)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, with special tokens left out."""
        ...


class CharTokenizer:
    """One id per character of a fixed alphabet, after two special tokens: pad = 0, eos = 1."""

    PAD = "<pad>"
    EOS = "<eos>"

    def __init__(self, alphabet: str = ARITHMETIC_ALPHABET) -> None:
        if not alphabet:
            raise ValueError("CharTokenizer needs a non-empty alphabet (e.g. 'char:0123456789+=')")
        duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if duplicates:
            raise ValueError(f"CharTokenizer alphabet {alphabet!r} repeats characters {duplicates}")
        self.alphabet = alphabet
        self.pad_id = 0
        self.eos_id = 1
        self.bos_id: int | None = None
        self.stop_ids: tuple[int, ...] = (self.eos_id,)
        self._specials = (self.PAD, self.EOS)
        self._char_to_id = {c: i + len(self._specials) for i, c in enumerate(alphabet)}
        self.vocab_size = len(self._specials) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of `text`; a character outside the alphabet raises ValueError."""
        ids = []
        for pos, char in enumerate(text):
            token = self._char_to_id.get(char)
            if token is None:
                raise ValueError(
                    f"character {char!r} at position {pos} of {text!r} is not in the tokenizer alphabet "
                    f"{self.alphabet!r}; use 'char:<alphabet>' with every character the data contains"
                )
            ids.append(token)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens dropped, or shown as <pad>/<eos> with `skip_special_tokens=False`."""
        out = []
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
            if token < len(self._specials):
                if not skip_special_tokens:
                    out.append(self._specials[token])
                continue
            out.append(self.alphabet[token - len(self._specials)])
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r}, vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloaded)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(
                f"tokenizer directory {str(path)!r} does not exist; give a local directory with tokenizer "
                "files (tokenizer.json / tokenizer_config.json) or 'char' for the built-in character "
                "tokenizer"
            )
        from transformers import AutoTokenizer  # heavy import: only when an HF tokenizer is asked for

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises OSError/ValueError/... depending on what is missing
            raise ValueError(f"could not load a tokenizer from {str(path)!r}: {exc}") from exc
        self.path = path
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(
                f"tokenizer at {str(path)!r} has no eos token; set eos_token in tokenizer_config.json"
            )
        self.eos_id = int(eos)
        pad = self._tok.pad_token_id
        # Many causal-LM tokenizers have no pad token; padding is never sampled or trained on, so eos serves.
        self.pad_id = int(pad) if pad is not None else self.eos_id
        bos = self._tok.bos_token_id
        self.bos_id = int(bos) if bos is not None else None
        # len() counts added tokens (chat markers), which `vocab_size` of HF tokenizers leaves out.
        self.vocab_size = len(self._tok)
        self.stop_ids = (self.eos_id,) + tuple(i for i in _generation_eos_ids(path) if i != self.eos_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, with special tokens left out."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


def _generation_eos_ids(path: Path) -> list[int]:
    """Extra end-of-response ids from generation_config.json (chat models such as Qwen3 list several)."""
    config = path / "generation_config.json"
    if not config.is_file():
        return []
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config}: unreadable generation config ({exc})") from exc
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def load_tokenizer(spec: str) -> Tokenizer:
    """Tokenizer named by `spec`: "char" (arithmetic alphabet), "char:<alphabet>", "qwen3" (Qwen3's vocabulary,
    offline: data/qwen3.py), or a local directory."""
    if spec == "qwen3":
        from megatron_gspo.data.qwen3 import Qwen3Tokenizer  # loads tiktoken and 151k ranks: only when asked for

        return Qwen3Tokenizer()
    if spec == "char":
        return CharTokenizer(ARITHMETIC_ALPHABET)
    if spec.startswith("char:"):
        return CharTokenizer(spec[len("char:") :])
    return HFTokenizer(spec)
