"""Dynamic sampling on 2 data-parallel ranks keeps one global prompt order: each top-up round the ranks take
consecutive slices of the next prompts of the global sampler, so across ranks and steps no prompt is used twice
and none is skipped, and every rank's sampler (the one checkpointed) stays the same."""

from collections import Counter

from megatron_gspo.data.dataset import PromptSampler, load_datasets
from megatron_gspo.training.config import load_run_config
from tests.distributed import run_distributed
from tests.training.test_end_to_end import MINI
from tests.training.trainer_ranks import collect_steps

STEPS = 3
OVERRIDES = ["rollout.dynamic_sampling=true", "rollout.max_topup_rounds=4"]


def test_top_ups_follow_one_global_order_across_data_parallel_ranks(tmp_path):
    ranks = run_distributed(collect_steps, str(tmp_path / "run"), OVERRIDES, STEPS, world_size=2)
    assert ranks[0]["sampler"] == ranks[1]["sampler"]
    rounds = [s["stats"]["topup_rounds"] for r in ranks for s in r["steps"]]
    assert max(rounds) >= 1 and rounds == [s["stats"]["topup_rounds"] for r in ranks[::-1] for s in r["steps"]]
    used = Counter(p for r in ranks for s in r["steps"] for p in s["generated"])
    # Each rank tops up by its own shortfall, so the ranks' needs differ (the case that drifted apart).
    needs = [[len(s["generated"]) for s in r["steps"]] for r in ranks]
    assert needs[0] != needs[1]
    # The oracle: the first prompts of the sampler's stream, as many as the run consumed.
    cfg = load_run_config("examples/tiny_moe_gspo.yaml", MINI)
    sampler = PromptSampler(load_datasets(cfg.data)[0], cfg.trainer.prompts_per_step, seed=cfg.data.seed)
    consumed = ranks[0]["sampler"]["position"]  # within the first epoch here
    assert ranks[0]["sampler"]["epoch"] == 0 and consumed == sum(used.values())
    assert used == Counter(it.prompt for it in sampler.next_items(consumed))
