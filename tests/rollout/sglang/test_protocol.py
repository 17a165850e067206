"""Request building and response decoding against hand-recorded SGLang response bodies (no server)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from megatron_gspo.rollout.sglang.protocol import (
    RoutingSpec,
    SGLangResponseError,
    build_generate_payload,
    decode_generate_response,
    decode_routed_experts,
    parse_json_body,
    parse_weight_version,
)
from megatron_gspo.rollout.types import SamplingParams

URL = "http://10.0.0.7:30000"

# Routing of a 3-token prompt + 2-token response: 4 positions x 2 layers x 2 experts (int32, little-endian).
ROUTING_TLK = [
    [[0, 5], [7, 1]],
    [[3, 3], [6, 2]],
    [[4, 0], [1, 7]],
    [[2, 6], [5, 4]],
]
ROUTING_B64 = base64.b64encode(np.array(ROUTING_TLK, dtype="<i4").tobytes()).decode()

# A /generate answer as SGLang 0.5.x writes it with --skip-tokenizer-init (recorded by hand).
RECORDED = f"""{{
  "text": "",
  "output_ids": [42, 2],
  "meta_info": {{
    "id": "run-1-0-0-0",
    "finish_reason": {{"type": "stop", "matched": 2}},
    "prompt_tokens": 3,
    "weight_version": "4",
    "completion_tokens": 2,
    "cached_tokens": 0,
    "e2e_latency": 0.031,
    "output_token_logprobs": [[-0.25, 42, null], [-1.5, 2, null]],
    "routed_experts": "{ROUTING_B64}"
  }}
}}"""

SPEC = RoutingSpec(num_layers=2, topk=2, num_experts=8)


def recorded() -> dict:
    return json.loads(RECORDED)


def test_decode_recorded_response():
    rollout = decode_generate_response(
        recorded(), url=URL, prompt_ids=[5, 6, 7], prompt_index=3, routing=SPEC
    )
    assert rollout.prompt_ids == [5, 6, 7]
    assert rollout.response_ids == [42, 2]
    assert rollout.logprobs == [-0.25, -1.5]
    assert rollout.finish_reason == "stop"
    assert rollout.prompt_index == 3
    assert rollout.weight_version == 4
    assert rollout.extra["server"] == URL
    assert rollout.routed_experts.dtype == torch.uint8
    assert rollout.routed_experts.shape == (4, 2, 2)
    assert rollout.token_versions is None  # 0.5.9: one version per sample
    assert rollout.routed_experts.tolist() == ROUTING_TLK


def test_per_token_version_spans_are_checked():
    body = recorded()
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    body["meta_info"]["weight_versions"] = spans
    rollout = decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7])
    assert rollout.token_versions == [3, 4] and rollout.weight_version == 3  # weight_version "4": the newest
    spans[1]["start"] = 2
    with pytest.raises(SGLangResponseError, match="weight_versions=.* leaves a gap or overlap at token 1"):
        decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7])


def test_routed_experts_int16_for_many_experts_and_range_check():
    big = RoutingSpec(num_layers=1, topk=2, num_experts=300)
    encoded = base64.b64encode(np.array([[[299, 0]], [[17, 256]]], dtype="<i4").tobytes()).decode()
    experts = decode_routed_experts(encoded, 2, big)
    assert experts.dtype == torch.int16 and experts.tolist() == [[[299, 0]], [[17, 256]]]
    with pytest.raises(SGLangResponseError, match="expert id 299, outside \\[0, num_experts=200\\)"):
        decode_routed_experts(encoded, 2, RoutingSpec(num_layers=1, topk=2, num_experts=200))


def test_routed_experts_wrong_length_names_the_shape():
    with pytest.raises(SGLangResponseError, match="expected 5 tokens") as info:
        decode_routed_experts(ROUTING_B64, 5, SPEC, URL)
    assert URL in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SGLangResponseError, match="not valid base64"):
        decode_routed_experts("@@@", 1, SPEC, URL)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda b: b.pop("meta_info"), "meta_info"),
        (lambda b: b["meta_info"].pop("finish_reason"), "meta_info.finish_reason"),
        (lambda b: b["meta_info"].pop("output_token_logprobs"), "meta_info.output_token_logprobs"),
        (lambda b: b["meta_info"].pop("routed_experts"), "meta_info.routed_experts"),
    ],
)
def test_missing_field_is_a_one_line_error_naming_url_and_field(mutate, field):
    body = recorded()
    mutate(body)
    with pytest.raises(SGLangResponseError) as info:
        decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7], routing=SPEC)
    message = str(info.value)
    assert URL in message and f"lacks {field}" in message and "\n" not in message
    assert not info.value.retryable


def test_bad_entries_are_rejected():
    body = recorded()
    body["meta_info"]["output_token_logprobs"][1] = [None, 2, None]
    with pytest.raises(SGLangResponseError, match=r"output_token_logprobs\[1\] has log-prob None"):
        decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7])
    body = recorded()
    body["meta_info"]["finish_reason"] = {"type": "exploded"}
    with pytest.raises(SGLangResponseError, match="unknown type"):
        decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7])
    body = recorded()
    body["output_ids"] = [41, 2]
    with pytest.raises(SGLangResponseError, match="output_ids disagree"):
        decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7])


def test_length_and_abort_finish_reasons():
    body = recorded()
    body["meta_info"]["finish_reason"] = {"type": "length", "length": 2}
    assert decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7]).finish_reason == "length"
    # An aborted sample is never trained on: its routing is not required (nor decoded).
    body["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue"}
    del body["meta_info"]["routed_experts"]
    rollout = decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7], routing=SPEC)
    assert rollout.finish_reason == "abort" and rollout.routed_experts is None


def test_malformed_json_is_retryable_one_line_error():
    with pytest.raises(SGLangResponseError, match="/generate returned malformed JSON") as info:
        parse_json_body(b'{"text": "", "output_ids": [1, 2', URL, "/generate")
    assert info.value.retryable and URL in str(info.value) and "\n" not in str(info.value)


def test_weight_version_parsing():
    assert parse_weight_version("default", URL) == 0
    assert parse_weight_version(None, URL) == 0
    assert parse_weight_version("12", URL) == 12
    assert parse_weight_version(7, URL) == 7
    with pytest.raises(SGLangResponseError, match="weight_version='v1'"):
        parse_weight_version("v1", URL)


def test_generate_payload_shape():
    sampling = SamplingParams(
        max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(2, 3), n=4
    )
    payload = build_generate_payload(
        [1, 2, 3], sampling, rid="r", sampling_seed=11, return_routed_experts=True
    )
    assert payload == {
        "rid": "r",
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 16,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "stop_token_ids": [2, 3],
            "sampling_seed": 11,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
        "return_routed_experts": True,
    }
    plain = build_generate_payload([1], SamplingParams(top_k=5), rid="q")
    assert "sampling_seed" not in plain["sampling_params"] and "return_routed_experts" not in plain
    assert plain["sampling_params"]["top_k"] == 5


def test_routed_experts_of_sglang_0_5_9_name_the_release():
    """0.5.9 with --skip-tokenizer-init sends the routes as {} (issue 16 item 3); the error says why and what fixes it."""
    body = recorded()
    body["meta_info"]["routed_experts"] = {}
    with pytest.raises(SGLangResponseError, match=r"routed_experts is a JSON object.*SGLang 0\.5\.9.*>= 0\.5\.10"):
        decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7], routing=SPEC)
    del body["meta_info"]["routed_experts"]
    with pytest.raises(SGLangResponseError, match="lacks meta_info.routed_experts .*router that dropped"):
        decode_generate_response(body, url=URL, prompt_ids=[5, 6, 7], routing=SPEC)
