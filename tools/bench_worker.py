"""What the benchmarks in tools/ share: each variant runs in a fresh subprocess (its own peak memory, no warm
caches from another variant) that prints its result as one JSON line on stdout.

    from bench_worker import gib, run_worker      # tools/ is sys.path[0] when a tool runs as a script
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_worker(cmd: list[str], variant: str, *, env: dict | None = None, error_lines: int = 1) -> dict:
    """Runs `cmd` with the repository on PYTHONPATH; its last stdout line starting with "{" is the result. A worker
    that fails or prints none gives {variant, error: the last `error_lines` lines of its stderr}."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-error_lines:]
        return dict(variant=variant, error=" | ".join(tail))
    return json.loads(lines[-1])


def gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / 2**30:.2f}"
