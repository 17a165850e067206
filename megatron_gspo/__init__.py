"""megatron-gspo: GSPO (arXiv:2507.18071) reinforcement learning for Mixture-of-Experts models on Megatron-Core."""

__version__ = "0.1.0"
