"""SGLang's native HTTP API (0.5.x): the `/generate` bodies we send and the response bodies we decode.

Pure functions, no I/O: everything here is tested against recorded response bodies.
Legend: P = prompt tokens, R = response tokens, L = MoE layers, K = experts per token (top-k).

Response shape (REFERENCE.md §4)::

    {"output_ids": [...], "meta_info": {
        "finish_reason": {"type": "stop" | "length" | "abort", ...},
        "output_token_logprobs": [[logprob, token_id, text | null], ...],   # one per response token
        "routed_experts": "<base64 of int32 [P + R - 1, L, K]>",              # with return_routed_experts
        "weight_version": "3",                                                # a string; "default" at start
        "weight_versions": [{"version": "2", "start": 0, "end": k},          # SGLang >= 0.5.23: per-token
                            {"version": "3", "start": k, "end": R}]}}        # spans (weight_version: the last)
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np
import torch

from megatron_gspo.rollout.server.errors import ServerResponseError
from megatron_gspo.rollout.server.errors import parse_json_body as parse_server_json
from megatron_gspo.rollout.server.seeds import derive_sampling_seed
from megatron_gspo.rollout.server.weight_versions import expand_version_spans
from megatron_gspo.rollout.types import Rollout, RoutingSpec, SamplingParams, compact_expert_dtype

__all__ = [
    "KIND",
    "RoutingSpec",
    "SGLangResponseError",
    "build_generate_payload",
    "decode_generate_response",
    "decode_routed_experts",
    "derive_sampling_seed",
    "parse_json_body",
    "parse_weight_version",
]

KIND = "SGLang"


class SGLangResponseError(ServerResponseError):
    """A 2xx SGLang response whose body does not have the documented shape."""

    def __init__(self, url: str, problem: str, *, retryable: bool = False):
        super().__init__(url, problem, retryable=retryable, kind=KIND)


def build_generate_payload(
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    rid: str,
    sampling_seed: int | None = None,
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    """JSON body of one `/generate` request: one sample of one prompt, token ids in and out."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang disables top-k with -1
        "stop_token_ids": list(sampling.stop_token_ids),
    }
    if sampling_seed is not None:
        params["sampling_seed"] = int(sampling_seed)
    payload: dict[str, Any] = {
        "rid": rid,
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,  # log-probs of the output tokens only
        "stream": False,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def parse_json_body(raw: bytes, url: str, path: str) -> Any:
    """Decodes a response body; malformed JSON is a (retryable) one-line error naming the SGLang server."""
    try:
        return parse_server_json(raw, url, path)
    except ServerResponseError as e:
        raise SGLangResponseError(url, e.problem, retryable=True) from None


def parse_weight_version(value: Any, url: str) -> int:
    """SGLang reports the weight version as a string; 'default' (never updated) is version 0."""
    if value is None or value == "default":
        return 0
    if isinstance(value, bool):
        raise SGLangResponseError(url, f"meta_info.weight_version={value!r} is not an integer version")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise SGLangResponseError(
            url, f"meta_info.weight_version={value!r} is not an integer (this engine sets it to the step)"
        ) from None


def decode_weight_versions(meta: dict, url: str, num_tokens: int) -> list[int]:
    """The weight version of each response token. SGLang >= 0.5.23 reports per-token spans
    (`meta_info.weight_versions`, srt/utils/weight_versions.py) and `weight_version` = the newest span's, so a
    sample generated across an update is as old as its oldest span, not its `weight_version`; older releases
    report one version for the whole sample."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [parse_weight_version(meta.get("weight_version"), url)] * num_tokens
    try:
        return expand_version_spans(spans, num_tokens, lambda v: parse_weight_version(v, url))
    except ValueError as e:
        raise SGLangResponseError(url, f"meta_info.weight_versions{e}") from None


def decode_routed_experts(
    encoded: Any, num_tokens: int, spec: RoutingSpec, url: str = "<recorded response>"
) -> torch.Tensor:
    """base64 int32 [num_tokens, L, K] -> compact tensor (uint8 / int16), with the ids range-checked."""
    if isinstance(encoded, dict):
        raise SGLangResponseError(
            url,
            "meta_info.routed_experts is a JSON object, not base64: SGLang 0.5.9 with --skip-tokenizer-init "
            "serialises the tensor as {} (fixed in 0.5.10); R3 needs SGLang >= 0.5.10",
        )
    if not isinstance(encoded, str):
        kind = type(encoded).__name__
        raise SGLangResponseError(url, f"meta_info.routed_experts is {kind}, expected a base64 string")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise SGLangResponseError(url, f"meta_info.routed_experts is not valid base64 ({e})") from None
    per_token = spec.num_layers * spec.topk
    expected = num_tokens * per_token * 4
    if len(raw) != expected:
        got = f"{len(raw) / (per_token * 4):g}" if per_token else "?"
        raise SGLangResponseError(
            url,
            f"meta_info.routed_experts has {len(raw)} bytes = {got} tokens x {spec.num_layers} layers x "
            f"{spec.topk} experts of int32, expected {num_tokens} tokens (prompt + response - 1)",
        )
    ids_TLK = np.frombuffer(raw, dtype="<i4").reshape(num_tokens, spec.num_layers, spec.topk)
    if ids_TLK.size:
        low, high = int(ids_TLK.min()), int(ids_TLK.max())
        if low < 0 or high >= spec.num_experts:
            bad = low if low < 0 else high
            raise SGLangResponseError(
                url,
                f"meta_info.routed_experts holds expert id {bad}, "
                f"outside [0, num_experts={spec.num_experts})",
            )
    dtype = compact_expert_dtype(spec.num_experts)
    np_dtype = np.uint8 if dtype == torch.uint8 else np.int16
    return torch.from_numpy(ids_TLK.astype(np_dtype))


def _field(mapping: Any, key: str, where: str, url: str) -> Any:
    if not isinstance(mapping, dict):
        raise SGLangResponseError(url, f"{where} is {type(mapping).__name__}, expected a JSON object")
    if key not in mapping:
        missing = f"{where}.{key}" if where != "body" else key
        raise SGLangResponseError(url, f"response lacks {missing}")
    return mapping[key]


def decode_finish_reason(meta: dict, url: str) -> str:
    """meta_info.finish_reason {type: stop|length|abort, ...} -> Rollout.finish_reason."""
    reason = _field(meta, "finish_reason", "meta_info", url)
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    raise SGLangResponseError(url, f"meta_info.finish_reason={reason!r}: unknown type (stop/length/abort)")


def decode_output_logprobs(meta: dict, url: str) -> tuple[list[int], list[float]]:
    """meta_info.output_token_logprobs [[logprob, token_id, text|null], ...] -> (token ids, log-probs)."""
    entries = _field(meta, "output_token_logprobs", "meta_info", url)
    if not isinstance(entries, list):
        kind = type(entries).__name__
        raise SGLangResponseError(url, f"meta_info.output_token_logprobs is {kind}, expected a list")
    ids: list[int] = []
    logprobs: list[float] = []
    for i, entry in enumerate(entries):
        where = f"meta_info.output_token_logprobs[{i}]"
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise SGLangResponseError(url, f"{where}={entry!r} is not [logprob, token_id, ...]")
        lp, tok = entry[0], entry[1]
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or math.isnan(lp):
            raise SGLangResponseError(url, f"{where} has log-prob {lp!r}, expected a number")
        if type(tok) is not int or tok < 0:
            raise SGLangResponseError(url, f"{where} has token id {tok!r}")
        ids.append(tok)
        logprobs.append(float(lp))
    return ids, logprobs


def decode_generate_response(
    body: Any,
    *,
    url: str,
    prompt_ids: list[int],
    prompt_index: int = 0,
    routing: RoutingSpec | None = None,
) -> Rollout:
    """One `/generate` response body -> Rollout (token ids from output_token_logprobs, aligned with them).

    Routed experts are required when `routing` is given, except for aborted samples (never trained on).
    """
    meta = _field(body, "meta_info", "body", url)
    if not isinstance(meta, dict):
        raise SGLangResponseError(url, f"meta_info is {type(meta).__name__}, expected a JSON object")
    finish = decode_finish_reason(meta, url)
    response_ids, logprobs = decode_output_logprobs(meta, url)
    output_ids = body.get("output_ids")
    if output_ids is not None and (
        not isinstance(output_ids, list) or output_ids[: len(response_ids)] != response_ids[: len(output_ids)]
    ):
        raise SGLangResponseError(url, "output_ids disagree with meta_info.output_token_logprobs")
    versions = decode_weight_versions(meta, url, len(response_ids))
    experts = None
    if routing is not None and finish != "abort":
        if "routed_experts" not in meta:
            raise SGLangResponseError(
                url,
                "response lacks meta_info.routed_experts (a server started without --enable-return-routed-experts, "
                "or a router that dropped return_routed_experts from the request)",
            )
        encoded = meta["routed_experts"]
        experts = decode_routed_experts(encoded, len(prompt_ids) + len(response_ids) - 1, routing, url)
    return Rollout(
        prompt_ids=[int(t) for t in prompt_ids],
        response_ids=response_ids,
        logprobs=logprobs,
        finish_reason=finish,
        prompt_index=prompt_index,
        routed_experts=experts,
        weight_version=min(versions, default=parse_weight_version(meta.get("weight_version"), url)),
        token_versions=versions if len(set(versions)) > 1 else None,
        extra={"server": url, "rid": meta.get("id"), "abort_reason": meta.get("finish_reason")},
    )
