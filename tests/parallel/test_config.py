import pytest

from megatron_gspo.models.config import ModelConfig, preset
from megatron_gspo.parallel.config import ParallelConfig


def test_defaults_and_dp_size():
    p = ParallelConfig(tp=2, pp=2, sequence_parallel=True)
    assert p.etp == 2 and p.data_parallel_size(8) == 2
    assert ParallelConfig(ep=4).etp == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=0), r"parallel\.tp=0"),
        (dict(sequence_parallel=True), r"sequence_parallel=true needs parallel\.tp > 1"),
        (dict(virtual_pp=2), r"virtual_pp=2 needs parallel\.pp > 1"),
        # Context parallelism is not implemented (no per-CP-rank sequence split, no CP sum of log-probs).
        (dict(cp=2), r"^parallel\.cp=2 is not supported: context parallelism is not implemented; set parallel\.cp=1"),
    ],
)
def test_bad_values_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_world_size_must_fit():
    with pytest.raises(ValueError, match=r"world size 3 is not a multiple of parallel\.tp\*pp\*cp"):
        ParallelConfig(tp=2, sequence_parallel=True).data_parallel_size(3)


def test_bad_layouts_for_the_model():
    from megatron_gspo.models.build import validate_layout

    tiny = preset("tiny")
    with pytest.raises(ValueError, match=r"parallel\.ep=3 does not divide model\.num_experts=8"):
        validate_layout(tiny, ParallelConfig(ep=3))
    with pytest.raises(ValueError, match=r"parallel\.tp=4 does not divide model\.num_key_value_heads=2"):
        validate_layout(tiny, ParallelConfig(tp=4, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"parallel\.pp=3 .*does not divide model\.num_hidden_layers=4"):
        validate_layout(tiny, ParallelConfig(pp=3))
    with pytest.raises(ValueError, match=r"requires parallel\.sequence_parallel=true"):
        validate_layout(tiny, ParallelConfig(tp=2))
    with pytest.raises(ValueError, match=r"world size 3"):
        validate_layout(tiny, ParallelConfig(tp=2, sequence_parallel=True), world_size=3)


def test_model_config_validation_and_hf_roundtrip():
    with pytest.raises(ValueError, match=r"model\.num_experts_per_tok=9 exceeds model\.num_experts=8"):
        preset("tiny", num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"model\.preset='huge' is unknown"):
        preset("huge")
    cfg = preset("tiny", head_dim=24)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    assert ModelConfig.from_hf_config(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match="model_type must be 'qwen3_moe'"):
        ModelConfig.from_hf_config({**cfg.to_hf_dict(), "model_type": "llama"})
