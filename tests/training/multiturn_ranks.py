"""Rank functions of the multi-turn training tests: the real trainer on the calculator config, in a forked rank
(megatron's globals stay out of the pytest process)."""

from __future__ import annotations

# One minibatch per step: with K > 1 each data-parallel rank deals its own groups into the K minibatches (a
# different split of the batch than one process's), so only the step's whole update compares across layouts.
MINI = ["trainer.steps=2", "trainer.prompts_per_step=8", "trainer.micro_batch_size=16", "trainer.progress=false",
        "rollout.group_size=4", "data.train_size=256", "data.heldout_size=16", "eval.max_prompts=4", "eval.n=1",
        "trainer.save_final=false", "trainer.minibatches=1"]
FLAKY = ["multiturn.env=tests.rollout.multiturn.envs:ShapedFlakyCalculator", "loss.algorithm=gspo_token",
         "multiturn.advantage=turn_return", "loss.overlong_buffer=4"]


def multiturn_steps(run_dir: str, overrides: list[str], replay: list | None = None) -> dict:
    """`trainer.steps` RL steps of the calculator config. Without `replay` the trajectories are generated (the
    real engine and environments) and returned, per generate call, as one list of G rollouts per prompt of the
    global batch; with `replay` (what a 1-process run returned) each data-parallel rank trains on its share of
    those instead of generating: the same trajectories a 1-process run trained on. Returns the step metrics,
    the final weights (HF names) and the trajectories."""
    from megatron_gspo.models.hf_state import export_hf_state_dict
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_calculator.yaml", [*MINI, f"trainer.run_dir={run_dir}", *overrides])
    trainer = GSPOTrainer(cfg)
    g, generate, calls = cfg.rollout.group_size, trainer.generate, []

    def recording(items, seed):
        rollouts = generate(items, seed)
        calls.append([rollouts[i * g : (i + 1) * g] for i in range(len(items))])
        return rollouts

    def replaying(items, seed):
        groups = trainer.rt.shard(replay[len(calls)])
        calls.append(groups)
        assert [tuple(gr[0].prompt_ids) for gr in groups] == [tuple(trainer.rt.encode_prompt(it.prompt))
                                                               for it in items], "replay out of step"
        return [r for gr in groups for r in gr]

    trainer.generate = recording if replay is None else replaying
    try:
        trainer.train()
        return {"metrics": list(trainer.history), "weights": export_hf_state_dict(trainer.rt.models),
                "trajectories": calls}
    finally:
        trainer.close()


def failing_step(run_dir: str, overrides: list[str]) -> str:
    """The RunFailure message of a run whose environment failures reach scoring.max_error_frac."""
    from megatron_gspo.errors import RunFailure
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_calculator.yaml", [*MINI, f"trainer.run_dir={run_dir}", *overrides])
    trainer = GSPOTrainer(cfg)
    try:
        trainer.train()
    except RunFailure as err:
        return str(err)
    finally:
        trainer.close()
    return "no failure"
