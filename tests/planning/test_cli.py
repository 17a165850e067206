"""`plan_main`: the surface `megatron-gspo plan` exposes (flags, config keys, report, exit codes)."""

from __future__ import annotations

import io

import pytest

from megatron_gspo.planning.cli import build_parser, plan_main, read_config


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    code = plan_main(argv, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_flags_surface():
    flags = {a for action in build_parser()._actions for a in action.option_strings}
    expected = {"--config", "--preset", "--nodes", "--gpus-per-node", "--gpu-memory-gb", "--seq-len",
                "--micro-batch-size", "--recompute", "--routing-replay", "--tp", "--pp", "--ep", "--etp"}
    assert expected <= flags
    assert "--cp" not in flags  # context parallelism is not implemented: the planner does not offer it


def test_config_with_context_parallelism_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("parallel: {tp: 2, sequence_parallel: true, cp: 2}\n")
    code, _, err = run(["--config", str(path), "--nodes", "2"])
    assert code == 2
    assert "parallel.cp=2 is not supported" in err and len(err.strip().splitlines()) == 1


def test_help_exits_zero(capsys):
    assert plan_main(["--help"]) == 0
    assert "--gpu-memory-gb" in capsys.readouterr().out


def test_bad_choice_exits_two(capsys):
    assert plan_main(["--recompute", "some"]) == 2


def test_report_for_a_layout_that_fits():
    code, out, _ = run(["--nodes", "2", "--tp", "2", "--ep", "8", "--recompute", "full"])
    assert code == 0
    assert "total 30.53B" in out and "active 3.35B" in out and "active compute 3.04B" in out
    assert "layout    tp=2 pp=1 ep=8 etp=1 cp=1 dp=8  [FITS" in out
    for term in ("weights (bf16)", "grads (fp32", "optimizer (fp32", "activations", "routing replay", "overhead"):
        assert term in out
    assert "naive fp32 path" in out and "fused kernel" in out
    assert "suggested layouts" in out


def test_one_gpu_does_not_fit():
    code, out, _ = run(["--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80"])
    assert code == 1 and "NOTHING FITS" in out
    code, out, _ = run(["--nodes", "1", "--gpus-per-node", "1", "--tp", "1"])
    assert code == 1 and "DOES NOT FIT" in out


def test_invalid_layout_exits_two_and_names_keys():
    code, out, err = run(["--tp", "3", "--ep", "5"])
    assert code == 2 and out == ""
    assert "parallel.tp=3" in err and "parallel.ep=5" in err


def test_tiny_preset():
    code, out, _ = run(["--preset", "tiny", "--gpus-per-node", "2", "--seq-len", "256", "--gpu-memory-gb", "8"])
    assert code == 0 and "model     tiny" in out and "total 1.78M" in out


def test_unknown_preset():
    code, _, err = run(["--preset", "gpt5"])
    assert code == 2 and "model.preset='gpt5'" in err


CONFIG = """
model:
  preset: qwen3-30b-a3b
  dtype: bf16
  recompute: full
  load: /ignored/path
parallel:
  tp: 2
  pp: 2
  ep: 4
  sequence_parallel: true
trainer:
  steps: 100
  prompts_per_step: 32
  minibatches: 4
  micro_batch_size: 1
rollout:
  group_size: 8
  temperature: 1.0
loss:
  algorithm: gspo
sglang:
  mode: attach
"""


def test_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    cfg = read_config(path)
    assert cfg.name == "qwen3-30b-a3b" and cfg.model.num_experts == 128 and cfg.recompute == "full"
    assert cfg.parallel == {"tp": 2, "pp": 2, "ep": 4, "sequence_parallel": True}
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.rollout_batch_size) == (1, 64, 256)
    code, out, _ = run(["--config", str(path), "--nodes", "2", "--routing-replay", "r2"])
    assert code in (0, 1)
    assert "layout    tp=2 pp=2 ep=4 etp=1 cp=1 dp=4" in out
    assert "global batch 64 sequences," in out and "rollout batch 256 sequences" in out
    assert "recompute full" in out
    # Flags win over the file.
    code, out, _ = run(["--config", str(path), "--nodes", "2", "--tp", "1", "--pp", "1", "--recompute", "none"])
    assert "layout    tp=1 pp=1 ep=4" in out and "recompute none" in out


def test_config_defaults_are_the_schema_defaults(tmp_path):
    """A key the file leaves out means what it means to the run: the run-config schema's default."""
    from megatron_gspo.training.config import ModelSection, RolloutConfig, TrainerConfig

    path = tmp_path / "run.yaml"
    path.write_text("loss: {algorithm: gspo}\n")
    cfg = read_config(path)
    t, r, m = TrainerConfig(), RolloutConfig(), ModelSection()
    assert cfg.name == m.preset and cfg.recompute == m.recompute
    assert cfg.micro_batch_size == t.micro_batch_size
    assert cfg.rollout_batch_size == t.prompts_per_step * r.group_size
    assert cfg.global_batch_size == t.prompts_per_step * r.group_size // t.minibatches


def test_config_global_batch_is_checked(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("parallel: {ep: 8}\ntrainer: {prompts_per_step: 5, minibatches: 1, micro_batch_size: 1}\n"
                    "rollout: {group_size: 4}\nmodel: {preset: qwen3-30b-a3b}\n")
    code, _, err = run(["--config", str(path), "--nodes", "2"])
    assert code == 2 and "trainer.global_batch_size=20" in err


def test_config_minibatches_must_divide(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer: {prompts_per_step: 3, minibatches: 4}\nrollout: {group_size: 1}\n")
    code, _, err = run(["--config", str(path)])
    assert code == 2 and "trainer.minibatches=4" in err


def test_config_model_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny, overrides: {num_experts: 16}}\n")
    code, out, _ = run(["--config", str(path), "--seq-len", "128", "--gpus-per-node", "1"])
    assert code == 0 and "model     tiny:" in out and "16 experts" in out


def test_config_hf_config(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        __import__("json").dumps(__import__("megatron_gspo.models.config", fromlist=["x"]).preset("tiny").to_hf_dict())
    )
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{hf_config: {tmp_path / 'hf'}}}\n")
    code, out, _ = run(["--config", str(path), "--seq-len", "128", "--gpus-per-node", "1"])
    assert code == 0 and "total 1.78M" in out


@pytest.mark.parametrize(
    "text,message",
    [
        ("- a\n- b\n", "top level"),
        ("parallel: 3\n", "parallel must be a section"),
        ("model: {preset: gpt5}\n", "model.preset='gpt5'"),
        ("rollout: {group_size: many}\n", "rollout.group_size='many'"),
        ("trainer: {micro_batch_size: 0}\n", "trainer.micro_batch_size=0"),
        ("model: [\n", "invalid YAML"),
    ],
)
def test_bad_config_file(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, _, err = run(["--config", str(path)])
    assert code == 2 and err.startswith("error:") and message in err


def test_missing_config_file(tmp_path):
    code, _, err = run(["--config", str(tmp_path / "nope.yaml")])
    assert code == 2 and "nope.yaml" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--micro-batch-size", "0"], "micro_batch_size=0"),
        (["--nodes", "0"], "nodes=0"),
        (["--gpu-memory-gb", "-1"], "gpu_memory_gb=-1"),
    ],
)
def test_bad_numbers_exit_two(argv, message):
    code, _, err = run(argv)
    assert code == 2 and message in err
