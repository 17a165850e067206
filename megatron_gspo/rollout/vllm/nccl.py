"""The trainer's end of vLLM's NCCL weight transfer (GPU servers), without importing vLLM.

vLLM 0.32's `NCCLWeightTransferEngine` (vllm/distributed/weight_transfer/nccl_engine.py, nccl_common.py) joins a
trainer-led NCCL group either through vLLM's own TCP-store rendezvous or from a pre-shared `ncclUniqueId`
(`init_info.nccl_unique_id_b64`, base64 of the 128 raw bytes), which is what a foreign trainer uses: the trainer
mints the id (torch.cuda.nccl.unique_id), sends it in `/init_weight_transfer_engine` to every server
(`rank_offset` = 1 + the server's first rank) and joins as rank 0 at the same time; right after
`ncclCommInitRank` every vLLM rank issues a one-element all_reduce (the warm-up handshake of
`PyNcclCommunicator._init_comm`), so the trainer issues one too. Unpacked mode (`packed: false`): for each
`/update_weights {update_info: {names, dtype_names, shapes}}` the workers receive one broadcast per tensor from
rank 0, in list order, and load it with `model.load_weights`.
"""

from __future__ import annotations

import base64
from typing import Any

import torch


class NcclWeightSender:
    """Rank 0 of the trainer + vLLM workers NCCL group (torch's NCCL bindings, this process's CUDA device)."""

    def __init__(self, world_size: int, device: torch.device):
        if device.type != "cuda":
            raise RuntimeError(
                "vllm.weight_transport=nccl needs the trainer on a CUDA device; use shm or disk"
            )
        self.world_size = world_size
        self.device = device
        self.unique_id: bytes = torch.cuda.nccl.unique_id()
        self._comm: Any = None

    def init_info(self, rank_offset: int) -> dict[str, Any]:
        """`/init_weight_transfer_engine` body of the server whose first rank is `rank_offset`."""
        return {
            "init_info": {
                "nccl_unique_id_b64": base64.b64encode(self.unique_id).decode("ascii"),
                "rank_offset": rank_offset,
                "world_size": self.world_size,
                "packed": False,
            }
        }

    def join(self) -> None:
        """ncclCommInitRank as rank 0, then the warm-up all_reduce (blocks until every worker joined)."""
        torch.cuda.set_device(self.device)  # runs in a worker thread, whose current device defaults to 0
        self._comm = torch.cuda.nccl.init_rank(self.world_size, self.unique_id, 0)
        warmup = torch.zeros(1, device=self.device)
        torch.cuda.nccl.all_reduce([warmup], comms=[self._comm])
        torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Sends one tensor from rank 0 and waits until it is sent."""
        torch.cuda.set_device(self.device)
        tensor = tensor.detach().to(self.device).contiguous()
        torch.cuda.nccl.broadcast([tensor], root=0, comms=[self._comm])
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Drops the communicator (torch frees it when the handle goes)."""
        self._comm = None
