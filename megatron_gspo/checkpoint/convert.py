"""Checkpoint conversion: Hugging Face Qwen3-MoE safetensors <-> megatron-gspo model checkpoints.

    megatron-gspo convert hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N --etp N] [--dtype bf16]
    megatron-gspo convert megatron-to-hf --ckpt DIR --out DIR [--dtype bf16] [--tokenizer DIR] [--max-shard-size 5GB]

Both run in one process or under torchrun (every rank then builds and handles only its own shards).

Memory: hf-to-megatron validates names and shapes from the safetensors headers alone, then builds this rank's
model shard and fills it through `HFCheckpointReader`, which reads one HF tensor when `load_hf_state_dict` asks for
it (one shard memory-mapped at a time; tensors of other ranks are never read): beyond its model shard a rank holds
one parameter's HF tensors (q/k/v, or gate/up, or one other) plus that parameter's full megatron form. So a 30B
model needs no rank to hold all of it as long as the layout splits it (e.g. torchrun with --pp/--ep on CPU hosts;
on GPUs the parameters live in device memory). megatron-to-hf streams `iter_hf_tensors` (one gathered tensor at a
time) into `write_hf_checkpoint` on rank 0, which keeps at most one output shard in memory.

Both functions (re)initialize megatron's parallel state for `parallel`: they are for conversion processes, not for
calling inside a training run (a trainer exports its live model with `iter_hf_tensors` instead).

Errors in the input (missing / unexpected / mis-shaped tensors, an unsupported architecture, a config.json that
disagrees with the weights) are reported before anything is built or written; output goes to a temporary directory
renamed into place at the end, so a failed conversion leaves nothing at `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.checkpoint.dist_io import raise_rank0_failure
from megatron_gspo.checkpoint.hf_io import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPE_NAMES,
    HFCheckpointReader,
    hf_config_extras,
    parse_dtype,
    tokenizer_files,
    write_hf_checkpoint,
)
from megatron_gspo.checkpoint.model_io import (
    load_model_checkpoint,
    read_checkpoint_info,
    read_model_config,
    resolve_model_checkpoint,
    save_model_checkpoint,
)
from megatron_gspo.models.config import ModelConfig
from megatron_gspo.models.hf_state import count_tensors, hf_tensor_shapes, tensor_listing, weight_problems
from megatron_gspo.parallel.config import ParallelConfig

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------------------
# Validation (headers only)
# ---------------------------------------------------------------------------------------------------------
def inspect_hf_checkpoint(hf_dir: str | Path) -> tuple[ModelConfig, HFCheckpointReader]:
    """Reads config.json and the safetensors headers of `hf_dir` and checks that they agree.

    Returns the ModelConfig and an open lazy reader. Raises ValueError listing every problem (missing, unexpected
    and mis-shaped tensors, with what the weights say about the config), FileNotFoundError for missing files.
    No tensor data is read.
    """
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json (is it a Hugging Face model directory?)")
    try:
        cfg = ModelConfig.from_hf_config(hf_dir)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{hf_dir / 'config.json'}: {err}") from err
    reader = HFCheckpointReader(hf_dir)
    problems = weight_problems(cfg, reader.shapes)
    not_float = sorted(n for n, t in reader.shapes.items() if not t.dtype.is_floating_point)
    if not_float:
        problems.append(f"{count_tensors(not_float)} not floating point: {tensor_listing(not_float)}")
    if problems:
        reader.close()
        listing = "\n  - ".join(problems)
        raise ValueError(f"Hugging Face checkpoint {hf_dir} does not match its config.json:\n  - {listing}")
    return cfg, reader


def _stored_dtype(reader: HFCheckpointReader) -> torch.dtype:
    """The dtype of most of the checkpoint's bytes."""
    weight: dict[torch.dtype, int] = defaultdict(int)
    for t in reader.shapes.values():
        weight[t.dtype] += t.numel() * t.element_size()
    dtype = max(weight, key=weight.get)
    if dtype not in DTYPE_NAMES.values():
        raise ValueError(f"the weights are stored as {dtype}; pass dtype=fp32, bf16 or fp16 explicitly")
    return dtype


def _check_out(out: Path, overwrite: bool, *sources: Path) -> None:
    for src in sources:
        if out.resolve() == src.resolve():
            raise ValueError(f"--out {out} is the input directory; choose a new output directory")
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"--out {out} already exists; remove it, choose another directory or pass --overwrite"
        )


# ---------------------------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------------------------
class _ShardProgress:
    """tqdm bar over the input shards: each tensor read advances it by its share of its shard's bytes. With several
    ranks it shows rank 0, which reads only the tensors of its own model shard (so it may end below the total)."""

    def __init__(self, reader: HFCheckpointReader, enabled: bool, world_size: int):
        from tqdm.auto import tqdm

        self.reader = reader
        self.bar = tqdm(
            total=len(reader.files),
            desc="hf->megatron: reading shards" + (" (rank 0's tensors)" if world_size > 1 else ""),
            unit="shard",
            disable=not enabled,
            bar_format="{l_bar}{bar}| {n:.1f}/{total_fmt} shards [{elapsed}<{remaining}]",
        )

    def __call__(self, name: str, nbytes: int, file: str) -> None:
        self.bar.update(nbytes / max(1, self.reader.file_bytes[file]))

    def close(self) -> None:
        self.bar.n = round(self.bar.n, 6)
        self.bar.close()


def hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    parallel: ParallelConfig | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Converts a Hugging Face Qwen3-MoE checkpoint into a model checkpoint at `out_dir` (see model_io).

    `parallel` is the layout to build in (default: one process; under torchrun it must fit the world size); the
    result loads into any layout. `dtype`: fp32 / bf16 / fp16, or None to keep the dtype the weights are stored in.
    Every rank calls it; each reads only the HF tensors of its own shard.
    """
    from megatron_gspo.models.build import BuildOptions, build_model, validate_layout
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import initialize, shutdown

    hf_dir, out = Path(hf_dir), Path(out_dir)
    _check_out(out, overwrite, hf_dir)
    parallel = parallel or ParallelConfig()
    cfg, reader = inspect_hf_checkpoint(hf_dir)
    owns_dist = not dist.is_initialized()
    try:
        dtype = parse_dtype(dtype) or _stored_dtype(reader)
        validate_layout(cfg, parallel)
        env = initialize(parallel)
        chunks = build_model(cfg, parallel, BuildOptions(dtype=dtype))
        bar = _ShardProgress(reader, enabled=progress and env.rank == 0, world_size=env.world_size)
        reader.on_read = bar
        try:
            # strict=False: names and shapes were checked from the headers (strict would read every tensor).
            load_hf_state_dict(chunks, reader, strict=False)
        finally:
            reader.on_read = None
            bar.close()
        metadata = {
            "source": f"huggingface:{hf_dir.resolve()}",
            "hf_config_extras": hf_config_extras(json.loads((hf_dir / "config.json").read_text())),
        }
        save_model_checkpoint(chunks, out, cfg, metadata=metadata)
        if env.rank == 0:
            log.info("wrote model checkpoint %s (%s, built as %s)", out, str(dtype), parallel)
        return out
    finally:
        reader.close()
        if owns_dist:
            shutdown()


def megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    parallel: ParallelConfig | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Writes a model checkpoint (or trainer iteration dir) as a transformers-loadable HF checkpoint at `out_dir`.

    Safetensors shards of at most `max_shard_bytes`, the index, config.json and, from `tokenizer_dir`, the tokenizer
    files. `dtype` defaults to the checkpoint's. `parallel` is the layout to load in (default: one process; under
    torchrun pass a layout that fits the world size). Every rank calls it; rank 0 writes.
    """
    from megatron_gspo.models.build import BuildOptions, build_model, validate_layout
    from megatron_gspo.models.hf_state import iter_hf_tensors
    from megatron_gspo.parallel import initialize, shutdown

    root, out = resolve_model_checkpoint(ckpt_dir), Path(out_dir)
    _check_out(out, overwrite, root)
    if tokenizer_dir is not None:
        tokenizer_files(tokenizer_dir)  # fail before any work
    cfg = read_model_config(root)
    info = read_checkpoint_info(root)
    stored = parse_dtype(info.get("dtype", "float32"))
    out_dtype = parse_dtype(dtype) or stored
    parallel = parallel or ParallelConfig()
    validate_layout(cfg, parallel)
    owns_dist = not dist.is_initialized()
    try:
        env = initialize(parallel)
        chunks = build_model(cfg, parallel, BuildOptions(dtype=stored))
        load_model_checkpoint(chunks, root)
        stream = iter_hf_tensors(chunks, dst=0, dtype=out_dtype)
        error = None
        if env.rank == 0:
            from tqdm.auto import tqdm

            total = len(hf_tensor_shapes(cfg))
            bar = tqdm(total=total, desc="megatron->hf", unit="tensor", disable=not progress)
            try:
                write_hf_checkpoint(
                    stream,
                    out,
                    cfg,
                    max_shard_bytes=max_shard_bytes,
                    tokenizer_dir=tokenizer_dir,
                    config_extras=info.get("hf_config_extras"),
                    overwrite=overwrite,
                    progress=lambda name, t: bar.update(),
                )
            except Exception as err:  # noqa: BLE001 - re-raised after the other ranks are released
                error = err
            finally:
                bar.close()
        for _ in stream:  # ranks > 0 take part in the gathers; rank 0 drains what is left after a failure
            pass
        raise_rank0_failure(error, f"writing {out}")
        return out
    finally:
        if owns_dist:
            shutdown()


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
OVERWRITE_HELP = "replace an existing --out once the new one is complete"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB' (10^9), '200KB', '1GiB' (2^30), '1000000' -> bytes (transformers' max_shard_size convention)."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 200KB")
    unit = (m[2] or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0] if unit[0] in "KMGT" else "B"]
    size = int(float(m[1]) * base**power)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return size


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-gspo convert",
        description="Convert Qwen3-MoE checkpoints between Hugging Face and Megatron.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{hf-to-megatron,megatron-to-hf}")
    dtypes = ["auto", *DTYPE_NAMES]

    def layout(p: argparse.ArgumentParser, what: str) -> None:
        g = p.add_argument_group(f"layout to {what} in (default: one process; under torchrun it must fit)")
        g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
        g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
        g.add_argument("--ep", type=int, default=1, help="expert-parallel size")
        g.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size")

    a = sub.add_parser("hf-to-megatron", help="HF safetensors -> megatron checkpoint (loads in any layout)")
    a.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output model checkpoint directory (must not exist)")
    a.add_argument("--dtype", choices=dtypes, default="auto", help="parameter dtype (auto: as stored)")
    layout(a, "convert")
    a.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    a.add_argument("--no-progress", action="store_true", help="no progress bar")

    b = sub.add_parser("megatron-to-hf", help="megatron model checkpoint -> HF safetensors for transformers")
    b.add_argument("--ckpt", required=True, help="model checkpoint or trainer iteration directory")
    b.add_argument("--out", required=True, help="output Hugging Face directory (must not exist)")
    b.add_argument("--dtype", choices=dtypes, default="auto", help="output dtype (auto: as stored)")
    b.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied along")
    b.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="largest shard (e.g. 5GB, 200KB)",
    )
    layout(b, "load")
    b.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def convert_main(argv: list[str] | None = None) -> int:
    """Entry point of `megatron-gspo convert`: returns 0 on success, 2 on bad input (the error on stderr)."""
    args = _parser().parse_args(argv)
    try:
        # sequence parallelism does not change the weights; megatron requires it for TP with MoE layers
        parallel = ParallelConfig(
            tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, sequence_parallel=args.tp > 1
        )
        if args.command == "hf-to-megatron":
            out = hf_to_megatron(
                args.hf,
                args.out,
                parallel,
                args.dtype,
                overwrite=args.overwrite,
                progress=not args.no_progress,
            )
        else:
            out = megatron_to_hf(
                args.ckpt,
                args.out,
                dtype=args.dtype,
                tokenizer_dir=args.tokenizer,
                max_shard_bytes=args.max_shard_size,
                parallel=parallel,
                overwrite=args.overwrite,
                progress=not args.no_progress,
            )
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"megatron-gspo convert {args.command}: error: {err}", file=sys.stderr)
        return 2
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        print(_summary(args.command, Path(out)))
    return 0


def _summary(command: str, out: Path) -> str:
    if command == "hf-to-megatron":
        info = read_checkpoint_info(out)
        lay = info.get("layout", {})
        return (
            f"wrote {out}: megatron model checkpoint, {info.get('dtype')}, written with tp={lay.get('tp')} "
            f"pp={lay.get('pp')} ep={lay.get('ep')} (loads in any layout)"
        )
    shards = sorted(out.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards) / 1e6
    extra = sorted(p.name for p in out.iterdir() if p.suffix != ".safetensors")
    return f"wrote {out}: {len(shards)} safetensors shard(s), {size:.1f} MB, {', '.join(extra)}"


if __name__ == "__main__":
    sys.exit(convert_main())
