"""Test helpers for checkpoint conversion: tiny random HF models on disk and the rank functions run by
run_distributed (they must be importable at module level)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatron_gspo.models.config import preset

MAIN = dict(vocab_size=37)
"""The tiny preset with a vocabulary that TP=2 has to pad (37 -> 38) and that is no multiple of 128."""
ODD = dict(
    vocab_size=37,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,  # a single KV head
    head_dim=24,  # != hidden_size / heads = 16
    num_experts=16,  # more experts than the 2 x 4 = 8 tokens of a batch
    num_experts_per_tok=2,
    moe_intermediate_size=48,
)
"""Shapes beyond the tiny preset."""
BATCH = {"main": (2, 8), "odd": (2, 4)}


def model_config(kind: str):
    return preset("tiny", **(MAIN if kind == "main" else ODD))


def token_ids(kind: str) -> torch.Tensor:
    cfg = model_config(kind)
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, cfg.vocab_size, BATCH[kind], generator=g)


def save_random_hf_model(kind: str, out: Path, seed: int = 0) -> torch.Tensor:
    """Saves a random fp32 Qwen3MoeForCausalLM in several safetensors shards; returns its logits on token_ids."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(model_config(kind).to_hf_config()).float().eval()
    model.save_pretrained(out, max_shard_size="200KB")
    with torch.no_grad():
        return model(token_ids(kind)).logits


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (sharded) safetensors directory."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------------------------------------------------
# Rank functions
# ---------------------------------------------------------------------------------------------------------
def megatron_logits(chunks, cfg, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [B, S, V] through megatron's schedule (forward only), on the last pipeline stage."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.training.engine import forward_backward

    seq = ids.shape[1]
    positions = torch.arange(seq).unsqueeze(0)
    for c in chunks:
        c.eval()

    def step(mb, model):
        out = model(mb, positions.expand(mb.shape[0], -1), None)
        return out, lambda o: (o.sum() * 0, {"logits": o})

    with torch.no_grad():
        outs = forward_backward(
            chunks, list(ids.chunk(ids.shape[0])), step, seq_length=seq, micro_batch_size=1, forward_only=True
        )
    if not outs:
        return None
    local = torch.cat([o["logits"] for o in outs], dim=0)
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : cfg.vocab_size]


def load_and_run(ckpt: str, parallel, kind: str) -> torch.Tensor | None:
    """Builds `kind` in `parallel`, loads `ckpt` and returns its logits (None off the last stage)."""
    from megatron_gspo.checkpoint.model_io import load_model_checkpoint
    from megatron_gspo.models.build import build_model
    from megatron_gspo.parallel import initialize

    cfg = model_config(kind)
    initialize(parallel, seed=123)  # not the conversion's seed: the weights must come from the file
    chunks = build_model(cfg, parallel)
    load_model_checkpoint(chunks, ckpt)
    return megatron_logits(chunks, cfg, token_ids(kind))


def single_process_job(work: dict[str, str]) -> dict:
    """World size 1: convert both models each way (the main one through the CLI), logits of the loaded checkpoints,
    a bf16 conversion, and model_io's error paths."""
    from megatron_gspo.checkpoint.convert import convert_main, hf_to_megatron, megatron_to_hf
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    initialize(ParallelConfig())
    try:
        res: dict = {}
        argv = ["hf-to-megatron", "--hf", work["main_hf"], "--out", work["main_ck"], "--no-progress"]
        assert convert_main(argv) == 0
        hf_to_megatron(work["odd_hf"], work["odd_ck"], progress=False)
        for kind in ("main", "odd"):
            res[f"{kind}_logits"] = load_and_run(work[f"{kind}_ck"], ParallelConfig(), kind)
        argv = ["megatron-to-hf", "--ckpt", work["main_ck"], "--out", work["main_back"]]
        argv += ["--max-shard-size", "300KB", "--tokenizer", work["tokenizer"], "--no-progress"]
        assert convert_main(argv) == 0
        megatron_to_hf(work["odd_ck"], work["odd_back"], progress=False)
        hf_to_megatron(work["main_hf"], work["bf16_ck"], dtype="bf16", progress=False)
        megatron_to_hf(work["bf16_ck"], work["bf16_back"], progress=False)
        res["errors"] = model_io_errors(work)
        return res
    finally:
        shutdown()


def model_io_errors(work: dict[str, str]) -> dict:
    """Exercises model_io failures; returns the messages (and what is left on disk) for the parent to check."""
    from megatron_gspo.checkpoint import model_io
    from megatron_gspo.models.build import build_model
    from megatron_gspo.parallel import ParallelConfig, initialize

    out: dict = {}
    parallel = ParallelConfig()
    initialize(parallel)
    wrong = dataclasses.replace(model_config("main"), num_hidden_layers=2, num_experts_per_tok=3)
    chunks = build_model(wrong, parallel)
    try:
        model_io.load_model_checkpoint(chunks, work["main_ck"])
    except ValueError as err:
        out["config_mismatch"] = str(err)
    try:
        model_io.load_model_checkpoint(chunks, work["main_ck"] + "-nope")
    except FileNotFoundError as err:
        out["missing_dir"] = str(err)
    corrupt = Path(work["scratch"]) / "corrupt"
    corrupt.mkdir(parents=True)
    (corrupt / "model").mkdir()
    (corrupt / "config.json").write_text((Path(work["main_ck"]) / "config.json").read_text())
    marker = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    (corrupt / "model" / "metadata.json").write_text(marker)
    (corrupt / "model" / ".metadata").write_bytes(b"not a checkpoint")
    good = build_model(model_config("main"), parallel)
    try:
        model_io.load_model_checkpoint(good, corrupt)
    except ValueError as err:
        out["corrupt"] = str(err)

    # A trainer iteration dir: model checkpoint + extra files; also reachable through its model/ subdirectory.
    model_io.load_model_checkpoint(good, work["main_ck"])
    reference = [p.detach().clone() for p in good[0].parameters()]
    iter_dir = Path(work["scratch"]) / "run" / "iter_0000003"
    model_io.save_model_checkpoint(good, iter_dir, model_config("main"), metadata={"step": 3})
    (iter_dir / "trainer_state.json").write_text("{}")
    fresh = build_model(model_config("main"), parallel)
    model_io.load_model_checkpoint(fresh, iter_dir / "model")
    out["iter_dir_equal"] = all(torch.equal(a, b) for a, b in zip(reference, fresh[0].parameters()))
    out["iter_info"] = model_io.read_checkpoint_info(iter_dir)
    try:
        model_io.load_model_checkpoint(fresh, iter_dir.parent)
    except FileNotFoundError as err:
        out["run_dir"] = str(err)

    # A failing save leaves the existing checkpoint as it was and no temporary directory behind.
    before = sorted(p.name for p in iter_dir.iterdir())
    original = model_io.write_model_checkpoint

    def failing(*args, **kwargs):
        original(*args, **kwargs)
        raise OSError("disk full (simulated)")

    model_io.write_model_checkpoint = failing
    try:
        model_io.save_model_checkpoint(good, iter_dir, model_config("main"))
    except OSError as err:
        out["failed_save"] = str(err)
    finally:
        model_io.write_model_checkpoint = original
    out["after_failed_save"] = sorted(p.name for p in iter_dir.iterdir()) == before
    out["siblings"] = sorted(p.name for p in iter_dir.parent.iterdir())
    # Saving over an existing checkpoint replaces it once complete.
    model_io.save_model_checkpoint(good, iter_dir, model_config("main"), metadata={"step": 4})
    out["replaced_info"] = model_io.read_checkpoint_info(iter_dir)
    out["replaced_siblings"] = sorted(p.name for p in iter_dir.parent.iterdir())
    return out


def layouts_job(layouts: dict[str, dict], work: dict[str, str]) -> dict:
    """Two ranks, each layout in turn: load the single-process checkpoints, convert HF -> megatron in this layout,
    and (pp) also load with virtual pipeline stages and export megatron -> HF from this layout."""
    from megatron_gspo.checkpoint.convert import hf_to_megatron, megatron_to_hf
    from megatron_gspo.parallel import ParallelConfig, shutdown

    results: dict = {}
    try:
        for name, layout in layouts.items():
            parallel = ParallelConfig(**layout)
            res = results[name] = {"main_logits": load_and_run(work["main_ck"], parallel, "main")}
            if parallel.tp == 1:  # one KV head cannot be split over TP
                res["odd_logits"] = load_and_run(work["odd_ck"], parallel, "odd")
            if parallel.pp > 1:
                vpp = ParallelConfig(**layout, virtual_pp=2)
                res["vpp_logits"] = load_and_run(work["main_ck"], vpp, "main")
                megatron_to_hf(work["main_ck"], work[f"{name}_hf_out"], parallel=parallel, progress=False)
            hf_to_megatron(work["main_hf"], work[f"{name}_ck"], parallel, progress=False)
        return results
    finally:
        shutdown()


def reload_job(work: dict[str, str], names: list[str]) -> dict:
    """World size 1: megatron -> HF from checkpoints that were written by 2-rank layouts."""
    from megatron_gspo.checkpoint.convert import megatron_to_hf
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    initialize(ParallelConfig())
    try:
        for name in names:
            megatron_to_hf(work[f"{name}_ck"], work[f"{name}_back"], progress=False)
        return {}
    finally:
        shutdown()
