"""Cold-start supervised fine-tuning: teacher-forced cross-entropy on the reference answers.

The paper starts RL from a cold-start SFT model. REFERENCE.md §8: on the synthetic task accuracy jumps suddenly,
so the stage stops on a held-out accuracy target rather than a step count.
"""

from __future__ import annotations

import logging
import time

import torch

from megatron_gspo.batching.logprobs import token_logprobs_from_logits
from megatron_gspo.data.dataset import PromptSampler
from megatron_gspo.rewards.registry import RewardScorer
from megatron_gspo.training.config import RunConfig
from megatron_gspo.training.engine import forward_backward
from megatron_gspo.training.evaluate import evaluate
from megatron_gspo.training.optim_config import OptimConfig
from megatron_gspo.training.runtime import Runtime
from megatron_gspo.training.steps import model_forward

log = logging.getLogger(__name__)


def _sft_batch(rt: Runtime, items) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the model's device: tokens [B, S+1] (prompt + answer + eos, right-padded), a loss mask over answer + eos
    labels [B, S] and the input lengths [B] (real tokens fed for a prediction; the rest is padding)."""
    s = rt.seq_len
    tokens = torch.full((len(items), s + 1), rt.tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), s), dtype=torch.bool)
    lens = torch.zeros(len(items), dtype=torch.long)
    for i, it in enumerate(items):
        prompt = rt.encode_prompt(it.prompt)
        answer = rt.tokenizer.encode(it.answer) + [rt.tokenizer.eos_id]
        seq = (prompt + answer)[: s + 1]
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, len(prompt) - 1 : len(seq) - 1] = True
        lens[i] = len(seq) - 1
    # Built on the host, moved to the model's device once.
    return tokens.to(rt.device), mask.to(rt.device), lens.to(rt.device)


def sft_forward_step(vocab_size: int):
    """The forward step of one SFT micro-batch (tokens, loss mask, input lengths): the summed negative
    log-likelihood of the answer tokens, with the token count as megatron's loss unit (token-mean cross-entropy)."""

    def fwd(mb, model):
        toks, m, lens = mb
        out = model_forward(model, toks, lens)

        def reduce(logits):
            lp = token_logprobs_from_logits(logits, toks[:, 1:], m, vocab_size, 1.0)
            return -lp.token_logprobs.sum(), m.sum().to(torch.int), {}

        return out, reduce

    return fwd


def sft_runtime(cfg: RunConfig) -> Runtime:
    """A Runtime with the SFT optimizer settings."""
    s, o = cfg.sft, cfg.optim
    # SFT's own step settings; how the optimizer is distributed is the run's (optim.*).
    optim = OptimConfig(lr=s.lr, warmup_steps=s.warmup_steps, beta2=0.99, clip_grad=1.0, distributed=o.distributed,
                        overlap_grad_reduce=o.overlap_grad_reduce, overlap_param_gather=o.overlap_param_gather,
                        bucket_size=o.bucket_size)
    return Runtime(cfg, optim, s.max_steps)


def run_sft(cfg: RunConfig, out_dir: str | None = None) -> dict:
    """Trains until held-out greedy accuracy >= sft.target_accuracy (or sft.max_steps); saves the model."""
    rt = sft_runtime(cfg)
    scorer = RewardScorer(cfg.data.reward, scoring=cfg.scoring)  # one worker pool for every held-out check
    try:
        result = sft_loop(rt, scorer)
        if out_dir:
            from megatron_gspo.checkpoint.model_io import save_model_checkpoint

            rt.params_ready()
            save_model_checkpoint(rt.models, out_dir, rt.model_config, metadata=result)
            log.info("SFT model saved to %s", out_dir)
        return result
    finally:
        scorer.close()
        rt.close()


def sft_loop(rt: Runtime, scorer: RewardScorer | None = None) -> dict:
    """The SFT steps on an existing Runtime; returns {sft_steps, sft_accuracy, sft_seconds}."""
    cfg, s = rt.cfg, rt.cfg.sft
    sampler = PromptSampler(rt.train_data, s.batch_size, seed=cfg.data.seed + 17)
    fwd = sft_forward_step(rt.model_config.vocab_size)
    mbs = min(cfg.trainer.micro_batch_size, s.batch_size // rt.dp.size)
    start, step, acc = time.time(), 0, 0.0
    for step in range(1, s.max_steps + 1):
        tokens, mask, lens = _sft_batch(rt, rt.shard(next(sampler)))
        micro = list(zip(tokens.split(mbs), mask.split(mbs), lens.split(mbs)))
        forward_backward(rt.chunks, micro, fwd, seq_length=rt.seq_len, micro_batch_size=mbs,
                         units_of=lambda mb: int(mb[1].sum()))
        ok, grad_norm, _ = rt.optimizer.step()
        if ok:
            rt.scheduler.step(increment=1)
        if step % s.eval_every == 0 or step == s.max_steps:
            rt.sync_engine(step)
            acc = evaluate(rt, seed=step, temperature=0.0, max_prompts=s.eval_prompts, scorer=scorer)["eval_accuracy"]
            log.info("sft step %d: held-out greedy accuracy %.3f", step, acc)
            if s.target_accuracy and acc >= s.target_accuracy:
                break
    return {"sft_steps": step, "sft_accuracy": acc, "sft_seconds": time.time() - start}
