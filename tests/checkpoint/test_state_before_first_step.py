"""An optimizer checkpoint before any optimizer step (issue 25, item 3).

With TE's or apex's FusedAdam (stood in for on CPU by tests/checkpoint/lazy_state_ranks.py) Adam's moments do not
exist until the first step, and megatron's distributed-optimizer save reads them for every param: KeyError
'exp_avg' before the fix. Now each sub-optimizer's `init_state_fn` creates them: 2 gloo ranks (DP=2, bf16 params,
fp32 masters) save, load into a second optimizer, find zero moments and masters equal to the weights, and step;
also with torch's AdamW (megatron's choice without TE), whose per-param step count megatron's save reads too."""

import pytest

from tests.checkpoint.lazy_state_ranks import save_and_load_before_first_step
from tests.distributed import run_distributed


@pytest.mark.parametrize("fused", [True, False], ids=["fused_adam", "torch_adamw"])
def test_checkpoint_before_the_first_step_saves_loads_and_steps(tmp_path, fused):
    ranks = run_distributed(save_and_load_before_first_step, str(tmp_path / "ckpt"), fused, world_size=2)
    for r in ranks:
        assert r["moments"] == 0.0
        assert r["masters_match"]
        assert r["ok"] and r["moved"] > 0
        assert r["steps"] == [1]
