"""`megatron-gspo plan`: validate a layout, count parameters, estimate per-GPU memory, suggest layouts that fit.

Inputs, highest precedence first: command-line flags, the run config of `--config`, defaults. From the config only
these keys of the run-config schema (`megatron_gspo.training.config`) are read; other keys and sections are ignored:
  model.preset, model.hf_config, model.overrides   the architecture (as `ModelSection.model_config()` builds it)
  model.recompute                                  activation recompute
  parallel.{tp, pp, ep, etp, cp, sequence_parallel, virtual_pp}
  trainer.micro_batch_size
  trainer.prompts_per_step x rollout.group_size    sequences per rollout batch (the routing-replay cache)
  ... / trainer.minibatches                        sequences per optimizer step (the global batch)
A key the file leaves out takes the schema's default, as in the run itself (e.g. model.preset=tiny,
trainer.micro_batch_size=16). Without --config: model qwen3-30b-a3b, micro-batch 1, global batch 256 sequences,
rollout batch 4x the global batch (paper §5.1: 4 minibatches), recompute selective.

The memory model is the GPU training path whatever model.dtype says: bf16 weights, fp32 main grads, distributed
optimizer (planning/memory.py).

Exit status: 0 when the given layout fits (or, without one, when some suggested layout fits), 1 when it does not,
2 for invalid input (each message names its key).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from megatron_gspo.models.config import PRESETS, ModelConfig, preset
from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.planning.layouts import Cluster, LayoutError, LayoutPlan, plan_layout, suggest_layouts
from megatron_gspo.planning.memory import (
    LOGPROB_CHOICES,
    RECOMPUTE_CHOICES,
    REPLAY_CHOICES,
    GiB,
    MemoryAssumptions,
    Workload,
)
from megatron_gspo.planning.params import count_parameters, format_count

DEFAULT_PRESET = "qwen3-30b-a3b"
DEFAULT_GLOBAL_BATCH = 256
DEFAULT_RECOMPUTE = "selective"
PARALLEL_KEYS = ("tp", "pp", "ep", "etp", "cp", "sequence_parallel", "virtual_pp")


@dataclass
class ConfigInputs:
    """What the planner takes from a run config file (None: no config file)."""

    name: str | None = None
    """Model name for the report (the preset, or the hf_config path)."""
    model: ModelConfig | None = None
    """model.preset / model.hf_config / model.overrides, resolved."""
    recompute: str | None = None
    """model.recompute."""
    parallel: dict[str, Any] = field(default_factory=dict)
    """parallel.<key> for PARALLEL_KEYS."""
    micro_batch_size: int | None = None
    """trainer.micro_batch_size."""
    global_batch_size: int | None = None
    """Sequences per optimizer step: trainer.prompts_per_step * rollout.group_size / trainer.minibatches."""
    rollout_batch_size: int | None = None
    """Sequences per rollout batch: trainer.prompts_per_step * rollout.group_size."""


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a section (mapping) in the config file, got {value!r}")
    return value


def _known(cls: type, section: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in section.items() if k in names}


def _int(section: dict[str, Any], name: str, key: str, default: int) -> int:
    """section[key] (else the schema's default) as a positive int; errors name the key."""
    value = section.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}.{key}={value!r} must be a positive integer")
    return value


def read_config(path: str | Path) -> ConfigInputs:
    """The planner's keys of a YAML run config (module docstring); other keys are ignored."""
    import yaml

    # The run-config schema gives the defaults of keys the file leaves out (imported here: it pulls in torch).
    from megatron_gspo.training.config import ModelSection, RolloutConfig, TrainerConfig

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: invalid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the top level must be a mapping of sections")
    section = ModelSection(**_known(ModelSection, _section(data, "model")))
    trainer, rollout = _section(data, "trainer"), _section(data, "rollout")
    trainer_defaults, rollout_defaults = TrainerConfig(), RolloutConfig()
    prompts = _int(trainer, "trainer", "prompts_per_step", trainer_defaults.prompts_per_step)
    group = _int(rollout, "rollout", "group_size", rollout_defaults.group_size)
    minibatches = _int(trainer, "trainer", "minibatches", trainer_defaults.minibatches)
    if (prompts * group) % minibatches:
        raise ValueError(
            f"trainer.minibatches={minibatches} does not divide trainer.prompts_per_step*rollout.group_size="
            f"{prompts}*{group}={prompts * group}"
        )
    return ConfigInputs(
        name=section.preset if section.hf_config is None else str(section.hf_config),
        model=section.model_config(),
        recompute=section.recompute,
        parallel={k: v for k, v in _section(data, "parallel").items() if k in PARALLEL_KEYS and v is not None},
        micro_batch_size=_int(trainer, "trainer", "micro_batch_size", trainer_defaults.micro_batch_size),
        global_batch_size=prompts * group // minibatches,
        rollout_batch_size=prompts * group,
    )


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    return next((v for v in values if v is not None), None)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `megatron-gspo plan` (flags left unset fall back to the config file, then to defaults)."""
    p = argparse.ArgumentParser(
        prog="megatron-gspo plan",
        description="Validate a parallel layout, count parameters, estimate per-GPU memory and suggest layouts.",
    )
    p.add_argument("--config", help="run config YAML (reads model.*, parallel.*, trainer/rollout batch sizes)")
    p.add_argument(
        "--preset", help=f"model preset {sorted(PRESETS)} (default: the config's model, else {DEFAULT_PRESET})"
    )
    p.add_argument("--nodes", type=int, default=1, help="training nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="usable memory per GPU in GiB (default 80)")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence, prompt + response (default 8192)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (default: config, else 1)")
    p.add_argument(
        "--global-batch-size", type=int, help=f"sequences per optimizer step (default {DEFAULT_GLOBAL_BATCH})"
    )
    p.add_argument("--rollout-batch-size", type=int, help="sequences per rollout batch (default 4x global batch)")
    p.add_argument(
        "--recompute", choices=RECOMPUTE_CHOICES, help=f"(default: model.recompute, else {DEFAULT_RECOMPUTE})"
    )
    p.add_argument("--routing-replay", choices=REPLAY_CHOICES, default="off", help="(default off)")
    p.add_argument(
        "--logprob", choices=LOGPROB_CHOICES, default="fused", help="log-prob path counted in the total (default fused)"
    )
    p.add_argument("--overhead-gb", type=float, default=4.0, help="fixed per-GPU overhead in GiB (default 4)")
    # No --cp: context parallelism is not implemented (ParallelConfig rejects parallel.cp > 1).
    for name in ("tp", "pp", "ep", "etp"):
        p.add_argument(f"--{name}", type=int, help=f"check this layout: parallel.{name}")
    p.add_argument("--vpp", type=int, help="check this layout: parallel.virtual_pp")
    p.add_argument("--top", type=int, default=5, help="layouts to suggest (default 5)")
    return p


def _model(args: argparse.Namespace, cfg: ConfigInputs) -> tuple[str, ModelConfig]:
    """--preset wins; else the config's model; else the default preset."""
    if args.preset is not None:
        return args.preset, preset(args.preset)
    if cfg.model is not None:
        return cfg.name or "model", cfg.model
    return DEFAULT_PRESET, preset(DEFAULT_PRESET)


def _parallel(args: argparse.Namespace, cfg: ConfigInputs) -> ParallelConfig | None:
    """The layout to check: config `parallel` overlaid by flags; None when neither names one."""
    values = dict(cfg.parallel)
    for key, flag in (("tp", "tp"), ("pp", "pp"), ("ep", "ep"), ("etp", "etp"), ("virtual_pp", "vpp")):
        if getattr(args, flag) is not None:
            values[key] = getattr(args, flag)
    if not values:
        return None
    if args.tp is not None:  # a --tp flag also decides sequence parallelism (on exactly when tp > 1)
        values["sequence_parallel"] = args.tp > 1
    values.setdefault("sequence_parallel", values.get("tp", 1) > 1)
    return ParallelConfig(**values)


def _gib(x: float) -> str:
    return f"{x / GiB:7.2f}"


def _print_memory(plan: LayoutPlan, out: TextIO) -> None:
    m = plan.memory
    pp = plan.layout.pp
    out.write(
        f"  memory per GPU at the peak pipeline stage {m.stage} (of 0..{pp - 1}) "
        f"({format_count(m.params)} params on the rank: "
        f"{format_count(m.dense_params)} dense + {format_count(m.expert_params)} expert; "
        f"micro-batches in flight: {m.inflight_microbatches:g}), GiB:\n"
    )
    rows = [
        ("weights (bf16)", m.weights),
        ("grads (fp32 main grads)", m.grads),
        ("optimizer (fp32 master + Adam, sharded)", m.optimizer),
        ("activations", m.activations),
        (f"logits, counted ({'fused kernel' if m.logits == m.logits_fused else 'naive'})", m.logits),
        ("routing replay", m.routing_replay),
        ("overhead (CUDA context, NCCL, slack)", m.overhead),
    ]
    for label, value in rows:
        out.write(f"    {label:<42}{_gib(value)}\n")
    out.write(f"    {'total':<42}{_gib(m.total)}  of {plan.gpu_memory_gib:g}\n")
    last = plan.last_stage
    where = "" if last.stage == m.stage else f" on the last stage {last.stage} (its total: {last.total / GiB:.2f})"
    out.write(
        f"    (logits{where}: naive fp32 path {last.logits_naive / GiB:.2f}, "
        f"fused kernel {last.logits_fused / GiB:.2f})\n"
    )


def _verdict(plan: LayoutPlan) -> str:
    word = "FITS" if plan.fits else "DOES NOT FIT"
    return f"{word}: {plan.memory.total / GiB:.1f} of {plan.gpu_memory_gib:g} GiB, headroom {plan.headroom_gib:.1f}"


def _print_table(plans: list[LayoutPlan], out: TextIO) -> None:
    head = (
        f"  {'#':>2} {'tp':>3} {'pp':>3} {'ep':>4} {'etp':>3} {'cp':>3} {'dp':>4} |"
        f" {'weights':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'logits':>7} {'replay':>7} {'ovh':>5} |"
        f" {'total':>7} {'fit':>3} {'stage':>5} | {'comm GB intra/inter':>19} {'step s':>7}\n"
    )
    out.write(head)
    for i, plan in enumerate(plans, 1):
        lay, m, st = plan.layout, plan.memory, plan.step
        out.write(
            f"  {i:>2} {lay.tp:>3} {lay.pp:>3} {lay.ep:>4} {lay.etp:>3} {lay.cp:>3} {lay.dp:>4} |"
            f" {_gib(m.weights)} {_gib(m.grads)} {_gib(m.optimizer)} {_gib(m.activations)} {_gib(m.logits)}"
            f" {_gib(m.routing_replay)} {m.overhead / GiB:5.1f} |"
            f" {_gib(m.total)} {'yes' if plan.fits else 'no':>3} {m.stage:>5} |"
            f" {st.intra_bytes / 1e9:9.1f}/{st.inter_bytes / 1e9:<9.1f} {st.step_s:7.2f}\n"
        )


def plan_main(argv: list[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run `megatron-gspo plan` with `argv` (without the program name); print the report; return the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse already printed
        return int(exc.code or 0)
    try:
        cfg = read_config(args.config) if args.config else ConfigInputs()
        name, model = _model(args, cfg)
        cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_memory_gb)
        global_explicit = args.global_batch_size is not None or cfg.global_batch_size is not None
        workload = Workload(
            seq_len=args.seq_len,
            micro_batch_size=_first(args.micro_batch_size, cfg.micro_batch_size, 1),
            global_batch_size=_first(args.global_batch_size, cfg.global_batch_size, DEFAULT_GLOBAL_BATCH),
            rollout_batch_size=_first(args.rollout_batch_size, cfg.rollout_batch_size),
            recompute=_first(args.recompute, cfg.recompute, DEFAULT_RECOMPUTE),
            routing_replay=args.routing_replay,
            logprob=args.logprob,
        )
        assumptions = MemoryAssumptions(overhead_gib=args.overhead_gb)
        parallel = _parallel(args, cfg)
        checked = None
        if parallel is not None:
            checked = plan_layout(
                model, parallel, cluster, workload, assumptions, check_global_batch=global_explicit
            )
        suggestions = suggest_layouts(
            model,
            cluster,
            workload,
            assumptions,
            top=args.top,
            check_global_batch=global_explicit,
        )
    except LayoutError as exc:
        err.write("error: invalid layout:\n" + "".join(f"  - {p}\n" for p in exc.problems))
        return 2
    except ValueError as exc:
        err.write(f"error: {exc}\n")
        return 2

    counts = count_parameters(model)
    out.write(
        f"model     {name}: {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads}/{model.num_key_value_heads} q/kv heads, {model.num_experts} experts "
        f"top-{model.num_experts_per_tok}, vocab {model.vocab_size}\n"
        f"params    total {format_count(counts.total)} ({counts.total:,}), active {format_count(counts.active)} "
        f"({counts.active:,}; embedding table and LM head counted in full)\n"
        f"          active compute {format_count(counts.active_compute)} (input-embedding lookup excluded), "
        f"non-embedding {format_count(counts.non_embedding)} total / {format_count(counts.non_embedding_active)} "
        f"active\n"
        f"cluster   {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = {cluster.world_size} GPUs, "
        f"{cluster.gpu_memory_gib:g} GiB each\n"
        f"workload  seq {workload.seq_len} x micro-batch {workload.micro_batch_size}, global batch "
        f"{workload.global_batch_size} sequences{'' if global_explicit else ' (assumed)'}, recompute "
        f"{workload.recompute}, routing replay {workload.routing_replay} (rollout batch "
        f"{workload.rollout_sequences} sequences), log-probs {workload.logprob}\n"
    )
    if checked is not None:
        out.write(f"\nlayout    {checked.layout.describe()}  [{_verdict(checked)}]\n")
        _print_memory(checked, out)
    out.write(
        "\nsuggested layouts (fitting first, ranked by a step-time proxy: compute + pipeline bubble + comm;\n"
        "the memory columns are GiB of each layout's peak pipeline stage)\n"
    )
    if not suggestions:
        out.write("  none: no valid layout for this cluster\n")
    else:
        if not any(p.fits for p in suggestions):
            out.write("  NOTHING FITS; the smallest estimates are:\n")
        _print_table(suggestions, out)
        out.write(f"\n#1        {suggestions[0].layout.describe()}  [{_verdict(suggestions[0])}]\n")
        _print_memory(suggestions[0], out)
    if checked is not None:
        return 0 if checked.fits else 1
    return 0 if any(p.fits for p in suggestions) else 1


if __name__ == "__main__":
    raise SystemExit(plan_main(sys.argv[1:]))
