"""vLLM servers that cannot start or cannot be reached, through `megatron-gspo train` and the real launcher: a
wrong `vllm.python` is one line naming the key, before anything starts; a server that exits while starting is
one line naming its log; attaching to a URL nobody answers says at once what it waits for, reports progress and
fails in one line at `vllm.startup_timeout_s`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.distributed import free_port
from tests.rollout.vllm.test_end_to_end import MINI, ROOT, SERVER, VLLM_PYTHON
from tests.training.test_end_to_end import _env

TRAIN = [
    sys.executable,
    "-m",
    "megatron_gspo.cli.main",
    "train",
    "--config",
    "examples/tiny_moe_gspo.yaml",
    *MINI,
    *SERVER,
    "trainer.steps=1",
    "rollout.engine=vllm",
]


def _run(tmp_path, *overrides):
    return subprocess.run(
        [*TRAIN, f"trainer.run_dir={tmp_path / 'run'}", *overrides],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _last_line(res, code: int) -> str:
    assert res.returncode == code, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-gspo: error: "), last
    return last


def test_a_wrong_vllm_python_is_one_line_naming_the_key(tmp_path):
    line = _last_line(_run(tmp_path, "vllm.python=/nonexistent/bin/python"), 2)
    assert "vllm.python='/nonexistent/bin/python' is not an executable file" in line


@pytest.mark.skipif(
    not VLLM_PYTHON.exists() and not os.environ.get("CI"),
    reason="no .venv-vllm: run `make rollout-env` (make test builds it; in CI this test never skips)",
)
def test_a_server_that_exits_while_starting_is_one_line_naming_its_log(tmp_path):
    """The real vLLM CPU server refuses an unknown option and exits."""
    res = _run(
        tmp_path,
        f"vllm.port_base={free_port()}",
        f"vllm.log_dir={tmp_path / 'logs'}",
        "vllm.extra_server_args=[--no-such-option]",
    )
    line = _last_line(res, 1)
    assert "vLLM server 0" in line and "did not start" in line and "exited with code" in line, line
    assert str(tmp_path / "logs" / "vllm_server_0.log") in line
    assert "--no-such-option" in (tmp_path / "logs" / "vllm_server_0.log").read_text()


def test_attaching_to_an_unreachable_server_reports_what_it_waits_for_and_fails_in_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    res = _run(
        tmp_path,
        "vllm.mode=attach",
        f"vllm.urls=[{url}]",
        "vllm.model_path=unused",
        "vllm.startup_timeout_s=6",
    )
    line = _last_line(res, 1)
    assert f"{url} not healthy after 6 s" in line, line
    lines = res.stderr.splitlines()
    (announce,) = [x for x in lines if "waiting up to 6 s for" in x]
    assert url in announce and "/health" in announce
    progress = [x for x in lines if "still waiting for" in x]
    assert progress and all(url in x and "of 6 s" in x for x in progress), res.stderr[-3000:]
