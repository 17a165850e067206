"""Weight buckets: the exporter's (Hugging Face name, full tensor) stream grouped, in order, under a byte limit.

The stream is consumed lazily, one bucket at a time, so at most about two buckets of exported tensors are alive at
once. Every server engine's weight sync (SGLang's NCCL and disk paths, vLLM's transports) sends buckets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

NamedTensor = tuple[str, torch.Tensor]
"""(Hugging Face checkpoint name, full tensor)."""

T = TypeVar("T")


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
