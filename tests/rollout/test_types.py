"""Rollout's per-token weight versions (partial rollouts): validation and the routed-row versions."""

from __future__ import annotations

import pytest

from megatron_gspo.rollout.types import Rollout


def _rollout(**fields) -> Rollout:
    base = dict(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], logprobs=[-1.0] * 4, finish_reason="length")
    return Rollout(**{**base, **fields})


def test_token_versions_spell_out_a_sample_across_updates():
    r = _rollout(weight_version=2, token_versions=[2, 2, 3, 3])
    assert r.versions == [2, 2, 3, 3]
    # rows 0, 1: prompt tokens 1, 2 (first forward, with token 0); row 2 (prompt token 3) sampled token 0; ...
    assert r.route_versions == [2, 2, 2, 2, 3, 3]
    assert len(r.route_versions) == len(r.prompt_ids) + len(r.response_ids) - 1  # one per routed row
    uniform = _rollout(weight_version=5)
    assert uniform.versions == [5] * 4 and uniform.route_versions == [5] * 6
    assert _rollout(response_ids=[], logprobs=[], token_versions=[]).route_versions == []


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(weight_version=2, token_versions=[2, 3]), "4 response tokens but 2 token versions"),
        (dict(weight_version=3, token_versions=[2, 2, 3, 3]), "weight_version=3 is not its oldest token's version 2"),
    ],
)
def test_inconsistent_versions_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        _rollout(**fields)
