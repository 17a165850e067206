"""The `megatron-gspo` command line (cli/main.py)."""
