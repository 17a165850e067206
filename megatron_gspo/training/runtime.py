"""What every job (train, sft, eval) sets up: process groups, tokenizer, data, the DDP model, its optimizer and
schedule, and a rollout engine over the training model. Megatron globals are touched here and in engine.py."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_gspo.data.dataset import load_datasets
from megatron_gspo.data.tokenizer import load_tokenizer
from megatron_gspo.models.build import BuildOptions
from megatron_gspo.parallel import initialize, shutdown
from megatron_gspo.rollout.types import SamplingParams
from megatron_gspo.training.config import RunConfig
from megatron_gspo.training.engine import build_ddp_model, build_optimizer, finish_param_gather, unwrap
from megatron_gspo.training.optim_config import OptimConfig

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class DataParallelInfo:
    """This rank's place among data-parallel replicas."""

    rank: int
    size: int


class Runtime:
    """Set-up shared by `train`, `sft` and `eval` (one per process)."""

    def __init__(
        self,
        cfg: RunConfig,
        optim: OptimConfig,
        total_steps: int,
        *,
        routing_replay: bool = False,
        resume: bool = False,
    ):
        self.cfg = cfg
        self.resume = resume
        """The run continues one (--resume) whose trainer may have been killed: the rollout engine undoes what that
        trainer left on attached servers (rollout/sglang/engine.py `_undo_dead_trainer`)."""
        self.env = initialize(cfg.parallel, seed=cfg.trainer.seed)
        self.model_config = cfg.model.model_config()
        self.dtype = _DTYPES[cfg.model.dtype]
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} ids but model.vocab_size={self.model_config.vocab_size}"
            )
        self.train_data, self.heldout_data = load_datasets(cfg.data)
        self.dp = DataParallelInfo(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        self.chunks = build_ddp_model(
            self.model_config,
            cfg.parallel,
            BuildOptions(
                dtype=self.dtype, recompute=cfg.model.recompute, routing_replay=routing_replay, use_te=cfg.model.use_te
            ),
            optim,
        )
        self.models = [unwrap(c) for c in self.chunks]
        self.device: torch.device = next(self.models[0].parameters()).device
        """The model's device: every tensor that meets the model or a collective is made on it or moved to it."""
        self.optimizer = build_optimizer(self.chunks, optim, self.dtype)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim.warmup_steps else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=optim.warmup_steps,
            lr_decay_steps=max(total_steps, optim.warmup_steps + 1),
            lr_decay_style="constant" if optim.min_lr == optim.lr or optim.min_lr == 0 else "cosine",
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
        )
        self.max_prompt_len = self._max_prompt_len()
        # Sequence parallelism splits the sequence over TP ranks: pad the fixed training length up to a multiple of
        # that split; the extra columns are padding, never in the loss. (parallel.cp is always 1: ParallelConfig.)
        split = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
        self.seq_len = -(-(self.max_prompt_len + cfg.rollout.max_new_tokens) // split) * split
        if self.seq_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"prompts ({self.max_prompt_len} tokens) + rollout.max_new_tokens exceed "
                f"model.max_position_embeddings={self.model_config.max_position_embeddings}"
            )
        self.engine = self._make_engine()
        if cfg.model.load:
            self.load_model(cfg.model.load)
        elif cfg.rollout.engine != "local":
            # Servers start from their own checkpoint; push the trainer's weights so both policies are equal.
            self.sync_engine(0)

    # ---- helpers ----------------------------------------------------------------------------------------
    @property
    def is_logging_rank(self) -> bool:
        return self.env.rank == 0

    def _max_prompt_len(self) -> int:
        longest = 0
        for data in (self.train_data, self.heldout_data):
            if data is None:
                continue
            for item in data:
                longest = max(longest, len(self.encode_prompt(item.prompt)))
        return longest

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        bos = getattr(self.tokenizer, "bos_id", None)
        return ([bos] if bos is not None else []) + ids

    def _make_engine(self):
        if self.cfg.rollout.engine == "sglang":
            from megatron_gspo.rollout.sglang import make_sglang_engine

            return make_sglang_engine(self)
        if self.cfg.rollout.engine == "vllm":
            from megatron_gspo.rollout.vllm.engine import make_vllm_engine

            return make_vllm_engine(self)
        from megatron_gspo.rollout.local import LocalEngine

        local = self.cfg.rollout.local
        return LocalEngine(
            self.models,
            self.model_config,
            pad_id=self.tokenizer.pad_id,
            backend=local.backend,
            dtype=local.torch_dtype(),
        )

    def sampling(self, n: int, temperature: float, seed: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_p=r.top_p if temperature > 0 else 1.0,
            top_k=r.top_k if temperature > 0 else 0,
            stop_token_ids=tuple(self.tokenizer.stop_ids),
            n=n,
            seed=seed,
        )

    def shard(self, items: list) -> list:
        """This data-parallel rank's contiguous share of a global list."""
        if len(items) % self.dp.size:
            raise ValueError(f"{len(items)} items do not split over {self.dp.size} data-parallel ranks")
        per = len(items) // self.dp.size
        return items[self.dp.rank * per : (self.dp.rank + 1) * per]

    def gather_objects(self, obj) -> list:
        """all_gather_object over the whole world (small metadata only)."""
        if dist.get_world_size() == 1:
            return [obj]
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def load_weights(self, path, *, verify: bool = True) -> dict:
        """Loads a model checkpoint into the chunks and makes the optimizer's master weights follow it.

        In bf16 / fp16 megatron's `Float16OptimizerWithFloat16Params` clones fp32 main params of the model as it is
        when the optimizer is built (the random init) and copies them back into the model after every `step()`:
        without `reload_model_params()` the first step would write random init + update over the loaded weights
        (Megatron-LM calls it after every model-only load). With fp32 (`FP32Optimizer`) it is a no-op. Every load
        into a Runtime's model goes through here. Returns the checkpoint's megatron_gspo.json. `verify`: check the
        files against the checkpoint's integrity record first (False: the caller did).
        """
        from megatron_gspo.checkpoint.model_io import load_model_checkpoint

        info = load_model_checkpoint(self.models, path, verify=verify)
        self.optimizer.reload_model_params()
        return info

    def load_model(self, path: str) -> None:
        """`model.load`: the weights (and master weights) from `path`, then the rollout engine synced to them."""
        self.load_weights(path)
        self.sync_engine(0)

    def params_ready(self) -> None:
        """Makes the model's params whole before anything reads them without a forward (weight export, checkpoint):
        with the distributed optimizer's `overlap_param_gather`, updated shards otherwise arrive only in the next
        forward (engine.finish_param_gather)."""
        finish_param_gather(self.chunks)

    def sync_engine(self, version: int) -> None:
        """Pushes the current weights to the rollout engine (complete params, never a mix of shards)."""
        self.params_ready()
        self.engine.update_weights(self.models, version)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            shutdown()


def configure_logging() -> None:
    """Rank-0 INFO logging; other ranks WARNING."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[%(asctime)s r{rank}] %(message)s", datefmt="%H:%M:%S")
    # megatron-core logs every parameter and config at INFO; keep its warnings only.
    logging.getLogger("megatron").setLevel(logging.WARNING)
