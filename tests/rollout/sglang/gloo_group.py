"""The trainer's end of the weight-update group over gloo, for CPU tests against the fake server.

Against a real SGLang server the group is NCCL (rollout/sglang/weight_sync.py: join_update_group); on a CPU the
fake server joins with gloo, so the tests inject this factory (`SGLangEngine(..., group_factory=join_gloo_group)`):
the same bound TCP store (host_update_store) and key prefixes (update_group_store, with gloo's "cpu/" for NCCL's
"cuda/"), real broadcasts.
The conformance test joins SGLang's own `init_custom_process_group` (gloo) against it.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.rollout.sglang.weight_sync import TorchUpdateGroup, update_group_store


def join_gloo_group(
    *,
    store: Any,
    master_address: str,
    world_size: int,
    group_name: str,
    timeout_s: float,
    device: torch.device,
) -> TorchUpdateGroup:
    """join_update_group's signature and store layout, over gloo on the CPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = update_group_store(store, group_name)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), 0, world_size, opts)
    return TorchUpdateGroup(store, pg, torch.device("cpu"))
