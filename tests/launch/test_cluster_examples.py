"""launch/ with the Qwen3-30B-A3B example configs: the pipeline's defaults, SFT with rollout servers, the
convert rank count, and the run-config overrides the scripts add (checked against the example files)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from megatron_gspo.rollout.sglang.config import SGLangConfig
from megatron_gspo.training.config import load_run_config
from tests.launch.test_scripts import FOUR_NODES, flag, slurm  # noqa: F401  (slurm is a fixture)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SFT_EXAMPLE = EXAMPLES / "qwen3_30b_a3b_sft.yaml"
GSPO_EXAMPLE = EXAMPLES / "qwen3_30b_a3b_gspo.yaml"


def _env_of(job: list[str]) -> dict[str, str]:
    """VAR=value arguments of an `env VAR=value ... sbatch ...` command."""
    return dict(a.split("=", 1) for a in job[1 : job.index("sbatch")])


def _overrides(cmd: list[str], config: Path) -> list[str]:
    """The key=value arguments after `--config CONFIG` (flags such as `--out DIR` left out)."""
    rest = cmd[cmd.index(str(config)) + 1 :]
    if rest[:1] == ["--out"]:
        rest = rest[2:]
    return [a for a in rest if not a.startswith("--")]


def test_pipeline_defaults_to_the_example_configs(slurm):
    r = slurm("pipeline.sh", HF_MODEL="/models/base", WORK_DIR="/w")
    jobs = r.find("sbatch")
    sft, rl = _env_of(jobs[1]), _env_of(jobs[3])
    assert sft["CONFIG"] == str(SFT_EXAMPLE) and rl["CONFIG"] == str(GSPO_EXAMPLE)
    assert SFT_EXAMPLE.is_file() and GSPO_EXAMPLE.is_file()
    # SFT's held-out checks generate on SGLang servers started from the base model; RL's from the SFT export.
    assert sft["ROLLOUT_MODE"] == "colocated" and sft["SGLANG_MODEL_PATH"] == "/models/base"
    assert rl["SGLANG_MODEL_PATH"] == "/w/sft-hf"


def test_pipeline_sft_without_servers(slurm):
    r = slurm("pipeline.sh", STEPS="sft", SFT_ROLLOUT_MODE="none", WORK_DIR="/w")
    (job,) = r.find("sbatch")
    env = _env_of(job)
    assert env["ROLLOUT_MODE"] == "none" and "SGLANG_MODEL_PATH" not in env


def test_pipeline_sft_servers_need_a_model(slurm):
    r = slurm("pipeline.sh", expect_ok=False, STEPS="sft", WORK_DIR="/w")
    assert r.proc.returncode != 0 and "SFT_SGLANG_MODEL_PATH or HF_MODEL" in r.err


@pytest.mark.parametrize(
    "layout,nproc",
    [(dict(TP="1", PP="1", EP="1"), 1), (dict(TP="2", PP="1", EP="4"), 4), (dict(TP="1", PP="2", EP="4"), 8)],
)
def test_pipeline_convert_ranks_fit_the_layout(slurm, layout, nproc):
    r = slurm("pipeline.sh", STEPS="convert", HF_MODEL="/m", WORK_DIR="/w", **layout)
    cmd = shlex.split(flag(r.find("sbatch")[0], "--wrap"))
    assert r["CONVERT_NPROC"] == str(nproc)
    if nproc == 1:
        assert cmd[1:4] == ["-m", "megatron_gspo.cli.main", "convert"]
    else:
        assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    assert cmd[-6:] == ["--tp", layout["TP"], "--pp", layout["PP"], "--ep", layout["EP"]]


def test_pipeline_convert_layout_larger_than_a_node(slurm):
    r = slurm("pipeline.sh", expect_ok=False, STEPS="convert", HF_MODEL="/m", TP="2", PP="2", EP="8")
    assert r.proc.returncode != 0 and "needs 16 ranks" in r.err


def test_sft_job_attaches_to_its_servers(slurm):
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="a", SLURM_NNODES="1")
    r = slurm("pipeline.sh", PIPELINE_MODE="local", STEPS="sft", HF_MODEL="/models/base", WORK_DIR="/w",
              SGLANG_TP="4", **env)
    servers = r.find("sglang.launch_server")
    assert len(servers) == 2 and all(flag(c, "--model-path") == "/models/base" for c in servers)
    (cmd,) = r.find("torch.distributed.run", "sft")
    overrides = _overrides(cmd, SFT_EXAMPLE)
    assert "sglang.tp_size=4" in overrides and "sglang.master_address=a" in overrides
    cfg = load_run_config(SFT_EXAMPLE, overrides)
    sglang = SGLangConfig.from_dict(cfg.sglang)
    assert sglang.urls == ["http://a:30000", "http://a:30001"] and sglang.tp_size == 4 and sglang.colocated
    assert cfg.model.load == "/w/megatron-base"


def test_gspo_example_disaggregated(slurm):
    """The example's stated cluster: 4 training nodes (the planner's layout, dp=8) + 2 SGLang nodes."""
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="gpu[001-006]", SLURM_NNODES="6")
    r = slurm("train.sbatch", CONFIG=str(GSPO_EXAMPLE), ROLLOUT_MODE="disaggregated", ROLLOUT_NODES="2",
              SGLANG_TP="4", SGLANG_MODEL_PATH="/ckpt/sft-hf", **env)
    assert r["WORLD_SIZE"] == "32"
    cmd = r.find("torch.distributed.run")[0]
    cfg = load_run_config(GSPO_EXAMPLE, _overrides(cmd, GSPO_EXAMPLE))
    assert cfg.parallel.data_parallel_size(int(r["WORLD_SIZE"])) == 8
    sglang = SGLangConfig.from_dict(cfg.sglang)
    assert sglang.urls == [f"http://gpu00{n}:{30000 + i}" for n in (5, 6) for i in (0, 1)]
    assert sglang.tp_size == 4 and sglang.master_address == "gpu001" and not sglang.colocated


def test_external_servers_publish_their_tp(slurm, tmp_path):
    urls_file = tmp_path / "urls.txt"
    r = slurm("rollout_servers.sbatch", SLURM_JOB_NODELIST="r1", SLURM_NNODES="1", SLURM_GPUS_ON_NODE="8",
              SGLANG_TP="2", SGLANG_MODEL_PATH="/m", ROLLOUT_URLS_FILE=str(urls_file))
    assert "tp 2" in r.out.splitlines()
    urls_file.write_text("worker http://r1:30000\nworker http://r1:30001\ntp 2\n")
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="a", SLURM_NNODES="1")
    r = slurm("train.sbatch", CONFIG="c.yaml", ROLLOUT_MODE="external", ROLLOUT_URLS_FILE=str(urls_file),
              SGLANG_TP="8", **env)
    (cmd,) = r.find("torch.distributed.run")
    assert "sglang.tp_size=2" in cmd and "sglang.urls=[http://r1:30000,http://r1:30001]" in cmd


def test_weight_sync_address_override(slurm):
    env = dict(FOUR_NODES, SLURM_JOB_NODELIST="a", SLURM_NNODES="1")
    r = slurm("train.sbatch", CONFIG="c.yaml", ROLLOUT_MODE="external", ROLLOUT_URLS="http://r:30000",
              WEIGHT_SYNC_ADDR="10.0.0.7", **env)
    (cmd,) = r.find("torch.distributed.run")
    assert "sglang.master_address=10.0.0.7" in cmd and not any(a.startswith("sglang.tp_size") for a in cmd)
    cfg = load_run_config(None, _overrides(cmd, Path("c.yaml")))
    assert SGLangConfig.from_dict(cfg.sglang).master_address == "10.0.0.7"
