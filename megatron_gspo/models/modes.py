"""Training / evaluation mode of a model, switched without torch's recursive module walk on every switch.

An RL step switches the policy to eval and back three times (generation, the old-policy pass, the drift
forward). `Module.train(mode)` walks the module tree (~200 modules on the tiny model) through generators and
`Module.__setattr__` each time, a visible share of a small step's CPU time (tools/profile_step.py). The flag it
sets is the same `training` attribute on every module; the tree is walked once per model here and the flag set
directly. A model holding a module whose class overrides `train` is switched by its own `train`.
"""

from __future__ import annotations

import torch

_KEY = "_megatron_gspo_modules"
"""The model's module list, kept in the model's own __dict__: a cache outside it (e.g. a WeakKeyDictionary) would
hold the model alive through its own first module, and every trainer built in one process with it."""


def set_training(model: torch.nn.Module, mode: bool) -> None:
    """`model.train(mode)`: every module's `training` flag is `mode` afterwards."""
    modules = model.__dict__.get(_KEY)
    if modules is None:
        modules = tuple(model.modules())
        if any(type(m).train is not torch.nn.Module.train for m in modules):
            modules = ()  # someone's own train() may do more than set the flag
        model.__dict__[_KEY] = modules  # not Module.__setattr__: a plain attribute, no submodule registration
    if not modules:
        model.train(mode)
        return
    mode = bool(mode)
    for m in modules:
        m.__dict__["training"] = mode


__all__ = ["set_training"]
