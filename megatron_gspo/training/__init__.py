"""The RL loop on megatron-core: run config, runtime set-up, trainer phases, SFT, eval, checkpoints, metrics."""
