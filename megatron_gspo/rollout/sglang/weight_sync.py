"""SGLang's weight-update protocol: the file (`disk`, `shm`) and the `distributed` (NCCL) transports over its endpoints.

Input of both: buckets of (Hugging Face name, full tensor) pairs in a fixed order (server/buckets.py; the
exporter gathers TP / EP / PP shards and strips vocab padding; this module never sees Megatron).

- disk / shm: the buckets become a safetensors directory (server/transport.py, atomic), then every server gets
  `POST /update_weights_from_disk {model_path, weight_version, flush_cache: false}`.
- distributed: once, `POST /init_weights_update_group` to every server while the trainer joins the same NCCL group
  as rank 0 (SGLang's servers join with `init_custom_process_group`: a TCP store at master_address:master_port,
  world size = 1 + the servers' GPUs, the trainer hosting the store, bound before any server hears its port).
  Per bucket:
  `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache}` to every server
  while the trainer broadcasts each tensor from rank 0, in list order. The last bucket carries the new
  weight_version. Servers of SGLang >= 0.5.21 refuse that request (400, without joining the broadcast) outside
  a weight-update session: for them the buckets go between `POST /begin_weight_update` and
  `POST /end_weight_update` (versions.py).

No update asks the server to flush its cache itself (`flush_cache: false`): a flush refused because requests
are still running fails the update in 0.5.23 and kills 0.5.9's scheduler (an assert); the engine calls
`/flush_cache` afterwards and retries it while it answers 400.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Awaitable, Callable, Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from megatron_gspo.rollout.server.buckets import NamedTensor, dtype_name, with_last
from megatron_gspo.rollout.server.concurrency import all_or_first_error, in_daemon_thread
from megatron_gspo.rollout.server.transport import write_checkpoint_dir

Post = Callable[[str, str, dict], Awaitable[Any]]
"""(server url, path, JSON payload) -> decoded answer; raises on failure."""


# ------------------------------------------------------------------------------------------ disk transport


async def push_disk(
    post: Post, urls: list[str], buckets: Iterable[list[NamedTensor]], *, directory: Path, version: int
) -> Path:
    """Writes version `version` under `directory` and makes every server load it; returns its path."""
    target = Path(directory) / f"weights-v{version}"
    # On the caller's thread: the exporter may run collectives and CUDA work bound to this thread's device.
    write_checkpoint_dir(buckets, target)
    payload = {"model_path": str(target), "weight_version": str(version), "flush_cache": False}
    await asyncio.gather(*(post(url, "/update_weights_from_disk", payload) for url in urls))
    return target


# ----------------------------------------------------------------------------------- distributed transport


class UpdateGroup(Protocol):
    """The trainer's end (rank 0) of the weight-update process group."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Sends `tensor` from rank 0 to every server rank (blocking until it is sent)."""
        ...

    def close(self) -> None:
        """Releases the group."""
        ...


GroupFactory = Callable[..., UpdateGroup]
"""join_update_group's keyword signature: store (the bound TCP store, host_update_store), master_address,
world_size, group_name, timeout_s, device. Tests inject a gloo implementation (tests/rollout/sglang/gloo_group.py);
against real servers it is NCCL."""


class TorchUpdateGroup:
    """Rank 0 of a torch.distributed backend built outside the default group (never touches the trainer's)."""

    def __init__(self, store: Any, backend: Any, device: torch.device):
        self._store = store
        self._backend = backend
        self.device = device

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcasts from rank 0 (moved to the group's device, contiguous) and waits for completion."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # runs in a worker thread, whose current device defaults to 0
        tensor = tensor.detach().to(self.device).contiguous()
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        self._backend.broadcast([tensor], opts).wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Shuts the backend down (NCCL communicators are freed) and drops the store."""
        shutdown = getattr(self._backend, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:
                pass
        self._backend = None
        self._store = None


def host_update_store(*, master_address: str, master_port: int, world_size: int, timeout_s: float) -> Any:
    """Binds the weight-update group's TCP store (rank 0) at once, without waiting for the servers.

    master_port 0 binds a port the OS picks, read back from `store.port` and only then sent to the servers: a port
    picked free, released and bound later can be taken by another process in between (EADDRINUSE).
    """
    from torch.distributed import DistNetworkError, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        return TCPStore(master_address, master_port, world_size, True, timeout, wait_for_workers=False)
    except DistNetworkError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"sglang.master_port={master_port}, sglang.master_address={master_address}: cannot host the weight-update "
            f"store there ({first}); set an address of this host and a free port (0: the OS picks one)"
        ) from None


def update_group_store(store: Any, group_name: str) -> Any:
    """The store the trainer's backend gets, less the per-device prefix.

    The keys are prefixed exactly as on the server side: SGLang's `init_custom_process_group` wraps the rendezvous
    store in PrefixStore(group_name), torch's process-group helper adds f"{group_name}/", and the per-device
    backend adds "cuda/" (NCCL) or "cpu/" (gloo; tests/rollout/sglang/test_conformance.py joins SGLang's own
    function over gloo against this layout).
    """
    from torch.distributed import PrefixStore

    return PrefixStore(f"{group_name}/", PrefixStore(group_name, store))


def join_update_group(
    *,
    store: Any,
    master_address: str,
    world_size: int,
    group_name: str,
    timeout_s: float,
    device: torch.device,
) -> TorchUpdateGroup:
    """Joins the NCCL weight-update group as rank 0, over its bound TCP store (host_update_store); blocks until every
    server rank joined. Rank 0 publishes the NCCL unique id under the store's prefix."""
    from torch.distributed import PrefixStore

    if device.type != "cuda":
        raise RuntimeError(
            "sglang.weight_sync=distributed needs trainer rank 0 on a CUDA device (an NCCL group with the servers); "
            "use sglang.weight_sync=disk or shm"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = update_group_store(store, group_name)
    opts = torch.distributed.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.is_high_priority_stream = False
    pg = torch.distributed.ProcessGroupNCCL(PrefixStore("cuda/", prefixed), 0, world_size, opts)
    return TorchUpdateGroup(store, pg, device)


async def init_update_group(
    post: Post,
    urls: list[str],
    *,
    factory: GroupFactory,
    master_address: str,
    master_port: int,
    gpus_per_server: int,
    group_name: str,
    timeout_s: float,
) -> UpdateGroup:
    """Asks every server to join the NCCL group (server i's ranks start at 1 + i * gpus_per_server) while the
    trainer joins as rank 0 in a worker thread (both sides block until all ranks are in).

    The store is bound first (master_port 0: a port the OS picks) and the servers are told the bound port.
    """
    world_size = 1 + gpus_per_server * len(urls)
    store = host_update_store(
        master_address=master_address, master_port=master_port, world_size=world_size, timeout_s=timeout_s
    )
    port = store.port  # the one bound, also when master_port is 0
    # Resolved here, on the caller's thread: a worker thread's current CUDA device is always 0.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    joining = asyncio.ensure_future(
        in_daemon_thread(
            factory,
            store=store,
            master_address=master_address,
            world_size=world_size,
            group_name=group_name,
            timeout_s=timeout_s,
            device=device,
        )
    )
    requests = [
        asyncio.ensure_future(
            post(
                url,
                "/init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": port,
                    "rank_offset": 1 + i * gpus_per_server,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": "nccl",
                },
            )
        )
        for i, url in enumerate(urls)
    ]
    await all_or_first_error([joining, *requests])
    return joining.result()


def broadcast_bucket(group: UpdateGroup, bucket: list[NamedTensor]) -> None:
    """Broadcasts the bucket's tensors one by one, in list order (the order of the request's `names`)."""
    for _, tensor in bucket:
        group.broadcast(tensor)


async def push_distributed(
    post: Post,
    urls: list[str],
    buckets: Iterable[list[NamedTensor]],
    *,
    group: UpdateGroup,
    group_name: str,
    version: int,
    session_urls: Collection[str] = (),
) -> list[str]:
    """Sends every bucket to every server over the update group; returns the names sent, in order.

    The servers in `session_urls` (SGLang >= 0.5.21) get `/begin_weight_update` before the first bucket and
    `/end_weight_update` after the last; after a failure their session is still ended (best effort), so that
    the next sync can open one.
    """
    opened = [url for url in urls if url in session_urls]
    await asyncio.gather(*(post(url, "/begin_weight_update", {}) for url in opened))
    names_sent: list[str] = []
    try:
        for bucket, last in with_last(buckets):
            payload: dict[str, Any] = {
                "names": [name for name, _ in bucket],
                "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": group_name,
                "flush_cache": False,  # one explicit /flush_cache after the last bucket
            }
            if last:
                payload["weight_version"] = str(version)
            path = "/update_weights_from_distributed"
            requests = [asyncio.ensure_future(post(url, path, payload)) for url in urls]
            sending = asyncio.ensure_future(in_daemon_thread(broadcast_bucket, group, bucket))
            await all_or_first_error([sending, *requests])
            names_sent.extend(payload["names"])
        if not names_sent:
            raise ValueError("weight exporter yielded no tensors")
    except BaseException:
        await asyncio.gather(*(post(url, "/end_weight_update", {}) for url in opened), return_exceptions=True)
        raise
    await asyncio.gather(*(post(url, "/end_weight_update", {}) for url in opened))
    return names_sent
