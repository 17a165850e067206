"""The trainer's end of the weight-update group over gloo, for CPU tests against the fake server.

Against a real SGLang server the group is NCCL (rollout/sglang/weight_sync.py: join_update_group); on a CPU the
fake server joins with gloo, so the tests inject this factory (`SGLangEngine(..., group_factory=join_gloo_group)`):
the same TCP store, the same key prefixes (with gloo's "cpu/" for NCCL's "cuda/"), real broadcasts.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_gspo.rollout.sglang.weight_sync import TorchUpdateGroup


def join_gloo_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
    device: torch.device,
) -> TorchUpdateGroup:
    """join_update_group's signature and store layout, over gloo on the CPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, True, timeout)
    prefixed = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), 0, world_size, opts)
    return TorchUpdateGroup(store, pg, torch.device("cpu"))
