"""megatron-core's GPTModel that can hand back its final hidden states instead of LM-head logits.

The RL losses need log-probs of response tokens only. `GPTModel._postprocess` (megatron-core 0.16) runs the output
layer over every position, materialising [tokens, vocab / TP] logits for prompts and padding too. With
`output_hidden_states=True` the last pipeline stage returns the decoder output (after the final norm) as it
enters the output layer -- [s, b, h], sequence-split over TP ranks under sequence parallelism -- and the caller
computes log-probs from it and `output_layer.weight` with the fused kernel (batching/logprobs.py). Without the
flag nothing changes (generation, SFT and the logits reference path get logits).

Skipping the output layer's forward skips its forward pre-hooks too. megatron's DDP registers one on every module
under `overlap_param_gather`: it is the only wait for the all-gather of that module's parameter bucket (and it
dispatches the next bucket's), megatron-core 0.16 distributed/distributed_data_parallel.py `_make_forward_pre_hook`.
The LM head is in its own bucket at a real vocabulary size, so without the wait the fused kernel would read a
weight whose other ranks' rows are still in flight, and the next step's dispatch would find the gather unfinished
(`assert self.param_gather_handle is None`, param_and_grad_buffer.py:270). The hidden-states path therefore runs
the output layer's pre-hooks itself, exactly where its forward would have run.
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
            if self.post_process and self.output_layer is not None:
                _run_forward_pre_hooks(self.output_layer, hidden_states)
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)


def _run_forward_pre_hooks(module, *args) -> None:
    """Runs `module`'s own forward pre-hooks as a call of `module(*args)` would, without its forward (their return
    values, which would replace the inputs, are not used: nothing is computed from them)."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, args, {})
        else:
            hook(module, args)
