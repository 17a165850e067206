"""LocalEngine on the tiny Qwen3-MoE (HF random weights): KV cache vs full recompute, engine log-probs vs the
training model's teacher-forced log-probs, stops / lengths / grouping / seeds, routed experts, and the hf backend
(single process and TP=2 + sequence parallel on 2 gloo ranks) against the megatron backend.

Everything that needs megatron runs in spawned processes (megatron's parallel state is process-global); each
rank function returns plain data and the tests assert on it.
"""

import pytest
import torch

from megatron_gspo.rollout.types import RolloutEngine, SamplingParams, compact_expert_dtype
from tests.distributed import run_distributed
from tests.models.parity import hf_state_dict, tiny_config

MAX_NEW = 6
TEMPERATURE = 0.8
STOPS = tuple(range(0, 32, 6))


def _prompts():
    g = torch.Generator().manual_seed(11)
    short = torch.randint(2, 32, (3, 6), generator=g).tolist()
    long = torch.randint(2, 32, (2, 9), generator=g).tolist()
    return [short[0], long[0], short[1], short[2], long[1]]  # mixed lengths, interleaved


def _as_data(rollouts):
    return [
        dict(
            prompt_ids=r.prompt_ids,
            response_ids=r.response_ids,
            logprobs=torch.tensor(r.logprobs, dtype=torch.float64),
            finish_reason=r.finish_reason,
            prompt_index=r.prompt_index,
            routed_experts=r.routed_experts,
            weight_version=r.weight_version,
        )
        for r in rollouts
    ]


def _build(layout: dict, ddp: bool = False):
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize
    from megatron_gspo.training.engine import build_ddp_model, unwrap

    cfg = tiny_config()
    parallel = ParallelConfig(**layout)
    initialize(parallel, seed=5)
    chunks = build_ddp_model(cfg, parallel) if ddp else build_model(cfg, parallel)
    load_hf_state_dict([unwrap(c) for c in chunks], hf_state_dict(cfg))
    return cfg, chunks


def _full_logits(model, ids):
    """Logits of every position, no KV cache (the reference path)."""
    ids_t = torch.tensor([ids])
    pos = torch.arange(len(ids)).unsqueeze(0)
    return model(ids_t, pos, None)[0, :, : tiny_config().vocab_size]


def _teacher_forced(model, rollout, topk):
    """Log-probs of the response (temperature-scaled) and the routers' top-k ids (probability order) from one
    plain forward of prompt + response[:-1], without any inference context."""
    routers = [layer.mlp.router for layer in model.decoder.layers]
    captured = []

    def hook(module, args, output):
        captured.append(output[0].topk(topk, dim=-1).indices)  # probs: zero outside the routed set

    hooks = [r.register_forward_hook(hook) for r in routers]
    try:
        ids = rollout.prompt_ids + rollout.response_ids[:-1]
        logits = _full_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    start = len(rollout.prompt_ids) - 1
    logp = torch.log_softmax(logits[start:].double() / TEMPERATURE, -1)
    targets = torch.tensor(rollout.response_ids)
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)
    experts = torch.stack(captured, dim=1)  # [tokens, layers, topk], probability order
    return token_logp, experts


def _single_process():
    from megatron_gspo.parallel import shutdown
    from megatron_gspo.rollout.local import LocalEngine

    cfg, chunks = _build({})
    model = chunks[0]
    out: dict = {}
    try:
        prompts = _prompts()
        engine = LocalEngine(chunks, cfg, max_batch_size=64, pad_id=0)
        out["backend"] = engine.backend
        out["is_engine"] = isinstance(engine, RolloutEngine)

        # (b) greedy with the KV cache vs a full forward over the whole prefix every step
        model.train()
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
        out["training_restored"] = model.training
        out["hooks_left"] = sum(len(layer.mlp.router._forward_hooks) for layer in model.decoder.layers)
        model.eval()
        reference = []
        with torch.no_grad():
            for p in prompts:
                ids, logps = list(p), []
                for _ in range(MAX_NEW):
                    logits = _full_logits(model, ids)[-1]
                    tok = int(logits.argmax())
                    logps.append(float(torch.log_softmax(logits, -1)[tok]))
                    ids.append(tok)
                logps_t = torch.tensor(logps, dtype=torch.float64)
                reference.append(dict(response_ids=ids[len(p) :], logprobs=logps_t))
        out["greedy"], out["greedy_reference"] = _as_data(greedy), reference

        # (c, e) sampled rollouts vs teacher-forced log-probs and routing of the training model
        sampling = SamplingParams(
            max_new_tokens=MAX_NEW, temperature=TEMPERATURE, top_p=0.95, n=3, seed=3, stop_token_ids=(3, 4, 5)
        )
        state = torch.get_rng_state()
        sampled = engine.generate(prompts, sampling)
        out["global_rng_untouched"] = torch.equal(state, torch.get_rng_state())
        out["sampled"] = _as_data(sampled)
        with torch.no_grad():
            forced = [_teacher_forced(model, r, cfg.num_experts_per_tok) for r in sampled]
        out["forced_logprobs"] = [f[0] for f in forced]
        out["forced_experts"] = [f[1] for f in forced]

        # (d) stops, lengths, grouping, seeds, batch splitting
        many_stops = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=4, seed=1, stop_token_ids=STOPS)
        out["stops"] = _as_data(engine.generate(prompts, many_stops))
        out["same_seed"] = _as_data(engine.generate(prompts, many_stops))
        other_seed = SamplingParams(**{**many_stops.__dict__, "seed": 2})
        out["other_seed"] = _as_data(engine.generate(prompts, other_seed))
        unseeded = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=4)
        out["unseeded"] = [_as_data(engine.generate(prompts, unseeded)) for _ in range(2)]
        one = SamplingParams(max_new_tokens=1, temperature=1.0, n=2, seed=0)
        out["one_token"] = _as_data(engine.generate(prompts, one))
        small = LocalEngine(chunks, cfg, max_batch_size=2, pad_id=0)
        out["greedy_small_batches"] = _as_data(
            small.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, n=3))
        )
        greedy_n3 = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, n=3)
        out["greedy_n3"] = _as_data(engine.generate(prompts, greedy_n3))

        # (f) hf backend in the same process, before and after a weight update
        hf = LocalEngine(chunks, cfg, max_batch_size=64, pad_id=0, backend="hf")
        out["hf_backend"] = hf.backend
        out["hf_greedy"] = _as_data(hf.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)))
        out["hf_sampled"] = _as_data(hf.generate(prompts, sampling))  # same seed: same draws as "sampled"
        with torch.no_grad():
            for layer in model.decoder.layers:
                layer.mlp.router.weight.mul_(-1.0)  # flips every routing decision
            model.output_layer.weight.mul_(-1.0)
        engine.update_weights(chunks, 3)
        hf.update_weights(chunks, 3)
        greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
        out["updated_megatron"] = _as_data(engine.generate(prompts, greedy))
        out["updated_hf"] = _as_data(hf.generate(prompts, greedy))
        hf.close()
        hf.close()

        # (g) the engine in bf16 beside the fp32 trainer (rollout.local.dtype): an hf replica of rounded weights
        bf16 = LocalEngine(chunks, cfg, max_batch_size=64, pad_id=0, dtype=torch.bfloat16)
        out["bf16_backend"] = bf16.backend
        gate, router = bf16._replica.model.model.layers[0].mlp.gate.weight, model.decoder.layers[0].mlp.router.weight
        out["bf16_replica_dtype"] = str(gate.dtype)
        out["bf16_weights_rounded"] = torch.equal(gate, router.detach().to(torch.bfloat16))
        out["trainer_dtype_kept"] = str(router.dtype)
        bf16_sampled = bf16.generate(prompts, sampling)
        out["bf16_sampled"] = _as_data(bf16_sampled)
        with torch.no_grad():
            out["bf16_forced_logprobs"] = [_teacher_forced(model, r, cfg.num_experts_per_tok)[0] for r in bf16_sampled]
        bf16.close()
        try:
            LocalEngine(chunks, cfg, backend="megatron", dtype=torch.bfloat16)
            out["megatron_bf16"] = "accepted"
        except ValueError as err:
            out["megatron_bf16"] = str(err)
        engine.close()
        try:
            engine.generate(prompts, greedy)
            out["generate_after_close"] = "returned"
        except RuntimeError:
            out["generate_after_close"] = "raised"
        return out
    finally:
        shutdown()


def _tensor_parallel_hf():
    from megatron_gspo.parallel import shutdown
    from megatron_gspo.rollout.local import LocalEngine

    cfg, chunks = _build(dict(tp=2, sequence_parallel=True), ddp=True)
    try:
        try:
            LocalEngine(chunks, cfg, backend="megatron")
            forced_megatron = "accepted"
        except ValueError as err:
            forced_megatron = str(err)
        engine = LocalEngine(chunks, cfg, pad_id=0)
        rollouts = engine.generate(_prompts(), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
        return dict(backend=engine.backend, greedy=_as_data(rollouts), forced_megatron=forced_megatron)
    finally:
        shutdown()


@pytest.fixture(scope="module")
def single():
    return run_distributed(_single_process, world_size=1)[0]


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_tensor_parallel_hf, world_size=2)


def _assert_same(a, b, atol=1e-4, experts=True):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["prompt_index"] == y["prompt_index"]
        assert x["response_ids"] == y["response_ids"]
        torch.testing.assert_close(x["logprobs"], y["logprobs"], atol=atol, rtol=0)
        if experts:
            assert torch.equal(x["routed_experts"], y["routed_experts"])


def test_engine_protocol_and_backend(single):
    assert single["is_engine"]
    assert single["backend"] == "megatron"
    assert single["hf_backend"] == "hf"


def test_kv_cache_matches_full_recompute(single):
    for got, ref in zip(single["greedy"], single["greedy_reference"], strict=True):
        assert got["response_ids"] == ref["response_ids"]
        torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
        assert got["finish_reason"] == "length"
    # the prompts are not all alike: the check covers varied continuations
    assert len({tuple(g["response_ids"]) for g in single["greedy"]}) > 1


def test_engine_logprobs_equal_teacher_forced_logprobs(single):
    sampled = single["sampled"]
    # some rows stop early while others go on: rows leave the KV cache mid-batch
    assert {s["finish_reason"] for s in sampled} == {"stop", "length"}
    for s, forced in zip(sampled, single["forced_logprobs"], strict=True):
        torch.testing.assert_close(s["logprobs"], forced, atol=1e-4, rtol=0)


def test_routed_experts_match_a_teacher_forced_forward(single):
    cfg = tiny_config()
    for s, forced in zip(single["sampled"], single["forced_experts"], strict=True):
        rows = len(s["prompt_ids"]) + len(s["response_ids"]) - 1
        e = s["routed_experts"]
        assert e.dtype == compact_expert_dtype(cfg.num_experts)
        assert tuple(e.shape) == (rows, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert torch.equal(e.long(), forced), "routed experts differ from a plain forward (ids or order)"


def test_stop_tokens_end_responses_and_finish_reasons(single):
    stops = set(STOPS)
    reasons = {r["finish_reason"] for r in single["stops"]}
    assert reasons == {"stop", "length"}
    for r in single["stops"]:
        resp = r["response_ids"]
        assert 1 <= len(resp) <= MAX_NEW
        assert not stops & set(resp[:-1]), "generation continued after a stop token"
        if r["finish_reason"] == "stop":
            assert resp[-1] in stops
        else:
            assert len(resp) == MAX_NEW and resp[-1] not in stops
        assert len(r["logprobs"]) == len(resp)
        assert r["routed_experts"].shape[0] == len(r["prompt_ids"]) + len(resp) - 1
    for r in single["one_token"]:
        assert len(r["response_ids"]) == 1 and r["routed_experts"].shape[0] == len(r["prompt_ids"])


def test_samples_are_grouped_per_prompt(single):
    prompts = _prompts()
    for key, n in (("stops", 4), ("sampled", 3), ("one_token", 2), ("greedy_small_batches", 3)):
        rollouts = single[key]
        assert [r["prompt_index"] for r in rollouts] == [i for i in range(len(prompts)) for _ in range(n)], key
        assert all(r["prompt_ids"] == prompts[r["prompt_index"]] for r in rollouts)
        assert all(r["weight_version"] == 0 for r in rollouts)
    # the n samples of a prompt are drawn independently
    first = single["stops"][:4]
    assert len({tuple(r["response_ids"]) for r in first}) > 1


def test_seeds_make_generation_reproducible(single):
    _assert_same(single["same_seed"], single["stops"], atol=0)
    assert [r["response_ids"] for r in single["other_seed"]] != [r["response_ids"] for r in single["stops"]]
    a, b = single["unseeded"]
    assert [r["response_ids"] for r in a] != [r["response_ids"] for r in b], "unseeded calls repeat themselves"
    assert single["global_rng_untouched"]


def test_batch_splitting_does_not_change_greedy_results(single):
    _assert_same(single["greedy_small_batches"], single["greedy_n3"])
    # n samples share one prefill whose KV rows are copied: each greedy copy equals the n = 1 result
    expected = [g for g in single["greedy"] for _ in range(3)]
    _assert_same(single["greedy_n3"], expected)


def test_model_state_is_restored(single):
    assert single["training_restored"]
    assert single["hooks_left"] == 0
    assert single["generate_after_close"] == "raised"


def test_hf_backend_matches_megatron_backend(single):
    _assert_same(single["hf_greedy"], single["greedy"])
    # n samples per prompt, top-p, stop tokens, rows leaving the cache: identical results for one seed
    _assert_same(single["hf_sampled"], single["sampled"])
    assert [r["finish_reason"] for r in single["hf_sampled"]] == [r["finish_reason"] for r in single["sampled"]]


def test_update_weights_reaches_both_backends(single):
    before = [r["response_ids"] for r in single["greedy"]]
    after = [r["response_ids"] for r in single["updated_megatron"]]
    assert after != before, "the weight change did not change the megatron backend's output"
    _assert_same(single["updated_hf"], single["updated_megatron"])
    assert all(r["weight_version"] == 3 for r in single["updated_hf"] + single["updated_megatron"])


def test_bf16_engine_samples_from_rounded_weights_beside_the_fp32_trainer(single):
    """rollout.local.dtype=bf16: the replica holds the trainer's weights rounded to bf16 (the trainer's stay fp32),
    and its log-probs of its own samples differ from the fp32 trainer's teacher-forced ones by bf16 rounding:
    nonzero (the engine is no longer the trainer) and far below a token's log-prob."""
    assert single["bf16_backend"] == "hf"
    assert single["bf16_replica_dtype"] == "torch.bfloat16" and single["trainer_dtype_kept"] == "torch.float32"
    assert single["bf16_weights_rounded"]
    diffs = torch.cat([r["logprobs"] - f for r, f in zip(single["bf16_sampled"], single["bf16_forced_logprobs"])])
    assert diffs.abs().max() > 1e-5, "the bf16 engine's log-probs equal the fp32 trainer's"
    assert diffs.abs().max() < 0.2
    assert "rollout.local.backend=hf" in single["megatron_bf16"]


def test_tensor_parallel_hf_backend_matches_single_process_megatron(tp2, single):
    for rank_result in tp2:
        assert rank_result["backend"] == "hf"
        _assert_same(rank_result["greedy"], single["greedy"])
        assert "tp=2" in rank_result["forced_megatron"], "backend='megatron' must refuse a split model"


@pytest.mark.parametrize("kwargs", [dict(backend="vllm"), dict(max_batch_size=0)])
def test_bad_engine_arguments_are_rejected(kwargs):
    from megatron_gspo.rollout.local import LocalEngine

    with pytest.raises(ValueError, match="rollout\\."):
        LocalEngine([], tiny_config(), **kwargs)
