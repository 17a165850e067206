"""Runs for the determinism test, in a spawned interpreter (megatron's globals stay out of the pytest process)."""

from __future__ import annotations

import json
from pathlib import Path


def metrics_of_runs(run_root: str, overrides: list[str], seeds: list[int],
                    extra: list[list[str]] | None = None) -> list[list[dict]]:
    """One short RL run per entry of `seeds` (one after another in this process, as the stability benchmark runs
    them; run i with the overrides extra[i] too); returns each run's metrics.jsonl rows and eval.jsonl rows."""
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    out = []
    for i, seed in enumerate(seeds):
        run_dir = Path(run_root) / f"run{i}"
        cfg = load_run_config(
            "examples/tiny_moe_gspo.yaml",
            [*overrides, *(extra[i] if extra else []), f"trainer.seed={seed}", f"trainer.run_dir={run_dir}"],
        )
        trainer = GSPOTrainer(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
        evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines() if x]
        out.append(rows + evals)
    return out
