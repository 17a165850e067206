"""RL step time of the tiny task with the in-process engine (baseline) vs a vLLM CPU server, measured in one run.

    .venv/bin/python tools/bench_rollout_engines.py [--steps 6] [--run-dir runs/bench_engines]

Each engine trains `--steps` GSPO steps of examples/tiny_moe_gspo.yaml (32 prompts x G=8, old log-probs from the
engine) in its own `megatron-gspo train` process; the first step (vLLM's warm-up) is left out of the means. Prints
per-phase seconds and the vllm / local ratios. Needs .venv-vllm (`make rollout-env`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time_generate", "time_old_logprobs", "time_update", "time_sync")
COMMON = ["trainer.prompts_per_step=32", "trainer.micro_batch_size=64", "trainer.progress=false",
          "trainer.save_final=false", "eval.max_prompts=8", "eval.n=1", "rollout.old_logprobs=engine"]  # fmt: skip
VLLM = ["rollout.engine=vllm", "vllm.dtype=float32", "vllm.max_model_len=64", "vllm.kv_cache_memory_bytes=16000000",
        "vllm.cpu_threads=1", f"vllm.python={ROOT / '.venv-vllm' / 'bin' / 'python'}"]  # fmt: skip


def run(name: str, extra: list[str], steps: int, run_dir: Path) -> tuple[float, dict]:
    out = run_dir / name
    cmd = [sys.executable, "-m", "megatron_gspo.cli.main", "train", "--config", "examples/tiny_moe_gspo.yaml",
           *COMMON, f"trainer.steps={steps}", f"trainer.run_dir={out}", *extra]  # fmt: skip
    start = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **_env()})
    wall = time.monotonic() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line][1:]
    return wall, {p: sum(r[p] for r in rows) / len(rows) for p in PHASES}


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--run-dir", default="runs/bench_engines")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    local_wall, local = run("local", [], args.steps, run_dir)
    vllm_wall, vllm = run("vllm", VLLM, args.steps, run_dir)
    print(f"{'phase (s / step, steps 2..)':<28} {'local':>8} {'vllm':>8} {'vllm/local':>10}")
    for p in PHASES:
        ratio = f"{vllm[p] / local[p]:10.2f}" if local[p] >= 1e-3 else f"{'-':>10}"  # local sync: nothing to send
        print(f"{p:<28} {local[p]:8.3f} {vllm[p]:8.3f} {ratio}")
    lt, vt = sum(local.values()), sum(vllm.values())
    print(f"{'RL step':<28} {lt:8.3f} {vt:8.3f} {vt / lt:10.2f}")
    print(f"{'process wall (incl. start)':<28} {local_wall:8.1f} {vllm_wall:8.1f} {vllm_wall / local_wall:10.2f}")


if __name__ == "__main__":
    main()
