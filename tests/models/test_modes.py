"""set_training: the training flag of every module, as Module.train sets it, without the walk per switch."""

import gc
import weakref

import torch

from megatron_gspo.models.modes import set_training


def _tree() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.ReLU()))


def _flags(model):
    return [m.training for m in model.modules()]


def test_set_training_sets_every_flag_as_module_train_does():
    model, reference = _tree(), _tree()
    for mode in (False, True, False, True):
        set_training(model, mode)
        reference.train(mode)
        assert _flags(model) == _flags(reference) == [mode] * len(_flags(reference))
    # the flag is what the modules read: dropout is the identity in eval mode only
    set_training(model, False)
    x = torch.ones(1, 2)
    assert torch.equal(model(x), model(x))
    set_training(model, True)
    torch.manual_seed(0)
    assert not torch.equal(model[1][0](torch.ones(1000)), torch.ones(1000))


def test_a_module_with_its_own_train_is_switched_by_it():
    calls = []

    class Own(torch.nn.Module):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Own())
    set_training(model, False)
    set_training(model, True)
    assert calls == [False, True]
    assert _flags(model) == [True, True, True]


def test_a_switched_model_is_freed_once_dropped():
    """The module list cached for the switch must not keep the model alive (trainers built one after the other in
    one process, e.g. the stability benchmark's runs, would otherwise all stay in memory)."""
    model = _tree()
    set_training(model, False)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
