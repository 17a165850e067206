"""Benchmark: how long a trainer checkpoint stops training, synchronous vs `trainer.async_save` (background).

Each variant runs in a fresh subprocess (tools/bench_worker.py) that builds the trainer on a widened tiny
Qwen3-MoE (`--hidden`, `--layers`, `--experts`: about 58M parameters by default, fp32: model + fp32 masters + two
Adam moments = 16 bytes per parameter on disk) and writes checkpoints through the trainer's own path
(`GSPOTrainer.checkpoint`, checkpoint/manager.py):
  sync   `checkpoint()`: blocked = the whole save (planning, every file written and fsynced, rename, `latest`)
  async  `checkpoint(background=True)` with trainer.async_save=true: blocked = until it returns (planning,
         common files, staging, fork of megatron's writer); complete = until `wait()` has renamed it (the writes
         and the metadata, what a step boundary's `poll` would finish)
Both include the integrity record (checkpoint/integrity.py): the sync save hashes its files inline, the async one
in its background writer. `hash s` is that hashing alone, timed again on the last checkpoint's files (CRC-32, the
record's threads; files in the page cache, as right after a save), with its throughput.
The variants take turns for `--rounds` rounds and each keeps its best time (the machine's load drifts). Prints a
table and the ratio of the blocked times measured in the same run; asserts nothing. Usage:
  python tools/bench_checkpoint.py                 # CPU defaults (check `uptime`: the cores are shared)
  python tools/bench_checkpoint.py --hidden 1024 --device-note "H200"   # wider model (more bytes per save)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from bench_worker import gib, run_worker  # tools/ is sys.path[0] when this runs as a script


def _worker(args) -> dict:
    import torch

    from megatron_gspo.checkpoint.integrity import hash_files
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    torch.set_num_threads(args.threads)
    overrides = [
        f"model.overrides.hidden_size={args.hidden}",
        f"model.overrides.num_hidden_layers={args.layers}",
        f"model.overrides.num_experts={args.experts}",
        f"model.overrides.moe_intermediate_size={args.hidden}",
        f"model.overrides.head_dim={args.hidden // 4}",
        "trainer.progress=false",
        f"trainer.run_dir={args.run_dir}",
        f"trainer.async_save={str(args.worker == 'async').lower()}",
        "trainer.keep_last=1",
    ]
    trainer = GSPOTrainer(load_run_config("examples/tiny_moe_gspo.yaml", overrides))
    try:
        params = sum(p.numel() for c in trainer.rt.chunks for p in c.parameters())
        best_blocked = best_complete = float("inf")
        for i in range(args.saves):
            trainer.step = i + 1
            start = time.perf_counter()
            path = trainer.checkpoint(background=args.worker == "async")
            blocked = time.perf_counter() - start
            trainer.ckpt.wait()
            complete = time.perf_counter() - start
            best_blocked, best_complete = min(best_blocked, blocked), min(best_complete, complete)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        files = [f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file()]
        best_hash = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            hash_files(path, files)
            best_hash = min(best_hash, time.perf_counter() - start)
    finally:
        trainer.close()
    return dict(variant=args.worker, params=params, bytes=size, blocked=best_blocked, complete=best_complete,
                hashed=best_hash)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--saves", type=int, default=2, help="checkpoints per worker (the best one counts)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="sync,async")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as work:
        for r in range(args.rounds):
            for variant in args.variants.split(","):
                cmd = [sys.executable, __file__, "--worker", variant, "--run-dir", os.path.join(work, f"{variant}{r}"),
                       "--hidden", str(args.hidden), "--layers", str(args.layers), "--experts", str(args.experts),
                       "--saves", str(args.saves), "--threads", str(args.threads)]
                out = run_worker(cmd, variant, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
                if "error" in out:
                    print(f"{variant}: failed: {out['error']}")
                    continue
                kept = best.get(variant)
                if kept is None or out["blocked"] < kept["blocked"]:
                    best[variant] = out
    print(f"{'variant':8} {'params':>8} {'ckpt GiB':>9} {'blocked s':>10} {'complete s':>11} {'hash s':>7} "
          f"{'hash GB/s':>9} {'hash / complete':>15}")
    for variant, out in best.items():
        print(f"{variant:8} {out['params'] / 1e6:7.1f}M {gib(out['bytes']):>9} {out['blocked']:10.2f} "
              f"{out['complete']:11.2f} {out['hashed']:7.3f} {out['bytes'] / out['hashed'] / 1e9:9.2f} "
              f"{out['hashed'] / out['complete']:15.1%}")
    if "sync" in best and "async" in best:
        print(f"async / sync blocked time: x{best['async']['blocked'] / best['sync']['blocked']:.2f}")


if __name__ == "__main__":
    main()
