"""What setup.py installs: the `gpu` extra's transformer-engine range is megatron-core's own (0.16.1 declares the
TE releases it supports in its `dev` extra); outside it megatron's TE extension breaks at import or at build."""

from __future__ import annotations

import runpy
from importlib.metadata import requires
from pathlib import Path

import setuptools
from packaging.requirements import Requirement

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def _setup_kwargs(monkeypatch) -> dict:
    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(SETUP.parent)
    runpy.run_path(str(SETUP), run_name="__main__")
    return captured


def _transformer_engine(reqs) -> Requirement:
    found = [r for r in map(Requirement, reqs) if r.name == "transformer-engine"]
    assert len(found) == 1, found
    return found[0]


def test_gpu_extra_pins_transformer_engine_to_megatron_cores_range(monkeypatch):
    ours = _transformer_engine(_setup_kwargs(monkeypatch)["extras_require"]["gpu"])
    megatron = _transformer_engine(r for r in requires("megatron-core") if "transformer-engine" in r)
    assert ours.specifier == megatron.specifier and str(ours.specifier)  # e.g. <2.12.0,>=2.9.0a0
    assert "pytorch" in ours.extras


def test_rollout_extras_pin_the_sglang_releases_the_conformance_test_checks(monkeypatch):
    """Issue 16 item 9: unpinned, `pip install megatron-gspo[rollout]` gets whatever SGLang is newest."""
    from megatron_gspo.rollout.sglang.versions import SGLANG_ROUTER, TESTED_SGLANG

    extras = _setup_kwargs(monkeypatch)["extras_require"]
    pinned = {}
    for extra in ("rollout", "rollout-cu12", "gpu"):
        for req in map(Requirement, extras[extra]):
            if req.name.startswith("sglang"):
                (spec,) = req.specifier
                assert spec.operator == "==", f"{extra}: {req} is not pinned"
                pinned.setdefault(req.name, set()).add(spec.version)
    assert pinned["sglang"] == set(TESTED_SGLANG)
    assert pinned["sglang-router"] == {SGLANG_ROUTER}
    assert [str(r) for r in map(Requirement, extras["rollout"])] == ["sglang==0.5.23", "sglang-router==0.3.2"]


# ------------------------------------------------------------------ tools/install.sh on a GPU host (stand-ins)

import importlib.util  # noqa: E402
import sys  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

ROOT = SETUP.parent
# Stands in for the venv's python on a GPU host: a real GPU install (CUDA torch, transformer-engine built against
# it) needs a GPU and several GB of downloads, neither here; the script's pins, order and one-line failures are
# what is tested, against the commands it records.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$FAKE_LOG"
case "$1" in
  -c) if [ -n "$FAKE_TORCH" ]; then echo "$FAKE_TORCH"; exit 0; fi; exit 1 ;;
  tools/gpu_env_check.py) echo "gpu env: FAIL te: stand-in"; exit "${FAKE_CHECK_RC:-0}" ;;
esac
exit 0
"""


def _install(tmp_path, **env):
    """tools/install.sh against a stand-in virtual environment whose python logs what it is asked to run (pip
    installs, the torch probe answering FAKE_TORCH, the GPU check exiting FAKE_CHECK_RC)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    run_env = {**os.environ, "GSPO_VENV": str(venv), "FAKE_LOG": str(log), **env}
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "install.sh")], env=run_env, capture_output=True, text=True, timeout=60
    )
    return done, log.read_text().splitlines(), (venv / ".installed").exists()


@pytest.mark.parametrize("engine, torch_pin", [("sglang", "2.14.1"), ("vllm", "2.13.0")])
def test_gpu_install_pins_the_rollout_engines_torch_installs_te_and_checks(tmp_path, engine, torch_pin):
    done, calls, installed = _install(tmp_path, GSPO_DEVICE="gpu", GSPO_ROLLOUT_ENGINE=engine, FAKE_TORCH="")
    assert done.returncode == 0, done.stderr
    assert f"-m pip install -q torch=={torch_pin}" in calls
    assert "-m pip install -q -e .[test]" in calls
    assert (
        "-m pip install -q --no-build-isolation -e .[gpu]" in calls
    )  # TE, in megatron-core's range (setup.py)
    assert calls[-1] == "tools/gpu_env_check.py" and installed


def test_gpu_install_keeps_the_pinned_cuda_torch_and_replaces_a_cpu_or_other_one(tmp_path):
    _, calls, _ = _install(tmp_path, GSPO_DEVICE="gpu", FAKE_TORCH="2.14.1 13.0")
    assert not any("torch==" in c for c in calls)
    for have in ("2.14.1 cpu", "2.13.0 12.8"):
        _, calls, _ = _install(tmp_path, GSPO_DEVICE="gpu", FAKE_TORCH=have)
        assert "-m pip install -q torch==2.14.1" in calls, have


def test_a_failing_gpu_check_fails_the_install(tmp_path):
    done, _, installed = _install(tmp_path, GSPO_DEVICE="gpu", FAKE_CHECK_RC="1")
    assert done.returncode != 0 and not installed
    assert "gpu env: FAIL te: stand-in" in done.stdout


def test_cpu_install_is_unchanged(tmp_path):
    done, calls, installed = _install(tmp_path, GSPO_DEVICE="cpu", FAKE_TORCH="")
    assert done.returncode == 0 and installed
    assert "-m pip install -q torch==2.13.0" in calls and not any("gpu" in c for c in calls)


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(GSPO_ROLLOUT_ENGINE="trt"), "GSPO_ROLLOUT_ENGINE=trt must be"),
        (dict(GSPO_DEVICE="tpu"), "GSPO_DEVICE=tpu must be gpu or cpu"),
    ],
)
def test_bad_install_settings_are_one_line(tmp_path, env, message):
    done, calls, installed = _install(tmp_path, **env)
    assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1 and not installed
    assert calls == []


# ------------------------------------------------------------------ tools/gpu_env_check.py (stand-ins)


def _env_check():
    spec = importlib.util.spec_from_file_location("gpu_env_check", ROOT / "tools" / "gpu_env_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _importer(versions: dict):
    """import_module stand-in: modules named in `versions` import (with that __version__), others fail."""

    def import_module(name):
        if name not in versions:
            raise ImportError(f"libtransformer_engine.so: cannot open shared object file ({name})")
        return SimpleNamespace(__version__=versions[name])

    return import_module


def _torch(cuda=True, nccl=(2, 30, 7), pg=True):
    def version():
        if nccl is None:
            raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")
        return nccl

    return SimpleNamespace(
        __version__="2.14.1",
        cuda=SimpleNamespace(is_available=lambda: cuda, nccl=SimpleNamespace(version=version)),
        distributed=SimpleNamespace(is_nccl_available=lambda: pg),
    )


def test_env_checks_pass_and_fail_in_one_line_each():
    check = _env_check()
    te_ok = {
        "transformer_engine.pytorch": "",
        "transformer_engine": "2.10.0",
        "megatron.core.extensions.transformer_engine": "",
    }
    lines: list[str] = []
    rc = check.run(
        {
            "te": lambda: check.check_te(_importer(te_ok)),
            "te-missing": lambda: check.check_te(_importer({})),
            "te-old": lambda: check.check_te(_importer({**te_ok, "transformer_engine": "2.8.0"})),
            "te-megatron": lambda: check.check_te(
                _importer({k: v for k, v in te_ok.items() if "megatron" not in k})
            ),
            "triton": lambda: check.check_triton(lambda: ["/usr/lib64"], lambda: None),
            "triton-libcuda": lambda: check.check_triton(
                lambda: (_ for _ in ()).throw(AssertionError("libcuda.so cannot found!\nPlease")),
                lambda: None,
            ),
            "triton-compile": lambda: check.check_triton(
                lambda: ["/usr/lib64"], lambda: (_ for _ in ()).throw(RuntimeError("ptxas fatal"))
            ),
            "nccl": lambda: check.check_nccl(_torch()),
            "nccl-cpu": lambda: check.check_nccl(_torch(cuda=False)),
            "nccl-missing": lambda: check.check_nccl(_torch(nccl=None)),
            "nccl-pg": lambda: check.check_nccl(_torch(pg=False)),
        },
        out=lines.append,
    )
    assert rc == 1 and len(lines) == 11
    status = {line.split()[3].rstrip(":"): line.split()[2] for line in lines}  # "gpu env: PASS te: ..."
    assert {k for k, v in status.items() if v == "PASS"} == {"te", "triton", "nccl"}, lines
    by = {line.split()[3].rstrip(":"): line for line in lines}
    assert "transformer-engine 2.10.0" in by["te"] and "NCCL 2.30.7" in by["nccl"]
    assert (
        "does not import" in by["te-missing"]
        and "pip install 'transformer-engine[pytorch]" in by["te-missing"]
    )
    assert "2.8.0 is outside megatron-core 0.16.1's range" in by["te-old"]
    assert "TE extension does not load" in by["te-megatron"]
    assert "finds no libcuda.so" in by["triton-libcuda"] and "TRITON_LIBCUDA_PATH" in by["triton-libcuda"]
    assert "cannot compile and run" in by["triton-compile"] and "ptxas fatal" in by["triton-compile"]
    assert "no CUDA device" in by["nccl-cpu"] and "has no NCCL" in by["nccl-missing"]
    assert "without ProcessGroupNCCL" in by["nccl-pg"]
    assert all("\n" not in line for line in lines)
    assert check.run({"ok": lambda: "fine"}, out=lines.append) == 0


def test_env_check_on_this_cpu_machine_fails_nccl_in_one_line(capsys):
    assert _env_check().main(["--skip", "te", "--skip", "triton"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [out[0]] and out[0].startswith("gpu env: FAIL nccl: torch sees no CUDA device")


def test_the_agreement_check_runs_for_real_on_gloo():
    """check_rank_agreement over gloo: the code path the GPU check runs over NCCL (a fresh process: it creates
    and destroys a default process group); it must report a False rank, so it is not vacuous."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('c', {str(ROOT / 'tools' / 'gpu_env_check.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.check_rank_agreement('gloo'))\n"
        "import megatron_gspo.rollout.server.factory as f\n"
        "f.all_ranks_ok = lambda ok=True: True\n"  # an agreement that ignores a failed rank must be caught
        "try:\n    m.check_rank_agreement('gloo')\nexcept RuntimeError as e:\n    print('CAUGHT', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "all_ranks_ok over a one-rank gloo group, main and second thread" in done.stdout
    assert "CAUGHT all_ranks_ok over gloo answered [True, True, True]" in done.stdout
