"""Preflight of an NCCL weight transport: the trainer and the rollout servers must load the same NCCL.

NCCL refuses a communicator whose ranks run different NCCL releases ("Mismatched NCCL version"), and each side
loads the NCCL of its own torch: the trainer's environment and the rollout engine's separate one
(`<section>.python`). SGLang 0.5.23 pins torch 2.14.1 (NCCL 2.30.7), vLLM 0.32 torch 2.13.0 (NCCL 2.29.7), so a
trainer installed with any other torch fails at the first weight sync, after the whole model was loaded on both
sides, with a message from deep inside NCCL. Before joining the group each side reports its versions -- the
trainer from its own torch, the servers' environment by running its interpreter -- and a difference is one line
naming both and the two fixes: the rollout engine's torch in the trainer environment (tools/install.sh pins it
per engine: GSPO_ROLLOUT_ENGINE), or a file transport.

Attached servers (`mode: attach`) run in an environment this process cannot run: their versions are not known,
and the check says so once (a warning) instead of guessing.
"""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass

from megatron_gspo.errors import RunFailure

logger = logging.getLogger(__name__)

PROBE = (
    "import json, torch\n"
    "try:\n"
    "    v = torch.cuda.nccl.version()\n"
    "except Exception:\n"
    "    v = None\n"
    "print(json.dumps({'torch': torch.__version__, 'nccl': v if v is None or isinstance(v, int) else list(v)}))\n"
)
"""What each side runs: its torch release and the NCCL that torch loads (None: a build without NCCL)."""


@dataclass(frozen=True)
class NcclSide:
    """One side's versions, as it reported them."""

    who: str
    """Which side: 'the trainer', 'the vllm environment (.venv-vllm/bin/python)'."""
    torch: str
    nccl: tuple[int, ...] | None
    """(major, minor, patch); None where that torch has no NCCL (a CPU build)."""

    def describe(self) -> str:
        nccl = ".".join(map(str, self.nccl)) if self.nccl else "no NCCL"
        return f"{self.who}: torch {self.torch}, NCCL {nccl}"


def _nccl_tuple(value) -> tuple[int, ...] | None:
    """torch.cuda.nccl.version() as (major, minor, patch): a tuple, or NCCL's integer code (major * 10000 +
    minor * 100 + patch since 2.9; major * 1000 + minor * 100 + patch before)."""
    if value is None:
        return None
    if isinstance(value, int):
        if value >= 10000:
            return value // 10000, value // 100 % 100, value % 100
        return value // 1000, value // 100 % 10, value % 100
    return tuple(int(x) for x in list(value)[:3])


def parse_report(who: str, text: str) -> NcclSide:
    """A side from the PROBE's output (its last line); ValueError naming `who` when it is not one."""
    lines = text.strip().splitlines()
    try:
        body = json.loads(lines[-1])
        return NcclSide(who, str(body["torch"]), _nccl_tuple(body["nccl"]))
    except (IndexError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{who} did not report its torch / NCCL versions: {text.strip()[-200:]!r}") from err


def this_side(who: str = "the trainer") -> NcclSide:
    """This process's versions (the trainer's)."""
    import torch

    try:
        nccl = _nccl_tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):  # a torch built without NCCL (CPU)
        nccl = None
    return NcclSide(who, torch.__version__, nccl)


def probe_python(python: str, who: str, timeout_s: float = 300.0) -> NcclSide:
    """The versions of the environment of interpreter `python` (it imports its torch: seconds). A failure is a
    one-line ValueError naming the interpreter."""
    try:
        done = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"{who}: could not run {python} to read its torch / NCCL versions: {err}") from err
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"{who}: {python} failed to report its torch / NCCL versions: {last}")
    return parse_report(who, done.stdout)


class NcclVersionMismatch(RunFailure):
    """The trainer and the rollout servers load different NCCL releases: their NCCL group cannot form. A RunFailure:
    the CLI prints its one line as it is (as a RuntimeError mentioning NCCL it read as a failed collective)."""


def check_same_nccl(trainer: NcclSide, servers: NcclSide, *, setting: str, file_transports: str) -> None:
    """Raises NcclVersionMismatch (one line: both sides and the fixes) when both report NCCL and it differs.
    `setting` is the transport's config key and value ('sglang.weight_sync=distributed'), `file_transports` what
    to set instead ('sglang.weight_sync=disk or shm'). A side without NCCL is not compared (the join itself then
    fails with its own error: that side cannot run NCCL at all)."""
    if trainer.nccl is None or servers.nccl is None:
        logger.warning(
            "%s: NCCL versions not compared (%s; %s)", setting, trainer.describe(), servers.describe()
        )
        return
    if trainer.nccl == servers.nccl:
        return
    raise NcclVersionMismatch(
        f"{setting} cannot work: {trainer.describe()}; {servers.describe()}; NCCL refuses a group across "
        f"releases ('Mismatched NCCL version'). Install torch {servers.torch} in the trainer environment "
        f"(tools/install.sh pins it per rollout engine: GSPO_ROLLOUT_ENGINE), or set {file_transports}"
    )


def preflight(config, *, setting: str, file_transports: str, trainer: NcclSide | None = None) -> None:
    """Before the first NCCL weight sync of the servers of `config` (a ServerConfig): compares the trainer's
    versions (`trainer`, default this process's) with those of the servers' environment (`config.python`,
    launch mode). Attached servers: a warning that they cannot be checked. A trainer without NCCL (CPU) has
    nothing to compare: the transport's own device check refuses it."""
    trainer = trainer or this_side()
    if trainer.nccl is None:
        return
    section = getattr(config, "section", "server")
    if config.mode != "launch":
        logger.warning(
            "%s with attached servers: their NCCL cannot be checked from here (%s); a 'Mismatched NCCL version' at "
            "the first sync means the servers' torch differs: install theirs, or set %s",
            setting,
            trainer.describe(),
            file_transports,
        )
        return
    servers = probe_python(config.python, f"the {section} environment ({config.python})")
    check_same_nccl(trainer, servers, setting=setting, file_transports=file_transports)
