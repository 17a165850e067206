"""launch/ scripts: syntax, and dry runs in a fake Slurm environment (stub `scontrol` on PATH) checking the
node / rank arithmetic and the exact command lines. The fake stays because a real Slurm on one host cannot express
these cases (4-6 nodes of 8 GPUs, rollout nodes, multi-node rank arithmetic); what one host can run, the scripts do
under a real Slurm in test_slurm_jobs.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
SCRIPTS = sorted(p for p in LAUNCH.iterdir() if p.suffix in (".sh", ".sbatch"))

# `scontrol show hostnames LIST` for lists like "gpu[001-004]", "gpu[1-2,7],login1", "a,b".
SCONTROL = f"""#!{sys.executable}
import re, sys
if sys.argv[1:3] != ["show", "hostnames"] or len(sys.argv) != 4:
    sys.exit("stub scontrol: only 'show hostnames LIST'")
for part in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?", sys.argv[3]):
    m = re.fullmatch(r"(.*)\\[(.*)\\]", part)
    if not m:
        print(part)
        continue
    for item in m.group(2).split(","):
        lo, _, hi = item.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{{m.group(1)}}{{i:0{{len(lo)}}d}}")
"""


@pytest.fixture()
def slurm(tmp_path):
    """Run a launch script with DRY_RUN=1 in a fake Slurm job; returns (stdout, vars, commands)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "scontrol"
    stub.write_text(SCONTROL)
    stub.chmod(0o755)

    def run(script: str, *args: str, expect_ok: bool = True, **env: str):
        full = {
            "PATH": f"{bindir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "DRY_RUN": "1",
            "SLURM_SUBMIT_DIR": str(tmp_path),
            **env,
        }
        proc = subprocess.run(
            ["bash", str(LAUNCH / script), *args],
            cwd=tmp_path,
            env=full,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if expect_ok:
            assert proc.returncode == 0, proc.stderr + proc.stdout
        return DryRun(proc)

    return run


class DryRun:
    """Parsed dry-run output: KEY=VALUE lines (last value wins; `all` keeps every one) and '+ ' commands."""

    def __init__(self, proc: subprocess.CompletedProcess):
        self.proc = proc
        self.out = proc.stdout
        self.err = proc.stderr
        self.all: dict[str, list[str]] = {}
        self.commands: list[list[str]] = []
        for line in self.out.splitlines():
            line = line.strip()
            if line.startswith("+ "):
                self.commands.append(shlex.split(line[2:]))
            elif "=" in line and not line.startswith("#") and line.split("=", 1)[0].isupper():
                key, value = line.split("=", 1)
                self.all.setdefault(key, []).append(value)

    def __getitem__(self, key: str) -> str:
        return self.all[key][-1]

    def find(self, *words: str) -> list[list[str]]:
        """Commands containing every one of `words` as an argument."""
        return [c for c in self.commands if all(w in c for w in words)]


def flag(cmd: list[str], name: str) -> str:
    """The value of --name=value or --name value in a command."""
    for i, arg in enumerate(cmd):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name:
            return cmd[i + 1]
    raise AssertionError(f"{name} not in {cmd}")


FOUR_NODES = dict(SLURM_JOB_NODELIST="gpu[001-004]", SLURM_NNODES="4", SLURM_GPUS_ON_NODE="8", SLURM_JOB_ID="4242")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_scripts_present():
    names = {p.name for p in SCRIPTS}
    assert {"common.sh", "task.sh", "train.sbatch", "rollout_servers.sbatch", "pipeline.sh"} <= names
    assert (LAUNCH / "README.md").is_file()


def test_train_torchrun_four_nodes(slurm):
    r = slurm("train.sbatch", "trainer.steps=10", CONFIG="gspo.yaml", **FOUR_NODES)
    assert r["NNODES"] == "4" and r["TRAIN_NODES"] == "4" and r["GPUS_PER_NODE"] == "8"
    assert r["WORLD_SIZE"] == "32"
    assert r["MASTER_ADDR"] == "gpu001"
    assert r["MASTER_PORT"] == str(20000 + 4242)
    assert r["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    (step,) = r.find("srun")
    assert flag(step, "--nodes") == "4" and flag(step, "--ntasks") == "4"
    assert flag(step, "--nodelist") == "gpu001,gpu002,gpu003,gpu004"
    assert step[-2:] == ["train", "trainer.steps=10"] and step[-3].endswith("launch/task.sh")
    launches = r.find("torch.distributed.run")
    assert [flag(c, "--node-rank") for c in launches] == ["0", "1", "2", "3"]
    assert r.all["NODE_RANK"] == ["0", "1", "2", "3"]
    for cmd in launches:
        assert flag(cmd, "--nnodes") == "4" and flag(cmd, "--nproc-per-node") == "8"
        assert flag(cmd, "--master-addr") == "gpu001" and flag(cmd, "--master-port") == "24242"
        tail = cmd[cmd.index("-m", 3) :]
        assert tail[:4] == ["-m", "megatron_gspo.cli.main", "train", "--config"] and tail[4] == "gspo.yaml"
        assert tail[-1] == "trainer.steps=10"
        assert f"trainer.run_dir={r['RUN_DIR']}" in tail and r["RUN_DIR"].endswith("/runs/megatron-gspo-4242")
        assert "--resume" not in tail and not any(a.startswith("sglang.") for a in tail)


def test_task_node_rank_from_slurm_nodeid(slurm):
    r = slurm("task.sh", "train", CONFIG="c.yaml", SLURM_NODEID="2", **FOUR_NODES)
    assert r["NODE_RANK"] == "2" and r["WORLD_SIZE"] == "32" and r["MASTER_ADDR"] == "gpu001"
    (cmd,) = r.find("torch.distributed.run")
    assert flag(cmd, "--node-rank") == "2" and flag(cmd, "--nnodes") == "4"
    assert "ranks 16..23" in r.out and "(gpu003)" in r.out


def test_task_one_rank_per_gpu(slurm):
    env = dict(FOUR_NODES, LAUNCHER="srun", SLURM_NODEID="2", SLURM_LOCALID="3", SLURM_PROCID="19", SLURM_NTASKS="32")
    r = slurm("task.sh", "train", CONFIG="c.yaml", PYTHON="/venv/bin/python", **env)
    assert (r["RANK"], r["LOCAL_RANK"], r["NODE_RANK"], r["WORLD_SIZE"]) == ("19", "3", "2", "32")
    (cmd,) = r.find("megatron_gspo.cli.main")
    assert cmd[:5] == ["/venv/bin/python", "-m", "megatron_gspo.cli.main", "train", "--config"]
    bad = slurm("task.sh", "train", expect_ok=False, CONFIG="c.yaml", **dict(env, SLURM_PROCID="18"))
    assert bad.proc.returncode != 0 and "SLURM_PROCID=18" in bad.err


def test_train_one_task_per_gpu(slurm):
    r = slurm(
        "train.sbatch",
        CONFIG="c.yaml",
        LAUNCHER="srun",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="h100:4",
    )
    assert r["WORLD_SIZE"] == "8" and r["GPUS_PER_NODE"] == "4" and r["MASTER_ADDR"] == "n1"
    step = r.find("srun")[0]
    assert flag(step, "--ntasks") == "8" and flag(step, "--ntasks-per-node") == "4"
    assert r.all["RANK"] == [str(i) for i in range(8)]
    assert r.all["LOCAL_RANK"] == ["0", "1", "2", "3"] * 2
    assert r.all["NODE_RANK"] == ["0"] * 4 + ["1"] * 4
    assert len(r.find("megatron_gspo.cli.main")) == 8


def test_disaggregated_rollout_nodes(slurm):
    r = slurm(
        "train.sbatch",
        CONFIG="c.yaml",
        ROLLOUT_MODE="disaggregated",
        ROLLOUT_NODES="1",
        SGLANG_TP="4",
        SGLANG_ROUTER="1",
        SGLANG_DETERMINISTIC="1",
        SGLANG_PYTHON="/opt/sglang/bin/python",
        SGLANG_MODEL_PATH="/ckpt/sft-hf",
        **FOUR_NODES,
    )
    assert r["TRAIN_NODES"] == "3" and r["WORLD_SIZE"] == "24" and r["ROLLOUT_HOSTS"] == "gpu004"
    assert r["ROLLOUT_URLS"] == "http://gpu004:30000 http://gpu004:30001"
    assert r["ROUTER_URL"] == "http://gpu004:29000"
    rollout_step, train_step = r.find("srun")
    assert flag(rollout_step, "--nodelist") == "gpu004" and rollout_step[rollout_step.index(">") - 1] == "rollout"
    assert flag(train_step, "--nodelist") == "gpu001,gpu002,gpu003" and flag(train_step, "--nodes") == "3"
    servers = r.find("sglang.launch_server")
    assert [c[1] for c in servers] == ["CUDA_VISIBLE_DEVICES=0,1,2,3", "CUDA_VISIBLE_DEVICES=4,5,6,7"]
    for cmd, port in zip(servers, ("30000", "30001")):
        assert cmd[2] == "/opt/sglang/bin/python"
        assert flag(cmd, "--tp") == "4" and flag(cmd, "--port") == port and flag(cmd, "--model-path") == "/ckpt/sft-hf"
        assert "--skip-tokenizer-init" in cmd and "--enable-deterministic-inference" in cmd
        assert "--enable-return-routed-experts" not in cmd and "--enable-memory-saver" not in cmd
    (router,) = r.find("sglang_router.launch_router")
    assert router[router.index("--worker-urls") + 1 :][:2] == ["http://gpu004:30000", "http://gpu004:30001"]
    launches = r.find("torch.distributed.run")
    assert [flag(c, "--node-rank") for c in launches] == ["0", "1", "2"]
    assert all(flag(c, "--nnodes") == "3" for c in launches)
    assert "rollout.engine=sglang" in launches[0] and "sglang.mode=attach" in launches[0]
    assert "sglang.colocated=true" not in launches[0] and "sglang.return_routed_experts=true" not in launches[0]
    assert "sglang.urls=[http://gpu004:30000,http://gpu004:30001]" in launches[0]
    assert "sglang.router_url=http://gpu004:29000" in launches[0]
    assert "sglang.deterministic_inference=true" in launches[0]
    # R3: servers return routed experts, and generation skips the router (which drops return_routed_experts)
    r3 = slurm("train.sbatch", CONFIG="c.yaml", ROLLOUT_MODE="disaggregated", ROLLOUT_NODES="1", SGLANG_TP="4",
               ROUTING_REPLAY="r3", SGLANG_MODEL_PATH="/ckpt/sft-hf", **FOUR_NODES)
    assert all("--enable-return-routed-experts" in c for c in r3.find("sglang.launch_server"))
    (first, *_) = r3.find("torch.distributed.run")
    assert "sglang.return_routed_experts=true" in first and "moe.routing_replay=r3" in first
    assert not any(a.startswith("sglang.router_url") for a in first)


def test_colocated_servers_on_training_nodes(slurm):
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="a,b", SLURM_NNODES="2")
    r = slurm("train.sbatch", CONFIG="c.yaml", ROLLOUT_MODE="colocated", SGLANG_TP="8", SGLANG_MODEL_PATH="/m", **env)
    assert r["WORLD_SIZE"] == "16"
    servers = r.find("sglang.launch_server")
    assert len(servers) == 2 and all("--enable-memory-saver" in c for c in servers)
    assert "--enable-return-routed-experts" not in servers[0]
    assert r["ROLLOUT_URLS"] == "http://a:30000 http://b:30000"
    # issue 16 item 4: a server shares trainer rank 0's GPU, so no NCCL group: weights go through the run dir
    launches = r.find("torch.distributed.run")
    assert all("sglang.colocated=true" in c and "sglang.weight_sync=disk" in c for c in launches)
    assert all(f"sglang.weight_sync_dir={r['RUN_DIR']}/weight_sync" in c for c in launches)
    bad = slurm("train.sbatch", expect_ok=False, CONFIG="c.yaml", ROLLOUT_MODE="colocated", LAUNCHER="srun",
                SGLANG_MODEL_PATH="/m", **env)
    assert bad.proc.returncode != 0 and "LAUNCHER=torchrun" in bad.err


def test_rollout_servers_job(slurm, tmp_path):
    urls_file = tmp_path / "urls.txt"
    r = slurm(
        "rollout_servers.sbatch",
        SLURM_JOB_NODELIST="r[1-2]",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="8",
        SGLANG_TP="2",
        SGLANG_ROUTER="1",
        SGLANG_MODEL_PATH="/m",
        ROLLOUT_URLS_FILE=str(urls_file),
    )
    assert r["SERVERS_PER_NODE"] == "4" and r["NUM_SERVERS"] == "8"
    servers = r.find("sglang.launch_server")
    assert len(servers) == 8
    assert [c[1] for c in servers[:4]] == [f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1}" for i in range(4)]
    (router,) = r.find("sglang_router.launch_router")
    workers = router[router.index("--worker-urls") + 1 : router.index(">")]
    assert workers == [f"http://r{n}:{30000 + i}" for n in (1, 2) for i in range(4)]
    assert "worker http://r2:30003" in r.out and "router http://r1:29000" in r.out
    assert not urls_file.exists()  # dry run writes nothing


def test_external_servers_from_urls_file(slurm, tmp_path):
    urls_file = tmp_path / "urls.txt"
    urls_file.write_text("worker http://r1:30000\nworker http://r2:30000\nrouter http://r1:29000\n")
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="a", SLURM_NNODES="1")
    r = slurm("train.sbatch", CONFIG="c.yaml", ROLLOUT_MODE="external", ROLLOUT_URLS_FILE=str(urls_file), **env)
    (cmd,) = r.find("torch.distributed.run")
    assert "sglang.urls=[http://r1:30000,http://r2:30000]" in cmd
    assert "sglang.router_url=http://r1:29000" in cmd


def test_pipeline_sbatch_chain(slurm):
    r = slurm(
        "pipeline.sh",
        HF_MODEL="/models/base",
        SFT_CONFIG="sft.yaml",
        RL_CONFIG="rl.yaml",
        WORK_DIR="/w",
        EP="8",
        RL_NODES="4",
        RL_ROLLOUT_MODE="disaggregated",
        RL_ROLLOUT_NODES="1",
    )
    jobs = r.find("sbatch")
    assert [flag(c, "--job-name") for c in jobs] == ["mg-convert", "mg-sft", "mg-sft_export", "mg-rl", "mg-export"]
    deps = [next((a for a in c if a.startswith("--dependency=")), None) for c in jobs]
    assert deps == [None] + [f"--dependency=afterok:<jobid:{n}>" for n in ("convert", "sft", "sft_export", "rl")]
    convert = shlex.split(flag(jobs[0], "--wrap"))
    # ep=8 needs 8 ranks to build the model in (one process fails: world size 1 is no multiple of ep=8)
    assert convert[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8"]
    assert convert[convert.index("convert") :] == ["convert", "hf-to-megatron", "--hf", "/models/base", "--out",
                                                   "/w/megatron-base", "--tp", "1", "--pp", "1", "--ep", "8"]
    assert "MG_SUBCOMMAND=sft" in jobs[1] and "SFT_OUT=/w/sft-model" in jobs[1]
    assert jobs[1][-1] == "model.load=/w/megatron-base"
    assert shlex.split(flag(jobs[2], "--wrap"))[3:] == ["convert", "megatron-to-hf", "--ckpt", "/w/sft-model",
                                                       "--out", "/w/sft-hf"]
    assert "SGLANG_MODEL_PATH=/w/sft-hf" in jobs[3] and flag(jobs[3], "--nodes") == "4"
    assert "ROLLOUT_NODES=1" in jobs[3] and jobs[3][-1] == "model.load=/w/sft-model"
    export = flag(jobs[4], "--wrap")  # resolves checkpoints/latest when the job runs
    assert export.startswith("ckpt=/w/rl/checkpoints/$(cat /w/rl/checkpoints/latest) && ")
    assert shlex.split(export)[-5:] == ["megatron-to-hf", "--out", "/w/final-hf", "--ckpt", "$ckpt"]


def test_pipeline_local_expands_train_steps(slurm):
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="a,b", SLURM_NNODES="2")
    r = slurm("pipeline.sh", PIPELINE_MODE="local", STEPS="sft rl", SFT_CONFIG="s.yaml", RL_CONFIG="r.yaml",
              SGLANG_MODEL_PATH="/m", WORK_DIR="/w", SFT_ROLLOUT_MODE="none", **env)
    sft = r.find("torch.distributed.run", "sft")
    rl = r.find("torch.distributed.run", "train")
    assert len(sft) == 2 and len(rl) == 2
    assert "model.load=/w/megatron-base" in sft[0] and "model.load=/w/sft-model" in rl[1]
    assert sft[0][sft[0].index("--out") + 1] == "/w/sft-model" and "trainer.run_dir=/w/sft" in sft[0]
    assert "trainer.run_dir=/w/rl" in rl[0]
    assert len(r.find("sglang.launch_server")) == 2 * 8  # colocated, SGLANG_TP=1 by default


@pytest.mark.parametrize(
    "script,env,message",
    [
        ("train.sbatch", dict(FOUR_NODES), "CONFIG is not set"),
        ("train.sbatch", dict(FOUR_NODES, CONFIG="c", SLURM_NNODES="3"), "SLURM_NNODES=3"),
        ("train.sbatch", dict(FOUR_NODES, CONFIG="c", ROLLOUT_MODE="disaggregated"), "ROLLOUT_NODES >= 1"),
        ("train.sbatch", dict(FOUR_NODES, CONFIG="c", ROLLOUT_MODE="colocated", SGLANG_TP="3", SGLANG_MODEL_PATH="/m"),
         "SGLANG_TP=3 does not divide GPUS_PER_NODE=8"),
        ("train.sbatch", dict(FOUR_NODES, CONFIG="c", ROLLOUT_MODE="disaggregated", ROLLOUT_NODES="1",
                              SGLANG_ROUTER="1", ROUTING_REPLAY="r3", SGLANG_MODEL_PATH="/m"),
         "SGLANG_ROUTER=1 with ROUTING_REPLAY=r3: sglang-router re-sends /generate without return_routed_experts"),
        ("train.sbatch", dict(FOUR_NODES, CONFIG="c", DRY_RUN="0", FAKE_HOSTNAMES="a"), "FAKE_HOSTNAMES"),
        ("train.sbatch", dict(CONFIG="c", SLURM_NNODES="1"), "SLURM_JOB_NODELIST"),
        ("pipeline.sh", dict(STEPS="convert"), "HF_MODEL"),
    ],
)
def test_errors_are_named(slurm, script, env, message):
    r = slurm(script, expect_ok=False, **env)
    assert r.proc.returncode != 0
    assert message in r.err


def test_fake_hostnames_instead_of_scontrol(slurm):
    r = slurm("train.sbatch", CONFIG="c", FAKE_HOSTNAMES="x1,x2", SLURM_NNODES="2", GPUS_PER_NODE="2",
              PATH="/usr/bin:/bin")
    assert r["MASTER_ADDR"] == "x1" and r["WORLD_SIZE"] == "4"


def test_real_run_refuses_outside_slurm(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CONFIG": "c"}
    proc = subprocess.run(["bash", str(LAUNCH / "train.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode != 0 and "SLURM_JOB_NODELIST" in proc.stderr
    assert not (tmp_path / "runs").exists()
    assert os.listdir(tmp_path) == []


# ---- real (non-dry) runs against stubs: srun runs the tasks locally, python / curl / SGLang are stubs -------------
SRUN = f"""#!{sys.executable}
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes = int(opts.get("nodes", 1))
ntasks = int(opts.get("ntasks", nodes))
per_node = int(opts.get("ntasks-per-node", 1))
status = 0
for task in range(ntasks):
    env = dict(os.environ, SLURM_NODEID=str(task // per_node), SLURM_PROCID=str(task),
               SLURM_LOCALID=str(task % per_node), SLURM_NTASKS=str(ntasks))
    status = max(status, subprocess.call(args, env=env))
sys.exit(status)
"""


@pytest.fixture()
def stubs(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls.log"
    pids = tmp_path / "pids.log"
    files = {
        "scontrol": SCONTROL,
        "srun": SRUN,
        # Healthy once the stub server on that port has started (logged its pid and arguments).
        "curl": (
            f'#!/bin/bash\nurl="${{@: -1}}"; port="${{url##*:}}"; port="${{port%%/*}}"\n'
            f'for _ in $(seq 200); do grep -qs -- "--port $port" {pids} && exit 0; sleep 0.05; done\nexit 7\n'
        ),
        "python-stub": f'#!/bin/bash\necho "$*" >> {calls}\n',
        "sglang-stub": f'#!/bin/bash\necho "$$ $*" >> {pids}\nexec sleep 60\n',
    }
    for name, text in files.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "PYTHON": str(bindir / "python-stub"),
        "SGLANG_PYTHON": str(bindir / "sglang-stub"),
        "CONFIG": "c.yaml",
        "SLURM_JOB_ID": "7",
    }
    return env, calls, pids


def test_real_run_with_stub_srun(stubs, tmp_path):
    env, calls, _ = stubs
    env.update(SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="4")
    proc = subprocess.run(["bash", str(LAUNCH / "train.sbatch"), "x=1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        args = line.split()
        assert args[:2] == ["-m", "torch.distributed.run"] and f"--node-rank={rank}" in args
        assert "--nnodes=2" in args and "--nproc-per-node=4" in args and args[-1] == "x=1"
    assert (tmp_path / "runs" / "megatron-gspo-7" / "logs").is_dir()


def test_real_colocated_servers_are_stopped(stubs, tmp_path):
    env, calls, pids = stubs
    env.update(SLURM_JOB_NODELIST="n1", SLURM_NNODES="1", SLURM_GPUS_ON_NODE="4", ROLLOUT_MODE="colocated",
               SGLANG_TP="2", SGLANG_MODEL_PATH="/m")
    proc = subprocess.run(["bash", str(LAUNCH / "train.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    started = [line.split()[0] for line in pids.read_text().splitlines()]
    assert len(started) == 2
    for pid in started:  # the launcher stopped its servers after training
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert "sglang.urls=[http://n1:30000,http://n1:30001]" in calls.read_text()
    assert "sglang.colocated=true" in calls.read_text()


def test_real_run_propagates_failure(stubs, tmp_path):
    env, _, _ = stubs
    failing = tmp_path / "bin" / "python-fail"
    failing.write_text("#!/bin/bash\nexit 3\n")
    failing.chmod(0o755)
    env.update(SLURM_JOB_NODELIST="n1", SLURM_NNODES="1", SLURM_GPUS_ON_NODE="1", PYTHON=str(failing))
    proc = subprocess.run(["bash", str(LAUNCH / "train.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3


def test_pipeline_export_resolves_latest_checkpoint(stubs, tmp_path):
    env, calls, _ = stubs
    work = tmp_path / "work dir"
    (work / "rl" / "checkpoints").mkdir(parents=True)
    (work / "rl" / "checkpoints" / "latest").write_text("iter_0000012\n")
    env.update(PIPELINE_MODE="local", STEPS="export", WORK_DIR=str(work))
    proc = subprocess.run(["bash", str(LAUNCH / "pipeline.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().split(" --ckpt ")[-1].strip() == f"{work}/rl/checkpoints/iter_0000012"


def test_resume_and_sft_arguments(slurm):
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="a", SLURM_NNODES="1")
    r = slurm("train.sbatch", CONFIG="c.yaml", RESUME="1", **env)
    (cmd,) = r.find("torch.distributed.run")
    assert cmd[cmd.index("c.yaml") + 1] == "--resume"
    r = slurm("train.sbatch", CONFIG="c.yaml", MG_SUBCOMMAND="sft", RUN_DIR="/r", RESUME="1", **env)
    (cmd,) = r.find("torch.distributed.run")
    tail = cmd[cmd.index("megatron_gspo.cli.main") + 1 :]
    assert tail == ["sft", "--config", "c.yaml", "--out", "/r/sft_model", "trainer.run_dir=/r"]


def test_overrides_are_valid_run_config_keys(slurm):
    """What the scripts append after --config is accepted by the run-config loader and the SGLang config."""
    from megatron_gspo.training.config import load_run_config

    SGLangConfig = pytest.importorskip("megatron_gspo.rollout.sglang.config").SGLangConfig

    r = slurm("train.sbatch", CONFIG="c.yaml", ROLLOUT_MODE="colocated", ROUTING_REPLAY="r3", SGLANG_MODEL_PATH="/m",
              SGLANG_ROUTER="0", **dict(FOUR_NODES, SLURM_JOB_NODELIST="a", SLURM_NNODES="1"))
    (cmd,) = r.find("torch.distributed.run")
    overrides = cmd[cmd.index("c.yaml") + 1 :]
    cfg = load_run_config(None, overrides)
    assert cfg.rollout.engine == "sglang" and cfg.moe == {"routing_replay": "r3"}
    sglang = SGLangConfig(**cfg.sglang, num_experts=128, num_moe_layers=48, moe_topk=8)
    assert sglang.mode == "attach" and sglang.colocated and sglang.return_routed_experts
    assert sglang.weight_sync == "disk" and sglang.weight_sync_dir.endswith("/weight_sync")
    assert sglang.urls == [f"http://a:{30000 + i}" for i in range(8)]


def test_one_node_torchrun_binds_its_own_port(slurm):
    # One node: no port picked in advance (another job on a shared node could take it first); --standalone lets
    # torchrun bind one the kernel picks. A MASTER_PORT the user sets is used as given.
    one = dict(FOUR_NODES, SLURM_JOB_NODELIST="gpu001", SLURM_NNODES="1")
    (cmd,) = slurm("train.sbatch", CONFIG="gspo.yaml", **one).find("torch.distributed.run")
    assert "--standalone" in cmd and not any(a.startswith("--master-port") for a in cmd), cmd
    (cmd,) = slurm("train.sbatch", CONFIG="gspo.yaml", MASTER_PORT="23456", **one).find("torch.distributed.run")
    assert "--standalone" not in cmd and flag(cmd, "--master-port") == "23456", cmd
