"""Balanced token counts over data-parallel ranks: the sequences of each minibatch are re-dealt between replicas.

Each replica generates the rollouts of its own prompts, so one replica can hold much longer responses than another
and the others wait for it at every gradient reduction. Before the old-policy pass the sequences of minibatch k
of all replicas are pooled and dealt back, every replica keeping the same number of them, with balanced input
token counts (batching/bin_packing.py `equal_count_partition`); a replica gets the part that overlaps most with
what it already holds, so few sequences move. The deal depends only on the (all-gathered) lengths, so every rank
computes the same one; pipeline and tensor-parallel peers of a replica hold the same data and move the same rows.

The loss is unchanged by any deal (sums over sequences divided by the global count, training/engine.py), and
everything downstream (old-policy log-probs, R2 recording, R3 replay from the rollouts' routes) happens after it:
the moved rows travel with their Rollout objects (routes included) in ONE all_to_all of serialised bytes, only to
the replica that takes them.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from megatron_gspo.batching.batch import RolloutBatch
from megatron_gspo.batching.bin_packing import equal_count_partition
from megatron_gspo.batching.inputs import input_lengths


def deal(lengths_RN: list[list[int]], minibatches: int) -> list[list[tuple[int, int]]]:
    """For each replica d, the (source replica, source row) it holds after the deal, in its new row order:
    minibatch by minibatch, in pool order (source replica, then row). `lengths_RN[r][i]`: input tokens of row i
    of replica r (every replica holds the same number of rows, divisible by `minibatches`)."""
    replicas, n = len(lengths_RN), len(lengths_RN[0])
    if any(len(x) != n for x in lengths_RN) or n % minibatches:
        raise ValueError(f"replicas must hold equally many rows divisible by {minibatches} minibatches")
    per = n // minibatches
    out: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
    for k in range(minibatches):
        pool = [(r, k * per + j) for r in range(replicas) for j in range(per)]
        parts = equal_count_partition([lengths_RN[r][i] for r, i in pool], replicas)
        # Part -> replica: most rows already there first (deterministic ties), so little data moves.
        overlap = [[sum(pool[i][0] == r for i in part) for r in range(replicas)] for part in parts]
        pairs = sorted(
            ((overlap[p][r], p, r) for p in range(replicas) for r in range(replicas)), key=lambda x: (-x[0], x[1], x[2])
        )
        owner: dict[int, int] = {}
        taken: set[int] = set()
        for _, p, r in pairs:
            if p not in owner and r not in taken:
                owner[p] = r
                taken.add(r)
        for p, part in enumerate(parts):
            out[owner[p]].extend(pool[i] for i in part)
    return out


def _to_bytes(obj, device) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)


def exchange_objects(per_dest: list, group, device) -> list:
    """all_to_all of Python objects: rank r sends per_dest[d] to rank d; returns the objects received from each
    rank (in rank order). Bytes travel on `device` (NCCL takes CUDA tensors only)."""
    world = dist.get_world_size(group)
    payloads = [_to_bytes(obj, device) for obj in per_dest]
    send_sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=device)
    recv_sizes = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    recv_split = [int(x) for x in recv_sizes.tolist()]
    received = torch.empty(sum(recv_split), dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        received, torch.cat(payloads), recv_split, [p.numel() for p in payloads], group=group
    )
    out, offset = [], 0
    host = received.cpu().numpy().tobytes()
    for size in recv_split:
        out.append(torch.load(io.BytesIO(host[offset : offset + size]), weights_only=False))
        offset += size
    return out


def balance_data_parallel(batch: RolloutBatch, minibatches: int, group) -> RolloutBatch:
    """This replica's rows after the deal (module doc): same row count, minibatch structure kept, `seq_index_N`
    renumbered 0..n-1 with `rollouts` in the new row order."""
    device = batch.tokens_NL.device
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths_N = torch.tensor(input_lengths(batch), dtype=torch.int64, device=device)
    every = torch.empty(world * lengths_N.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, lengths_N, group=group)
    lengths_RN = every.view(world, -1).tolist()
    plan = deal(lengths_RN, minibatches)
    rollouts = batch.rollouts or [None] * batch.num_sequences
    per_dest = []
    for d in range(world):
        rows = [i for r, i in plan[d] if r == rank]
        sub = batch.rows(torch.tensor(rows, dtype=torch.long, device=device)).to(torch.device("cpu"))
        per_dest.append({"rows": rows, "batch": sub, "rollouts": [rollouts[i] for i in rows]})
    received = exchange_objects(per_dest, group, device)
    offsets, total = [], 0
    for got in received:
        offsets.append(total)
        total += len(got["rows"])
    where = {(r, i): offsets[r] + j for r, got in enumerate(received) for j, i in enumerate(got["rows"])}
    order = [where[src] for src in plan[rank]]
    pooled = _concat([got["batch"] for got in received if got["rows"]])
    merged = pooled.rows(torch.tensor(order, dtype=torch.long)).to(device)
    merged.seq_index_N = torch.arange(merged.num_sequences, device=device)
    if batch.rollouts is not None:
        flat = [ro for got in received for ro in got["rollouts"]]
        merged.rollouts = [flat[i] for i in order]
    return merged


def _concat(parts: list[RolloutBatch]) -> RolloutBatch:
    def cat(name):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return RolloutBatch(
        tokens_NL=cat("tokens_NL"),
        loss_mask_NS=cat("loss_mask_NS"),
        engine_logprobs_NS=cat("engine_logprobs_NS"),
        rewards_N=cat("rewards_N"),
        advantages_N=cat("advantages_N"),
        old_logprobs_NS=cat("old_logprobs_NS"),
        prompt_lens_N=cat("prompt_lens_N"),
        response_lens_N=cat("response_lens_N"),
        seq_index_N=cat("seq_index_N"),
        weight_version_N=cat("weight_version_N"),
        truncated_N=cat("truncated_N"),
        extra={k: torch.cat([p.extra[k] for p in parts]) for k in parts[0].extra},
    )
