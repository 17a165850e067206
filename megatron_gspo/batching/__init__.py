"""The batching package, one way: RolloutBatch (batch.py) -> minibatches and micro-batch plan (micro_batches.py:
token budget with bin_packing.py, replica balance with dp_balance.py) -> model inputs, padded or packed THD
(inputs.py) -> response-token log-probs from the last stage's output (logprobs.py)."""
