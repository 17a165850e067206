"""The optimizer state of a trainer checkpoint, which any layout loads.

    optimizer/        distributed optimizer (optim.distributed=true, the default): per-rank shard files
                      (checkpoint/optimizer_shards.py) -- `rank_<r>.pt`, each rank's own fp32 masters and Adam
                      moments, written by every rank in parallel, and `distributed.pt` (rank 0: param groups,
                      grad scaler, LR schedule)
                      plain optimizer: dist_checkpointing (torch_dist) of `optimizer.sharded_state_dict(...)`,
                      plus the LR schedule (a common, rank-0 entry)

The distributed optimizer's files are bounded by each rank's shard (host memory and bytes written) and reshard
over TP / PP / EP / DP on load; why not one of megatron's own formats: checkpoint/optimizer_shards.py. Earlier
checkpoints of the distributed optimizer (megatron's `fully_reshardable` format with `mem_efficient`, which
gathered each data-parallel group's state onto its DP rank 0 in host memory) are still read: an `optimizer/`
without `distributed.pt` is loaded as before.

The plain optimizer's tensors (fp32 master weight, Adam exp_avg / exp_avg_sq) are stored under their model
tensor's global key (`optimizer.state.exp_avg.<model key>`), sharded exactly like it, so resharding over TP / PP
works as for the model (every DP rank holds the whole state; its replica 0 writes). `chained_optim_avoid_prefix`
keeps the keys free of the dense / expert sub-optimizer index (megatron-LM's choice for new checkpoints).

Loading: megatron's `load_state_dict` of each optimizer copies the loaded fp32 masters into its main params (and,
for bf16, does not touch the model copy: the caller's model load has put the weights there), so masters resume
bit-exactly in any layout.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from megatron_gspo.checkpoint.dist_io import dist_save, quiet_dcp, rank0, require_dist
from megatron_gspo.checkpoint.model_io import model_sharded_state_dict, use_stored_names
from megatron_gspo.checkpoint.optimizer_shards import COMMON_FILE, load_shards, read_common, write_shards
from megatron_gspo.errors import describe

OPTIMIZER_DIR = "optimizer"
SHARDED_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}
"""How megatron builds the optimizer's sharded state dict (read by DistributedOptimizer / ChainedOptimizer): for
the plain optimizer, and to read a distributed optimizer's checkpoint of the earlier format."""
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
    returns the AsyncRequest that writes the plain optimizer's tensors (checkpoint/dist_io.py `dist_save`), else
    None.

    Distributed optimizer: every rank writes its own shard now, from host copies, with no communication but a
    final agreement (checkpoint/optimizer_shards.py), and rank 0 the param groups of all sub-optimizers
    (hyperparameters and Adam's step) as one list, so a layout with another split into dense / expert
    sub-optimizers (EP=1 has one, EP>1 two) finds its groups; with `asynchronous` too (None is returned: only the
    model's tensors go to the background writer). The plain optimizer (optim.distributed=false) is stored as
    megatron builds it (every DP rank holds the whole state; its replica 0 writes): it reshards over TP / PP / DP,
    but its state is keyed by sub-optimizer and megatron splits off an expert optimizer for EP > 1 only, so the
    trainer refuses an EP change for it."""
    require_dist()
    root = Path(path) / OPTIMIZER_DIR
    _initialise_optimizer_state(optimizer)  # a checkpoint before the first step
    rank0(lambda: root.mkdir(parents=True, exist_ok=True), f"creating {root}")
    if _is_distributed(optimizer):
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        states = [sub.state_dict() for sub in subs]  # param groups and grad scaler: no parameter state
        common = {"format": "distributed", "param_groups": [g for s in states for g in s["optimizer"]["param_groups"]],
                  "grad_scaler": [s.get("grad_scaler") for s in states], "scheduler": scheduler.state_dict()}
        # Each rank's own shard, written now from host copies (checkpoint/optimizer_shards.py); an asynchronous
        # save leaves only the model's tensors to the background writer.
        write_shards(optimizer, model_sharded_state_dict(chunks), root, common)
        return None
    sharded = optimizer.sharded_state_dict(model_sharded_state_dict(chunks), is_loading=False, metadata=SHARDED_METADATA)
    state = {"format": "plain", "optimizer": sharded, "scheduler": scheduler.state_dict()}
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
    distributed = _is_distributed(optimizer)
    if (root / COMMON_FILE).is_file():
        _load_shard_format(chunks, optimizer, scheduler, root, distributed)
        return
    if not (root / "metadata.json").is_file():
        raise ValueError(f"optimizer checkpoint {root} is missing (neither {COMMON_FILE} nor metadata.json)")
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


def _load_shard_format(chunks, optimizer, scheduler, root: Path, distributed: bool) -> None:
    """Loads the per-rank shard format (checkpoint/optimizer_shards.py): param groups, grad scaler and schedule
    from `distributed.pt`, then each rank's shard from the shard files, resharded to this layout. Every rank
    learns whether every rank loaded (one all-gather): a rank that failed alone would leave the others to wait
    in the next collective until parallel.timeout_s; instead each raises the first failing rank's one line."""
    error = None
    try:
        _load_shards_here(chunks, optimizer, scheduler, root, distributed)
    except ValueError as err:
        error = err
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, None if error is None else str(error))
        failed = [(r, line) for r, line in enumerate(everyone) if line is not None]
        if failed and error is None:
            raise ValueError(f"{failed[0][1]} (on rank {failed[0][0]})")
    if error is not None:
        raise error


def _load_shards_here(chunks, optimizer, scheduler, root: Path, distributed: bool) -> None:
    common = read_common(root)
    if not distributed:
        raise ValueError(f"optimizer checkpoint {root} holds the distributed optimizer's state but this run uses the "
                         "plain one: set optim.distributed=true")
    _initialise_optimizer_state(optimizer)
    try:
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            state = sub.state_dict()
            state["optimizer"]["param_groups"] = [
                _saved_group(group, common["param_groups"], root) for group in state["optimizer"]["param_groups"]
            ]
            scalers = [s for s in common["grad_scaler"] if s is not None]
            if scalers:
                state["grad_scaler"] = scalers[0]
            sub.load_state_dict(state)
        load_shards(optimizer, model_sharded_state_dict(chunks), root, int(common["world_size"]))
        scheduler.load_state_dict(common["scheduler"])
    except (KeyError, TypeError, ValueError, RuntimeError, AssertionError) as err:
        if isinstance(err, ValueError) and str(root) in str(err):
            raise
        raise ValueError(f"optimizer checkpoint {root} does not fit this run: {describe(err)}") from err


def _saved_group(current: dict, saved: list[dict], root: Path) -> dict:
    """The saved param group (hyperparameters, step) of the group `current`, by _GROUP_KEYS; its megatron
    identity keys stay the current layout's."""
    key = tuple(current.get(k) for k in _GROUP_KEYS)
    for group in saved:
        if tuple(group.get(k) for k in _GROUP_KEYS) == key:
            return {**group, "is_expert_parallel": current.get("is_expert_parallel")}
    raise ValueError(f"{root} has no param group with {dict(zip(_GROUP_KEYS, key))}")
