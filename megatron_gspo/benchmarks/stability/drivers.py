"""The collapse drivers of the stability benchmark as named config overrides, and cells built from them.

A driver is one setting of one mechanism the sources name as a cause of GRPO's collapse on MoE models (issue 29):
- train / inference mismatch: the engine in another precision or implementation than the trainer (Precision-RL:
  bf16 runs collapse; R3 paper, arXiv:2510.11370 §3: ~10% of routers differ between engine and trainer);
- pi_old taken from the engine instead of recomputed by the trainer (GSPO paper §5.4): the mismatch then enters
  the ratio pi_theta / pi_old itself;
- staleness within a rollout batch: K minibatches (optimizer steps) per rollout batch (GSPO paper §5.1: 4;
  MiniRL: R2 needed from 2x, R3 from 4x off-policy);
- answer length: token-ratio variance grows with the number of tokens (NeMo-RL #2269, verl #3597);
- router sensitivity: fewer experts per token, no load-balancing loss (Qwen3 has no router z-loss to switch off);
- learning rate: larger updates change more routes (GSPO paper §5.3: ~10% of experts per update).
Asynchronous rollout lag needs a server engine (rollout.mode=one_step_off / async); it is not a driver of the CPU
preset, whose engine is in-process.

A cell is a "+"-joined list of drivers ("engine_bf16+k8"): their overrides applied in order; two drivers of a cell
may not set the same key. Everything is an override of the run config, so a cell is reproducible with
`megatron-gspo train --config examples/stability_moe.yaml <overrides>`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Driver:
    """One setting of one collapse mechanism."""

    mechanism: str
    """Which mechanism (module docstring): mismatch | pi_old | staleness | length | router | lr | none."""
    overrides: tuple[str, ...]
    """Config overrides on top of the benchmark preset."""
    new_model: bool = False
    """Whether the setting changes the architecture or the task, so that the cold-start SFT model of the preset
    cannot be reused (a precision, a learning rate or a loss coefficient keep it: the SFT weights load into any)."""


DRIVERS: dict[str, Driver] = {
    "baseline": Driver("none", ()),
    # A second implementation in the same precision: separates "other kernels" from "other precision".
    "engine_hf_fp32": Driver("mismatch", ("rollout.local.backend=hf",)),
    "engine_bf16": Driver("mismatch", ("rollout.local.dtype=bf16",)),
    "engine_fp16": Driver("mismatch", ("rollout.local.dtype=fp16",)),
    # bf16 trainer (fp32 master weights in the optimizer) and a bf16 engine of its own kernels.
    "bf16_both": Driver("mismatch", ("model.dtype=bf16", "rollout.local.backend=hf")),
    "pi_old_engine_bf16": Driver("pi_old", ("rollout.local.dtype=bf16", "rollout.old_logprobs=engine")),
    "k1": Driver("staleness", ("trainer.minibatches=1", "optim.warmup_steps=1")),
    "k2": Driver("staleness", ("trainer.minibatches=2", "optim.warmup_steps=2")),
    "k8": Driver("staleness", ("trainer.minibatches=8", "optim.warmup_steps=8")),
    "k16": Driver("staleness", ("trainer.minibatches=16", "optim.warmup_steps=16")),
    "lr_1e-4": Driver("lr", ("optim.lr=1e-4",)),
    # Between the preset's 3e-4 (stable for both) and 4.5e-4 (both collapse in the screen): the threshold region.
    "lr_3.75e-4": Driver("lr", ("optim.lr=3.75e-4",)),
    "lr_4.5e-4": Driver("lr", ("optim.lr=4.5e-4",)),
    "lr_6e-4": Driver("lr", ("optim.lr=6e-4",)),
    "aux_off": Driver("router", ("model.overrides.router_aux_loss_coef=0.0",)),
    "top2": Driver("router", ("model.overrides.num_experts_per_tok=2",), new_model=True),
    "experts128": Driver("router", ("model.overrides.num_experts=128",), new_model=True),
    # count2: answers of 17-254 characters (data/tasks.py CountTask), room for 256 tokens after a 6-token prompt.
    "long_answers": Driver(
        "length",
        (
            "data.train=task:count2",
            "data.heldout=task:count2",
            "data.train_size=2048",  # count2 has ~4000 distinct train prompts (the preset asks for 8192)
            "rollout.max_new_tokens=256",
            "model.overrides.max_position_embeddings=320",
            "trainer.prompts_per_step=16",
        ),
        new_model=True,
    ),
}
"""The drivers the screening pass crosses with the algorithms (benchmarks/stability/screen.py)."""

SCREEN_CELLS = (
    "baseline",
    "engine_hf_fp32",
    "engine_bf16",
    "engine_fp16",
    "bf16_both",
    "pi_old_engine_bf16",
    "k1",
    "k8",
    "k16",
    "lr_4.5e-4",
    "lr_6e-4",
    "aux_off",
    "engine_bf16+k8",
    "engine_bf16+lr_4.5e-4",
    "top2",
    "long_answers",
)
"""The screening pass's cells, cheapest first: single drivers, then combinations of the mismatch with staleness
and learning rate, then those that need their own cold-start SFT model."""


DEFAULT_CELL = "engine_bf16+k8"
DEFAULT_STEPS = 20
DEFAULT_LABEL = (
    "Default setting of `megatron-gspo stability` (no --config, no --cell): cell engine_bf16+k8 at 20 RL steps, the "
    "most discriminating setting the CPU map found (results/stability_moe/pass_bf16_k8.md: GRPO collapsed in 3/3 "
    "seeds, GSPO in 2/3, GRPO + R2 3/3, GRPO + R3 3/3), short of issue 29's bar (GRPO in >= 2/3, GSPO in 0/3): the "
    "one GRPO / GSPO difference found (GSPO's seed 1235) is within the seed spread and the held-out evaluation's noise; "
    "no CPU setting found separates them (README 'Collapse drivers'); `--cell baseline` runs the plain preset."
)
"""`megatron-gspo stability`'s default on the CPU preset (cli/main.py), and what the map says of it: the 3-seed pass of
gspo / grpo / grpo_r2 / grpo_r3 on the cells where GRPO collapsed in the screen."""


def parse_cell(cell: str) -> list[str]:
    """The driver names of a cell ("engine_bf16+k8" -> ["engine_bf16", "k8"]); unknown names are an error."""
    names = [n.strip() for n in cell.split("+")]
    if not cell.strip() or any(not n for n in names):
        raise ValueError(f"cell {cell!r} must be driver names joined by '+', e.g. engine_bf16+k8")
    unknown = [n for n in names if n not in DRIVERS]
    if unknown:
        raise ValueError(f"cell {cell!r}: unknown driver {unknown[0]!r}; drivers: {', '.join(DRIVERS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"cell {cell!r} names a driver twice")
    return names


def cell_overrides(cell: str) -> list[str]:
    """The overrides of a cell, its drivers' in order; two drivers setting the same key is an error."""
    out: list[str] = []
    owner: dict[str, str] = {}
    for name in parse_cell(cell):
        for item in DRIVERS[name].overrides:
            key = item.split("=", 1)[0]
            if key in owner:
                raise ValueError(f"cell {cell!r}: drivers {owner[key]} and {name} both set {key}")
            owner[key] = name
            out.append(item)
    return out


def model_cell(cell: str) -> str:
    """The cell whose cold-start SFT model `cell` starts from: its drivers that change the architecture or the task
    ("engine_bf16+long_answers" -> "long_answers"), or "preset" when none does."""
    own = [n for n in parse_cell(cell) if DRIVERS[n].new_model]
    return "+".join(own) if own else "preset"
