"""combine_metrics of a single part (a minibatch of one micro-batch) takes a shortcut: the same bits as the
documented combination (fp64 sums / min / max, weighted means sum(v * w) / max(sum(w), 1), cast to fp32), checked
against that formula in plain Python floats, special values included."""

import math
import random
import struct

import torch

from megatron_gspo.algorithms import combine_metrics
from megatron_gspo.algorithms.metrics import METRIC_REDUCTIONS


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _want(value: float, reduction: str, weight: float | None) -> float:
    if reduction in ("min", "max"):
        total = value
    elif reduction == "sum":
        total = 0.0 + value  # a sum starts from +0.0
    else:
        total = (0.0 + value * weight) / max(weight, 1.0)
    return float(torch.tensor(total, dtype=torch.float64).to(torch.float32))  # IEEE round to nearest


def test_one_part_equals_the_formula_bit_for_bit():
    rng = random.Random(5)
    specials = [-0.0, 0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -3.4e38, 0.1]
    for trial in range(200):
        part, weights = {}, {}
        for count_key in ("num_sequences", "num_tokens"):
            w = rng.choice([0.0, 1.0, 3.0, 12345.0, 2.0**30, 0.5]) if trial % 3 else float(rng.randint(1, 99))
            weights[count_key] = w
            part[count_key] = torch.tensor(w, dtype=torch.float32)
        for name, reduction in METRIC_REDUCTIONS.items():
            if name in part:
                continue
            v = rng.choice(specials) if rng.random() < 0.3 else rng.uniform(-5, 5)
            part[name] = torch.tensor(v, dtype=torch.float32)
            part[f"staleness_1/{name}"] = torch.tensor(v, dtype=torch.float32)
        for bucket in ("", "staleness_1/"):
            for count_key, w in weights.items():
                part[bucket + count_key] = torch.tensor(w, dtype=torch.float32)
        got = combine_metrics([part])
        assert sorted(got) == sorted(part)
        for key, value in part.items():
            bucket, _, name = key.rpartition("/")
            reduction = METRIC_REDUCTIONS[name]
            weight_key = f"{bucket}/{reduction}" if bucket else reduction
            w = None if reduction in ("sum", "min", "max") else float(part[weight_key])
            want = _want(float(value), reduction, w)
            g = float(got[key])
            assert got[key].dtype == torch.float32 and got[key].shape == ()
            assert (math.isnan(g) and math.isnan(want)) or _bits(g) == _bits(want), (key, float(value), w, g, want)


def test_one_part_holding_fp64_values_takes_the_general_path():
    part = {"num_tokens": torch.tensor(3.0, dtype=torch.float64),
            "mismatch_kl": torch.tensor(0.1, dtype=torch.float64)}
    got = combine_metrics([part])
    assert got["mismatch_kl"].dtype == torch.float32
    assert float(got["mismatch_kl"]) == float(torch.tensor((0.1 * 3.0) / 3.0, dtype=torch.float32))
