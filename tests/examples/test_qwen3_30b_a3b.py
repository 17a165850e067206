"""examples/qwen3_30b_a3b_*.yaml: they load, carry the GSPO paper's settings (arXiv:2507.18071 §5.1), and the
planner accepts their layout on the node count their comments state (4 nodes x 8 GPUs of 80 GB)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

from megatron_gspo.algorithms.config import PolicyLossConfig
from megatron_gspo.moe.config import MoEConfig
from megatron_gspo.planning.cli import plan_main, read_config
from megatron_gspo.planning.layouts import Cluster, plan_layout
from megatron_gspo.planning.memory import GiB, Workload, estimate_stage_memory
from megatron_gspo.rollout.sglang.config import SGLangConfig
from megatron_gspo.training.config import load_run_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GSPO, GRPO_R2, SFT = "qwen3_30b_a3b_gspo.yaml", "qwen3_30b_a3b_grpo_r2.yaml", "qwen3_30b_a3b_sft.yaml"
ALL = (GSPO, GRPO_R2, SFT)
# What the configs' comments state: 4 training nodes of 8 x 80 GB GPUs; rows of prompt (<= 1024 tokens) +
# rollout.max_new_tokens (8192).
NODES, GPUS_PER_NODE, GPU_GB, SEQ_LEN = 4, 8, 80, 9216
# (algorithm, paper clip range (eps_low, eps_high), moe.routing_replay)
RL = {GSPO: ("gspo", (3e-4, 4e-4), "off"), GRPO_R2: ("grpo", (0.2, 0.27), "r2")}


@pytest.fixture(scope="module")
def configs():
    return {name: load_run_config(EXAMPLES / name) for name in ALL}


@pytest.mark.parametrize("name", ALL)
def test_common_settings(configs, name):
    cfg = configs[name]
    assert cfg.model.preset == "qwen3-30b-a3b" and cfg.model.dtype == "bf16"
    assert cfg.model.load and cfg.model.recompute in ("selective", "full")
    assert cfg.data.train.endswith(".jsonl") and cfg.data.heldout.endswith(".jsonl")
    assert not cfg.data.tokenizer.startswith("char") and cfg.data.reward == "math_verify"
    assert "{prompt}" in cfg.data.prompt_template
    # Generation runs on SGLang servers (SFT too, for its held-out checks: the in-process engine cannot hold
    # a split 30B model); the section is valid, in attach mode, for the URLs the launch scripts fill in.
    assert cfg.rollout.engine == "sglang"
    sglang = SGLangConfig.from_dict(cfg.sglang)
    assert sglang.mode == "attach" and sglang.python.endswith("python") and sglang.model_path
    assert cfg.rollout.max_new_tokens >= 8192
    world = NODES * GPUS_PER_NODE
    assert cfg.parallel.data_parallel_size(world) == world // (cfg.parallel.tp * cfg.parallel.pp)


@pytest.mark.parametrize("name", list(RL))
def test_rl_paper_settings(configs, name):
    cfg = configs[name]
    algorithm, clip_range, replay = RL[name]
    assert cfg.loss.algorithm == algorithm
    assert cfg.loss.clip_low is None and cfg.loss.clip_high is None  # the paper's values, not restated
    assert cfg.loss.clip_range == pytest.approx(clip_range)
    assert cfg.trainer.minibatches == 4  # §5.1: 4 minibatches (optimizer steps) per rollout batch
    assert (cfg.trainer.prompts_per_step * cfg.rollout.group_size) % 4 == 0
    assert cfg.rollout.group_size in (8, 16) and cfg.rollout.temperature == 1.0
    assert cfg.eval.n == 32  # AIME'24 avg@32
    moe = MoEConfig.from_dict(cfg.moe)
    assert moe.routing_replay == replay
    if replay == "r2":
        assert cfg.rollout.old_logprobs == "recompute"
    # No KL term: the paper states none, and the loss schema has none to set.
    assert not [f.name for f in dataclasses.fields(PolicyLossConfig) if "kl" in f.name.lower()]


def test_gspo_and_grpo_runs_differ_only_in_the_algorithm(configs):
    """The comparison is fair: same model, data, layout, batch, optimizer and rollout settings."""
    a, b = configs[GSPO].to_dict(), configs[GRPO_R2].to_dict()
    for d in (a, b):
        d.pop("loss"), d.pop("moe")
        d["trainer"].pop("run_dir")
    assert a == b


def test_sft_settings(configs):
    cfg, rl = configs[SFT], configs[GSPO]
    assert cfg.model.load != rl.model.load  # SFT starts from the converted base model, RL from the SFT model
    assert cfg.parallel == rl.parallel
    dp = cfg.parallel.data_parallel_size(NODES * GPUS_PER_NODE)
    assert cfg.sft.batch_size % dp == 0 and cfg.sft.lr < 1e-4 and cfg.sft.max_steps >= 100


def _plan_argv(name: str, cfg) -> list[str]:
    argv = ["--config", str(EXAMPLES / name), "--nodes", str(NODES), "--gpus-per-node", str(GPUS_PER_NODE),
            "--gpu-memory-gb", str(GPU_GB), "--seq-len", str(SEQ_LEN)]
    if MoEConfig.from_dict(cfg.moe).routing_replay != "off" and name != SFT:
        argv += ["--routing-replay", MoEConfig.from_dict(cfg.moe).routing_replay]
    if name == SFT:  # the SFT global batch is sft.batch_size (the planner reads the RL batch keys)
        argv += ["--global-batch-size", str(cfg.sft.batch_size)]
    return argv


@pytest.mark.parametrize("name", ALL)
def test_planner_accepts_the_layout(configs, name):
    cfg = configs[name]
    out, err = io.StringIO(), io.StringIO()
    code = plan_main(_plan_argv(name, cfg), out=out, err=err)
    p = cfg.parallel
    assert code == 0, err.getvalue() + out.getvalue()
    assert f"layout    tp={p.tp} pp={p.pp} ep={p.ep} etp={p.etp} cp={p.cp} dp=8  [FITS" in out.getvalue()


@pytest.mark.parametrize("name", ALL)
def test_layout_fits_with_the_trainers_unsharded_optimizer(configs, name):
    """The planner counts megatron's distributed optimizer, the trainer's default; with optim.distributed=false
    (12 bytes per parameter on every rank) the layout fits too, on every pipeline stage."""
    cfg = configs[name]
    inputs = read_config(EXAMPLES / name)
    replay = MoEConfig.from_dict(cfg.moe).routing_replay if name != SFT else "off"
    workload = Workload(
        seq_len=SEQ_LEN,
        micro_batch_size=inputs.micro_batch_size,
        global_batch_size=cfg.sft.batch_size if name == SFT else inputs.global_batch_size,
        rollout_batch_size=inputs.rollout_batch_size,
        recompute=inputs.recompute,
        routing_replay=replay,
    )
    plan = plan_layout(inputs.model, cfg.parallel, Cluster(NODES, GPUS_PER_NODE, GPU_GB), workload,
                       check_global_batch=True)
    for stage in range(plan.layout.pp):
        m = estimate_stage_memory(inputs.model, plan.layout, workload, stage)
        unsharded = m.total - m.optimizer + 12.0 * m.params
        assert unsharded <= GPU_GB * GiB, f"stage {stage}: {unsharded / GiB:.1f} GiB"
