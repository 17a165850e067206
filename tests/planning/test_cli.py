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
                "--micro-batch-size", "--recompute", "--routing-replay", "--tp", "--pp", "--ep", "--etp", "--cp"}
    assert expected <= flags


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
  checkpoint: /ignored/path
parallel:
  tp: 2
  pp: 2
  ep: 4
trainer:
  micro_batch_size: 1
  global_batch_size: 64
  lr: 1.0e-6
rollout:
  prompts_per_step: 32
  group_size: 8
  temperature: 1.0
gspo:
  clip_low: 3.0e-4
"""


def test_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    cfg = read_config(path)
    assert cfg.preset == "qwen3-30b-a3b" and cfg.model_overrides == {}
    assert cfg.parallel == {"tp": 2, "pp": 2, "ep": 4}
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.rollout_batch_size) == (1, 64, 256)
    code, out, _ = run(["--config", str(path), "--nodes", "2", "--routing-replay", "r2"])
    assert code in (0, 1)
    assert "layout    tp=2 pp=2 ep=4 etp=1 cp=1 dp=4" in out
    assert "global batch 64 sequences," in out and "rollout batch 256 sequences" in out
    # Flags win over the file.
    code, out, _ = run(["--config", str(path), "--nodes", "2", "--tp", "1", "--pp", "1"])
    assert "layout    tp=1 pp=1 ep=4" in out


def test_config_global_batch_is_checked(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("parallel: {ep: 8}\ntrainer: {global_batch_size: 20}\n")
    code, _, err = run(["--config", str(path), "--nodes", "2"])
    assert code == 2 and "trainer.global_batch_size=20" in err


def test_config_model_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny, num_experts: 16}\n")
    code, out, _ = run(["--config", str(path), "--seq-len", "128"])
    assert code == 0 and "16 experts" in out


@pytest.mark.parametrize("text", ["- a\n- b\n", "parallel: 3\n"])
def test_bad_config_file(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, _, err = run(["--config", str(path)])
    assert code == 2 and err.startswith("error:")


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


def test_bad_batch_in_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout: {prompts_per_step: 32, group_size: many}\n")
    code, _, err = run(["--config", str(path)])
    assert code == 2 and "rollout.group_size='many'" in err
