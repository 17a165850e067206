"""Training / evaluation mode of a model, switched without torch's recursive module walk on every switch.

An RL step switches the policy to eval and back three times (generation, the old-policy pass, the drift
forward). `Module.train(mode)` walks the module tree (~200 modules on the tiny model) through generators and
`Module.__setattr__` each time, a visible share of a small step's CPU time (tools/profile_step.py). The flag it
sets is the same `training` attribute on every module; the tree is walked once per model here and the flag set
directly. A model holding a module whose class overrides `train` is switched by its own `train`.
"""

from __future__ import annotations

import weakref

import torch

_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_training(model: torch.nn.Module, mode: bool) -> None:
    """`model.train(mode)`: every module's `training` flag is `mode` afterwards."""
    modules = _MODULES.get(model)
    if modules is None:
        modules = tuple(model.modules())
        if any(type(m).train is not torch.nn.Module.train for m in modules):
            modules = ()  # someone's own train() may do more than set the flag
        _MODULES[model] = modules
    if not modules:
        model.train(mode)
        return
    mode = bool(mode)
    for m in modules:
        m.__dict__["training"] = mode


__all__ = ["set_training"]
