"""What `train` does with the run directory it is given.

- A new run refuses a directory that already holds a run (its metrics and checkpoints would be overwritten or,
  worse, mixed with the new run's): pass --resume, or pick another `trainer.run_dir`.
- A resumed run continues the checkpoint's run, so its config must be the checkpoint's except for the keys in
  RESUMABLE (length, cadences, memory knobs, the addresses of the rollout servers) and, for checkpoints whose
  state reshards (format 2), RESHARDABLE (the parallel layout); any other difference is refused with a one-line
  diff.
- A resumed run cuts metrics.jsonl / eval.jsonl back to the checkpoint's step (the rows after it belong to steps
  the run does again) and drops a partial last line (a kill or a full disk mid-write).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from pathlib import Path

import yaml

from megatron_gspo.checkpoint.durable import fsync_path

log = logging.getLogger(__name__)

RUN_FILES = ("metrics.jsonl", "eval.jsonl", "summary.json", "checkpoints")
"""Entries that make a directory hold a run (a `logs/` directory, e.g. the Slurm scripts', does not)."""

RESUMABLE = {
    "trainer.steps": "train longer or shorter (the learning-rate schedule keeps the length it started with)",
    "trainer.ckpt_every": "checkpoint cadence",
    "trainer.keep_last": "checkpoints kept",
    "trainer.save_final": "final checkpoint",
    "trainer.async_save": "how checkpoints are written (the same files)",
    "trainer.async_save_timeout_s": "background checkpoint writer timeout",
    "trainer.progress": "progress bar",
    "trainer.run_dir": "the run directory may have moved",
    "trainer.hang_warning_s": "hang warnings",
    "trainer.micro_batch_size": "memory: changes float rounding only (not with model.router_aux_loss_coef > 0)",
    "model.recompute": "memory: activation recompute is exact",
    "model.load": "unused on resume: the weights come from the checkpoint",
    "eval.every": "evaluation cadence",
    "parallel.timeout_s": "process-group timeout",
    "health.*": "monitoring",
    "scoring.workers": "reward worker processes",
    "scoring.timeout_s": "reward call timeout",
    "scoring.max_error_frac": "reward failure threshold",
    "sglang.*": "rollout servers: addresses, ports, resources (a requeued job runs on other nodes)",
    **dict.fromkeys(
        [f"vllm.{key}" for key in ("mode", "urls", "num_servers", "host", "port_base", "master_address", "python",
                                   "log_dir", "weight_sync_dir", "cpu_threads", "cpu_threads_bind")],
        "where the vLLM servers run and how they are reached (a requeued job runs on other nodes)",
    ),  # fmt: skip
    "vllm.worker_in_engine_core": "vLLM server process layout: the same worker code, model and sampling",
}
"""Config keys (fnmatch patterns) a resumed run may change, and why that is safe."""

RESHARDABLE = {
    "parallel.tp": "tensor-parallel size",
    "parallel.pp": "pipeline stages",
    "parallel.ep": "expert-parallel size",
    "parallel.etp": "expert tensor-parallel size",
    "parallel.virtual_pp": "virtual pipeline chunks",
    "parallel.sequence_parallel": "sequence parallelism (a TP split of activations)",
    "optim.overlap_grad_reduce": "communication overlap",
    "optim.overlap_param_gather": "communication overlap",
    "optim.bucket_size": "communication buckets",
}
"""Keys a resumed run may also change when its checkpoint is reshardable (format 2: model and optimizer state in
dist_checkpointing, read by any layout): the layout, and how gradient and parameter communication overlaps."""

PER_MICRO_BATCH = ("trainer.micro_batch_size",)
"""Keys that change the objective when the router's load-balancing loss is on: megatron computes it per micro-batch
(N_E * sum_i f_i P_i over that micro-batch's tokens, Switch Transformer Eq. 4), and its gradient is the mean over
micro-batches (engine.forward_backward), so other micro-batches are another loss, not only other rounding.
(`trainer.max_tokens_per_micro_batch` is not in RESUMABLE at all.)"""


def check_new_run_dir(run_dir: Path) -> None:
    """Refuses a run directory that is a file or already holds a run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"trainer.run_dir={run_dir} is a file, not a directory")
    if not run_dir.is_dir():
        return
    held = [n for n in RUN_FILES if (run_dir / n).exists() and not _empty(run_dir / n)]
    if held:
        raise ValueError(
            f"trainer.run_dir={run_dir} already holds a run ({', '.join(held)}): pass --resume to continue it, "
            "or choose another trainer.run_dir"
        )


def check_resume_dir(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"trainer.run_dir={run_dir} is a file, not a directory")


def _empty(path: Path) -> bool:
    if path.is_dir():
        return not any(path.iterdir())
    return path.stat().st_size == 0


# ---------------------------------------------------------------------------------------------------------
# Config changes on resume
# ---------------------------------------------------------------------------------------------------------
def config_tree(cfg_dict: dict) -> dict:
    """A run config as the plain tree YAML round-trips (so saved and current configs compare like for like), with
    the `moe` section's defaults filled in."""
    from megatron_gspo.moe import MoEConfig

    tree = yaml.safe_load(yaml.safe_dump(cfg_dict, sort_keys=False)) or {}
    if isinstance(tree.get("moe"), dict):
        try:
            tree["moe"] = vars(MoEConfig.from_dict(tree["moe"]))
        except ValueError:
            pass  # an invalid section is reported where it is used
    return tree


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):  # an empty section has no leaves: the same as an absent one
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def config_changes(saved: dict, current: dict, defaults: dict | None = None) -> list[tuple[str, object, object]]:
    """(key, saved value, current value) for every leaf that differs; a missing leaf reads as `<unset>`, except that
    a leaf the saved config lacks reads as its value in `defaults` (the schema's defaults: a checkpoint written
    before a key existed ran with that key's default)."""
    a, b = _flatten(config_tree(saved)), _flatten(config_tree(current))
    if defaults is not None:
        a = {**_flatten(config_tree(defaults)), **a}
    unset = "<unset>"
    return [(k, a.get(k, unset), b.get(k, unset)) for k in sorted(set(a) | set(b)) if a.get(k, unset) != b.get(k, unset)]


def resumable(key: str, *, reshardable: bool = False) -> bool:
    allowed = {**RESUMABLE, **RESHARDABLE} if reshardable else RESUMABLE
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in allowed)


def check_resume_config(
    saved_text: str,
    current: dict,
    checkpoint: Path,
    step: int,
    *,
    router_aux_loss_coef: float = 0.0,
    reshardable: bool = False,
    defaults: dict | None = None,
) -> list[str]:
    """Raises ValueError (one line) when the current config differs from the checkpoint's in keys a resumed run
    cannot change (RESUMABLE, and RESHARDABLE for a `reshardable` checkpoint; PER_MICRO_BATCH too when the model's
    `router_aux_loss_coef` > 0), or asks for fewer steps than were done; returns the allowed changes as
    'key: old -> new'. `defaults`: the schema's default config, standing in for keys the saved config lacks."""
    try:
        saved = yaml.safe_load(saved_text)
    except yaml.YAMLError as err:
        raise ValueError(f"{checkpoint}/run_config.yaml is not valid YAML: {err}".splitlines()[0]) from err
    if not isinstance(saved, dict):
        raise ValueError(f"{checkpoint}/run_config.yaml does not hold a run config")
    changes = config_changes(saved, current, defaults)
    refused = [c for c in changes if not resumable(c[0], reshardable=reshardable)]
    if router_aux_loss_coef > 0:
        per_micro = [c for c in changes if c[0] in PER_MICRO_BATCH]
        if per_micro:
            k, old, new = per_micro[0]
            raise ValueError(
                f"--resume: {k}: {old!r} -> {new!r} changes the load-balancing loss, which is computed per "
                f"micro-batch (model.router_aux_loss_coef={router_aux_loss_coef:g} > 0): keep {k}={old!r}"
            )
    if refused:
        listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in refused)
        allowed = [*RESUMABLE, *(RESHARDABLE if reshardable else ())]
        raise ValueError(
            f"--resume: the config differs from the one {checkpoint} was trained with, in keys a resumed run cannot "
            f"change: {listing} (may change on resume: {', '.join(allowed)}; to change the others, start a new "
            f"run with model.load={checkpoint})"
        )
    steps = current.get("trainer", {}).get("steps")
    if isinstance(steps, int) and steps < step:
        raise ValueError(f"--resume: trainer.steps={steps} is below the step of {checkpoint} ({step})")
    return [f"{k}: {old!r} -> {new!r}" for k, old, new in changes]


# ---------------------------------------------------------------------------------------------------------
# Logs on resume
# ---------------------------------------------------------------------------------------------------------
def trim_log(path: Path, last_step: int) -> int:
    """Keeps the rows of a jsonl log whose step is <= `last_step` (-1: none), drops unreadable rows and a partial
    last line, rewriting the file atomically when anything changed. Returns the number of rows dropped."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    lines = data.split(b"\n")
    kept, dropped = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = row["step"]
            if not isinstance(step, int):
                raise ValueError(f"step {step!r} is not an integer")
        except (ValueError, KeyError, TypeError) as err:
            # A partial last line (no newline after it) is a row cut off mid-write.
            why = "a partial last line" if number == len(lines) else str(err).splitlines()[0]
            log.warning("%s:%d: dropping an unreadable row (%s)", path, number, why)
            dropped += 1
            continue
        if step <= last_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped or not data.endswith(b"\n") and data:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(b"".join(line + b"\n" for line in kept))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)  # the cut is durable before the run appends to the log again
        log.info("%s: kept %d rows up to step %d, dropped %d", path, len(kept), last_step, dropped)
    return dropped
