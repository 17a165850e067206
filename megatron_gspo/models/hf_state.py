"""Hugging Face Qwen3-MoE tensors in and out of megatron GPTModel shards, for any TP/SP/EP/PP layout.

HF names are the on-disk (safetensors) names, e.g. `model.layers.3.mlp.experts.5.gate_proj.weight`.

Mapping (REFERENCE.md §3):
  embed_tokens        <-> embedding.word_embeddings      rows split over TP, vocab padded with zero rows
  lm_head             <-> output_layer                   rows split over TP, vocab padded
  model.norm          <-> decoder.final_layernorm
  input_layernorm     <-> input_layernorm                (TE spec: self_attention.linear_qkv.layer_norm_weight)
  q/k/v_proj          <-> linear_qkv                     per query group g: [q heads of g; k_g; v_g], rows split over TP
  q_norm / k_norm     <-> q_layernorm / k_layernorm
  o_proj              <-> linear_proj                    columns split over TP
  post_attention_ln   <-> pre_mlp_layernorm
  mlp.gate            <-> mlp.router
  experts.E.gate/up   <-> experts.local_experts.e.linear_fc1 = [gate_i; up_i] on expert-TP shard i,
                          e = E - ep_rank * E/ep             (TE grouped: experts.linear_fc1.weight{e})
  experts.E.down_proj <-> experts.local_experts.e.linear_fc2 columns split over expert-TP

Export streams one HF tensor at a time in a fixed global order: the owning ranks gather their TP / expert-TP
shards, then the lowest owning rank broadcasts (or sends to `dst`), so no rank ever holds more than one full
tensor beyond what it returns.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_gspo.models.config import ModelConfig

_FUSED_GATE_UP = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.down_proj$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------------
# HF name space
# ---------------------------------------------------------------------------------------------------------
def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint with its shape, in canonical order."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
        for e in range(cfg.num_experts):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (i, h)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (i, h)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def canonical_hf_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accepts transformers' in-memory fused experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]) as well as the on-disk per-expert names; returns on-disk names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        m = _FUSED_GATE_UP.match(name)
        if m:
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"model.layers.{m[1]}.mlp.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"model.layers.{m[1]}.mlp.experts.{e}.up_proj.weight"] = up[e]
            continue
        m = _FUSED_DOWN.match(name)
        if m:
            for e in range(tensor.shape[0]):
                out[f"model.layers.{m[1]}.mlp.experts.{e}.down_proj.weight"] = tensor[e]
            continue
        out[name] = tensor
    return out


def weight_problems(cfg: ModelConfig, shapes: Mapping[str, torch.Tensor]) -> list[str]:
    """Human-readable differences between the tensors `cfg` implies and `shapes` (name -> tensor-like)."""
    expected = hf_tensor_shapes(cfg)
    missing = [n for n in expected if n not in shapes]
    extra = sorted(n for n in shapes if n not in expected)
    wrong = [
        f"{n} {tuple(shapes[n].shape)} (expected {expected[n]})"
        for n in expected
        if n in shapes and tuple(shapes[n].shape) != expected[n]
    ]
    problems = []
    if missing:
        problems.append(f"{count_tensors(missing)} missing: {tensor_listing(missing)}")
    if extra:
        problems.append(f"{count_tensors(extra)} unexpected: {tensor_listing(extra)}")
    if wrong:
        problems.append(f"{count_tensors(wrong)} with wrong shapes: " + "; ".join(wrong[:6]) + _more(wrong, 6))
    if problems:
        problems += _config_hints(cfg, shapes)
    return problems


def _config_hints(cfg: ModelConfig, shapes: Mapping[str, torch.Tensor]) -> list[str]:
    """What the weights themselves say about the fields config.json sets differently."""
    hints = []

    def hint(field: str, theirs) -> None:
        ours = getattr(cfg, field)
        if theirs is not None and theirs != ours:
            hints.append(f"config.json says {field}={ours} but the weights have {field}={theirs}")

    layers = {int(m[1]) for n in shapes if (m := _LAYER.match(n))}
    hint("num_hidden_layers", max(layers) + 1 if layers else None)
    experts = {int(m[1]) for n in shapes if (m := _EXPERT.match(n))}
    hint("num_experts", max(experts) + 1 if experts else None)

    def dim(name: str, axis: int) -> int | None:
        t = shapes.get(name)
        return int(t.shape[axis]) if t is not None and len(t.shape) > axis else None

    hint("vocab_size", dim("model.embed_tokens.weight", 0))
    hint("hidden_size", dim("model.embed_tokens.weight", 1))
    head_dim = dim("model.layers.0.self_attn.q_norm.weight", 0)
    hint("head_dim", head_dim)
    if head_dim:
        q = dim("model.layers.0.self_attn.q_proj.weight", 0)
        k = dim("model.layers.0.self_attn.k_proj.weight", 0)
        hint("num_attention_heads", q // head_dim if q else None)
        hint("num_key_value_heads", k // head_dim if k else None)
    hint("moe_intermediate_size", dim("model.layers.0.mlp.experts.0.gate_proj.weight", 0))
    return hints


def tensor_listing(names: list[str], limit: int = 8) -> str:
    """Names grouped by layer ('model.layers.4.* (27 tensors)'), at most `limit` entries."""
    groups: dict[str, list[str]] = defaultdict(list)
    for n in names:
        m = _LAYER.match(n)
        groups[f"model.layers.{m[1]}.*" if m else n].append(n)
    items = [
        members[0] if len(members) == 1 else f"{key} ({len(members)} tensors, e.g. {members[0]})"
        for key, members in groups.items()
    ]
    return ", ".join(items[:limit]) + _more(items, limit)


def count_tensors(items: list) -> str:
    return f"{len(items)} tensor{'s' if len(items) != 1 else ''}"


def _more(items: list, shown: int) -> str:
    return f", ... and {len(items) - shown} more" if len(items) > shown else ""


def check_hf_state_dict(cfg: ModelConfig, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raises ValueError listing missing, unexpected and mis-shaped tensors."""
    problems = weight_problems(cfg, state_dict)
    if problems:
        raise ValueError("HF state dict does not match the model config:\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------------------------------------------------
# Units: one megatron parameter <-> one or more HF tensors
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _Unit:
    key: tuple
    """Global identity, e.g. ("layer", 3, "qkv") or ("expert", 3, 17, "fc1")."""
    hf_names: tuple[str, ...]
    param: torch.nn.Parameter | None
    """The local megatron parameter (None on ranks that do not own the unit)."""
    split: str
    """How the local param is a shard of the full megatron tensor: none | rows_tp | cols_tp | fc1_etp | cols_etp."""


def _layers(chunk) -> list:
    decoder = getattr(chunk, "decoder", None)
    return list(decoder.layers) if decoder is not None else []


def _expert_params(mlp, num_local: int) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    experts = mlp.experts
    if hasattr(experts, "local_experts"):  # SequentialMLP (local spec)
        return [(ex.linear_fc1.weight, ex.linear_fc2.weight) for ex in experts.local_experts]
    # TEGroupedMLP: weights named weight0..weight{n-1}
    return [
        (getattr(experts.linear_fc1, f"weight{e}"), getattr(experts.linear_fc2, f"weight{e}"))
        for e in range(num_local)
    ]


def _local_units(chunks: list, cfg: ModelConfig) -> list[_Unit]:
    units: list[_Unit] = []
    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    num_local = cfg.num_experts // ep
    for chunk in chunks:
        if getattr(chunk, "pre_process", False):
            units.append(_Unit(("embed",), ("model.embed_tokens.weight",), chunk.embedding.word_embeddings.weight, "rows_tp"))
        for layer in _layers(chunk):
            idx = layer.layer_number - 1
            p = f"model.layers.{idx}."
            attn = layer.self_attention
            qkv = attn.linear_qkv
            in_norm = getattr(qkv, "layer_norm_weight", None)
            if in_norm is None:
                in_norm = layer.input_layernorm.weight
            units += [
                _Unit(("layer", idx, "in_norm"), (p + "input_layernorm.weight",), in_norm, "none"),
                _Unit(
                    ("layer", idx, "qkv"),
                    (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                    qkv.weight,
                    "rows_tp",
                ),
                _Unit(("layer", idx, "proj"), (p + "self_attn.o_proj.weight",), attn.linear_proj.weight, "cols_tp"),
                _Unit(("layer", idx, "q_norm"), (p + "self_attn.q_norm.weight",), attn.q_layernorm.weight, "none"),
                _Unit(("layer", idx, "k_norm"), (p + "self_attn.k_norm.weight",), attn.k_layernorm.weight, "none"),
                _Unit(
                    ("layer", idx, "mlp_norm"),
                    (p + "post_attention_layernorm.weight",),
                    layer.pre_mlp_layernorm.weight,
                    "none",
                ),
                _Unit(("layer", idx, "router"), (p + "mlp.gate.weight",), layer.mlp.router.weight, "none"),
            ]
            for local_e, (fc1, fc2) in enumerate(_expert_params(layer.mlp, num_local)):
                e = ep_rank * num_local + local_e
                q = f"{p}mlp.experts.{e}."
                units.append(_Unit(("expert", idx, e, "fc1"), (q + "gate_proj.weight", q + "up_proj.weight"), fc1, "fc1_etp"))
                units.append(_Unit(("expert", idx, e, "fc2"), (q + "down_proj.weight",), fc2, "cols_etp"))
        if getattr(chunk, "post_process", False):
            units.append(_Unit(("final_norm",), ("model.norm.weight",), chunk.decoder.final_layernorm.weight, "none"))
            if not cfg.tie_word_embeddings:
                units.append(_Unit(("head",), ("lm_head.weight",), chunk.output_layer.weight, "rows_tp"))
    return units


def _global_order(cfg: ModelConfig) -> list[tuple]:
    keys: list[tuple] = [("embed",)]
    for idx in range(cfg.num_hidden_layers):
        keys += [("layer", idx, k) for k in ("in_norm", "qkv", "proj", "q_norm", "k_norm", "mlp_norm", "router")]
        for e in range(cfg.num_experts):
            keys += [("expert", idx, e, "fc1"), ("expert", idx, e, "fc2")]
    keys.append(("final_norm",))
    if not cfg.tie_word_embeddings:
        keys.append(("head",))
    return keys


# ---------------------------------------------------------------------------------------------------------
# Full megatron tensor <-> HF tensors
# ---------------------------------------------------------------------------------------------------------
def _qkv_from_hf(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    groups, hd = cfg.num_key_value_heads, cfg.head_dim
    per = cfg.num_attention_heads // groups
    h = q.shape[-1]
    q = q.reshape(groups, per * hd, h)
    k = k.reshape(groups, hd, h)
    v = v.reshape(groups, hd, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def _qkv_to_hf(cfg: ModelConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, hd = cfg.num_key_value_heads, cfg.head_dim
    per = cfg.num_attention_heads // groups
    h = qkv.shape[-1]
    x = qkv.reshape(groups, (per + 2) * hd, h)
    q, k, v = x.split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _group(split: str):
    if split in ("rows_tp", "cols_tp"):
        return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    if split in ("fc1_etp", "cols_etp"):
        return ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return None, 0, 1


def _shard(full: torch.Tensor, split: str) -> torch.Tensor:
    _, rank, size = _group(split)
    if size == 1 or split == "none":
        return full
    if split == "rows_tp":
        return full.chunk(size, dim=0)[rank]
    if split in ("cols_tp", "cols_etp"):
        return full.chunk(size, dim=1)[rank]
    if split == "fc1_etp":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    raise AssertionError(split)


def _unshard(local: torch.Tensor, split: str) -> torch.Tensor:
    group, _, size = _group(split)
    if size == 1 or split == "none":
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if split == "rows_tp":
        return torch.cat(parts, dim=0)
    if split in ("cols_tp", "cols_etp"):
        return torch.cat(parts, dim=1)
    if split == "fc1_etp":
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return torch.cat(list(gates) + list(ups), dim=0)
    raise AssertionError(split)


def _full_from_hf(cfg: ModelConfig, unit: _Unit, sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
    tensors = [sd[n] for n in unit.hf_names]
    kind = unit.key[-1] if unit.key[0] in ("layer", "expert") else unit.key[0]
    if kind == "qkv":
        return _qkv_from_hf(cfg, *tensors)
    if kind == "fc1":
        return torch.cat(tensors, dim=0)
    if kind in ("embed", "head"):
        return _pad_rows(tensors[0], unit.param.shape[0] * _group(unit.split)[2])
    return tensors[0]


def _hf_from_full(cfg: ModelConfig, key: tuple, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    kind = key[-1] if key[0] in ("layer", "expert") else key[0]
    if kind == "qkv":
        return _qkv_to_hf(cfg, full)
    if kind == "fc1":
        return tuple(full.chunk(2, dim=0))
    if kind in ("embed", "head"):
        return (full[: cfg.vocab_size],)
    return (full,)


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------
def _config_of(chunks: list) -> ModelConfig:
    cfg = getattr(chunks[0], "model_config", None)
    if cfg is None:
        raise ValueError("model chunks were not built by megatron_gspo.models.build_model (no model_config)")
    return cfg


def _unwrap(chunks) -> list:
    if not isinstance(chunks, (list, tuple)):
        chunks = [chunks]
    out = []
    for c in chunks:
        while hasattr(c, "module") and not hasattr(c, "model_config"):
            c = c.module
        out.append(c)
    return out


@torch.no_grad()
def load_hf_state_dict(chunks, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copies full HF-named tensors into this rank's shards (no communication).

    `state_dict` may be a lazy mapping (e.g. backed by safetensors files); only the tensors this rank owns are
    read. Fused in-memory transformers expert tensors are accepted too.
    """
    chunks = _unwrap(chunks)
    cfg = _config_of(chunks)
    if any(_FUSED_GATE_UP.match(n) or _FUSED_DOWN.match(n) for n in state_dict):
        state_dict = canonical_hf_state_dict(state_dict)
    if strict:
        check_hf_state_dict(cfg, {n: _Shape(state_dict, n) for n in state_dict})
    for unit in _local_units(chunks, cfg):
        full = _full_from_hf(cfg, unit, state_dict)
        local = _shard(full, unit.split)
        if tuple(local.shape) != tuple(unit.param.shape):
            raise ValueError(
                f"{', '.join(unit.hf_names)}: shard shape {tuple(local.shape)} != parameter {tuple(unit.param.shape)}"
            )
        unit.param.copy_(local.to(unit.param.dtype))


class _Shape:
    """Shape-only view used to validate lazy state dicts without loading tensors."""

    def __init__(self, sd: Mapping, name: str):
        t = sd[name]
        self.shape = tuple(t.shape) if hasattr(t, "shape") else tuple(t.get_shape())


def _owner_table(chunks: list, cfg: ModelConfig) -> dict[tuple, int]:
    """Global rank that sends each unit: the lowest rank owning it at (expert-)TP rank 0."""
    mine = []
    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    for unit in _local_units(chunks, cfg):
        lead = etp_rank == 0 if unit.key[0] == "expert" else tp_rank == 0
        if lead:
            mine.append(unit.key)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    owners: dict[tuple, int] = {}
    for rank, keys in enumerate(gathered):
        for key in keys:
            owners.setdefault(tuple(key), rank)
    return owners


@torch.no_grad()
def iter_hf_tensors(
    chunks,
    *,
    dst: int | None = None,
    dtype: torch.dtype | None = None,
    values: Mapping[torch.nn.Parameter, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, full tensor) in canonical order, streaming one unit at a time.

    Every rank must iterate (collectives inside). With `dst=None` every rank receives every tensor; with
    `dst=r` only rank r yields tensors (others yield nothing). Tensors are cast to `dtype` (default: as stored).
    `values` maps every local parameter to a tensor of its shape (and one dtype for all) exported in its place,
    e.g. its fp32 master weight or an Adam moment, through the same resharding and renaming.
    """
    chunks = _unwrap(chunks)
    cfg = _config_of(chunks)
    local = {u.key: u for u in _local_units(chunks, cfg)}
    if values is not None:
        local = {k: _Unit(u.key, u.hf_names, values[u.param], u.split) for k, u in local.items()}
    owners = _owner_table(chunks, cfg)
    me = dist.get_rank()
    shapes = hf_tensor_shapes(cfg)
    first = next(iter(local.values())).param if local else None
    param_dtype = first.dtype if first is not None else torch.float32
    # Receive buffers live where the collectives run: the GPU under NCCL, the CPU under gloo.
    device = first.device if first is not None else torch.device("cpu")
    for key in _global_order(cfg):
        if key not in owners:
            raise RuntimeError(f"no rank owns {key}: the model chunks do not cover the whole model")
        src = owners[key]
        unit = local.get(key)
        tensors: tuple[torch.Tensor, ...] | None = None
        if unit is not None:
            tensors = _hf_from_full(cfg, key, _unshard(unit.param.detach(), unit.split))
        names = _names_for(cfg, key)
        out = []
        for j, name in enumerate(names):
            if dst is None:
                buf = tensors[j].contiguous() if me == src else torch.empty(shapes[name], dtype=param_dtype, device=device)
                if dist.get_world_size() > 1:
                    dist.broadcast(buf, src=src)
                out.append((name, buf))
            elif src == dst:
                if me == dst:
                    out.append((name, tensors[j].contiguous()))
            elif me == src:
                dist.send(tensors[j].contiguous(), dst=dst)
            elif me == dst:
                buf = torch.empty(shapes[name], dtype=param_dtype, device=device)
                dist.recv(buf, src=src)
                out.append((name, buf))
        for name, t in out:
            yield name, (t.to(dtype) if dtype is not None else t.clone())


def _names_for(cfg: ModelConfig, key: tuple) -> tuple[str, ...]:
    if key[0] == "embed":
        return ("model.embed_tokens.weight",)
    if key[0] == "head":
        return ("lm_head.weight",)
    if key[0] == "final_norm":
        return ("model.norm.weight",)
    if key[0] == "expert":
        _, idx, e, kind = key
        q = f"model.layers.{idx}.mlp.experts.{e}."
        return (q + "gate_proj.weight", q + "up_proj.weight") if kind == "fc1" else (q + "down_proj.weight",)
    _, idx, kind = key
    p = f"model.layers.{idx}."
    return {
        "in_norm": (p + "input_layernorm.weight",),
        "qkv": (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
        "proj": (p + "self_attn.o_proj.weight",),
        "q_norm": (p + "self_attn.q_norm.weight",),
        "k_norm": (p + "self_attn.k_norm.weight",),
        "mlp_norm": (p + "post_attention_layernorm.weight",),
        "router": (p + "mlp.gate.weight",),
    }[kind]


def export_hf_state_dict(
    chunks,
    *,
    rank0_only: bool = False,
    dtype: torch.dtype | None = None,
    values: Mapping[torch.nn.Parameter, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Full, unsharded HF-named tensors from any layout: the same dict on every rank (or only rank 0); `values` as
    in `iter_hf_tensors`."""
    return dict(iter_hf_tensors(chunks, dst=0 if rank0_only else None, dtype=dtype, values=values))
