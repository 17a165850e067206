"""The demos' two stages: a cold-start SFT model, then RL from it (`megatron-gspo demo`, `demo --multi-turn`)."""

from __future__ import annotations

from pathlib import Path


def sft_then_rl(config: str | Path, run_dir: Path, overrides: list[str], *, sft_overrides: list[str] = ()):
    """SFT with the config (plus `sft_overrides`, e.g. the SFT data) into run_dir/sft_model, then GSPO from that
    model in run_dir. Returns (SFT result, the closed trainer, its summary, the RL config)."""
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.sft import run_sft
    from megatron_gspo.training.trainer import GSPOTrainer

    sft_cfg = load_run_config(config, [f"trainer.run_dir={run_dir}", *sft_overrides, *overrides])
    sft = run_sft(sft_cfg, out_dir=str(run_dir / "sft_model"))
    rl_cfg = load_run_config(config, [f"trainer.run_dir={run_dir}", f"model.load={run_dir / 'sft_model'}", *overrides])
    trainer = GSPOTrainer(rl_cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return sft, trainer, summary, rl_cfg
