"""The SGLang releases this engine is written and tested against, and the protocol changes between them.

Standard library only: setup.py (the `rollout` extras) and tools/sglang_conformance_env.sh (the conformance test's
environment) read these pins from this file, so the versions installed, tested and documented are one list.

Read in SGLang's own source (sglang/srt/...), per release:
- /begin_weight_update and /end_weight_update exist from 0.5.21 on, and from 0.5.21 on
  /update_weights_from_distributed outside such a session answers 400 without joining the broadcast
  (managers/scheduler_components/weight_updater.py); 0.5.20 has neither.
- With --skip-tokenizer-init (which this engine always uses: token ids in and out), 0.5.9 puts the routed-experts
  tensor itself into meta_info and FastAPI serialises it as `{}`; from 0.5.10 on the tokenizer manager sends it
  base64-encoded (int32) on that path too.
- /server_info (GET) returns the server arguments and `version` in every release listed here.
- 0.5.23 tags every output token with the weight version that sampled it (`meta_info.weight_versions` spans,
  srt/utils/weight_versions.py; `weight_version` is then the newest span's); 0.5.9 reports one version per
  sample. Releases in between were not read: partial rollouts are used from 0.5.23 on.
"""

from __future__ import annotations

TESTED_SGLANG = ("0.5.9", "0.5.23")
"""Releases the conformance test (tests/rollout/sglang/test_conformance.py) checks our requests against."""
SGLANG_DEFAULT = "0.5.23"
"""What `pip install megatron-gspo[rollout]` installs (torch 2.14 / CUDA 13 wheels)."""
SGLANG_CUDA12 = "0.5.9"
"""What `pip install megatron-gspo[rollout-cu12]` installs (torch 2.9.1 / CUDA 12.8 wheels; no R3, see below)."""
SGLANG_ROUTER = "0.3.2"
"""sglang-router release the router command line and its request forwarding are tested against."""

WEIGHT_UPDATE_SESSION_FROM = (0, 5, 21)
"""First release whose weight updates must run between /begin_weight_update and /end_weight_update."""
PER_TOKEN_VERSIONS_FROM = (0, 5, 23)
"""First release read here that reports per-token weight versions (what partial rollouts need)."""
ROUTED_EXPERTS_BASE64_FROM = (0, 5, 10)
"""First release that returns routed experts (base64) to a server started with --skip-tokenizer-init."""


def parse_version(text: str) -> tuple[int, ...]:
    """'0.5.23' -> (0, 5, 23); pre-release / local suffixes ('0.5.10rc1', '0.5.9+cu128') are dropped."""
    parts: list[int] = []
    for piece in str(text).strip().split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ValueError(f"{text!r} is not an SGLang version")
    return tuple(parts)


def needs_weight_update_session(version: tuple[int, ...]) -> bool:
    """Whether weight updates must be wrapped in /begin_weight_update ... /end_weight_update."""
    return version >= WEIGHT_UPDATE_SESSION_FROM


def returns_routed_experts(version: tuple[int, ...]) -> bool:
    """Whether a --skip-tokenizer-init server returns routed experts we can decode (R3)."""
    return version >= ROUTED_EXPERTS_BASE64_FROM
