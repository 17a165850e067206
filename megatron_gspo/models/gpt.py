"""megatron-core's GPTModel that can hand back its final hidden states instead of LM-head logits.

The RL losses need log-probs of response tokens only. `GPTModel._postprocess` (megatron-core 0.16) runs the output
layer over every position, materialising [tokens, vocab / TP] logits for prompts and padding too. With
`output_hidden_states=True` the last pipeline stage returns the decoder output (after the final norm) as it
enters the output layer -- [s, b, h], sequence-split over TP ranks under sequence parallelism -- and the caller
computes log-probs from it and `output_layer.weight` with the fused kernel (batching/logprobs.py). Without the
flag nothing changes (generation, SFT and the logits reference path get logits).
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel


class Qwen3MoEModel(GPTModel):
    """GPTModel with `forward(..., output_hidden_states=True)` returning the final hidden states [s, b, h]."""

    _return_hidden = False

    def forward(self, *args, output_hidden_states: bool = False, **kwargs):
        if output_hidden_states and self.config.mtp_num_layers:
            raise ValueError("output_hidden_states with multi-token prediction layers is not supported")
        self._return_hidden = output_hidden_states
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._return_hidden = False

    def _postprocess(self, hidden_states, *args, **kwargs):
        if self._return_hidden:
            # Pre-LM-head activations; intermediate pipeline stages return the same thing anyway.
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)
