"""Hugging Face safetensors checkpoints, streamed: a lazy reader and a shard-by-shard writer.

Reading: `HFCheckpointReader(dir)` is a `Mapping[str, Tensor]` over `model.safetensors.index.json` + its shards (or a
single `model.safetensors`). It parses only the shard headers up front; a tensor is read from its shard (safetensors
`safe_open`, memory-mapped, one shard open at a time) when it is looked up, so a consumer that handles one tensor at
a time holds one tensor in memory. `reader.shapes` is a shape-only view (meta tensors) for validating names and
shapes without reading any data.

Writing: `write_hf_checkpoint(named_tensors, out_dir, model_config, max_shard_bytes=...)` consumes an iterable of
(name, tensor), flushes a shard file whenever the next tensor would push it past `max_shard_bytes` (so it never holds
more than one shard), then writes the index, config.json and optional tokenizer files. Everything goes to a temporary
sibling directory that is renamed to `out_dir` only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_gspo.checkpoint import integrity
from megatron_gspo.checkpoint.durable import fsync_path, fsync_tree
from megatron_gspo.models.config import ModelConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""transformers' default shard size (5 GB)."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Files copied from `tokenizer_dir` next to the weights (whichever of them exist)."""

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Command-line dtype names."""


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """`fp32` / `bf16` / `fp16` / `float32` / `bfloat16` / `float16` / a torch dtype / None (= keep as stored)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value == "auto":
        return None
    if value in DTYPE_NAMES:
        return DTYPE_NAMES[value]
    named = getattr(torch, str(value), None)
    if isinstance(named, torch.dtype) and named in DTYPE_NAMES.values():
        return named
    raise ValueError(f"dtype {value!r} is not supported; choose one of auto, {', '.join(DTYPE_NAMES)}")


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------
def _read_header(path: Path) -> dict[str, dict]:
    """Tensor entries of a safetensors file header (name -> {dtype, shape, data_offsets}); no data is read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file is shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 1024**2 or n > path.stat().st_size - 8:
                raise ValueError(f"header length {n} is not plausible")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        header.pop("__metadata__", None)
        # safetensors itself finds a short file only when it maps it ("incomplete metadata, file not fully
        # covered", with no file name): a copy cut short is named here, before any tensor is read.
        ends = [e["data_offsets"][1] for e in header.values()]
        size, expected = path.stat().st_size, 8 + n + max(ends, default=0)
        if size != expected:
            raise ValueError(f"{size} bytes, but its header describes {expected} "
                             f"({'truncated: the file was cut short' if size < expected else 'extra bytes at its end'})")
    except (OSError, ValueError, TypeError, KeyError, IndexError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    return header


class HFCheckpointReader(Mapping):
    """Lazy `Mapping[str, Tensor]` over a (sharded) safetensors checkpoint directory.

    Looking a name up reads that one tensor from its shard with safetensors' `safe_open` (memory-mapped). At most
    `max_open_shards` shards stay open (least recently used are closed), so the mapped pages stay bounded by that
    many shards whatever the access order. `on_read(name, nbytes, file)` is called after each read (progress).
    """

    def __init__(
        self,
        hf_dir: str | os.PathLike,
        on_read: Callable[[str, int, str], None] | None = None,
        *,
        max_open_shards: int = 1,
    ):
        self.dir = Path(hf_dir)
        self.on_read = on_read
        self.max_open_shards = max(1, max_open_shards)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"Hugging Face checkpoint directory {self.dir} does not exist")
        # A directory megatron-gspo wrote carries an integrity record: changed bytes are named before reading. Only
        # the weights (model*.safetensors and their index): users edit config.json and tokenizer files by hand.
        integrity.verify(self.dir, ("model",), collective=False)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{index} is not a safetensors index with a 'weight_map': {err}") from err
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"{self.dir} has neither {INDEX_NAME} nor {SINGLE_NAME}")

        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_NAME]
        missing_files = [f for f in files if not (self.dir / f).is_file()]
        if missing_files:
            raise FileNotFoundError(
                f"{index} names {len(missing_files)} shard file(s) that do not exist in {self.dir}: "
                f"{', '.join(missing_files[:5])}"
            )
        self.files: list[str] = files
        """Shard file names, in order."""
        self._file_of: dict[str, str] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.file_bytes: dict[str, int] = {}
        """Tensor bytes per shard file."""
        problems = []
        for file in files:
            header = _read_header(self.dir / file)
            total = 0
            for name, entry in header.items():
                if weight_map is not None and weight_map.get(name) != file:
                    problems.append(f"{name} is in {file} but the index maps it to {weight_map.get(name)}")
                    continue
                dtype = _DTYPES.get(entry.get("dtype"))
                if dtype is None:
                    kind = entry.get("dtype")
                    raise ValueError(f"{self.dir / file}: tensor {name} has unsupported dtype {kind}")
                start, end = entry["data_offsets"]
                total += end - start
                self._file_of[name] = file
                self._meta[name] = (tuple(entry["shape"]), dtype)
            self.file_bytes[file] = total
        if weight_map is not None:
            absent = [n for n, f in weight_map.items() if n not in self._file_of]
            problems += [f"{n} is mapped to {weight_map[n]} but that file lacks it" for n in absent[:5]]
        if problems:
            listing = "; ".join(problems[:5])
            raise ValueError(f"{self.dir}: the index and the shard files disagree: {listing}")
        self._handles: OrderedDict[str, object] = OrderedDict()

    # Mapping interface ----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._file_of[name]  # KeyError for unknown names, as a Mapping should
        handle = self._handles.get(file)
        if handle is None:
            while len(self._handles) >= self.max_open_shards:
                self._handles.popitem(last=False)
            handle = self._handles[file] = safe_open(str(self.dir / file), framework="pt")
        self._handles.move_to_end(file)
        tensor = handle.get_tensor(name)
        if self.on_read is not None:
            self.on_read(name, tensor.numel() * tensor.element_size(), file)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    # Metadata -------------------------------------------------------------------------------------------
    @property
    def shapes(self) -> dict[str, torch.Tensor]:
        """Shape-only view: name -> meta tensor with the stored shape and dtype (no data read)."""
        return {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in self._meta.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of one tensor."""
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of one tensor."""
        return self._meta[name][1]

    def file_of(self, name: str) -> str:
        """Shard file holding `name`."""
        return self._file_of[name]

    def close(self) -> None:
        """Drops the open shard handles (their memory maps are released when collected)."""
        self._handles.clear()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------
def temp_sibling(path: Path, tag: str) -> Path:
    """A unique hidden directory next to `path` (same file system, so a rename into place is atomic)."""
    return path.parent / f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}"


_DERIVED_KEYS = frozenset(
    {"num_local_experts", "rope_parameters", "rope_scaling", "dtype", "torch_dtype", "transformers_version"}
)


def hf_config_extras(hf_config: dict) -> dict:
    """The entries of a source config.json that ModelConfig does not model (token ids, initializer range, ...),
    kept so that an exported config.json can carry them again."""
    ours = set(ModelConfig().to_hf_dict())
    return {k: v for k, v in hf_config.items() if k not in ours and k not in _DERIVED_KEYS}


def hf_config_dict(model_config: ModelConfig, dtype: torch.dtype | None, extras: dict | None = None) -> dict:
    """config.json body for `model_config` with the dtype of the written weights; `extras` (see
    `hf_config_extras`) fill in the fields ModelConfig does not model, never override it."""
    data = {**hf_config_extras(extras or {}), **model_config.to_hf_dict()}
    data.pop("torch_dtype", None)
    if dtype is not None:
        data["dtype"] = str(dtype).removeprefix("torch.")
    return data


def write_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    model_config: ModelConfig,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_dir: str | os.PathLike | None = None,
    config_extras: dict | None = None,
    overwrite: bool = False,
    progress: Callable[[str, torch.Tensor], None] | None = None,
) -> Path:
    """Writes a transformers-loadable checkpoint from a stream of (HF name, tensor); returns `out_dir`.

    Shards hold at most `max_shard_bytes` of tensor data (a single larger tensor gets a shard of its own) and are
    written as the stream goes, so at most one shard is held in memory. With one shard the file is
    `model.safetensors`; otherwise `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
    All output goes to a temporary sibling directory renamed to `out_dir` at the end: on any failure nothing is
    left at `out_dir`. An existing `out_dir` is an error unless `overwrite` (then it is replaced when complete).
    `config_extras`: source config.json entries ModelConfig does not model (bos/eos token ids, ...) to carry over.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose a new output directory (or overwrite it)")
    tok_files = tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out, "tmp")
    tmp.mkdir()
    umask = os.umask(0)
    os.umask(umask)
    try:
        shard_files: list[str] = []
        weight_map: dict[str, int] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = total = 0
        dtype = None
        seen: set[str] = set()

        def flush() -> None:
            nonlocal shard, shard_bytes
            name = f"shard-{len(shard_files):05d}.tmp"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            os.chmod(tmp / name, 0o666 & ~umask)  # safetensors creates files 0600
            shard_files.append(name)
            shard, shard_bytes = {}, 0

        for name, tensor in named_tensors:
            if name in seen:
                raise ValueError(f"tensor {name} appears twice in the stream")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            if shard and shard_bytes + nbytes > max_shard_bytes:
                flush()
            t = tensor.detach().to("cpu").contiguous()
            if t.untyped_storage().nbytes() != nbytes:  # a view into a larger tensor: safetensors needs its own
                t = t.clone()
            shard[name] = t
            weight_map[name] = len(shard_files)
            shard_bytes += nbytes
            total += nbytes
            if dtype is None:
                dtype = tensor.dtype
            if progress is not None:
                progress(name, tensor)
        if not seen:
            raise ValueError("no tensors to write")
        flush()

        n = len(shard_files)
        final = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for tmp_name, name in zip(shard_files, final):
            os.replace(tmp / tmp_name, tmp / name)
        if n > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: final[i] for k, i in sorted(weight_map.items())},
            }
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config_dict(model_config, dtype, config_extras)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for src in tok_files:
            shutil.copy2(src, tmp / src.name)
        integrity.record_all_files(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def replace_dir(src: Path, dst: Path) -> None:
    """Moves the complete directory `src` to `dst`, replacing an existing `dst` only after `src` is complete.

    A rename cannot swap two directories atomically, so an existing `dst` is first renamed aside and deleted after
    `src` took its place: a reader sees either the old or the new complete directory, never a partial one. `src` is
    fsynced before and the parent directory after the rename (checkpoint/durable.py).
    """
    fsync_tree(src)  # durable before it becomes visible
    old = None
    if dst.exists():
        old = temp_sibling(dst, "old")
        os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        if old is not None:
            os.replace(old, dst)
        raise
    fsync_path(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tokenizer_files(tokenizer_dir: str | os.PathLike) -> list[Path]:
    root = Path(tokenizer_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist")
    found = [root / f for f in TOKENIZER_FILES if (root / f).is_file()]
    if not any(f.name != "generation_config.json" for f in found):
        looked = ", ".join(TOKENIZER_FILES[:7])
        raise ValueError(f"{root} contains no tokenizer files (looked for {looked}, ...)")
    return found
