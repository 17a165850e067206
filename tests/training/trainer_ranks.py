"""In-process trainer checks run in a spawned rank (megatron globals stay out of the pytest process)."""

from __future__ import annotations

import torch

from tests.training.test_end_to_end import MINI


def nonfinite_gradient_is_skipped(run_dir: str) -> dict:
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_gspo.yaml", [*MINI, f"trainer.run_dir={run_dir}"])
    trainer = GSPOTrainer(cfg)
    try:
        named = [(n, p) for m in trainer.rt.models for n, p in m.named_parameters()]
        params = [p for _, p in named]
        expert = next(i for i, (n, _) in enumerate(named) if ".experts." in n)  # in DDP's expert-parallel buffer
        before = [p.detach().clone() for p in params]
        for p in params:
            p.main_grad.fill_(0.01)
        skipped = []
        for index, value in ((3, float("nan")), (expert, float("inf"))):
            params[index].main_grad.view(-1)[-1] = value
            skipped.append(trainer._optimizer_step()[0])
            params[index].main_grad.view(-1)[-1] = 0.01
        unchanged = all(torch.equal(a, p) for a, p in zip(before, params))
        ok, norm = trainer._optimizer_step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, params))
        return dict(skipped=skipped, unchanged=unchanged, ok=ok, norm=norm, changed=changed)
    finally:
        trainer.close()


def device_witness_steps(run_dir: str, overrides: list[str]) -> dict:
    """One RL step (generate -> score -> old log-probs -> K minibatch updates -> metrics, eval before and after) and
    one SFT step with the model on the witness's CUDA device (tests/training/device_witness.py). Returns the
    violations and how many model forwards / collectives the witness saw."""
    import torch.distributed as dist

    from megatron_gspo.training.config import load_run_config
    from tests.training.device_witness import DeviceWitness

    witness = DeviceWitness()
    with witness:
        from megatron_gspo.training.sft import sft_loop
        from megatron_gspo.training.trainer import GSPOTrainer

        cfg = load_run_config("examples/tiny_moe_gspo.yaml", [
            *MINI, f"trainer.run_dir={run_dir}", "trainer.steps=1", "trainer.save_final=false", "eval.max_prompts=4",
            "eval.n=1", "sft.max_steps=1", "sft.batch_size=8", "sft.eval_every=1", "sft.eval_prompts=4", *overrides,
        ])
        trainer = GSPOTrainer(cfg)
        try:
            # The witness can fail: a host tensor in a collective is caught (then forgotten).
            dist.all_reduce(torch.zeros(2))
            control = [str(v) for v in witness.violations]
            witness.violations.clear()
            witness.watch(trainer.rt.models)
            trainer.train()
            sft_loop(trainer.rt)
        finally:
            trainer.close()
    return {
        "control": control,
        "violations": [str(v) for v in witness.violations],
        "model_calls": witness.model_calls,
        "collective_calls": witness.collective_calls,
        "device": str(trainer.rt.device),
    }


def _flat_by_prompt(items, group_size: int) -> torch.Tensor:
    """Scripted rewards: a prompt's group is flat (all 0) when crc32(prompt) is even, else [1, 0, 0, ...]."""
    import zlib

    rewards = torch.zeros(len(items), group_size)
    for i, item in enumerate(items):
        if zlib.crc32(item.prompt.encode()) % 2:
            rewards[i, 0] = 1.0
    return rewards.reshape(-1)


def collect_steps(run_dir: str, overrides: list[str], steps: int, scripted: str = "by_prompt") -> dict:
    """Runs the trainer's `collect` for `steps` steps (no update) with scripted rewards and returns, per step, the
    prompts generated (all rounds), the minibatches' advantages and the rollout statistics, and the sampler."""
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_gspo.yaml", [*MINI, f"trainer.run_dir={run_dir}", *overrides])
    trainer = GSPOTrainer(cfg)
    g = cfg.rollout.group_size
    generated: list[str] = []
    generate = trainer.generate

    def recording_generate(items, seed):
        generated.extend(it.prompt for it in items)
        return generate(items, seed)

    def scripted_score(items, rollouts):
        if scripted == "by_prompt":
            return _flat_by_prompt(items, g)
        # "by_position": the even positions of each call informative, the odd ones flat
        rewards = torch.zeros(len(items), g)
        rewards[::2, 0] = 1.0
        return rewards.reshape(-1)

    trainer.generate = recording_generate
    trainer.score = scripted_score
    out = []
    try:
        for _ in range(steps):
            generated.clear()
            batch, stats = trainer.collect(step_seed=cfg.trainer.seed * 1_000_003 + trainer.step)
            out.append({
                "generated": list(generated),
                "minibatch_advantages": [mb.advantages_N.cpu() for mb in batch.split(cfg.trainer.minibatches)],
                "stats": stats,
            })
            trainer.step += 1
        return {"steps": out, "sampler": trainer.sampler.state_dict()}
    finally:
        trainer.close()


def data_parallel_step_metrics(run_dir: str) -> dict:
    """One RL step on 2 data-parallel ranks with dynamic sampling and a reward that errs; records each rank's own
    share of every reduced metric (mismatch, drift, routing mismatch, reward errors, groups) and forces one of
    the 4 minibatch steps to be skipped."""
    from unittest import mock

    import megatron_gspo.algorithms.off_policy as correction_module
    import megatron_gspo.training.routing as routing_module
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_gspo.yaml", [
        *MINI, f"trainer.run_dir={run_dir}", "trainer.steps=1", "trainer.save_final=false",
        "rollout.dynamic_sampling=true", "rollout.max_topup_rounds=3", "eval.max_prompts=4", "eval.n=1",
        "data.reward=tests.training.rewards:fails_on_odd_answers",
    ])
    local: dict = {"mismatch": [], "drift": [], "scores": [], "norms": []}
    correction, route_change = correction_module.rollout_correction, routing_module.store_route_change

    def local_correction(*args, **kwargs):
        weights, metrics = correction(*args, **kwargs)
        local["mismatch"].append({k: float(v) for k, v in metrics.items()})
        return weights, metrics

    def local_route_change(*args, **kwargs):
        local["drift"].append(route_change(*args, **{**kwargs, "reduce_group": None}))
        return route_change(*args, **kwargs)

    with mock.patch.object(correction_module, "rollout_correction", local_correction), \
            mock.patch.object(routing_module, "store_route_change", local_route_change):
        trainer = GSPOTrainer(cfg)
        score, step = trainer.score, trainer._optimizer_step
        calls = []

        def recording_score(items, rollouts):
            rewards = score(items, rollouts)
            local["scores"].append({"rewards": rewards.view(len(items), -1).clone(),
                                    "errors": trainer.scorer.last_metrics["reward_errors"]})
            return rewards

        def one_skipped_step():
            calls.append(1)
            if len(calls) == 2:
                return False, float("nan")  # what a non-finite gradient gives (nothing is stepped)
            ok, norm = step()
            local["norms"].append(norm)
            return ok, norm

        trainer.score, trainer._optimizer_step = recording_score, one_skipped_step
        try:
            trainer.train()
            return {"metrics": trainer.history[-1], "local": local, "want": cfg.trainer.prompts_per_step // 2}
        finally:
            trainer.close()


def routing_statistics_follow_drift_every(run_dir: str, old_logprobs: str) -> dict:
    """Two RL steps with moe.drift_every=2: per step, how many forward-only passes ran, whether the old-policy
    pass recorded routes, and which routing statistics the step reported."""
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    overrides = [*MINI, f"trainer.run_dir={run_dir}", "moe.drift_every=2", f"rollout.old_logprobs={old_logprobs}"]
    trainer = GSPOTrainer(load_run_config("examples/tiny_moe_gspo.yaml", overrides))
    passes = []
    compute = trainer.compute_logprobs

    def counted(batch):
        passes[-1] += 1
        return compute(batch)

    trainer.compute_logprobs = counted
    steps = []
    try:
        for _ in range(2):
            passes.append(0)
            batch, _ = trainer.collect(step_seed=trainer.step)
            trainer.old_logprobs(batch)
            recorded = trainer.routing.pre_routes is not None
            updates = trainer.update(batch)
            trainer.step += 1
            steps.append(dict(passes=passes[-1], recorded=recorded, keys=sorted(updates[0]["drift"])))
        return dict(steps=steps)
    finally:
        trainer.close()


def drift_step(run_dir: str, overrides: list[str], probe: bool) -> dict:
    """One RL step (collect, old log-probs, K updates) with expert drift measured. Returns the forward-only passes
    the trainer ran, its drift metrics, the parameters after the step and the per-minibatch losses. `probe`: also
    route every minibatch independently, by a forward of our own recording routes, under pi_old (before the
    updates) and after exactly one optimizer step (right after the first), with the token rows they count."""
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_gspo.yaml", [
        *MINI, f"trainer.run_dir={run_dir}", "trainer.steps=1", "trainer.save_final=false", "optim.lr=0.05",
        "data.reward=tests.training.rewards:contains_one",
        *overrides,
    ])
    trainer = GSPOTrainer(cfg)
    compute, step = trainer.compute_logprobs, trainer._optimizer_step
    passes, steps = [0], []

    def counted(batch):
        passes[0] += 1
        return compute(batch)

    def routes_of(minibatches):
        out = []
        for mb in minibatches:
            with trainer.routing.rr.record() as rec:
                compute(mb)
            out.append({int(i): rec.routes[int(i)].to(torch.int64).tolist() for i in mb.seq_index_N.tolist()})
        return out

    probed: dict = {}
    minibatches: list = []

    def stepped():
        result = step()
        steps.append(1)
        if probe and len(steps) == 1:
            probed["after"] = routes_of(minibatches)
        return result

    trainer.compute_logprobs, trainer._optimizer_step = counted, stepped
    try:
        batch, _ = trainer.collect(step_seed=trainer.step)
        trainer.old_logprobs(batch)
        if probe:
            minibatches.extend(batch.split(cfg.trainer.minibatches))
            probed["before"] = routes_of(minibatches)
            probed["rows"] = [
                {int(i): list(range(int(p) - 1, int(p) + int(r) - 1))
                 for i, p, r in zip(mb.seq_index_N.tolist(), mb.prompt_lens_N.tolist(), mb.response_lens_N.tolist())}
                for mb in minibatches
            ]
        passes[0] = 0
        updates = trainer.update(batch)
        params = [p.detach().clone() for m in trainer.rt.models for p in m.parameters()]
        losses = [u["loss_parts"] for u in updates]
        return dict(passes=passes[0], drift=updates[0]["drift"], params=params, losses=losses, probe=probed,
                    topk=trainer.routing.rr.topk if trainer.routing.active else None,
                    layers=list(trainer.routing.rr.layer_ids) if trainer.routing.active else None)
    finally:
        trainer.close()
