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
