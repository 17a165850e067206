"""Device discipline: every tensor that meets the model or a collective is on the model's device.

A CPU-only machine cannot show a host tensor reaching a CUDA model: both are CPU tensors. The device witness
(tests/training/device_witness.py) runs the real RL and SFT steps on the CPU while it tracks which tensors a GPU
run would hold on the host (made by our code without a device, or moved to the CPU) and which on the model's
device, answers `Tensor.device` like a GPU run would, and records each op mixing the two, each host tensor
passed to a model forward and each host tensor passed to a torch.distributed collective. Where a CUDA device
raises, the witness records a violation (or our own device checks raise, as the log-prob kernel's does), so an
empty list over a full step is what the GPU needs: the model's inputs, labels, masks, position ids, the loss'
old log-probs and advantages, the routing-replay targets and every collective's buffer are on the device.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.device_witness import DEVICE, DeviceWitness
from tests.training.trainer_ranks import device_witness_steps


def test_the_witness_sees_host_tensors_meet_the_device():
    model = torch.nn.Linear(4, 3)  # made before the witness: "on the device"
    with DeviceWitness() as witness:
        witness.watch([model])
        model(torch.ones(2, 4, device="cuda"))
        ids = torch.arange(3, device=model.weight.device)
        assert not witness.violations and model.weight.device == DEVICE and ids.device == DEVICE
        host = torch.ones(2, 4)
        assert host.device == torch.device("cpu")
        model(host)
        assert [v.what for v in witness.violations] == ["Linear.forward", "linear"]
        witness.violations.clear()
        model(host.to(DEVICE)).sum().cpu().add(torch.ones(1))  # moved there, and its result back: fine
        assert not witness.violations
        model.weight.detach()[torch.tensor([0, 1])] += 1.0  # CPU index tensors are allowed, as on CUDA
        torch.cat([model.weight, torch.zeros(1, 4)])
        assert [v.what for v in witness.violations] == ["_VariableFunctionsClass.cat"]


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, ["parallel.pp=2"]),
        (2, ["moe.routing_replay=r2", "rollout.dynamic_sampling=true", "data.reward=tests.training.rewards:contains_one"]),
    ],
    ids=["pp2", "dp2-r2-dynamic"],
)
def test_rl_and_sft_steps_keep_every_tensor_on_the_model_device(tmp_path, world, overrides):
    ranks = run_distributed(device_witness_steps, str(tmp_path / "run"), overrides, world_size=world)
    for rank in ranks:
        assert rank["device"] == "cuda:0"
        assert len(rank["control"]) == 1 and "torch.distributed.all_reduce" in rank["control"][0]
        assert rank["model_calls"] > 0 and rank["collective_calls"] > 0
        assert rank["violations"] == []
