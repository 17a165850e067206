"""What the engine learns from each server's /server_info and what it refuses: R3 on 0.5.9 (issue 16 item 3),
seeds without deterministic inference (item 6), the context length (item 7), servers started without the flags a
configuration needs."""

from __future__ import annotations

import logging

import pytest

from megatron_gspo.rollout.sglang import SGLangError
from megatron_gspo.rollout.sglang.server_info import ServerInfo
from megatron_gspo.rollout.sglang.versions import parse_version
from megatron_gspo.rollout.types import SamplingParams

R3 = dict(return_routed_experts=True, num_experts=8, num_moe_layers=2, moe_topk=2)


def test_versions_parse_and_order():
    assert parse_version("0.5.23") == (0, 5, 23) > parse_version("0.5.9") == (0, 5, 9)
    assert parse_version("0.5.10rc1") == (0, 5, 10) and parse_version("0.5.9+cu128") == (0, 5, 9)
    with pytest.raises(ValueError, match="not an SGLang version"):
        parse_version("latest")
    info = ServerInfo.from_json("http://s:1", {"version": "0.5.21", "context_length": None})
    assert info.weight_update_session and info.context_length is None
    assert not ServerInfo.from_json("http://s:1", {"version": "0.5.20"}).weight_update_session
    with pytest.raises(SGLangError, match=r"http://s:1/server_info has no 'version'"):
        ServerInfo.from_json("http://s:1", {"detail": "Not Found"})


def test_r3_on_sglang_0_5_9_is_refused_at_start(fake_servers, attach):
    """0.5.9 with --skip-tokenizer-init returns routed experts as {}: on main every R3 sample failed at decode time."""
    (old,) = fake_servers(1, version="0.5.9")
    with pytest.raises(SGLangError, match=r"runs SGLang 0\.5\.9, which with --skip-tokenizer-init serialises routed "
                                          r"experts as \{\} \(fixed in 0\.5\.10\): R3 .* needs SGLang >= 0\.5\.10"):
        attach([old], **R3)
    assert old.generate_count == 0
    # without --skip-tokenizer-init 0.5.9's detokenizer encodes them (base64): R3 works there
    (detok,) = fake_servers(1, version="0.5.9", skip_tokenizer_init=False)
    (rollout,) = attach([detok], **R3).generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert rollout.routed_experts.shape == (5, 2, 2)
    # and plain rollouts from 0.5.9 are fine
    (plain,) = attach([old]).generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert plain.routed_experts is None


def test_servers_without_the_flags_a_config_needs_are_refused(fake_servers, attach):
    (no_routes,) = fake_servers(1, return_routed_experts=False)
    with pytest.raises(SGLangError, match="runs without --enable-return-routed-experts"):
        attach([no_routes], **R3)
    (no_saver,) = fake_servers(1, memory_saver=False)
    with pytest.raises(SGLangError, match="runs without --enable-memory-saver"):
        attach([no_saver], colocated=True, weight_sync="shm")
    (random_sampling,) = fake_servers(1, deterministic_inference=False)
    with pytest.raises(SGLangError, match="runs without --enable-deterministic-inference"):
        attach([random_sampling], deterministic_inference=True)


def test_untested_release_is_named_in_a_warning(fake_servers, attach, caplog):
    (server,) = fake_servers(1, version="0.5.22")
    with caplog.at_level(logging.WARNING):
        engine = attach([server])
    assert "runs SGLang 0.5.22; this engine is tested against 0.5.9, 0.5.23" in caplog.text
    assert engine.server_info[server.url].weight_update_session


def test_seeds_are_only_reproducible_with_deterministic_inference(fake_servers, attach, caplog):
    """Issue 16 item 6: SGLang uses sampling_seed only under --enable-deterministic-inference."""
    sampling = SamplingParams(max_new_tokens=6, n=2, seed=7)
    (seeded,) = fake_servers(1)  # started with --enable-deterministic-inference
    engine = attach([seeded], deterministic_inference=True)
    assert engine.seeds_honoured
    first = [r.response_ids for r in engine.generate([[1, 2, 3]], sampling)]
    assert first == [r.response_ids for r in engine.generate([[1, 2, 3]], sampling)]

    (unseeded,) = fake_servers(1, deterministic_inference=False)
    engine = attach([unseeded])
    assert not engine.seeds_honoured
    with caplog.at_level(logging.WARNING):
        runs = [[r.response_ids for r in engine.generate([[1, 2, 3]], sampling)] for _ in range(3)]
    assert runs[0] != runs[1] or runs[1] != runs[2]  # the seed did not fix the samples
    assert caplog.text.count("SGLang ignores sampling_seed unless its servers run with "
                             "--enable-deterministic-inference") == 1


def test_prompt_plus_max_new_tokens_must_stay_below_the_context_length(fake_servers, attach):
    """Issue 16 item 7: SGLang refuses prompt + max_new_tokens >= context length (a 400 per sample on main)."""
    (server,) = fake_servers(1, context_length=16)
    engine = attach([server], context_length=16)
    (ok,) = engine.generate([[1] * 10], SamplingParams(max_new_tokens=5))  # 15 < 16
    assert len(ok.response_ids) == 5
    with pytest.raises(ValueError, match=r"prompt 1 has 11 tokens \+ rollout.max_new_tokens=5 = 16, not below the "
                                         r"SGLang servers' context length 16"):
        engine.generate([[1] * 10, [2] * 11], SamplingParams(max_new_tokens=5))
    assert server.generate_count == 1  # refused before anything was sent
    (other,) = fake_servers(1, context_length=8192)
    with pytest.raises(SGLangError, match="runs with --context-length 8192 but sglang.context_length=16"):
        attach([other], context_length=16)
