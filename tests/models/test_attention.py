"""The local spec's packed (THD) attention (models/attention.py): each token attends to the earlier tokens of its
own sequence only, against a float64 per-sequence softmax attention written out here, in the output and in the
gradients of q, k and v; and the padded groups it builds, against hand-written ones."""

import math
import random
import types

import pytest
import torch

from megatron_gspo.models.attention import PackedAttentionParams, PackedDotProductAttention, attention_groups


def test_groups_sort_by_length_and_pad_with_the_last_token():
    # sequences of lengths 3, 2, 0 (skipped), 30, 1 at 0, 3, 5, 5, 35
    groups = attention_groups([0, 3, 5, 5, 35, 36], "cpu")
    # 1, 2, 3 fit one group (slack 8 over the shortest); 30 is its own
    assert groups.shapes == ((3, 3), (1, 30))
    assert groups.gather_R.tolist() == [35, 35, 35, 3, 4, 4, 0, 1, 2, *range(5, 35)]
    assert groups.take_T.tolist() == [6, 7, 8, 3, 4, *range(9, 39), 0]


def _reference(q, k, v, cu, scale):
    """float64 softmax attention per sequence, causal; q [T, Hq, D], k / v [T, G, D] (GQA: head h reads group
    h // (Hq / G))."""
    q, k, v = (t.double() for t in (q, k, v))
    per = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for lo, hi in zip(cu[:-1], cu[1:]):
        for t in range(lo, hi):
            for h in range(q.shape[1]):
                keys, values = k[lo : t + 1, h // per], v[lo : t + 1, h // per]
                weights = torch.softmax(keys @ q[t, h] * scale, dim=0)
                out[t, h] = weights @ values
    return out


def _module():
    """What PackedDotProductAttention.forward reads of itself on the packed path (building the module needs
    megatron's parallel state; whole models run it in tests/training/test_packed_update.py)."""
    config = types.SimpleNamespace(attention_dropout=0.0, apply_query_key_layer_scaling=False, window_size=None)
    return types.SimpleNamespace(training=True, config=config, softmax_offset=None, softmax_scale=None)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_attention_is_per_sequence_causal_attention_values_and_gradients(seed, dtype, tol):
    """fp32, and bf16 as a cluster's activations are (against the float64 reference of the same bf16 inputs)."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, rng.randint(3, 12), rng.randint(13, 40)]) for _ in range(rng.randint(1, 14))]
    lengths.append(rng.randint(1, 5))  # at least one token
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(cu[-1], 4, 8, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(cu[-1], 2, 8, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(cu[-1], 2, 8, generator=gen).to(dtype).requires_grad_()
    params = PackedAttentionParams(qkv_format="thd", cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                                   cu_seqlens_kv=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=max(lengths),
                                   max_seqlen_kv=max(lengths))
    out = PackedDotProductAttention.forward(_module(), q, k, v, None, packed_seq_params=params)
    assert out.shape == (cu[-1], 32) and out.dtype == dtype
    ref = _reference(q, k, v, cu, 1 / math.sqrt(8))
    torch.testing.assert_close(out.double().view(-1, 4, 8), ref, atol=tol / 10, rtol=tol / 10)
    weights = torch.randn(out.shape, generator=gen).to(dtype)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weights.double().view(-1, 4, 8)).sum(), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert w.abs().max() > 0, name
        torch.testing.assert_close(g.double(), w.double(), atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_cu_seqlens_that_miss_tokens_are_refused():
    q = torch.zeros(5, 4, 8)
    params = PackedAttentionParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32),
                                   cu_seqlens_kv=torch.tensor([0, 2, 4], dtype=torch.int32), max_seqlen_q=2,
                                   max_seqlen_kv=2)
    with pytest.raises(ValueError, match=r"cover all T tokens"):
        PackedDotProductAttention.forward(_module(), q, q[:, :2], q[:, :2], None, packed_seq_params=params)


def test_a_copy_of_the_params_does_not_share_the_group_cache():
    """tools/gpu_packed_check.py declares each pack as one sequence with dataclasses.replace: the copy's groups are
    its own (a shared cache would hand one of them the other's groups; found in review)."""
    import dataclasses

    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    p = PackedAttentionParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=3, max_seqlen_kv=3,
                              cu_seqlens_host=(0, 2, 5))
    one = torch.tensor([0, 5], dtype=torch.int32)
    q = dataclasses.replace(p, cu_seqlens_q=one, cu_seqlens_kv=one, cu_seqlens_host=(0, 5))
    assert q.groups("cpu").shapes == ((1, 5),)
    assert p.groups("cpu").shapes == ((2, 3),)
    assert q._groups is not p._groups
