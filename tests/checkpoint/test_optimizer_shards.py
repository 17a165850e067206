"""The distributed optimizer's checkpoint is written by every data-parallel rank, each its own shard (issue 25,
item 5).

megatron's `fully_reshardable` save, which this replaced, gathered each DP group's fp32 state onto its DP rank 0
over gloo: rank 0 held and wrote all of it, rank 1 nothing. 2 gloo ranks (DP=2, bf16 params, fp32 masters, one
AdamW step): each rank's optimizer files hold about half of the fp32 state (masters + 2 moments), nothing is
gathered into host memory, and a second optimizer loads the state bit-equal, as it does a checkpoint of the
earlier format. A missing shard file is a one-line error naming it. Resuming in other layouts:
tests/training/test_resume_layout.py (whole trainers), and below, for one tensor, every TP split of the saved and
of the loading layout (rows, columns, none).
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.checkpoint.optimizer_shards import KEYS, _piece_values
from tests.checkpoint.optimizer_shards_ranks import save_shards_and_reload
from tests.distributed import run_distributed


def test_each_rank_writes_only_its_own_shard_and_it_loads_back(tmp_path):
    ranks = run_distributed(save_shards_and_reload, str(tmp_path / "ckpt"), world_size=2)
    state = ranks[0]["state"]
    for r in ranks:
        assert r["moments"] > 0
        assert r["equal"] and r["earlier"]
        assert r["held"] == 0  # no DP-group gather
        # Half of the state each, plus per-chunk descriptions; the old format: rank 0 ~100%, rank 1 ~0%.
        assert 0.4 * state < r["mine"] < 0.6 * state, (r["mine"], state)
        assert r["missing"] is not None and "rank_00001.pt" in r["missing"] and "\n" not in r["missing"]
    assert ranks[1]["alone"].endswith(f"{tmp_path / 'ckpt'} cannot be read here") and "\n" not in ranks[1]["alone"]
    assert ranks[0]["alone"] == ranks[1]["alone"] + " (on rank 1)"


def _chunks_of(full: torch.Tensor, key: str, split_dim: int | None, parts: int, ranges: int) -> list[dict]:
    """The chunks a layout writes for one global tensor: split into `parts` along `split_dim` (TP), each local
    tensor's flat elements cut into `ranges` ranges (DP shards); every state key holds the same values here."""
    locals_ = [full] if split_dim is None else list(full.chunk(parts, dim=split_dim))
    out = []
    for i, local in enumerate(locals_):
        offset = [0] * full.dim()
        if split_dim is not None:
            offset[split_dim] = i * local.shape[split_dim]
        flat = local.contiguous().view(-1)
        bounds = torch.linspace(0, flat.numel(), ranges + 1).long().tolist()
        for a, b in zip(bounds, bounds[1:]):
            out.append(dict(key=key, global_shape=tuple(full.shape), global_offset=tuple(offset),
                            local_shape=tuple(local.shape), start=a, end=b,
                            **{k: flat[a:b].clone() for k in KEYS}))
    return out


@pytest.mark.parametrize("saved_dim, new_dim", [(1, None), (None, 1), (0, 1), (1, 0)],
                         ids=["row_parallel_to_dp", "dp_to_row_parallel", "column_to_row", "row_to_column"])
def test_a_shard_is_rebuilt_from_another_layouts_chunks(saved_dim, new_dim):
    """A row-parallel (dim 1) TP split makes a local flat range non-contiguous in the global tensor: the values
    land where they were, for every new TP part and DP range, element for element."""
    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    saved = _chunks_of(full, "w", saved_dim, 2, 3)
    locals_ = [full] if new_dim is None else list(full.chunk(2, dim=new_dim))
    for i, local in enumerate(locals_):
        offset = [0, 0]
        if new_dim is not None:
            offset[new_dim] = i * local.shape[new_dim]
        st = SimpleNamespace(key="w", global_shape=(6, 8), global_offset=tuple(offset), prepend_axis_num=0,
                             data=local.contiguous())
        flat = local.contiguous().view(-1)
        for a, b in [(0, flat.numel()), (5, 17), (3, 4)]:
            got = _piece_values(st, a, b, saved, Path("ckpt"))
            for k in KEYS:
                assert torch.equal(got[k], flat[a:b]), (k, i, a, b)


def test_a_shard_the_saved_chunks_do_not_cover_is_refused():
    full = torch.zeros(4, 4)
    saved = [c for c in _chunks_of(full, "w", 1, 2, 2) if c["start"] != 0]  # one DP shard lost
    st = SimpleNamespace(key="w", global_shape=(4, 4), global_offset=(0, 0), prepend_axis_num=0, data=full)
    with pytest.raises(ValueError, match="ckpt lacks part of w's optimizer state"):
        _piece_values(st, 0, 16, saved, Path("ckpt"))
