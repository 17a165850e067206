"""SGLangEngine.generate against fake SGLang servers: shapes, grouping, retries and failure modes."""

from __future__ import annotations

import pytest

from megatron_gspo.rollout.sglang import SGLangEngine, SGLangGenerateError, StaleWeightsError
from megatron_gspo.rollout.sglang.protocol import derive_sampling_seed
from megatron_gspo.rollout.types import RolloutEngine, SamplingParams
from tests.rollout.sglang.fake_server import fake_logprob, fake_routed_experts, fake_tokens

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
VOCAB = 97


def expected_response(prompt, seed, sampling):
    return fake_tokens(prompt, seed, sampling.max_new_tokens, list(sampling.stop_token_ids), VOCAB)


def test_happy_path_grouping_seeds_logprobs_and_finish(fake_servers, attach):
    servers = fake_servers(2)
    engine = attach(servers)
    assert isinstance(engine, RolloutEngine)
    sampling = SamplingParams(max_new_tokens=8, n=3, seed=5, stop_token_ids=tuple(range(0, VOCAB, 10)))
    rollouts = engine.generate(PROMPTS, sampling)
    assert len(rollouts) == 9
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    finishes = set()
    for i, r in enumerate(rollouts):
        p, s = divmod(i, 3)
        seed = derive_sampling_seed(5, p * 3 + s)
        assert r.prompt_ids == PROMPTS[p]
        assert r.extra["sampling_seed"] == seed
        assert r.response_ids == expected_response(PROMPTS[p], seed, sampling)
        assert r.logprobs == [fake_logprob(t) for t in r.response_ids]
        stopped = r.response_ids[-1] in sampling.stop_token_ids
        assert r.finish_reason == ("stop" if stopped else "length")
        finishes.add(r.finish_reason)
        assert r.weight_version == 0 and r.routed_experts is None
        # all samples of one prompt go to one server (its prefix cache holds the prompt)
        assert r.extra["server"] == servers[p % 2].url
    assert finishes == {"stop", "length"}
    # the n samples of a prompt differ (own seeds)
    assert len({tuple(r.response_ids) for r in rollouts[:3]}) == 3
    assert engine.generate([], sampling) == []


def test_routed_experts_over_http(fake_servers, attach):
    servers = fake_servers(1, num_layers=3, topk=2, num_experts=16)
    engine = attach(servers, return_routed_experts=True, num_experts=16, num_moe_layers=3, moe_topk=2)
    rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5))
    for r in rollouts:
        rows = len(r.prompt_ids) + len(r.response_ids) - 1
        assert r.routed_experts.shape == (rows, 3, 2)
        assert r.routed_experts.tolist() == fake_routed_experts(rows, 3, 2, 16).tolist()
    assert all(c[1]["return_routed_experts"] for c in servers[0].calls if c[0] == "/generate")


def test_concurrency_is_bounded(fake_servers, attach):
    (server,) = fake_servers(1)
    server.generate_delay_s = 0.05
    engine = attach([server], max_concurrency=3)
    assert len(engine.generate([[1, 2]] * 4, SamplingParams(max_new_tokens=2, n=3))) == 12
    assert 1 < server.max_in_flight <= 3


def test_retries_on_503_at_start_500_and_malformed_json(fake_servers, attach):
    (server,) = fake_servers(1)
    server.health_503 = 2  # starting: attach waits for /health_generate
    engine = attach([server], max_retries=3)
    assert server.health_count == 3
    server.fail_generate = {1, 2}
    server.malformed_json = 1
    rollouts = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=1))
    assert len(rollouts) == 1 and rollouts[0].extra["attempts"] == 4
    expected = expected_response([1, 2, 3], derive_sampling_seed(1, 0), SamplingParams(max_new_tokens=4))
    assert rollouts[0].response_ids == expected


def test_malformed_json_every_time_is_a_clear_error(fake_servers, attach):
    (server,) = fake_servers(1)
    engine = attach([server], max_retries=1)
    server.malformed_json = 10
    with pytest.raises(SGLangGenerateError) as info:
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    message = str(info.value)
    assert "prompt 0 sample 0: no rollout after 2 attempt(s)" in message
    assert f"SGLang server {server.url}: /generate returned malformed JSON" in message


def test_abort_is_retried_then_a_clear_error(fake_servers, attach):
    (server,) = fake_servers(1)
    engine = attach([server], max_retries=2)
    server.abort_next = 2
    (rollout,) = engine.generate([[3, 4]], SamplingParams(max_new_tokens=3))
    assert rollout.finish_reason != "abort" and rollout.extra["attempts"] == 3
    server.abort_next = 5
    with pytest.raises(SGLangGenerateError, match="aborted the request"):
        engine.generate([[3, 4]], SamplingParams(max_new_tokens=3))


def test_missing_field_is_not_retried(fake_servers, attach):
    (server,) = fake_servers(1)
    routing = dict(return_routed_experts=True, num_experts=8, num_moe_layers=2, moe_topk=2)
    engine = attach([server], max_retries=3, **routing)
    server.drop_fields = {"routed_experts"}
    with pytest.raises(SGLangGenerateError, match="lacks meta_info.routed_experts"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert server.generate_count == 1


def test_server_death_mid_batch_moves_work_to_the_other_server(fake_servers, attach):
    dying, healthy = fake_servers(2)
    dying.generate_delay_s = healthy.generate_delay_s = 0.02
    dying.die_after = 3
    engine = attach([dying, healthy], max_retries=2)
    sampling = SamplingParams(max_new_tokens=6, n=2, seed=9)
    prompts = [[i + 1, i + 2] for i in range(6)]
    rollouts = engine.generate(prompts, sampling)
    assert len(rollouts) == 12 and dying.dead
    for i, r in enumerate(rollouts):
        p, s = divmod(i, 2)
        assert r.prompt_index == p
        assert r.response_ids == expected_response(prompts[p], derive_sampling_seed(9, i), sampling)
    moved = [r for r in rollouts if r.extra["attempts"] > 1]
    assert moved and all(r.extra["server"] == healthy.url for r in moved)


def test_only_server_dies_is_a_clear_error_not_a_short_batch(fake_servers, attach):
    (server,) = fake_servers(1)
    server.generate_delay_s = 0.02
    server.die_after = 2
    engine = attach([server], max_retries=1)
    with pytest.raises(SGLangGenerateError) as info:
        engine.generate([[1, 2]] * 4, SamplingParams(max_new_tokens=2))
    assert server.url in str(info.value)


def test_timeout_retries_and_aborts_the_orphan(fake_servers, attach):
    (server,) = fake_servers(1)
    server.generate_delay_s = 0.5
    engine = attach([server], max_retries=1, request_timeout_s=0.1)
    with pytest.raises(SGLangGenerateError, match="no answer within 0.1 s"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert len(server.aborted_rids) == 2  # each timed-out request was aborted on the server


def test_failure_aborts_the_requests_still_running(fake_servers, attach):
    (server,) = fake_servers(1)
    engine = attach([server], max_retries=0)
    server.generate_delay_s = 1.0
    server.fail_generate = {1}
    # request 1 fails at once; the two others, still generating, are cancelled and aborted on the server
    with pytest.raises(SGLangGenerateError, match="HTTP 500"):
        engine.generate([[1, 2], [3, 4], [5, 6]], SamplingParams(max_new_tokens=2))
    assert len(server.aborted_rids) == 2
    assert engine._inflight == {}


def test_stale_weights_are_refused(fake_servers, attach):
    (server,) = fake_servers(1)
    engine = attach([server], max_retries=1)
    engine.weight_version = 3  # as if an update reached the engine but not this server
    server.report_version = "2"
    with pytest.raises(StaleWeightsError, match="weight_version 2, but the engine is at 3"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    server.report_version = "4"
    with pytest.raises(SGLangGenerateError, match="newer than this engine's 3"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    server.report_version = "3"
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].weight_version == 3


def test_bad_prompts_and_closed_engine(fake_servers, attach):
    engine = attach(fake_servers(1))
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty list"):
        engine.generate([[1], []], SamplingParams())
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], SamplingParams())


def test_attach_to_unreachable_server_fails_fast(fake_servers):
    from megatron_gspo.rollout.sglang import SGLangConfig

    (server,) = fake_servers(1)
    url = server.url
    server.stop()
    with pytest.raises(Exception, match="not healthy after 0.3 s"):
        SGLangEngine(SGLangConfig(mode="attach", urls=[url], startup_timeout_s=0.3))
