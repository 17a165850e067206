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
