"""The model checkpoint format shared by conversion and the trainer.

A model checkpoint is a directory:

    config.json          ModelConfig.to_hf_dict(): the architecture (transformers field names)
    megatron_gspo.json   format version, parameter dtype, source, the layout it was written from (informational)
    model/               megatron `dist_checkpointing` (torch_dist = PyTorch DCP) of the chunks' sharded_state_dict()

Sharded tensor keys are global (megatron stacks layers along a leading axis with pipeline / virtual-pipeline
offsets, and experts along an expert axis), so a checkpoint written from one TP / EP / PP / VPP layout loads into any
other: dist_checkpointing reads just the slices each rank owns. The vocabulary padding of the embedding and LM head
(which depends on TP) is handled by megatron's `allow_shape_mismatch` on those two tensors. Several virtual-pipeline
chunks are stored as `{"model0": ..., "model1": ...}` like megatron-LM; a single chunk as its plain state dict.

The two layer specs name a few things differently (megatron-core 0.16.1): the local spec stores the MoE layer's
pre-MLP norm as `mlp.linear_fc1.layer_norm_weight` (its `sharded_state_dict_keys_map` remaps `pre_mlp_layernorm.`
even for MoE), the TE spec as `pre_mlp_layernorm.weight` (its norm is a separate TENorm there); TE modules also
carry `_extra_state` objects (FP8 metadata) the local modules lack, e.g. `self_attention.core_attention._extra_state`
of TEDotProductAttention. Loading takes either name (SPEC_ALIASES) and leaves spec-specific `_extra_state` alone,
so a checkpoint written on a CPU host (local spec) loads on a GPU (TE spec) and back.

A trainer iteration directory is a model checkpoint plus its own extra files: `load_model_checkpoint` and
`read_model_config` accept it, and `write_model_checkpoint` writes the model part into a directory the caller
manages (the trainer's own temporary iteration directory).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from megatron_gspo.checkpoint import integrity
from megatron_gspo.checkpoint.dist_io import dist_save, quiet_dcp, rank0, require_dist
from megatron_gspo.checkpoint.hf_io import replace_dir, temp_sibling
from megatron_gspo.errors import RunFailure, describe
from megatron_gspo.models.config import ModelConfig

log = logging.getLogger(__name__)

FORMAT = "megatron_gspo.model"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
INFO_NAME = "megatron_gspo.json"
MODEL_DIR = "model"

SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "moe_intermediate_size",
    "tie_word_embeddings",
)
"""ModelConfig fields that determine parameter shapes: always compared on load."""
TRAINING_ONLY_FIELDS = ("router_aux_loss_coef", "max_position_embeddings")
"""Fields that change neither the weights nor the function computed (aux-loss weight, RoPE cache length): never
compared, so a run may set them differently from the checkpoint."""
_RESERVED = ("format", "format_version", "dtype", "layout")
INHERITED_KEYS = ("hf_config_extras",)
"""megatron_gspo.json entries that follow the weights: `load_model_checkpoint` remembers them on the chunks and
`write_model_checkpoint` writes them again (so a trainer checkpoint of a converted model exports the original HF
config fields such as the token ids)."""


# ---------------------------------------------------------------------------------------------------------
# Directory layout
# ---------------------------------------------------------------------------------------------------------
def resolve_model_checkpoint(path: str | os.PathLike) -> Path:
    """The model checkpoint directory for `path` (a model checkpoint, a trainer iteration dir, or its `model/`).

    Raises FileNotFoundError naming what is missing.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model checkpoint {p} does not exist")
    if not p.is_dir():
        raise FileNotFoundError(f"model checkpoint {p} is not a directory")
    in_model_dir = (p / "metadata.json").is_file() and (p.parent / CONFIG_NAME).is_file()
    if in_model_dir and not (p / CONFIG_NAME).is_file():
        p = p.parent  # pointed at the model/ subdirectory
    missing = [n for n in (CONFIG_NAME, f"{MODEL_DIR}/metadata.json") if not (p / n).is_file()]
    if missing:
        hint = ""
        inner = sorted(c.name for c in p.iterdir() if c.is_dir() and (c / CONFIG_NAME).is_file())
        if inner:
            hint = f"; it contains checkpoint directories: {', '.join(inner[:5])}"
        raise FileNotFoundError(
            f"{p} is not a megatron-gspo model checkpoint (missing {', '.join(missing)}){hint}"
        )
    return p


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored in a model checkpoint (or trainer iteration) directory."""
    root = resolve_model_checkpoint(path)
    try:
        return ModelConfig.from_hf_config(root / CONFIG_NAME)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{root / CONFIG_NAME} is not a valid model config: {err}") from err


def read_checkpoint_info(path: str | os.PathLike) -> dict[str, Any]:
    """The contents of megatron_gspo.json ({} when the file is absent)."""
    root = resolve_model_checkpoint(path)
    info_path = root / INFO_NAME
    if not info_path.is_file():
        return {}
    try:
        info = json.loads(info_path.read_text())
    except ValueError as err:
        raise ValueError(f"{info_path} is not valid JSON: {err}") from err
    version = info.get("format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{info_path}: format_version {version} is newer than this megatron-gspo reads ({FORMAT_VERSION})"
        )
    return info


def config_differences(saved: ModelConfig, built: ModelConfig, *, strict: bool = True) -> list[str]:
    """'field: checkpoint X, model Y' for each compared field that differs (shape fields always; with `strict` also
    routing / norm / RoPE fields; TRAINING_ONLY_FIELDS never)."""
    names = [f.name for f in fields(ModelConfig) if f.name not in TRAINING_ONLY_FIELDS]
    if not strict:
        names = [n for n in names if n in SHAPE_FIELDS]
    return [
        f"{n}: checkpoint {getattr(saved, n)!r}, model {getattr(built, n)!r}"
        for n in names
        if getattr(saved, n) != getattr(built, n)
    ]


SPEC_ALIASES = (
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)
"""(local spec, TE spec) endings of the same sharded tensor key (see the module docstring)."""
EXTRA_STATE = "_extra_state"


def spec_alias(key: str) -> str | None:
    """The other spec's name of sharded key `key`, or None."""
    for local, te in SPEC_ALIASES:
        for mine, other in ((local, te), (te, local)):
            if key.endswith("." + mine):
                return key[: -len(mine)] + other
    return None


def _is_extra_state(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == EXTRA_STATE


def _use_stored_names(sharded: dict, stored: set[str]) -> None:
    """Renames requested sharded tensors that the checkpoint stores under the other spec's name (in place)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for item in nested_values(sharded):
        key = getattr(item, "key", None)
        if key is None or key in stored:
            continue
        alias = spec_alias(key)
        if alias is not None and alias in stored:
            item.key = alias


def use_stored_names(sharded: dict, checkpoint_dir: Path) -> None:
    """Renames (in place) requested sharded tensors that the dist_checkpointing checkpoint `checkpoint_dir` stores
    under the other layer spec's name (SPEC_ALIASES; optimizer-state keys end with the model's keys)."""
    _use_stored_names(sharded, _stored_keys(checkpoint_dir))


def _stored_keys(model_dir: Path) -> set[str]:
    """Sharded keys (tensors and objects) a dist_checkpointing checkpoint holds."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {item.key for item in load_sharded_metadata(str(model_dir)).values()}


# ---------------------------------------------------------------------------------------------------------
# Model chunks
# ---------------------------------------------------------------------------------------------------------
def _unwrap(chunks) -> list:
    if not isinstance(chunks, (list, tuple)):
        chunks = [chunks]
    out = []
    for c in chunks:
        while hasattr(c, "module"):  # DDP / Float16Module wrappers
            c = c.module
        out.append(c)
    if not out:
        raise ValueError("no model chunks given")
    return out


def model_sharded_state_dict(chunks) -> dict:
    """The dist_checkpointing state dict of this rank's chunks (plain for one chunk, model0/model1/... for VPP)."""
    chunks = _unwrap(chunks)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _layout(chunks: list) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    cfg = chunks[0].config
    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        virtual_pp=getattr(cfg, "virtual_pipeline_model_parallel_size", None),
        sequence_parallel=bool(getattr(cfg, "sequence_parallel", False)),
        world_size=dist.get_world_size(),
    )


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------
def write_model_checkpoint(
    chunks,
    path: str | os.PathLike,
    model_config: ModelConfig,
    *,
    metadata: dict[str, Any] | None = None,
    asynchronous: bool = False,
):
    """Writes config.json, megatron_gspo.json and model/ into the existing directory `path` (all ranks call).

    Not atomic: for callers that write into a temporary directory of their own (the trainer's iteration dir);
    everyone else uses `save_model_checkpoint`. `asynchronous`: the tensors of model/ are written later, by the
    AsyncRequest returned (checkpoint/dist_io.py `dist_save`); otherwise None is returned, everything written.
    """
    require_dist()
    chunks = _unwrap(chunks)
    built = getattr(chunks[0], "model_config", None)
    diffs = config_differences(model_config, built) if built is not None else []
    if diffs:
        listing = "; ".join(diffs)
        raise ValueError(f"model_config differs from the config the chunks were built with: {listing}")
    inherited = getattr(chunks[0], "checkpoint_info", None) or {}
    metadata = {**{k: inherited[k] for k in INHERITED_KEYS if k in inherited}, **(metadata or {})}
    clash = [k for k in metadata if k in _RESERVED]
    if clash:
        raise ValueError(f"metadata keys {clash} are reserved by the checkpoint format")
    info = dict(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        dtype=str(next(chunks[0].parameters()).dtype).removeprefix("torch."),
        layout=_layout(chunks),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        **metadata,
    )
    info_text = json.dumps(info, indent=2, default=_json_value) + "\n"  # fails early on every rank
    config_text = json.dumps(model_config.to_hf_dict(), indent=2) + "\n"
    root = Path(path)
    rank0(lambda: (root / MODEL_DIR).mkdir(parents=True, exist_ok=True), f"creating {root / MODEL_DIR}")
    request = dist_save(model_sharded_state_dict(chunks), str(root / MODEL_DIR), asynchronous=asynchronous)

    def write_json() -> None:
        (root / CONFIG_NAME).write_text(config_text)
        (root / INFO_NAME).write_text(info_text)

    rank0(write_json, f"writing {root / CONFIG_NAME}")
    return request


def save_model_checkpoint(
    chunks, path: str | os.PathLike, model_config: ModelConfig, *, metadata: dict[str, Any] | None = None
) -> Path:
    """Saves the model chunks of every rank as a model checkpoint at `path` (all ranks call).

    Everything is written into a temporary sibling directory that rank 0 renames to `path` after all ranks finished;
    an existing `path` is replaced only then. On failure the temporary directory is removed and `path` is untouched.
    `metadata` (JSON-serialisable, e.g. {"source": ...}) is merged into megatron_gspo.json.
    """
    require_dist()
    final = Path(path)
    box = [temp_sibling(final, "tmp") if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    tmp: Path = box[0]
    try:
        rank0(lambda: tmp.mkdir(parents=True), f"creating {tmp}")
        write_model_checkpoint(chunks, tmp, model_config, metadata=metadata)
        _record_on_every_rank(tmp)
        rank0(lambda: integrity.record_common_files(tmp, dist.get_world_size()), f"recording {tmp}")
        rank0(lambda: replace_dir(tmp, final), f"moving {tmp} to {final}")
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _record_on_every_rank(tmp: Path) -> None:
    """Each rank records the files it wrote (checkpoint/integrity.py); every rank raises if any rank could not."""
    error = None
    try:
        integrity.record_rank_files(tmp, dist.get_rank())
    except OSError as err:  # a full disk
        error = f"rank {dist.get_rank()}: {describe(err)}"
    everyone = [error]
    if dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error)
    failed = [e for e in everyone if e is not None]
    if failed:
        raise RunFailure(f"integrity record of {tmp} not written: {failed[0]}")


# ---------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------
def load_model_checkpoint(
    chunks, path: str | os.PathLike, *, strict: bool = True, verify: bool = True
) -> dict[str, Any]:
    """Loads a model checkpoint (or trainer iteration dir) into this rank's chunks, resharding to the current layout.

    All ranks call. Raises ValueError naming the differing fields when config.json disagrees with the chunks'
    ModelConfig (see `config_differences`), and listing tensors the checkpoint lacks or has in excess (with
    `strict=False` shape fields must still match; routing/RoPE differences and tensors absent from the checkpoint
    are logged, and those parameters keep their values). Returns megatron_gspo.json's contents (also kept as
    `chunk.checkpoint_info`, see INHERITED_KEYS). `verify`: the model's files are first checked against the
    checkpoint's integrity record (checkpoint/integrity.py; CheckpointDamaged, a ValueError, names a damaged
    file); a caller that checked the whole checkpoint already passes False.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    require_dist()
    root = resolve_model_checkpoint(path)
    chunks = _unwrap(chunks)
    if verify:
        integrity.verify(root, (f"{MODEL_DIR}/", CONFIG_NAME, INFO_NAME))
    info = read_checkpoint_info(root)
    saved = read_model_config(root)
    built = getattr(chunks[0], "model_config", None)
    if built is not None:
        diffs = config_differences(saved, built, strict=strict)
        if diffs:
            listing = "; ".join(diffs)
            raise ValueError(f"{root / CONFIG_NAME} disagrees with the model being loaded: {listing}")
        for d in config_differences(saved, built, strict=True):  # only non-shape fields can be left here
            log.warning("model checkpoint %s: %s (loading anyway, strict=False)", root, d)
    sharded = model_sharded_state_dict(chunks)
    try:
        with quiet_dcp():
            use_stored_names(sharded, root / MODEL_DIR)
            loaded, ckpt_only, model_only = dist_checkpointing.load(
                sharded, str(root / MODEL_DIR), strict=StrictHandling.RETURN_ALL
            )
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - megatron / DCP raise many kinds
        # torch's CheckpointException (every rank's failure, with tracebacks) derives from BaseException.
        raise ValueError(f"model checkpoint {root / MODEL_DIR} is unreadable or corrupt: {describe(err)}") from err
    # megatron's naming: "missing" = in the checkpoint but not requested, "unexpected" = requested but not stored.
    # `_extra_state` present on one side only is the other layer spec's (FP8 metadata): not a mismatch; modules
    # whose extra state the checkpoint lacks keep their own.
    ckpt_only = {k for k in ckpt_only if not _is_extra_state(k)}
    model_only = {k for k in model_only if not _is_extra_state(k)}
    problems = []
    if model_only:
        problems.append(f"{len(model_only)} model tensors absent from the checkpoint: {_few(model_only)}")
    if ckpt_only:
        problems.append(f"{len(ckpt_only)} checkpoint tensors the model does not have: {_few(ckpt_only)}")
    if problems and strict:
        raise ValueError(f"model checkpoint {root} does not match the model: " + "; ".join(problems))
    for p in problems:
        log.warning("model checkpoint %s: %s", root, p)
    parts = [loaded] if len(chunks) == 1 else [loaded[f"model{i}"] for i in range(len(chunks))]
    for chunk, part in zip(chunks, parts):
        own_extra = {k: v for k, v in chunk.state_dict().items() if _is_extra_state(k) and k not in part}
        chunk.load_state_dict({**part, **own_extra}, strict=strict)
        chunk.checkpoint_info = info
    return info


def _json_value(obj: Any) -> Any:
    """numpy / torch scalars and paths in metadata; anything else is an error naming its type."""
    if hasattr(obj, "item") and getattr(obj, "ndim", 0) == 0:
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"metadata value {obj!r} of type {type(obj).__name__} is not JSON-serialisable")


def _few(keys, n: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


__all__ = [
    "config_differences",
    "load_model_checkpoint",
    "model_sharded_state_dict",
    "read_checkpoint_info",
    "read_model_config",
    "resolve_model_checkpoint",
    "save_model_checkpoint",
    "use_stored_names",
    "write_model_checkpoint",
]
