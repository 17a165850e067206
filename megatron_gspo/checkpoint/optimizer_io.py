"""The optimizer state of a trainer checkpoint, as a megatron `dist_checkpointing` checkpoint that any layout loads.

    optimizer/        dist_checkpointing (torch_dist) of `optimizer.sharded_state_dict(model_sharded_state_dict)`,
                      plus the LR schedule (a common, rank-0 entry)

Every optimizer tensor (fp32 master weight, Adam exp_avg / exp_avg_sq) is stored under its model tensor's global
key (`optimizer.state.exp_avg.<model key>`), sharded exactly like it, so resharding over TP / EP / PP works as for
the model. With megatron's DistributedOptimizer the `fully_reshardable` format with `mem_efficient` (SHARDED_METADATA;
megatron-core 0.16.1's default `fully_sharded_model_space` fails there: "flattened_range is not supported")
gathers each data-parallel group's optimizer state onto its DP rank 0 (over gloo, in host memory), which writes
it with the model tensor's replica id: every element is written once, so nothing is duplicated across
data-parallel replicas, and a load in another DP size reads what its ranks own now. The cost at scale: DP rank 0
holds its group's whole optimizer state in host memory while saving, and every rank builds its model-parallel
shard's full state in host memory while loading. `chained_optim_avoid_prefix` keeps the keys free of the dense / expert sub-optimizer
index (megatron-LM's choice for new checkpoints), so they do not depend on how parameters are grouped.

Loading: megatron's `load_state_dict` of each optimizer copies the loaded fp32 masters into its main params (and,
for bf16, does not touch the model copy: the caller's model load has put the weights there), so masters resume
bit-exactly in any layout.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from megatron_gspo.checkpoint.dist_io import dist_save, quiet_dcp, rank0, require_dist
from megatron_gspo.checkpoint.model_io import model_sharded_state_dict, use_stored_names
from megatron_gspo.errors import describe

OPTIMIZER_DIR = "optimizer"
SHARDED_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}
"""How megatron builds the optimizer's sharded state dict (read by DistributedOptimizer / ChainedOptimizer)."""
_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")
"""What identifies a param group in any layout (megatron's `param_group_identifier_keys` less `is_expert_parallel`,
which is true for expert params only when EP > 1)."""


def _parts(sharded: dict, optimizer) -> list[dict]:
    """The per-sub-optimizer state dicts of a (Chained)Optimizer's sharded state dict (megatron returns one
    sub-optimizer's directly and several as {index: state})."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [sharded] if len(subs) == 1 else [sharded[i] for i in range(len(subs))]


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return all(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def write_optimizer_checkpoint(chunks, optimizer, scheduler, path: Path, *, asynchronous: bool = False):
    """Writes `path/optimizer/` (all ranks call; the caller manages `path` and its atomic rename). `asynchronous`:
    returns the AsyncRequest that writes its tensors (checkpoint/dist_io.py `dist_save`), else None.

    Distributed optimizer: each sub-optimizer's parameter state (megatron's `fully_reshardable` tensors, keyed by
    the model's global keys) under `param_state.<i>`, and the param groups of all sub-optimizers (hyperparameters
    and Adam's step) as one common list, so a layout with another split into dense / expert sub-optimizers (EP=1
    has one, EP>1 two) finds its groups. The `mem_efficient` exchange gathers each DP group's shards over gloo on
    its DP rank 0 in host memory (no device memory beyond the shards), which alone writes them: one copy of each
    element. The plain optimizer (optim.distributed=false) is stored as megatron builds it (every DP rank holds
    the whole state; its replica 0 writes): it reshards over TP / PP / DP, but its state is keyed by sub-optimizer
    and megatron splits off an expert optimizer for EP > 1 only, so the trainer refuses an EP change for it."""
    require_dist()
    root = Path(path) / OPTIMIZER_DIR
    _initialise_optimizer_state(optimizer)  # a checkpoint before the first step
    sharded = optimizer.sharded_state_dict(model_sharded_state_dict(chunks), is_loading=False, metadata=SHARDED_METADATA)
    if _is_distributed(optimizer):
        parts = _parts(sharded, optimizer)
        param_state = {str(i): p["param_state"] for i, p in enumerate(parts) if p["param_state"] is not None}
        groups = [g for p in parts for g in p["optimizer"]["param_groups"]]
        state = {"format": "distributed", "param_state": param_state, "param_groups": groups,
                 "grad_scaler": [p.get("grad_scaler") for p in parts], "scheduler": scheduler.state_dict()}
    else:
        state = {"format": "plain", "optimizer": sharded, "scheduler": scheduler.state_dict()}
    rank0(lambda: root.mkdir(parents=True, exist_ok=True), f"creating {root}")
    return dist_save(state, str(root), asynchronous=asynchronous)


def _initialise_optimizer_state(optimizer) -> None:
    """Gives every never-stepped parameter of each sub-optimizer the state a fresh optimizer starts its first step
    from (zero moments), before a save or a load: a checkpoint may come before the first step.

    Adam creates its state lazily in `step()` -- torch's Adam / AdamW and TE's / apex's FusedAdam alike -- while
    megatron-core 0.16.1's DistributedOptimizer save reads `state[main_param]["exp_avg"]` for every param
    (distrib_optimizer.py `_get_main_param_and_optimizer_states`): KeyError 'exp_avg' before any step. Each
    sub-optimizer's own `init_state_fn` (megatron's, beside the Adam it built: plain zeros, or TE's
    `initialize_state` for the precision-aware optimizer) creates exactly what its first step would. torch's Adam
    also keeps a per-param `step`, which megatron's `state_dict()` reads without apex / TE (one value asserted):
    step 0 is added for it. A load overwrites these values; a first step from them is a fresh optimizer's."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        init_state_fn = getattr(opt, "init_state_fn", None)
        if inner is None or init_state_fn is None:  # SGD without momentum: no state
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        fresh = [p for p in params if not inner.state.get(p)]
        if not fresh:
            continue
        init_state_fn(inner, opt.config)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for p in fresh:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def load_optimizer_checkpoint(chunks, optimizer, scheduler, path: Path) -> None:
    """Restores optimizer and LR-schedule state from `path/optimizer/` into this layout (all ranks call; after the
    model weights are loaded). A missing, damaged or mismatching checkpoint is a ValueError naming it."""
    from megatron.core import dist_checkpointing

    require_dist()
    root = Path(path) / OPTIMIZER_DIR
    if not (root / "metadata.json").is_file():
        raise ValueError(f"optimizer checkpoint {root} is missing (no metadata.json)")
    distributed = _is_distributed(optimizer)
    _initialise_optimizer_state(optimizer)
    try:
        with quiet_dcp():
            sharded = optimizer.sharded_state_dict(
                model_sharded_state_dict(chunks), is_loading=True, metadata=SHARDED_METADATA
            )
            parts = _parts(sharded, optimizer) if distributed else None
            if distributed:
                request = {"param_state": {str(i): p["param_state"] for i, p in enumerate(parts)}}
            else:
                request = {"optimizer": sharded}
            use_stored_names(request, root)
            loaded = dist_checkpointing.load(request, str(root))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - megatron / DCP raise many kinds
        raise ValueError(f"optimizer checkpoint {root} is unreadable or corrupt: {describe(err)}") from err
    saved = loaded.get("format")
    if saved != ("distributed" if distributed else "plain"):
        raise ValueError(
            f"optimizer checkpoint {root} holds the {saved} optimizer's state but this run uses the "
            f"{'distributed' if distributed else 'plain'} one: set optim.distributed={str(saved == 'distributed').lower()}"
        )
    try:
        if distributed:
            for i, (sub, part) in enumerate(zip(optimizer.chained_optimizers, parts)):
                common = {k: v for k, v in part.items() if k != "param_state"}
                common["optimizer"]["param_groups"] = [
                    _saved_group(group, loaded["param_groups"], root) for group in common["optimizer"]["param_groups"]
                ]
                scalers = [s for s in loaded["grad_scaler"] if s is not None]
                if scalers:
                    common["grad_scaler"] = scalers[0]
                sub.load_state_dict({**common, "param_state": loaded["param_state"][str(i)]})
        else:
            optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    except (KeyError, TypeError, ValueError, RuntimeError, AssertionError) as err:
        raise ValueError(f"optimizer checkpoint {root} does not fit this run: {describe(err)}") from err


def _saved_group(current: dict, saved: list[dict], root: Path) -> dict:
    """The saved param group (hyperparameters, step) of the group `current`, by _GROUP_KEYS; its megatron
    identity keys stay the current layout's."""
    key = tuple(current.get(k) for k in _GROUP_KEYS)
    for group in saved:
        if tuple(group.get(k) for k in _GROUP_KEYS) == key:
            return {**group, "is_expert_parallel": current.get("is_expert_parallel")}
    raise ValueError(f"{root} has no param group with {dict(zip(_GROUP_KEYS, key))}")
