"""The RL loop on megatron-core: run config, runtime set-up, the trainer and its phases, the rollout buffer between
the rollout and training stages, the megatron step and its forward steps, SFT, evaluation."""
