"""Synchronous vs one-step-off vs asynchronous GSPO on the real vLLM CPU server, on a length-skewed task, in one run.

    .venv/bin/python tools/bench_async.py [--budget-s 240] [--seeds 1 2 3] [--rounds 1] [--run-dir runs/bench_async]
        [--modes sync one_step_off async trl] [--shm-busy-loop-s S] [--mp-executor]

One vLLM server (the tiny Qwen3-MoE, .venv-vllm) serves every run; each run is a `megatron-gspo train` process
that attaches to it (pushing its own initial weights first) and trains examples/tiny_moe_gspo.yaml on the
`count2` task (count from a to b: answers of 17 to 254 characters, so a synchronous step waits for its longest
answer) with the `prefix_match` reward and up to 256 response tokens. Each run gets the same wall budget, counted
from the end of its first step (vLLM's warm-up and the first evaluation left out) and is then stopped (SIGTERM);
what it logged by then is what it achieved. Rounds alternate the order of the modes (a slow phase of the shared machine
hits every mode), seeds repeat the set. Reported per mode, mean over seeds and rounds (min..max):
response tokens/s, RL steps/s, the reward of the last 3 steps within the budget, and CPU seconds (trainer
process + server, within the budget) beside wall seconds, and response tokens per CPU second (on a machine shared
with other jobs the CPU a run gets varies, this less so); then each mode's ratios to sync measured in the same
run.

`trl` (`make bench-env` first) is TRL 1.16's GRPOTrainer as GSPO (importance_sampling_level="sequence"; set up
by tools/bench_vs_trl.py, whose docstring says how its settings map to ours) on the same task, reward function,
model configuration, sizes (16 prompts x 4 answers per RL step, K=2 minibatch updates, up to 256 new tokens)
and optimiser settings, in its own environment: synchronous, generating in-process with transformers'
`generate` on one thread (no vLLM server: its CPU seconds are all its process's), old log-probs recomputed. Its
run alternates with ours in every round and gets the same wall budget, from the end of its first RL step; RL
steps ending within the budget count (its own process stops itself at the next step's end).

`--shm-busy-loop-s S` launches that server with vllm.shm_busy_loop_s=S (how long its processes spin on vLLM's
shared-memory queues; every mode shares the server). `--mp-executor` launches it with
vllm.worker_in_engine_core=false: vLLM's own multiprocess executor on CPU, whose EngineCore spins on its
Worker's shared-memory queue (the default runs the worker inside the EngineCore, with no such queue).

The machine's load is printed first and last (`uptime`): when it exceeds the machine's cores, the table says
the figures were measured under load and are unreliable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_vs_trl import trl_trainer, write_spec  # tools/ is sys.path[0] when this runs as a script
from bench_worker import run_worker

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAX_LEN = 320
MODEL = [f"model.overrides.max_position_embeddings={MAX_LEN}"]
COMMON = [
    *MODEL, "data.train=task:count2", "data.heldout=task:count2", "data.reward=prefix_match", "data.train_size=2048",
    "data.heldout_size=16", "rollout.max_new_tokens=256", "rollout.group_size=4", "rollout.old_logprobs=engine",
    "trainer.prompts_per_step=16", "trainer.micro_batch_size=16", "trainer.minibatches=2", "trainer.steps=100000",
    "trainer.progress=false", "trainer.save_final=false", "eval.max_prompts=4", "eval.n=1", "optim.lr=1e-3",
    "optim.warmup_steps=0", "rollout.engine=vllm", "vllm.mode=attach", "vllm.dtype=float32",
    f"vllm.max_model_len={MAX_LEN}", "vllm.cpu_threads=1", f"vllm.python={VLLM_PYTHON}",
]  # fmt: skip
MODES = {
    "sync": ["rollout.mode=sync"],
    "one_step_off": ["rollout.mode=one_step_off", "rollout.max_staleness=1"],
    "async": ["rollout.mode=async", "rollout.max_staleness=2"],
}


def start_server(root: Path, shm_busy_loop_s: float | None = None, worker_in_engine_core: bool = True):
    """The vLLM server on a tiny model written by transformers (as tests/rollout/vllm do), and its pid."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from megatron_gspo.rollout.vllm.config import VLLMConfig
    from megatron_gspo.rollout.vllm.engine import VLLMEngine
    from megatron_gspo.training.config import load_run_config

    model = load_run_config(ROOT / "examples" / "tiny_moe_gspo.yaml", MODEL).model.model_config()
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(model.to_hf_config()).save_pretrained(root / "hf")
    cfg = VLLMConfig(model_path=str(root / "hf"), python=str(VLLM_PYTHON), port_base=_free_port(), dtype="float32",
                     max_model_len=MAX_LEN, kv_cache_memory_bytes=64_000_000, cpu_threads=1,
                     startup_timeout_s=900, log_dir=str(root / "logs"), shm_busy_loop_s=shm_busy_loop_s,
                     worker_in_engine_core=worker_in_engine_core)
    engine = VLLMEngine(cfg)
    (proc,) = engine._supervisor.processes
    return engine, proc.pid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) and of its descendants (the server's engine core runs in
    one)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _descendants(pid: int) -> list[int]:
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if Path(f"/proc/{pid}").exists() else []:
        out += [int(child), *_descendants(int(child))]
    return out


def run(mode: str, seed: int, url: str, budget_s: float, run_dir: Path, server_pid: int) -> dict:
    out = run_dir / f"{mode}_seed{seed}_{int(time.time())}"
    cmd = [sys.executable, "-m", "megatron_gspo.cli.main", "train", "--config", "examples/tiny_moe_gspo.yaml",
           *COMMON, f"vllm.urls=[{url}]", f"trainer.seed={seed}", f"trainer.run_dir={out}", *MODES[mode]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics, arrivals, t0, server0, trainer0 = out / "metrics.jsonl", {}, None, 0.0, 0.0
    while proc.poll() is None:
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x] if metrics.exists() else []
        now = time.monotonic()
        for r in rows:
            if r["step"] not in arrivals:
                arrivals[r["step"]] = (now, r)
                if r["step"] == 1:
                    t0, server0, trainer0 = now, cpu_seconds(server_pid), cpu_seconds(proc.pid)
        if t0 is not None and now - t0 >= budget_s:
            break
        time.sleep(0.05)
    if proc.poll() is not None:
        raise RuntimeError(f"{mode} seed {seed} ended early: {proc.stderr.read()[-2000:]}")
    wall = time.monotonic() - t0
    server_cpu = cpu_seconds(server_pid) - server0
    trainer_cpu = cpu_seconds(proc.pid) - trainer0  # with its threads and child processes
    # SIGTERM, not SIGKILL: a trainer killed inside a weight update leaves the shared server mid-update (the next
    # run's /start_weight_update is refused); stopped, it finishes its step (after the budget: not counted).
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    steps = sorted(s for s in arrivals if s > 1)
    per_step = 16 * 4  # prompts_per_step x group_size
    tokens = sum(arrivals[s][1]["response_length"] * per_step for s in steps)
    last = [arrivals[s][1]["reward_mean"] for s in steps[-3:]] or [arrivals[1][1]["reward_mean"]]
    return {"tokens_per_s": tokens / wall, "steps_per_s": len(steps) / wall, "reward": statistics.mean(last),
            "tokens_per_cpu_s": tokens / max(trainer_cpu + server_cpu, 1e-9),
            "wall_s": wall, "cpu_s": trainer_cpu + server_cpu, "trainer_cpu_s": trainer_cpu,
            "server_cpu_s": server_cpu, "steps": len(steps),
            "staleness": statistics.mean(arrivals[s][1].get("staleness_mean", 0.0) for s in steps) if steps else 0,
            "response_length": statistics.mean(arrivals[s][1]["response_length"] for s in steps) if steps else 0}


def worker_trl(spec: dict, args) -> dict:
    """One TRL run (module docstring), in the TRL environment: trains until the first RL step that ends past
    `args.budget_s` after the first one; measures what the budget window held, with the same keys as `run`."""
    import threading

    from transformers import TrainerCallback

    k, per_step = spec["minibatches"], spec["prompts_per_step"] * spec["group_size"]
    ends: list[tuple[float, float]] = []  # (wall, process CPU) at the end of each RL step
    logged: list[tuple[float, float]] = []  # (mean response tokens, mean reward) of each RL step
    at_budget: list[tuple[float, float]] = []

    def budget_over() -> None:
        at_budget.append((time.perf_counter(), time.process_time()))

    class Budget(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % k:
                return
            ends.append((time.perf_counter(), time.process_time()))
            if len(ends) == 1:  # the budget starts at the end of the first RL step, as for ours
                timer = threading.Timer(args.budget_s, budget_over)
                timer.daemon = True
                timer.start()
            elif at_budget:
                control.should_training_stop = True

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                logged.append((float(logs["completions/mean_length"]), float(logs["reward"])))

    spec = {**spec, "seed": args.seed}
    trainer = trl_trainer(spec, work=args.work, threads=1, max_steps=k * 100_000, callbacks=[Budget()])
    trainer.train()
    (t0, cpu0), (t1, cpu1) = ends[0], at_budget[0]
    steps = [i for i in range(1, len(ends)) if ends[i][0] <= t1]
    tokens = sum(logged[i][0] * per_step for i in steps)
    wall, cpu = t1 - t0, cpu1 - cpu0
    last = [logged[i][1] for i in steps[-3:]] or [logged[0][1]]
    return {"tokens_per_s": tokens / wall, "steps_per_s": len(steps) / wall, "reward": statistics.mean(last),
            "tokens_per_cpu_s": tokens / max(cpu, 1e-9), "wall_s": wall, "cpu_s": cpu, "trainer_cpu_s": cpu,
            "server_cpu_s": 0.0, "steps": len(steps), "staleness": 0.0,
            "response_length": statistics.mean(logged[i][0] for i in steps) if steps else 0.0}


def run_trl(seed: int, budget_s: float, spec_path: Path, trl_python: str, work: Path) -> dict:
    """A TRL run in a fresh process of its own environment (worker_trl)."""
    cmd = [trl_python, str(Path(__file__).resolve()), "--worker", "trl", "--spec", str(spec_path),
           "--seed", str(seed), "--budget-s", str(budget_s), "--work", str(work)]
    out = run_worker(cmd, "trl", env={**os.environ, "OMP_NUM_THREADS": "1"}, error_lines=5)
    if "error" in out:
        raise RuntimeError(f"trl seed {seed} failed: {out['error']}")
    return out


def _loaded() -> bool:
    """Whether the machine's 1-minute load average is at least its number of cores."""
    return os.getloadavg()[0] >= (os.cpu_count() or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall seconds per run after its first step")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=[*MODES, "trl"], choices=[*MODES, "trl"])
    parser.add_argument("--run-dir", default="runs/bench_async")
    parser.add_argument("--shm-busy-loop-s", type=float, default=None,
                        help="vllm.shm_busy_loop_s of the shared server (default: vLLM's 1 s)")
    parser.add_argument("--mp-executor", action="store_true",
                        help="vllm.worker_in_engine_core=false: vLLM's multiprocess executor")
    parser.add_argument("--trl-python", default=str(ROOT / ".bench-env" / "bin" / "python"))
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker_trl(json.loads(Path(args.spec).read_text()), args)), flush=True)
        return
    if "trl" in args.modes and not Path(args.trl_python).exists():
        sys.exit(f"{args.trl_python} does not exist: run `make bench-env` first (or leave trl out of --modes)")
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    loaded = _loaded()
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    spec_path = write_spec(run_dir, COMMON) if "trl" in args.modes else None
    engine, server_pid = start_server(run_dir / "server", args.shm_busy_loop_s, not args.mp_executor)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    try:
        for r in range(args.rounds):
            for i, seed in enumerate(args.seeds):
                shift = (r + i) % len(args.modes)  # alternate which mode goes first
                for mode in args.modes[shift:] + args.modes[:shift]:
                    if mode == "trl":
                        res = run_trl(seed, args.budget_s, spec_path, args.trl_python, run_dir)
                    else:
                        res = run(mode, seed, engine.server_urls[0], args.budget_s, run_dir, server_pid)
                    results[mode].append(res)
                    print(f"round {r} seed {seed} {mode:<12} " + " ".join(
                        f"{k}={v:.3g}" for k, v in res.items()), flush=True)
    finally:
        engine.close()
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if loaded or _loaded():
        print(f"MEASURED UNDER LOAD (load average >= {os.cpu_count()} cores): the figures below are unreliable")
    keys = ("tokens_per_s", "steps_per_s", "reward", "cpu_s", "wall_s", "tokens_per_cpu_s", "staleness",
            "response_length")
    print(f"\n{'mode':<13}" + "".join(f"{k:>26}" for k in keys))
    for mode, rs in results.items():
        cells = [f"{statistics.mean(x[k] for x in rs):.3g} ({min(x[k] for x in rs):.3g}..{max(x[k] for x in rs):.3g})"
                 for k in keys]
        print(f"{mode:<13}" + "".join(f"{c:>26}" for c in cells))
    if "sync" in results:
        ratio_keys = ("tokens_per_s", "steps_per_s", "tokens_per_cpu_s")
        base = {k: statistics.mean(x[k] for x in results["sync"]) for k in ratio_keys}
        for mode, rs in results.items():
            ratios = {k: statistics.mean(x[k] for x in rs) / base[k] for k in base}
            print(f"{mode} / sync: response tokens/s x{ratios['tokens_per_s']:.2f}, RL steps/s "
                  f"x{ratios['steps_per_s']:.2f}, response tokens per CPU second x{ratios['tokens_per_cpu_s']:.2f}")


if __name__ == "__main__":
    main()
