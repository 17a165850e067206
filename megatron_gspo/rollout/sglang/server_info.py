"""What a running SGLang server is: its release and the flags it was started with (`GET /server_info`).

The engine reads it once per server (leader rank) and decides from it, instead of assuming: which weight-update
protocol the server speaks, whether R3 can work, whether request seeds mean anything, the context length. A
configuration the servers cannot serve is refused here, at start, with the server and the fix named.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_gspo.rollout.server.errors import ServerError, server_label
from megatron_gspo.rollout.sglang.versions import (
    ROUTED_EXPERTS_BASE64_FROM,
    SGLANG_DEFAULT,
    TESTED_SGLANG,
    needs_weight_update_session,
    parse_version,
    returns_routed_experts,
)

logger = logging.getLogger(__name__)

KIND = "SGLang"


@dataclass(frozen=True)
class ServerInfo:
    """The fields of one server's `/server_info` this engine acts on (SGLang's ServerArgs names)."""

    url: str
    version: str
    """SGLang release (`version`)."""
    deterministic_inference: bool = False
    """`enable_deterministic_inference`: only then does the server use `sampling_seed`."""
    skip_tokenizer_init: bool = False
    """`skip_tokenizer_init` (token ids in and out)."""
    return_routed_experts: bool = False
    """`enable_return_routed_experts`."""
    memory_saver: bool = False
    """`enable_memory_saver` (release / resume of GPU memory frees something)."""
    context_length: int | None = None
    """`context_length` when set on the command line (None: derived from the model's config.json)."""

    @property
    def release(self) -> tuple[int, ...]:
        """The version as a tuple, (0, 5, 23)."""
        return parse_version(self.version)

    @property
    def weight_update_session(self) -> bool:
        """Weight updates go between /begin_weight_update and /end_weight_update (SGLang >= 0.5.21)."""
        return needs_weight_update_session(self.release)

    @classmethod
    def from_json(cls, url: str, body: Any) -> ServerInfo:
        """From the decoded `/server_info` answer; a body without a version is a one-line error."""
        if not isinstance(body, dict) or not isinstance(body.get("version"), str):
            raise ServerError(
                f"{server_label(KIND, url)}/server_info has no 'version': not an SGLang server of a supported release "
                f"({', '.join(TESTED_SGLANG)})"
            )
        try:
            parse_version(body["version"])
        except ValueError:
            raise ServerError(f"{server_label(KIND, url)}/server_info reports version {body['version']!r}") from None
        context = body.get("context_length")
        return cls(
            url=url,
            version=body["version"],
            deterministic_inference=bool(body.get("enable_deterministic_inference", False)),
            skip_tokenizer_init=bool(body.get("skip_tokenizer_init", False)),
            return_routed_experts=bool(body.get("enable_return_routed_experts", False)),
            memory_saver=bool(body.get("enable_memory_saver", False)),
            context_length=context if isinstance(context, int) and not isinstance(context, bool) else None,
        )


def check_server(info: ServerInfo, cfg: Any) -> None:
    """Refuses (ServerError naming the server and the fix) what this server cannot do for `cfg` (SGLangConfig)."""
    where = server_label(KIND, info.url)
    if info.version not in TESTED_SGLANG:
        logger.warning(
            "%s runs SGLang %s; this engine is tested against %s (the protocol is chosen by version, see "
            "rollout/sglang/versions.py)", where, info.version, ", ".join(TESTED_SGLANG)
        )
    if cfg.return_routed_experts:
        if not info.return_routed_experts:
            raise ServerError(
                f"{where} runs without --enable-return-routed-experts, which sglang.return_routed_experts=true (R3) "
                "needs: restart it with the flag"
            )
        if info.skip_tokenizer_init and not returns_routed_experts(info.release):
            first = ".".join(map(str, ROUTED_EXPERTS_BASE64_FROM))
            raise ServerError(
                f"{where} runs SGLang {info.version}, which with --skip-tokenizer-init serialises routed experts as {{}} "
                f"(fixed in {first}): R3 (sglang.return_routed_experts=true) needs SGLang >= {first}, e.g. "
                f"{SGLANG_DEFAULT} (pip install 'megatron-gspo[rollout]')"
            )
    if cfg.deterministic_inference and not info.deterministic_inference:
        raise ServerError(
            f"{where} runs without --enable-deterministic-inference, which sglang.deterministic_inference=true "
            "requires (without it SGLang ignores sampling_seed): restart it with the flag"
        )
    if info.context_length is not None and cfg.context_length is not None and info.context_length != cfg.context_length:
        raise ServerError(
            f"{where} runs with --context-length {info.context_length} but sglang.context_length="
            f"{cfg.context_length} (the trainer fills in the model's max_position_embeddings): set "
            f"sglang.context_length={info.context_length}"
        )
    if cfg.colocated and not info.memory_saver:
        raise ServerError(
            f"{where} runs without --enable-memory-saver, so sglang.colocated=true could not free its GPU memory "
            "for training: restart it with the flag"
        )
