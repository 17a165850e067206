"""What the reward worker pool costs a fast reward: exact_match scored in-process vs through RewardPool.

    .venv/bin/python tools/bench_rewards.py [--batch 32] [--repeats 200] [--workers 1,2]

Prints the pool's start-up time (spawn + import, until the first batch is scored) and the time per batch of
`--batch` items (the tiny task's rollout batch: 8 prompts x 4 samples), as a ratio against calling the function in
the same process, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from megatron_gspo.rewards.exact_match import exact_match
from megatron_gspo.rewards.pool import RewardPool, call_reward


def per_batch(score, items, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        score(items)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--workers", default="1,2")
    args = parser.parse_args()
    items = [(f"{i % 1000:03d}", f"{(i * 7) % 1000:03d}", {"finish_reason": "stop"}) for i in range(args.batch)]
    base = per_batch(lambda xs: [call_reward(exact_match, *x) for x in xs], items, args.repeats)
    print(f"batch of {args.batch} items, median of {args.repeats}")
    print("| scoring | start-up s | per batch ms | ratio |")
    print("|---|---|---|---|")
    print(f"| in-process | 0 | {base * 1e3:.3f} | 1.00 |")
    for workers in (int(w) for w in args.workers.split(",")):
        t0 = time.perf_counter()
        pool = RewardPool(exact_match, workers=workers, timeout_s=30.0, name="exact_match")
        pool.map(items)
        startup = time.perf_counter() - t0
        try:
            t = per_batch(pool.map, items, args.repeats)
        finally:
            pool.close()
        print(f"| pool, {workers} worker(s) | {startup:.2f} | {t * 1e3:.3f} | {t / base:.1f} |")


if __name__ == "__main__":
    main()
