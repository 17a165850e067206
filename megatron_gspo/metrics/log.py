"""Step metrics: reduction over micro-batches / ranks, metrics.jsonl, tensorboard, progress bar, summary.json."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from megatron_gspo.algorithms import CORRECTION_METRICS, combine_metrics, has_stale_buckets

# Loss metrics shown on the progress bar (the paper reports clip fractions split lower/upper).
_BAR_KEYS = ("reward_mean", "clip_frac_low_tok", "clip_frac_high_tok")


ROLLOUT_COUNTS = ("groups_dropped", "groups_zero_variance_kept", "groups_stale", "reward_errors",
                  "multiturn_tool_calls", "multiturn_env_errors", "multiturn_turn_limit", "multiturn_token_limit")
"""Rollout statistics that are counts: summed over data-parallel replicas (the others are means over equal shares)."""
ROLLOUT_MAXIMA = ("staleness_max", "multiturn_turns_max", "producer_calls_peak")
"""Rollout statistics that are maxima: the largest over data-parallel replicas."""


def combine_rollout_stats(shares: list[dict]) -> dict:
    """The rollout statistics of the whole batch from each data-parallel replica's share (equal-sized shares: the
    mean of the replicas' means is the batch mean; counts add up; maxima are the largest)."""
    out = {}
    for key in shares[0]:
        values = [s[key] for s in shares]
        if key in ROLLOUT_MAXIMA:
            out[key] = max(values)
        else:
            total = math.fsum(values)
            out[key] = total if key in ROLLOUT_COUNTS else total / len(shares)
    return out


def reduce_step_metrics(rt, rollout_stats: dict, updates: list[dict], mismatch: dict, times: dict, batch) -> dict:
    """One flat dict per RL step, identical on every rank (rank 0 writes it).

    Every statistic covers the whole rollout batch: each data-parallel replica reports its share once (loss parts
    from its TP rank 0 of the last pipeline stage, rollout statistics and the train / rollout mismatch from its
    first model-parallel rank) and the shares combine like the full batch would (`combine_metrics`; counts add
    up). Expert drift and routing mismatch are combined over replicas where they are measured
    (`store_route_change`). Loss, mismatch and rollout metrics per staleness bucket ("staleness_<s>/<name>",
    algorithms/staleness.py) combine the same way and are reported when any sample of the step is stale.
    `grad_norm` is the mean over the minibatch steps taken; skipped steps are counted in
    `skipped_steps` instead (NaN only when every step was skipped).
    """
    from megatron.core import parallel_state as ps

    tp0 = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    report_parts = tp0 and ps.is_pipeline_last_stage(ignore_virtual=True)
    report_rollout = tp0 and ps.get_pipeline_model_parallel_rank() == 0
    local_parts = [u["loss_parts"] for u in updates if u["loss_parts"]] if report_parts else []
    engine = updates[0].get("engine_mismatch_parts") if report_parts else None
    gathered = rt.gather_objects(
        {
            "parts": [{k: v.item() for k, v in p.items()} for p in local_parts],
            "engine": {k: v.item() for k, v in engine.items()} if engine else None,
            "rollout": rollout_stats if report_rollout else None,
            "mismatch": mismatch if report_rollout and mismatch else None,
        }
    )
    out: dict = {}
    parts = [_tensors(p) for g in gathered for p in g["parts"]]
    if parts:
        out.update({k: float(v) for k, v in combine_metrics(parts).items()})
    engine_parts = [_tensors(g["engine"]) for g in gathered if g["engine"]]
    if engine_parts:
        for key, value in combine_metrics(engine_parts).items():
            bucket, _, name = key.rpartition("/")
            if name in ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max", "approx_kl"):
                out[f"{bucket}/mismatch_{name}" if bucket else f"mismatch_{name}"] = float(value)
    mismatch_parts = [_tensors(g["mismatch"]) for g in gathered if g["mismatch"]]
    if mismatch_parts:
        for key, value in combine_metrics(mismatch_parts).items():
            # The correction's metrics are named mismatch_*; the rollouts' (overlong, per bucket) keep their names.
            bucket, _, name = key.rpartition("/")
            if name in CORRECTION_METRICS and not name.startswith("mismatch"):
                name = f"mismatch_{name}"
            out[f"{bucket}/{name}" if bucket else name] = float(value)
    if not has_stale_buckets(out):
        # Synchronous RL: every sample has staleness 0, and bucket 0 would repeat the batch's metrics.
        out = {k: v for k, v in out.items() if not k.startswith("staleness_")}
    out.update(combine_rollout_stats([g["rollout"] for g in gathered if g["rollout"] is not None]))
    # Expert drift: each pipeline stage measured its own layers; store_route_change combined them already.
    out.update(updates[0].get("drift") or {})
    norms = [u["grad_norm"] for u in updates if not u["skipped"]]
    out["grad_norm"] = math.fsum(norms) / len(norms) if norms else float("nan")
    out["lr"] = updates[-1]["lr"]
    out["skipped_steps"] = sum(u["skipped"] for u in updates)
    out.update(times)
    step_time = sum(times.values())
    tokens = int(batch.tokens_NL.ne(rt.tokenizer.pad_id).sum()) * rt.dp.size
    out["tokens_per_s"] = tokens / step_time if step_time > 0 else float("nan")
    return out


def _tensors(metrics: dict) -> dict:
    return {k: torch.tensor(v) for k, v in metrics.items()}


class _Bar:
    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="GSPO", dynamic_ncols=True)

    def update(self, metrics: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{metrics[k]:.3g}" for k in _BAR_KEYS if k in metrics})
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsLogger:
    """Writes metrics.jsonl (one line per step), eval.jsonl, tensorboard events and summary.json (rank 0)."""

    def __init__(self, run_dir: Path, enabled: bool, append: bool = False, purge_step: int | None = None):
        """`purge_step`: a resumed run's first step; tensorboard hides the older events from that step on."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        mode = "a" if append else "w"
        self.metrics_file = open(self.run_dir / "metrics.jsonl", mode)
        self.eval_file = open(self.run_dir / "eval.jsonl", mode)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)
        except Exception:  # noqa: BLE001 - tensorboard is optional at run time
            self.tb = None

    def progress(self, total: int, initial: int, enabled: bool) -> _Bar:
        return _Bar(total, initial, enabled and self.enabled)

    def _write(self, fh, step: int, metrics: dict, prefix: str) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)

    def log_step(self, step: int, metrics: dict) -> None:
        if self.enabled:
            self._write(self.metrics_file, step, metrics, "train")

    def log_eval(self, step: int, metrics: dict) -> None:
        if self.enabled:
            self._write(self.eval_file, step, metrics, "eval")

    def write_summary(self, summary: dict) -> None:
        if not self.enabled:
            return
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2))
        os.replace(tmp, self.run_dir / "summary.json")

    def close(self) -> None:
        if not self.enabled:
            return
        self.metrics_file.close()
        self.eval_file.close()
        if self.tb is not None:
            self.tb.close()


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
