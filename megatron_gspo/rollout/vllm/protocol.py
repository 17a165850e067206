"""vLLM's token-in / token-out API (0.32, `/inference/v1/generate`, server flag `--enable-scale-out`): the bodies we
send and the response bodies we decode. Pure functions, no I/O (tested against recorded bodies).

Legend: P = prompt tokens, R = response tokens, L = MoE layers, K = experts per token (top-k).

Response shape (one choice per request; read in vllm/entrypoints/scale_out/token_in_token_out/protocol.py)::

    {"request_id": "generate-tokens-<ours>", "choices": [{
        "finish_reason": "stop" | "length" | "abort", "stop_reason": <token id> | null,
        "token_ids": [...],                                                     # R response tokens
        "logprobs": {"content": [{"token_id": t, "logprob": x, ...}, ...]},      # one per response token
        "routed_experts": "<base64 of .npy [P + R - 1, L, K]>" | null,          # --enable-return-routed-experts
        "weight_versions": [{"version": "3", "start": 0, "end": k}, {"version": "4", "start": k, "end": R}]}]}
                                             # per-token versions as spans ("default" before any update)
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any

import numpy as np
import torch

from megatron_gspo.rollout.server.errors import ServerResponseError
from megatron_gspo.rollout.server.weight_versions import expand_version_spans
from megatron_gspo.rollout.types import Rollout, RoutingSpec, SamplingParams, compact_expert_dtype

KIND = "vLLM"
REQUEST_ID_PREFIX = "generate-tokens-"
"""vLLM's prefix of the ids of /inference/v1/generate requests (what /abort_requests needs)."""


def _error(url: str, problem: str) -> ServerResponseError:
    return ServerResponseError(url, problem, kind=KIND)


def build_generate_request(
    prompt_ids: list[int], sampling: SamplingParams, *, rid: str, seed: int | None
) -> dict[str, Any]:
    """JSON body of one request: one sample of one prompt, token ids in and out, the sampled token's log-prob."""
    params: dict[str, Any] = {
        "n": 1,
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # vLLM: 0 disables
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }
    if seed is not None:
        params["seed"] = int(seed)
    return {"request_id": rid, "token_ids": [int(t) for t in prompt_ids], "sampling_params": params}


def parse_weight_version(value: Any, url: str) -> int:
    """vLLM labels weights with a string; 'default' (never updated) is version 0."""
    if value is None or value == "default":
        return 0
    try:
        return int(str(value).strip())
    except ValueError:
        raise _error(
            url, f"weight version {value!r} is not an integer (this engine sets it to the step)"
        ) from None


def decode_weight_versions(spans: Any, url: str, num_tokens: int) -> list[int]:
    """The weight version of each of the choice's `num_tokens` response tokens, from vLLM's spans (the engine
    core labels every step's output with the version it ran under, v1/engine/core.py `_attach_weight_version`;
    the output processor opens a span where the label changes)."""
    if spans is None:
        raise _error(url, "response lacks choices[0].weight_versions (a vLLM older than 0.32?)")
    try:
        return expand_version_spans(spans, num_tokens, lambda v: parse_weight_version(v, url))
    except ValueError as e:
        raise _error(url, f"choices[0].weight_versions{e}") from None


def decode_routed_experts(
    encoded: Any,
    num_tokens: int,
    spec: RoutingSpec,
    url: str,
    *,
    where: str = "choices[0].routed_experts",
) -> torch.Tensor:
    """base64 .npy [num_tokens, L, K] -> compact tensor (uint8 / int16), with the ids range-checked. Any other
    row count is an error: routes one token off would replay the wrong experts for every later token."""
    if not isinstance(encoded, str):
        raise _error(
            url,
            f"{where} is {type(encoded).__name__}: start the server with "
            "--enable-return-routed-experts (vLLM's GPU model runner; on CPU use vllm.capture_routes)",
        )
    try:
        ids_TLK = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as e:
        raise _error(url, f"{where} is not base64 .npy ({e})") from None
    expected = (num_tokens, spec.num_layers, spec.topk)
    if tuple(ids_TLK.shape) != expected:
        raise _error(
            url,
            f"{where} has shape {tuple(ids_TLK.shape)}, expected {expected} "
            "(prompt + response - 1 tokens, layers, top-k)",
        )
    if ids_TLK.size and (int(ids_TLK.min()) < 0 or int(ids_TLK.max()) >= spec.num_experts):
        first = int(((ids_TLK < 0) | (ids_TLK >= spec.num_experts)).any(axis=(1, 2)).nonzero()[0][0])
        raise _error(
            url,
            f"{where} holds expert ids outside [0, num_experts={spec.num_experts}) from token {first} "
            "(-1: a position the gate hooks never saw forwarded, e.g. with prefix caching on)",
        )
    np_dtype = np.uint8 if compact_expert_dtype(spec.num_experts) == torch.uint8 else np.int16
    return torch.from_numpy(ids_TLK.astype(np_dtype))


def decode_generate_response(
    body: Any, *, url: str, prompt_ids: list[int], prompt_index: int = 0, routing: RoutingSpec | None = None
) -> Rollout:
    """One /inference/v1/generate body -> Rollout (token ids and their log-probs, aligned and checked)."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or len(body["choices"]) != 1:
        raise _error(url, "response lacks choices (exactly one per request)")
    choice = body["choices"][0]
    if not isinstance(choice, dict):
        raise _error(url, f"choices[0] is {type(choice).__name__}, expected a JSON object")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length", "abort"):
        raise _error(url, f"choices[0].finish_reason={finish!r}: unknown (stop/length/abort)")
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise _error(url, f"choices[0].token_ids={tokens!r} is not a list of token ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list) or len(content) != len(tokens):
        got = len(content) if isinstance(content, list) else type(content).__name__
        raise _error(
            url,
            f"choices[0].logprobs.content has {got} entries for {len(tokens)} tokens "
            "(send sampling_params.logprobs=0)",
        )
    logprobs: list[float] = []
    for i, (token, entry) in enumerate(zip(tokens, content)):
        lp = entry.get("logprob") if isinstance(entry, dict) else None
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or math.isnan(lp):
            raise _error(url, f"choices[0].logprobs.content[{i}] has log-prob {lp!r}, expected a number")
        if entry.get("token_id") != token:
            raise _error(
                url,
                f"choices[0].logprobs.content[{i}] is for token {entry.get('token_id')!r}, "
                f"not the sampled {token}",
            )
        logprobs.append(float(lp))
    versions = []
    if finish != "abort":
        versions = decode_weight_versions(choice.get("weight_versions"), url, len(tokens))
    experts = None
    if routing is not None and finish != "abort":
        experts = decode_routed_experts(
            choice.get("routed_experts"), len(prompt_ids) + len(tokens) - 1, routing, url
        )
    return Rollout(
        prompt_ids=[int(t) for t in prompt_ids],
        response_ids=list(tokens),
        logprobs=logprobs,
        finish_reason=finish,
        prompt_index=prompt_index,
        routed_experts=experts,
        weight_version=min(versions, default=0),
        token_versions=versions if len(set(versions)) > 1 else None,
        extra={"server": url, "abort_reason": choice.get("stop_reason")},
    )


def decode_prompt_logprobs(body: Any, token_ids: list[int], url: str) -> list[float]:
    """`prompt_logprobs` of a response ([None, {token_id: {logprob, ...}}, ...], JSON keys are strings) -> the
    log-probs of token_ids[1:]."""
    entries = body.get("prompt_logprobs") if isinstance(body, dict) else None
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        raise _error(
            url,
            f"prompt_logprobs has {len(entries) if isinstance(entries, list) else entries!r} "
            f"entries for {len(token_ids)} prompt tokens (send sampling_params.prompt_logprobs=0)",
        )
    out = []
    for i, (token, entry) in enumerate(zip(token_ids[1:], entries[1:]), start=1):
        item = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
            raise _error(url, f"prompt_logprobs[{i}] lacks token {token}: {entry!r}")
        out.append(float(item["logprob"]))
    return out
