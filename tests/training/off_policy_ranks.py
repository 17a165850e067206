"""Rank function: one RL step of the real trainer with rollouts of mixed staleness, a correction preset,
loss.mask_truncated and the overlong penalty; records what each rank trained on and the step's metrics."""

from __future__ import annotations

from tests.training.test_end_to_end import MINI

MAX_NEW = 5
BUFFER = 2


def mixed_staleness_step(run_dir: str, overrides: list[str]) -> dict:
    """The local engine samples with the current weights (staleness 0); the weight versions are relabelled per
    rollout (0, 1 or 2 steps old) and so are the finish reasons (every other one 'length'), which is what an
    asynchronous producer / a length cut would report: the trainer's corrections and metrics only read the labels."""
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_gspo.yaml", [
        *MINI, f"trainer.run_dir={run_dir}", "trainer.steps=1", "trainer.save_final=false", "eval.max_prompts=4",
        "eval.n=1", f"rollout.max_new_tokens={MAX_NEW}", "data.reward=tests.training.rewards:contains_one",
        *overrides,
    ])
    trainer = GSPOTrainer(cfg)
    generate, scorer_score, update = trainer.generate, trainer.scorer.score, trainer.update
    seen: dict = {"trained": [], "raw_rewards": [], "rewards": [], "lens": []}

    def relabelled(items, seed):
        rollouts = generate(items, seed)
        for i, ro in enumerate(rollouts):
            ro.weight_version = trainer.step - (i % 3)
            ro.finish_reason = "length" if i % 2 == 0 else "stop"
        return rollouts

    def raw_score(*args, **kwargs):
        rewards = scorer_score(*args, **kwargs)
        seen["raw_rewards"].append(rewards.clone())
        return rewards

    def recording_score(items, rollouts):
        rewards = score(items, rollouts)
        seen["rewards"].append(rewards.clone())
        seen["lens"].append([len(r.response_ids) for r in rollouts])
        return rewards

    def recording_update(batch):
        seen["trained"].append({name: getattr(batch, name).detach().cpu().clone() for name in (
            "advantages_N", "truncated_N", "weight_version_N", "rewards_N", "response_lens_N", "loss_mask_NS")})
        return update(batch)

    score = trainer.score
    trainer.generate, trainer.score, trainer.update = relabelled, recording_score, recording_update
    trainer.scorer.score = raw_score
    try:
        trainer.train()
        return {"metrics": trainer.history[-1], "seen": seen, "step": 0}
    finally:
        trainer.close()
