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
        params = [p for m in trainer.rt.models for p in m.parameters()]
        before = [p.detach().clone() for p in params]
        for p in params:
            p.main_grad.fill_(0.01)
        params[3].main_grad[0] = float("nan")
        skipped_ok, skipped_norm = trainer._optimizer_step()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, params))
        params[3].main_grad[0] = 0.01
        ok, norm = trainer._optimizer_step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, params))
        return dict(skipped_ok=skipped_ok, unchanged=unchanged, ok=ok, norm=norm, changed=changed)
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
