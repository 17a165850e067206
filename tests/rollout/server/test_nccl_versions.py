"""The NCCL preflight of the weight transports (issue 25, item 2): each side reports its torch / NCCL versions
before the group forms, and a difference is one line naming both and the fixes.

The rollout environment is stood in for by small interpreters (shell scripts printing what the probe of torch
2.14.1 / NCCL 2.30.7 -- SGLang 0.5.23's pin -- or of a CPU torch prints, or failing); the trainer side by
NcclSide values (this machine's torch has no NCCL). The real probe runs once against this environment's own
interpreter."""

import logging
import sys
from types import SimpleNamespace

import pytest

from megatron_gspo.rollout.server import nccl_versions
from megatron_gspo.rollout.server.nccl_versions import NcclSide, NcclVersionMismatch

TRAINER_VLLM_PIN = NcclSide("the trainer", "2.13.0", (2, 29, 7))
TRAINER_SGLANG_PIN = NcclSide("the trainer", "2.14.1", (2, 30, 7))
SGLANG = dict(setting="sglang.weight_sync=distributed", file_transports="sglang.weight_sync=disk (or shm)")


def _stand_in(tmp_path, output: str, code: int = 0, name: str = "python") -> str:
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\necho '{output}'\nexit {code}\n")
    script.chmod(0o755)
    return str(script)


def _config(python: str, mode: str = "launch"):
    return SimpleNamespace(section="sglang", mode=mode, python=python)


def test_mismatched_nccl_is_one_line_naming_both_and_the_fixes(tmp_path):
    python = _stand_in(tmp_path, '{"torch": "2.14.1+cu129", "nccl": [2, 30, 7]}')
    with pytest.raises(NcclVersionMismatch) as err:
        nccl_versions.preflight(_config(python), trainer=TRAINER_VLLM_PIN, **SGLANG)
    message = str(err.value)
    assert "\n" not in message
    for part in (
        "the trainer: torch 2.13.0, NCCL 2.29.7",
        f"the sglang environment ({python}): torch 2.14.1+cu129, NCCL 2.30.7",
        "Install torch 2.14.1+cu129 in the trainer environment",
        "GSPO_ROLLOUT_ENGINE",
        "sglang.weight_sync=disk (or shm)",
        "sglang.weight_sync=distributed cannot work",
    ):
        assert part in message, (part, message)


def test_the_same_nccl_passes_and_the_integer_code_is_read(tmp_path):
    nccl_versions.preflight(
        _config(_stand_in(tmp_path, '{"torch": "2.14.1", "nccl": [2, 30, 7]}')),
        trainer=TRAINER_SGLANG_PIN,
        **SGLANG,
    )
    # Older torch reported NCCL's integer code (major * 10000 + minor * 100 + patch).
    nccl_versions.preflight(
        _config(_stand_in(tmp_path, '{"torch": "2.14.1", "nccl": 23007}', name="py2")),
        trainer=TRAINER_SGLANG_PIN,
        **SGLANG,
    )
    with pytest.raises(NcclVersionMismatch, match="NCCL 2.30.8"):
        nccl_versions.preflight(
            _config(_stand_in(tmp_path, '{"torch": "2.14.1", "nccl": 23008}', name="py3")),
            trainer=TRAINER_SGLANG_PIN,
            **SGLANG,
        )


def test_a_side_without_nccl_is_not_compared(tmp_path, caplog):
    python = _stand_in(tmp_path, '{"torch": "2.14.1+cpu", "nccl": null}')
    with caplog.at_level(logging.WARNING):
        nccl_versions.preflight(_config(python), trainer=TRAINER_SGLANG_PIN, **SGLANG)
    assert "not compared" in caplog.text and "no NCCL" in caplog.text
    # A trainer without NCCL (a CPU run) does not even start the probe: its interpreter may not exist.
    nccl_versions.preflight(
        _config(str(tmp_path / "missing")), trainer=NcclSide("the trainer", "2.13.0", None), **SGLANG
    )


def test_attached_servers_get_a_warning_not_a_guess(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        nccl_versions.preflight(
            _config(str(tmp_path / "missing"), mode="attach"), trainer=TRAINER_VLLM_PIN, **SGLANG
        )
    assert "cannot be checked" in caplog.text and "NCCL 2.29.7" in caplog.text


@pytest.mark.parametrize(
    "output, code, expected",
    [
        ("Traceback ...\\nModuleNotFoundError: No module named torch", 1, "failed to report"),
        ("no json here", 0, "did not report"),
    ],
)
def test_an_environment_that_cannot_report_is_a_one_line_error(tmp_path, output, code, expected):
    python = _stand_in(tmp_path, output, code)
    with pytest.raises(ValueError, match=expected) as err:
        nccl_versions.preflight(_config(python), trainer=TRAINER_VLLM_PIN, **SGLANG)
    assert "\n" not in str(err.value) and python in str(err.value)
    with pytest.raises(ValueError, match="could not run"):
        nccl_versions.probe_python(str(tmp_path / "missing"), "the vllm environment")


def test_the_probe_runs_in_a_real_interpreter():
    side = nccl_versions.probe_python(sys.executable, "this environment")
    here = nccl_versions.this_side("this environment")
    assert side == here and side.torch.startswith("2.")


def test_the_cli_prints_a_mismatch_as_it_is_not_as_a_failed_collective(capsys):
    # As a RuntimeError whose text mentions NCCL, the CLI called it "a collective failed ... another rank failed".
    from megatron_gspo.cli.main import run_command

    def command(args):
        raise NcclVersionMismatch("sglang.weight_sync=distributed cannot work: NCCL 2.29.7 vs NCCL 2.30.7")

    assert run_command(command, None) == 1
    err = capsys.readouterr().err
    assert err == "megatron-gspo: error: sglang.weight_sync=distributed cannot work: NCCL 2.29.7 vs NCCL 2.30.7\n"
