"""Benchmarks the CLI runs, apart from the training package: stability/ (`megatron-gspo stability`)."""
