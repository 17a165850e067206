"""Benchmark: host memory and bytes written per rank by the distributed optimizer's checkpoint, the per-rank shard
format (checkpoint/optimizer_shards.py) against megatron's `fully_reshardable` + `mem_efficient` format that it
replaced (written here the way checkpoint/optimizer_io.py wrote it before).

Two gloo ranks (DP=2) build the tiny Qwen3-MoE preset (`--hidden` / `--layers` / `--experts` widen it) with bf16
params and the distributed optimizer (fp32 masters, Adam moments), take one AdamW step, then save with each
format in turn. Per rank and format:
  written    bytes of the optimizer files the rank wrote itself
  gathered   bytes of the tensors megatron's `get_parameter_state_dp_zero` handed the save (the DP group's state
             on DP rank 0; 0 for the new format, which never calls it)
  staged     bytes of host copies the new format made (the rank's own shard)
  rss peak   the process's resident memory during the save above its level before it (sampled every 1 ms)
Asserts nothing. Usage: python tools/bench_optimizer_memory.py [--hidden 512 --layers 4 --experts 8]  (defaults: the tiny preset)
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time
from pathlib import Path


class _PeakRss:
    """Peak resident memory above the level at entry, sampled by a thread."""

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _rank(rank: int, port: int, args, out_dir: str, fmt: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_gspo.checkpoint import optimizer_shards
    from megatron_gspo.checkpoint.dist_io import dist_save
    from megatron_gspo.checkpoint.integrity import owned_by_rank
    from megatron_gspo.checkpoint.model_io import model_sharded_state_dict
    from megatron_gspo.checkpoint.optimizer_io import SHARDED_METADATA, write_optimizer_checkpoint
    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.config import preset
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, build_optimizer, unwrap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = preset("tiny", hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts=args.experts,
                 moe_intermediate_size=args.hidden, head_dim=args.hidden // 4)
    parallel = ParallelConfig()
    initialize(parallel, seed=5)
    try:
        optim = OptimConfig(distributed=True, lr=1e-2)
        chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=torch.bfloat16), optim)
        opt = build_optimizer(chunks, optim, torch.bfloat16)
        sched = OptimizerParamScheduler(opt, init_lr=1e-2, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
        for p in unwrap(chunks[0]).parameters():
            p.main_grad.normal_(0, 1e-3)
        opt.step()
        params = sum(p.numel() for p in unwrap(chunks[0]).parameters())

        gathered = [0]
        original = distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero

        def measured(self, *a, **k):
            got = original(self, *a, **k)
            stack = [got]
            while stack:
                x = stack.pop()
                if isinstance(x, torch.Tensor):
                    gathered[0] += x.numel() * x.element_size()
                elif isinstance(x, dict):
                    stack += list(x.values())
            return got

        staged = [0]
        chunks_original = optimizer_shards.shard_chunks

        def counted(*a, **k):
            got = chunks_original(*a, **k)
            staged[0] += sum(c[key].numel() * 4 for c in got for key in optimizer_shards.KEYS)
            return got

        distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero = measured
        optimizer_shards.shard_chunks = counted
        rows = []
        if True:  # one format per pair of fresh processes: a heap the other format grew would hide this one's peak
            root = Path(out_dir) / fmt
            (root / "optimizer").mkdir(parents=True, exist_ok=True)
            gathered[0] = staged[0] = 0
            gc.collect()
            dist.barrier()
            with _PeakRss() as rss:
                if fmt == "old":  # optimizer_io.py before the shard format (distributed optimizer branch)
                    sharded = opt.sharded_state_dict(model_sharded_state_dict(chunks), is_loading=False,
                                                     metadata=SHARDED_METADATA)
                    dist_save({"format": "distributed", "param_state": {"0": sharded["param_state"]}},
                              str(root / "optimizer"))
                    del sharded
                else:
                    write_optimizer_checkpoint(chunks, opt, sched, root)
            dist.barrier()
            written = sum(f.stat().st_size for f in (root / "optimizer").iterdir() if owned_by_rank(f.name, rank))
            rows.append((fmt, written, gathered[0], staged[0], rss.extra))
        everyone: list = [None] * 2
        dist.all_gather_object(everyone, rows)
        if rank == 0:
            mb = 1e6
            if fmt == "old":
                print(f"{params / 1e6:.2f}M params; full fp32 optimizer state (masters + 2 moments) "
                      f"{12 * params / mb:.1f} MB")
                print(f"{'rank':>4} {'format':>6} {'written MB':>11} {'gathered MB':>12} {'staged MB':>10} "
                      f"{'rss peak MB':>12}")
            for r, got in enumerate(everyone):
                for fmt, written, gath, stag, extra in got:
                    print(f"{r:>4} {fmt:>6} {written / mb:>11.1f} {gath / mb:>12.1f} {stag / mb:>10.1f} {extra / mb:>12.1f}")
    finally:
        shutdown()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    for fmt in ("old", "new"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_rank, args=(port, args, out_dir, fmt), nprocs=2)


if __name__ == "__main__":
    main()
