"""Multi-turn trajectories for the SGLang conformance test (test_conformance.py): a first pass through the fake
server (SGLang's server needs CUDA; the fake's answers only decide which tokens SGLang's own code is asked to
return) gives every turn's /generate body; the harness validates them and builds SGLang's answers to them; a
second pass generates the trajectories again from those answers (`CannedSGLang`)."""

from __future__ import annotations

from aiohttp import web

from megatron_gspo.data import CharTokenizer, PromptItem
from megatron_gspo.rollout.multiturn import MultiTurnConfig, MultiTurnRollouts
from megatron_gspo.rollout.sglang import SGLangConfig, SGLangEngine
from megatron_gspo.rollout.types import SamplingParams
from tests.rollout.multiturn.test_driver import ALPHABET, EchoEnv
from tests.rollout.sglang.fake_server import FakeSGLang, fake_logprob, fake_tokens

VERSION = "0.5.23"
"""The release whose R3 routes are usable (0.5.9's are not: test_conformance.py)."""
ROUTES = dict(num_experts=8, num_moe_layers=3, moe_topk=2)


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


def trajectories(server_cls, canned=None):
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


def turn_of(payload, out: list[int], rollouts) -> tuple[int, int]:
    """(trajectory, model turn) whose prefix the request's input ids are and whose turn is its answer `out` (two
    samples of a prompt share their first turn's input ids)."""
    ids = payload["input_ids"]
    for i, r in enumerate(rollouts):
        full = r.prompt_ids + r.response_ids
        for k, start in enumerate(r.extra["turn_starts"]):
            if len(r.prompt_ids) + start == len(ids) and full[: len(ids) + len(out)] == ids + out:
                return i, k
    raise AssertionError(f"request {ids} answered {out} continues no trajectory")


def key(payload) -> tuple:
    return tuple(payload["input_ids"]), payload["sampling_params"].get("sampling_seed")


def first_pass() -> dict:
    """The fake's trajectories, every turn's /generate body and the answers SGLang is asked to build for them (the
    same tokens; each turn's route record with its own values, `offset`, so a row taken from the wrong turn
    shows)."""
    first, requests = trajectories(FakeSGLang)
    responses = []
    for payload in requests:
        params = payload["sampling_params"]
        out = fake_tokens(payload["input_ids"], params.get("sampling_seed"), params["max_new_tokens"],
                          list(params.get("stop_token_ids") or []), 17)
        _, turn = turn_of(payload, out, first)
        routes = dict(num_tokens=len(payload["input_ids"]) + len(out) - 1, layers=3, topk=2, experts=8,
                      offset=1 + turn)
        finish = "stop" if out[-1] in params.get("stop_token_ids", []) else "length"
        responses.append(dict(payload=payload, output_ids=out, logprobs=[fake_logprob(t) for t in out],
                              finish=finish, routes=routes))
    return {"first": first, "requests": requests, "responses": responses}
