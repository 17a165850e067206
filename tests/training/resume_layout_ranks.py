"""Rank function of the layout-change resume tests: a trainer checkpoint written in one layout, resumed in another.

In layout A: one update on a rollout batch (so Adam's moments and the schedule have moved), a checkpoint, then
the "continue" update on the same batch. In layout B, in the same processes: --resume from that checkpoint, then
the same update. Everything is gathered to one layout (HF names, full tensors) so A and B compare directly.
"""

from __future__ import annotations

import os

import torch

from tests.training.test_end_to_end import MINI

EXAMPLE = "examples/tiny_moe_gspo.yaml"
COMMON = [*MINI, "trainer.minibatches=1", "trainer.steps=4", "data.reward=tests.training.rewards:contains_one",
          "optim.lr=3e-3", "optim.warmup_steps=2", "optim.min_lr=1e-4", "optim.eps=1e-4",
          "model.overrides.router_aux_loss_coef=0.01"]
"""A schedule that moves (warm-up then cosine), the recipes' load-balancing loss, one minibatch per step. Adam's
eps = 1e-4 bounds how much the update can react to a rounding difference of another layout's reductions
(|d update| <= lr / eps |d grad|); with 1e-8 a near-zero gradient element's step flips between +-lr."""


def _layout_args(layout: dict) -> list[str]:
    """parallel.<k>=v for each entry; dotted keys (e.g. optim.distributed) as they are."""
    return [f"{k if '.' in k else 'parallel.' + k}={str(v).lower()}" for k, v in layout.items()]


def _global_batch(trainer, batch):
    """The whole rollout batch (every data-parallel rank's rows, in rank order), on the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_gspo.batching.batch import RolloutBatch

    fields = ("tokens_NL", "loss_mask_NS", "engine_logprobs_NS", "rewards_N", "advantages_N", "old_logprobs_NS",
              "prompt_lens_N", "response_lens_N", "seq_index_N")
    mine = {f: getattr(batch, f).cpu() for f in fields if getattr(batch, f) is not None}
    group = ps.get_data_parallel_group()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return RolloutBatch(**{f: torch.cat([p[f] for p in parts]) for f in parts[0]})


def _fit(batch, seq_len: int):
    """The batch in a layout whose training length is `seq_len` (sequence parallelism pads it to a multiple of TP:
    the extra columns are padding, outside every loss mask)."""
    cut = batch.tokens_NL.shape[1] - 1 - seq_len
    assert cut >= 0 and not batch.loss_mask_NS[:, seq_len:].any()
    for name in ("loss_mask_NS", "engine_logprobs_NS", "old_logprobs_NS"):
        setattr(batch, name, getattr(batch, name)[:, :seq_len])
    batch.tokens_NL = batch.tokens_NL[:, : seq_len + 1]
    return batch


def _update(trainer, batch) -> dict:
    """One optimizer step on `batch` (this rank's rows); the step's loss metrics (None off the last stage / off TP
    rank 0), grad norm and the weights after it."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.models.hf_state import export_hf_state_dict

    (metrics,) = trainer.update(batch.to(trainer.rt.device))
    lead = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    trainer.rt.params_ready()
    return dict(parts={k: v.cpu() for k, v in metrics["loss_parts"].items()} if lead else None,
                grad_norm=metrics["grad_norm"], skipped=metrics["skipped"],
                weights={k: v.cpu() for k, v in export_hf_state_dict(trainer.rt.models).items()})


def _state(trainer) -> dict:
    from megatron_gspo.models.hf_state import export_hf_state_dict
    from tests.training.optimizer_state import full_optimizer_state

    trainer.rt.params_ready()
    return dict(optimizer=full_optimizer_state(trainer.rt.chunks, trainer.rt.optimizer),
                weights={k: v.cpu() for k, v in export_hf_state_dict(trainer.rt.models).items()},
                scheduler=trainer.rt.scheduler.state_dict(), sampler=trainer.sampler.state_dict(), step=trainer.step,
                lr=trainer.rt.optimizer.param_groups[0]["lr"])


def resume_in_other_layouts(work: str, pairs: dict[str, tuple[dict, dict]]) -> dict:
    """{pair name: {"saved", "resumed" (states), "continued", "after_resume" (updates), "log"}} for each
    (layout A, layout B) pair, one after another in these processes."""
    import logging

    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    out: dict = {}
    port = int(os.environ["MASTER_PORT"])

    def next_group() -> None:
        # Each trainer starts (and closes) its own process group; a new group on the port of a destroyed one
        # waits for the old store, so every trainer after the first rendezvouses on the next port.
        nonlocal port
        if not torch.distributed.is_initialized() and next_group.used:
            port += 1
            os.environ["MASTER_PORT"] = str(port)
        next_group.used = True

    next_group.used = False
    for name, (layout_a, layout_b) in pairs.items():
        run = [*COMMON, f"trainer.run_dir={work}/{name}"]
        next_group()
        trainer = GSPOTrainer(load_run_config(EXAMPLE, [*run, *_layout_args(layout_a)]))
        try:
            next(trainer.sampler)  # a sampler position that is not the start
            batch, _ = trainer.collect(step_seed=123)
            trainer.old_logprobs(batch)
            trainer.update(batch)
            trainer.step = 1
            trainer.checkpoint()
            saved = _state(trainer)
            data = _global_batch(trainer, batch)
            continued = _update(trainer, batch)
        finally:
            trainer.close()

        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())
        trainer_log = logging.getLogger("megatron_gspo.training.trainer")
        trainer_log.addHandler(handler)
        level = trainer_log.level
        trainer_log.setLevel(logging.INFO)
        try:
            next_group()
            trainer = GSPOTrainer(load_run_config(EXAMPLE, [*run, *_layout_args(layout_b)]), resume=True)
        finally:
            trainer_log.removeHandler(handler)
            trainer_log.setLevel(level)
        try:
            resumed = _state(trainer)
            per = data.num_sequences // trainer.rt.dp.size
            mine = _fit(data.rows(slice(trainer.rt.dp.rank * per, (trainer.rt.dp.rank + 1) * per)), trainer.rt.seq_len)
            after = _update(trainer, mine)
        finally:
            trainer.close()
        out[name] = dict(saved=saved, resumed=resumed, continued=continued, after_resume=after, log=records)
    return out
