"""MoEConfig: defaults, validation errors that name the key, the `moe:` section parser."""

import pytest

from megatron_gspo.moe import ROUTING_REPLAY_MODES, MoEConfig


def test_defaults_and_properties():
    cfg = MoEConfig()
    assert (cfg.routing_replay, cfg.drift_every, cfg.drift_sample_sequences, cfg.drift_rollout) == ("off", 1, 0, False)
    assert not cfg.replays and cfg.needs_router_replay  # drift is measured by default, which records routes
    assert not MoEConfig(drift_every=0).needs_router_replay
    assert MoEConfig(routing_replay="r3", drift_every=0).needs_router_replay
    assert ROUTING_REPLAY_MODES == ("off", "r2", "r3")


def test_measure_drift_every_n_steps():
    assert [MoEConfig(drift_every=3).measure_drift(s) for s in range(5)] == [True, False, False, True, False]
    assert not any(MoEConfig(drift_every=0).measure_drift(s) for s in range(5))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(routing_replay="r1"), "moe.routing_replay"),
        (dict(routing_replay=None), "moe.routing_replay"),
        (dict(drift_every=-1), "moe.drift_every"),
        (dict(drift_every=1.5), "moe.drift_every"),
        (dict(drift_every=True), "moe.drift_every"),
        (dict(drift_sample_sequences=-2), "moe.drift_sample_sequences"),
        (dict(drift_rollout="yes"), "moe.drift_rollout"),
    ],
)
def test_invalid_values_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        MoEConfig(**kwargs)


def test_from_dict():
    assert MoEConfig.from_dict({"routing_replay": "r2", "drift_every": 4}) == MoEConfig("r2", 4, 0)
    assert MoEConfig.from_dict(None) == MoEConfig()
    with pytest.raises(ValueError, match="moe.replay is not a known option"):
        MoEConfig.from_dict({"replay": "r2"})
