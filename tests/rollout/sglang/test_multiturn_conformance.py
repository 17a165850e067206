"""Multi-turn trajectories through SGLang's own code (0.5.23, the release with usable R3 routes): every turn's
/generate body is validated by SGLang's handler type and tokenizer-manager normalisation, and the trajectories are
generated a second time from the answers SGLang's tokenizer manager builds for those very requests
(sglang_harness.py), so the driver's token-in/token-out and per-turn route stitching run on what a real SGLang
server returns. The first pass needs a server that answers at all: the fake (SGLang's server needs CUDA); its
answers only decide which tokens the harness is asked to return."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from megatron_gspo.data import CharTokenizer, PromptItem
from megatron_gspo.rollout.multiturn import MultiTurnConfig, MultiTurnRollouts
from megatron_gspo.rollout.sglang import SGLangConfig, SGLangEngine
from megatron_gspo.rollout.types import SamplingParams
from tests.rollout.multiturn.test_driver import ALPHABET, EchoEnv
from tests.rollout.sglang.fake_server import FakeSGLang, fake_logprob, fake_tokens
from tests.rollout.sglang.test_conformance import ROUTES, pytestmark, run_harness, write_model  # noqa: F401

VERSION = "0.5.23"


class CannedSGLang(FakeSGLang):
    """The fake, answering each /generate with the body SGLang built for the same request (keyed by its input
    ids and seed); the other endpoints as the fake does."""

    canned: dict = {}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body, _, failure = await self._admit(request)
        if failure is not None:
            return failure
        key = (tuple(body["input_ids"]), body["sampling_params"].get("sampling_seed"))
        return web.json_response(self.canned[key])


def _trajectories(server_cls, canned=None):
    """Trajectories of 2 prompts x 2 samples, up to 3 turns (Echo's observation '77=' between them), generated
    through an SGLangEngine attached to one server of `server_cls`; with the /generate bodies it received."""
    tok = CharTokenizer(ALPHABET)
    server = server_cls(version=VERSION, vocab_size=17, num_layers=3, num_experts=8)
    if canned is not None:
        server.canned = canned
    server.start()
    try:
        engine = SGLangEngine(SGLangConfig(mode="attach", urls=[server.url], backoff_s=0.01, max_retries=1,
                                           request_timeout_s=20, return_routed_experts=True, **ROUTES,
                                           deterministic_inference=True))
        items = [PromptItem("12*34=", "408"), PromptItem("05+07=", "12")]
        driver = MultiTurnRollouts(engine, tok, EchoEnv, MultiTurnConfig(env="echo", max_turns=3,
                                                                           max_total_tokens=24))
        rollouts = driver.generate(items, [tok.encode(it.prompt) for it in items],
                                   SamplingParams(max_new_tokens=4, temperature=1.0, n=2, seed=11))
        engine.close()
    finally:
        server.stop()
    return rollouts, [payload for path, payload in server.calls if path == "/generate"]


def _turn_of(payload, out: list[int], rollouts) -> tuple[int, int]:
    """(trajectory, model turn) whose prefix the request's input ids are and whose turn is its answer `out` (two
    samples of a prompt share their first turn's input ids)."""
    ids = payload["input_ids"]
    for i, r in enumerate(rollouts):
        full = r.prompt_ids + r.response_ids
        for k, start in enumerate(r.extra["turn_starts"]):
            if len(r.prompt_ids) + start == len(ids) and full[: len(ids) + len(out)] == ids + out:
                return i, k
    raise AssertionError(f"request {ids} answered {out} continues no trajectory")


def _key(payload) -> tuple:
    return tuple(payload["input_ids"]), payload["sampling_params"].get("sampling_seed")


def test_multi_turn_through_sglangs_own_requests_and_answers(tmp_path):
    first, requests = _trajectories(FakeSGLang)
    assert any(r.extra["turns"] > 1 for r in first), "no multi-turn trajectory: change the seed"
    responses = []
    for payload in requests:
        params = payload["sampling_params"]
        out = fake_tokens(payload["input_ids"], params.get("sampling_seed"), params["max_new_tokens"],
                          list(params.get("stop_token_ids") or []), 17)
        _, turn = _turn_of(payload, out, first)
        # Each turn's record gets its own values (offset), so a row taken from the wrong turn shows.
        routes = dict(num_tokens=len(payload["input_ids"]) + len(out) - 1, layers=3, topk=2, experts=8,
                      offset=1 + turn)
        finish = "stop" if out[-1] in params.get("stop_token_ids", []) else "length"
        responses.append(dict(payload=payload, output_ids=out, logprobs=[fake_logprob(t) for t in out],
                              finish=finish, routes=routes))
    proc = run_harness(VERSION, dict(model_path=str(write_model(tmp_path / "model")),
                                     requests=[["/generate", p] for p in requests], responses=responses), tmp_path)
    assert proc.wait(timeout=600) == 0, (tmp_path / f"harness-{VERSION}.log").read_text()[-3000:]
    report = json.loads((tmp_path / f"out-{VERSION}.json").read_text())
    # Every turn's body is what SGLang's /generate handler accepts, no key dropped.
    assert [(v["ok"], v.get("ignored_keys") or []) for v in report["requests"]] == [(True, [])] * len(requests)
    answers = report["responses"]
    assert all(a["ok"] for a in answers), [a.get("trace") for a in answers if not a["ok"]]
    canned = {_key(p): a["body"] for p, a in zip(requests, answers)}
    routes_of = {_key(p): a["routes"] for p, a in zip(requests, answers)}

    second, sent = _trajectories(CannedSGLang, canned)
    assert len(sent) == len(requests)
    for r1, r2 in zip(first, second):
        # The same trajectories from SGLang's own answers: ids, log-probs, masks, turns.
        assert (r2.response_ids, r2.logprobs, r2.loss_mask) == (r1.response_ids, r1.logprobs, r1.loss_mask)
        assert r2.extra["turn_starts"] == r1.extra["turn_starts"]
    # Token in, token out: each turn's request is exactly the ids of everything before it (no re-tokenisation),
    # and SGLang's answer to it is the turn's tokens in the trajectory.
    turns: dict[int, list] = {}
    for payload in sent:
        i, k = _turn_of(payload, canned[_key(payload)]["output_ids"], second)
        turns.setdefault(i, []).append((k, payload))
    for i, r in enumerate(second):
        assert sorted(k for k, _ in turns[i]) == list(range(r.extra["turns"]))
    stitched = 0
    for i, r in enumerate(second):
        rows = r.routed_experts.tolist()
        assert len(rows) == len(r.prompt_ids) + len(r.response_ids) - 1
        for (start, end, _), (_, payload) in zip(r.extra["route_turns"], sorted(turns[i], key=lambda t: t[0]),
                                                strict=True):
            record = routes_of[_key(payload)]
            # Per turn: the rows from the previous turn's end come from this turn's own record, the prefix not.
            assert rows[start:end] == record[start:end]
            if start:
                assert record[:start] != rows[:start]
                stitched += 1
    assert stitched > 0
