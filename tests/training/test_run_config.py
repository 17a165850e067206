"""The config surface: YAML + dot-list overrides, unknown keys and bad values named."""

import pytest
import torch

from megatron_gspo.training.config import RunConfig, dump_run_config, load_run_config

EXAMPLE = "examples/tiny_moe_gspo.yaml"


def test_example_loads_with_overrides():
    cfg = load_run_config(EXAMPLE, ["trainer.steps=3", "parallel.tp=2", "parallel.sequence_parallel=true"])
    assert cfg.trainer.steps == 3 and cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel
    assert cfg.loss.algorithm == "gspo" and cfg.loss.clip_range == (3e-4, 4e-4)
    assert cfg.rollout.group_size == 8 and cfg.trainer.minibatches == 4


def test_roundtrip_through_yaml(tmp_path):
    cfg = load_run_config(EXAMPLE, ["loss.algorithm=grpo", "rollout.correction.level=sequence"])
    dump_run_config(cfg, tmp_path / "c.yaml")
    again = load_run_config(tmp_path / "c.yaml")
    assert again == cfg and isinstance(again, RunConfig)
    assert again.loss.clip_range == (0.2, 0.27)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.stepz=3", r"unknown config key trainer\.stepz"),
        ("nosuch.key=1", r"unknown config key nosuch"),
        ("trainer.steps=abc", r"trainer\.steps='abc' must be an integer"),
        ("trainer.steps=0", r"trainer\.steps=0 must be >= 1"),
        ("loss.algorithm=ppo", r"loss\.algorithm='ppo' is unknown"),
        ("rollout.group_size=1", r"rollout\.group_size=1 must be >= 2"),
        ("parallel.ep=0", r"parallel\.ep=0"),
        ("model.dtype=fp8", r"model\.dtype='fp8'"),
        ("trainer.steps", r"must look like key\.sub=value"),
        ("optim.lr=1e38", r"optim\.lr=1e\+38 overflows float32 in Adam's first step"),
        ("optim.lr=.nan", r"optim\.lr=nan must be a finite number > 0"),
        ("scoring.timeout_s=0", r"scoring\.timeout_s=0"),
        ("scoring.workers=-1", r"scoring\.workers=-1"),
        ("health.zero_grad_window=0", r"health\.zero_grad_window=0"),
        ("parallel.timeout_s=0", r"parallel\.timeout_s=0"),
        ("trainer.hang_warning_s=-1", r"trainer\.hang_warning_s=-1"),
        ("trainer.batch_layout=thd", r"trainer\.batch_layout='thd' must be packed or padded"),
        ("trainer.logprob_path=fast", r"trainer\.logprob_path='fast' must be fused or logits"),
        ("trainer.max_tokens_per_micro_batch=-1", r"trainer\.max_tokens_per_micro_batch=-1 must be >= 0"),
        ("rollout.local.dtype=fp8", r"rollout\.local\.dtype='fp8' must be null \(the trainer's\) or one of fp32"),
        ("rollout.local.backend=vllm", r"rollout\.local\.backend='vllm' must be one of auto, megatron, hf"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(EXAMPLE, [override])


def test_the_drift_sample_must_fill_whole_micro_batches():
    """It runs in micro-batches of micro_batch_size sequences: 6 of 4 crashed at the first drift step, after a
    rollout; a multiple, a smaller sample or a token budget are fine."""
    with pytest.raises(ValueError, match=r"moe\.drift_sample_sequences=6 must be a multiple of trainer\.micro_batch_size=4"):
        load_run_config(EXAMPLE, ["moe.drift_sample_sequences=6", "trainer.micro_batch_size=4"])
    for ok in (["moe.drift_sample_sequences=8"], ["moe.drift_sample_sequences=3"],
               ["moe.drift_sample_sequences=6", "trainer.max_tokens_per_micro_batch=64"]):
        load_run_config(EXAMPLE, ["trainer.micro_batch_size=4", *ok])


def test_token_budget_needs_packed_micro_batches():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch needs trainer.batch_layout=packed"):
        load_run_config(EXAMPLE, ["trainer.batch_layout=padded", "trainer.max_tokens_per_micro_batch=64"])


def test_rl_training_defaults_to_packed_fused():
    cfg = load_run_config(EXAMPLE)
    assert (cfg.trainer.batch_layout, cfg.trainer.logprob_path, cfg.trainer.max_tokens_per_micro_batch) == (
        "packed", "fused", 0)


def test_scientific_notation_without_a_dot_is_a_number():
    assert load_run_config(EXAMPLE, ["optim.lr=3e-4"]).optim.lr == 3e-4


def test_off_and_on_stay_strings(tmp_path):
    cfg = load_run_config(EXAMPLE, ["moe.routing_replay=off", "trainer.progress=false"])
    assert cfg.moe["routing_replay"] == "off" and cfg.trainer.progress is False
    (tmp_path / "c.yaml").write_text("moe:\n  routing_replay: off\n")
    assert load_run_config(tmp_path / "c.yaml").moe["routing_replay"] == "off"


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_run_config(tmp_path / "nope.yaml")


def test_context_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"parallel\.cp=2 is not supported: context parallelism is not implemented"):
        load_run_config(EXAMPLE, ["parallel.cp=2"])


def test_token_level_correction_is_refused_for_the_sequence_level_gspo_loss():
    """GSPO's loss reads only per-sequence log-prob sums: token weights would be ignored without a word."""
    with pytest.raises(ValueError, match=r"rollout\.correction\.level=token has no effect with loss\.algorithm=gspo"):
        load_run_config(EXAMPLE, ["rollout.correction.level=token"])
    for algorithm in ("gspo_token", "grpo"):  # token-level losses take the weights
        assert load_run_config(EXAMPLE, [f"loss.algorithm={algorithm}", "rollout.correction.level=token"])
    assert load_run_config(EXAMPLE, ["rollout.correction.level=sequence"]).rollout.correction.level == "sequence"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.correction.preset=grpo_icepop"],
         r"rollout\.correction\.preset=grpo_icepop \(level=token\) has no effect with loss\.algorithm=gspo"),
        (["rollout.correction.preset=gspo_seq_tis", "rollout.old_logprobs=engine"],
         r"rollout\.correction needs rollout\.old_logprobs=recompute"),
        (["rollout.correction.geo_mask_high=1.01", "rollout.old_logprobs=engine"],
         r"rollout\.correction needs rollout\.old_logprobs=recompute"),
        (["loss.overlong_buffer=9", "rollout.max_new_tokens=8"], r"loss\.overlong_buffer=9 must be <= rollout"),
        (["loss.overlong_buffer=-1"], r"loss\.overlong_buffer=-1 must be an integer >= 0"),
        (["loss.overlong_penalty_factor=-1"], r"loss\.overlong_penalty_factor=-1.0 must be a number >= 0"),
        (["rollout.correction.preset=nope"], r"rollout\.correction\.preset='nope' is unknown"),
    ],
)
def test_correction_and_overlong_keys_are_checked_against_the_rest_of_the_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(EXAMPLE, overrides)


def test_correction_presets_load_for_their_algorithms():
    for algorithm, preset in (("gspo", "gspo_geo_band"), ("gspo", "gspo_decoupled"), ("grpo", "grpo_icepop"),
                              ("gspo_token", "grpo_decoupled")):
        cfg = load_run_config(EXAMPLE, [f"loss.algorithm={algorithm}", f"rollout.correction.preset={preset}",
                                        "loss.mask_truncated=true", "loss.overlong_buffer=2"])
        assert cfg.rollout.correction.resolved().active
    # The engine's log-probs as pi_old with the default correction (monitoring only) stays allowed.
    assert load_run_config(EXAMPLE, ["rollout.old_logprobs=engine", "rollout.correction.preset=monitor"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.top_p=0.9"], r"vllm\.logprobs_mode=processed_logprobs and rollout\.top_p=0\.9 / rollout\.top_k=0"),
        (["rollout.top_k=20"], r"rollout\.top_p=1 / rollout\.top_k=20: vLLM's processed_logprobs are renormalised"),
        (["vllm.logprobs_mode=processed_logprobs", "rollout.top_p=0.5", "rollout.temperature=0.7"], r"top_p=0\.5"),
        (["vllm.logprobs_mode=raw_logprobs", "rollout.temperature=0.7"], r"at temperature 1, the trainer's are at rollout\.temperature=0\.7"),
    ],
)  # fmt: skip
def test_vllm_engine_logprobs_that_are_not_the_trainers_pi_old_are_refused(overrides, message):
    """vLLM's processed_logprobs are renormalised after top-k / top-p and its raw_logprobs are at temperature 1:
    neither is the full softmax at rollout.temperature the trainer's ratio uses when they serve as pi_old."""
    engine = ["rollout.engine=vllm", "rollout.old_logprobs=engine"]
    with pytest.raises(ValueError, match=message):
        load_run_config(EXAMPLE, [*engine, *overrides])
    # the same sampling with the trainer's own pi_old, or through SGLang (log softmax(logits / T) before
    # top-k / top-p), is a valid run
    assert load_run_config(EXAMPLE, ["rollout.engine=vllm", "rollout.old_logprobs=recompute", *overrides])
    sglang = [o for o in overrides if not o.startswith("vllm.")]
    assert load_run_config(EXAMPLE, ["rollout.engine=sglang", "rollout.old_logprobs=engine", *sglang])


def test_vllm_engine_logprobs_that_are_the_trainers_pi_old_are_accepted():
    engine = ["rollout.engine=vllm", "rollout.old_logprobs=engine"]
    for overrides in (
        ["rollout.temperature=0.7"],  # processed_logprobs: temperature applied, nothing filtered
        ["vllm.logprobs_mode=raw_logprobs", "rollout.top_p=0.9", "rollout.top_k=20"],  # T=1: full softmax
    ):
        assert load_run_config(EXAMPLE, [*engine, *overrides]).rollout.old_logprobs == "engine"


def test_engine_precision_other_than_the_trainers_needs_the_hf_replica():
    """rollout.local.dtype != model.dtype: the megatron backend would sample with the trainer's own parameters."""
    with pytest.raises(ValueError, match=r"rollout\.local\.dtype=bf16 differs from model\.dtype=fp32.*backend=hf"):
        load_run_config(EXAMPLE, ["rollout.local.dtype=bf16", "rollout.local.backend=megatron"])
    for extra in (["rollout.local.backend=hf"], ["rollout.local.backend=auto"]):
        cfg = load_run_config(EXAMPLE, ["rollout.local.dtype=bf16", *extra])
        assert cfg.rollout.local.torch_dtype() is torch.bfloat16
    same = load_run_config(EXAMPLE, ["rollout.local.dtype=fp32", "rollout.local.backend=megatron"])
    assert same.rollout.local.torch_dtype() is torch.float32
    assert load_run_config(EXAMPLE).rollout.local.torch_dtype() is None
