"""What a run records: metrics.jsonl / tensorboard / progress bar and the step reduction over ranks (log.py),
PNG plots of one run (plot.py, `megatron-gspo plot`)."""
