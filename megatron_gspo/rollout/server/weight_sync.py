"""Moving trainer weights into SGLang servers: bucketing, the `disk` transport and the `distributed` one.

Input of both transports: an iterable of (Hugging Face name, full tensor) pairs in a fixed order (the exporter
gathers TP / EP / PP shards and strips vocab padding; this module never sees Megatron). It is consumed lazily,
one bucket at a time, so at most about two buckets of exported tensors are alive at once.

- disk: each bucket becomes one safetensors shard in a hidden temporary directory next to the target, with a
  `model.safetensors.index.json`; the directory is renamed into place (atomic: the final path only ever
  appears complete), then every server gets `POST /update_weights_from_disk {model_path, weight_version}`.
- distributed: once, `POST /init_weights_update_group` to every server while the trainer joins the same group
  as rank 0 (SGLang's servers join with `init_custom_process_group`: a TCP store at
  master_address:master_port, world size = 1 + the servers' GPUs, the trainer hosting the store). Per bucket:
  `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache}` to every server
  while the trainer broadcasts each tensor from rank 0, in list order. The last bucket carries the new
  weight_version.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import shutil
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

NamedTensor = tuple[str, torch.Tensor]
Post = Callable[[str, str, dict], Awaitable[Any]]
"""(server url, path, JSON payload) -> decoded answer; raises on failure."""

T = TypeVar("T")

INDEX_FILE = "model.safetensors.index.json"


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[NamedTensor] | Mapping[str, Any], bucket_bytes: int
) -> Iterator[list[NamedTensor]]:
    """Groups named tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor travels alone).

    A mapping (name -> tensor, e.g. export_hf_state_dict's dict) is taken in its iteration order.
    Raises on a name seen twice or a value that is not a tensor (exporter bugs that would lose weights).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    seen: set[str] = set()
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
            raise TypeError(f"weight exporter yielded ({name!r}, {kind}); expected (str, Tensor)")
        if name in seen:
            raise ValueError(f"weight exporter yielded {name!r} twice")
        seen.add(name)
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """(item, is_last) pairs, looking one item ahead."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype ('bfloat16'; it resolves names with getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------ disk transport


def write_checkpoint_dir(buckets: Iterable[list[NamedTensor]], target: Path) -> list[str]:
    """Writes the buckets as safetensors shards + index into `target`, atomically; returns the names written.

    Everything goes to a hidden sibling directory first (fsynced), which is renamed to `target` at the end; on
    any error the temporary directory is removed and `target` is untouched. An existing `target` is replaced.
    """
    from safetensors.torch import save_file

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    names: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for i, bucket in enumerate(buckets):
            shard = f"model-{i + 1:05d}.safetensors"
            # copy=True: safetensors refuses tensors that share storage (views of one fused parameter).
            tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in bucket}
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
            _fsync_file(tmp / shard)
            for name, t in tensors.items():
                weight_map[name] = shard
                names.append(name)
                total += tensor_nbytes(t)
        if not names:
            raise ValueError("weight exporter yielded no tensors")
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True))
        _fsync_file(tmp / INDEX_FILE)
        _fsync_dir(tmp)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def push_disk(
    post: Post, urls: list[str], buckets: Iterable[list[NamedTensor]], *, directory: Path, version: int
) -> Path:
    """Writes version `version` under `directory` and makes every server load it; returns its path."""
    target = Path(directory) / f"weights-v{version}"
    # On the caller's thread: the exporter may run collectives and CUDA work bound to this thread's device.
    write_checkpoint_dir(buckets, target)
    payload = {"model_path": str(target), "weight_version": str(version)}
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
"""join_update_group's keyword signature: master_address, master_port, world_size, group_name, backend,
timeout_s, device."""


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


def join_update_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    device: torch.device,
) -> TorchUpdateGroup:
    """Joins the weight-update group as rank 0, hosting its TCP store; blocks until every server rank joined.

    The store keys are prefixed exactly as on the server side: SGLang's `init_custom_process_group` wraps the
    rendezvous store in PrefixStore(group_name), torch's process-group helper adds f"{group_name}/" and the
    per-device backend adds f"{device}/". Rank 0 publishes the NCCL unique id under that prefix.
    """
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(master_address, master_port, world_size, True, timeout)
    prefixed = PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("sglang.group_backend=nccl needs a CUDA device (gloo is for tests only)")
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        pg: Any = torch.distributed.ProcessGroupNCCL(PrefixStore("cuda/", prefixed), 0, world_size, opts)
    elif backend == "gloo":
        gloo = torch.distributed.ProcessGroupGloo
        opts = gloo._Options()
        opts._timeout = timeout
        opts._devices = [gloo.create_device(hostname=master_address)]
        pg = gloo(PrefixStore("cpu/", prefixed), 0, world_size, opts)
    else:
        raise ValueError(f"sglang.group_backend={backend!r} must be 'nccl' or 'gloo'")
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
    backend: str,
    timeout_s: float,
) -> UpdateGroup:
    """Asks every server to join the group (server i's ranks start at 1 + i * gpus_per_server) while the
    trainer joins as rank 0 in a worker thread (both sides block until all ranks are in)."""
    world_size = 1 + gpus_per_server * len(urls)
    # Resolved here, on the caller's thread: a worker thread's current CUDA device is always 0.
    cuda = backend == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    joining = asyncio.ensure_future(
        in_daemon_thread(
            factory,
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
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
                    "master_port": master_port,
                    "rank_offset": 1 + i * gpus_per_server,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                },
            )
        )
        for i, url in enumerate(urls)
    ]
    await _all_or_first_error([joining, *requests])
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
) -> list[str]:
    """Sends every bucket to every server over the update group; returns the names sent, in order."""
    names_sent: list[str] = []
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
        await _all_or_first_error([sending, *requests])
        names_sent.extend(payload["names"])
    if not names_sent:
        raise ValueError("weight exporter yielded no tensors")
    return names_sent


async def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs a blocking call (a group join, a broadcast) in a daemon thread: if the other side never shows up,
    the thread waits out the group's timeout without keeping the process from exiting (unlike to_thread)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop was closed meanwhile: nobody waits for this any more
            pass

    name = f"sglang-weight-sync-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


async def _all_or_first_error(futures: list[asyncio.Future]) -> None:
    """Waits for all; on the first failure cancels the others and raises it (a thread blocked in a collective
    cannot be cancelled: it ends at the group's timeout)."""
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    for fut in done:
        if fut.exception() is not None:
            for other in pending:
                other.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
            raise fut.exception()  # type: ignore[misc]
