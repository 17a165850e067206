"""One config schema for a run: typed dataclasses per component, YAML files, dot-list overrides.

`load_run_config("examples/tiny_moe_gspo.yaml", ["trainer.steps=50", "parallel.tp=2"])` reads the YAML, applies
the overrides, rejects unknown keys (naming them and the known ones) and builds the dataclasses, whose
`__post_init__` validate the values.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_gspo.algorithms import make_policy_loss
from megatron_gspo.algorithms.config import PolicyLossConfig, RolloutCorrectionConfig
from megatron_gspo.data.config import DataConfig
from megatron_gspo.lifecycle.health import HealthConfig
from megatron_gspo.models.config import PRESETS, ModelConfig, preset
from megatron_gspo.moe.config import MoEConfig
from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.rewards.config import ScoringConfig
from megatron_gspo.rollout.local.config import LocalEngineConfig
from megatron_gspo.rollout.multiturn.config import MultiTurnConfig
from megatron_gspo.rollout.vllm.config import VLLMConfig, engine_logprobs_problem
from megatron_gspo.training.optim_config import OptimConfig


@dataclass
class ModelSection:
    """Which model to train and how it is instantiated."""

    preset: str | None = "tiny"
    """Named architecture (tiny | tiny-moe64 | qwen3-30b-a3b); ignored when `hf_config` is set."""
    hf_config: str | None = None
    """Directory or config.json of a Hugging Face Qwen3-MoE checkpoint (architecture only)."""
    overrides: dict = field(default_factory=dict)
    """ModelConfig fields that replace the preset's (e.g. {num_hidden_layers: 2})."""
    load: str | None = None
    """Model checkpoint to start from (from `megatron-gspo convert hf-to-megatron` or `sft`)."""
    dtype: str = "fp32"
    """fp32 | bf16 | fp16 parameters and compute."""
    recompute: str = "none"
    """Activation recompute: none | selective (core attention, + expert activations with the TE spec) | full."""
    use_te: bool | None = None
    """Transformer-engine layer spec: null = on a CUDA machine when TE imports (a warning names the import error
    when it does not); false = the local spec (e.g. a GPU without TE); true = TE or an error."""

    def __post_init__(self) -> None:
        if self.hf_config is None and self.preset not in PRESETS:
            raise ValueError(f"model.preset={self.preset!r} is unknown; choose one of {sorted(PRESETS)}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"model.dtype={self.dtype!r} must be fp32, bf16 or fp16")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"model.recompute={self.recompute!r} must be none, selective or full")

    def model_config(self) -> ModelConfig:
        """The architecture this section describes."""
        if self.hf_config is not None:
            base = dataclasses.asdict(ModelConfig.from_hf_config(self.hf_config))
            return ModelConfig(**{**base, **self.overrides})
        return preset(self.preset, **self.overrides)


@dataclass
class RolloutConfig:
    """Generation of the rollout batch."""

    engine: str = "local"
    """local (in-process, the training model) | vllm | sglang (servers; rollout/vllm/config.py, rollout/sglang/config.py)."""
    group_size: int = 8
    """G: responses per prompt (Eq.5-6)."""
    max_new_tokens: int = 8
    """Most response tokens."""
    temperature: float = 1.0
    """Sampling temperature (also used when recomputing log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    old_logprobs: str = "recompute"
    """recompute (training engine forward) | engine (the rollout engine's log-probs; paper §5.4)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and top up from the next prompts."""
    max_topup_rounds: int = 4
    """Extra generation rounds allowed per step when dynamic sampling tops up."""
    correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance correction between training and rollout engine log-probs."""
    local: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    """The in-process engine (engine=local): backend and precision (rollout/local/config.py)."""
    mode: str = "sync"
    """sync (generate, then train: the reference) | one_step_off (batch s+1 is generated while step s trains,
    weight syncs between generate calls) | async (rollouts run up to max_staleness batches ahead; an engine with
    partial rollouts takes weight syncs mid-call). training/producer.py."""
    max_staleness: int = 1
    """Weight versions a rollout may lag the weights that train on it (one_step_off: >= 1; async: how many batches
    the producer runs ahead, 0 = sync's rollouts). Unused by sync (always 0)."""

    def __post_init__(self) -> None:
        if self.engine not in ("local", "vllm", "sglang"):
            raise ValueError(f"rollout.engine={self.engine!r} must be local, vllm or sglang")
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size={self.group_size} must be >= 2 (advantages are group-relative)")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0 for RL sampling")
        if self.old_logprobs not in ("recompute", "engine"):
            raise ValueError(f"rollout.old_logprobs={self.old_logprobs!r} must be recompute or engine")
        if self.max_topup_rounds < 0:
            raise ValueError(f"rollout.max_topup_rounds={self.max_topup_rounds} must be >= 0")
        if self.mode not in ("sync", "one_step_off", "async"):
            raise ValueError(f"rollout.mode={self.mode!r} must be sync, one_step_off or async")
        if type(self.max_staleness) is not int or self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={self.max_staleness!r} must be an integer >= 0 (weight versions)")
        if self.mode == "one_step_off" and self.max_staleness < 1:
            raise ValueError("rollout.mode=one_step_off trains on rollouts one version old: set rollout.max_staleness"
                             " >= 1 (or rollout.mode=async with rollout.max_staleness=0 for no lag)")
        if self.mode != "sync" and self.engine == "local" and (self.mode != "async" or self.max_staleness):
            # The in-process engine samples from the training model itself: it cannot generate while it trains.
            raise ValueError(f"rollout.mode={self.mode} needs a server engine (rollout.engine=local generates with "
                             "the training model in this process): set rollout.engine=vllm or sglang, or "
                             "rollout.mode=sync (local supports async only with rollout.max_staleness=0)")


@dataclass
class EvalConfig:
    """Held-out evaluation (avg@n and pass@k)."""

    every: int = 0
    """Evaluate every N RL steps (0: only before and after training)."""
    n: int = 4
    """Samples per held-out prompt (the paper's AIME'24 metric uses 32)."""
    temperature: float = 1.0
    """Sampling temperature for eval (0 = greedy, then n is forced to 1)."""
    max_prompts: int = 256
    """Held-out prompts used."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.n < 1 or self.max_prompts < 1 or self.temperature < 0:
            raise ValueError("eval.every >= 0, eval.n >= 1, eval.max_prompts >= 1 and eval.temperature >= 0 required")


@dataclass
class TrainerConfig:
    """The RL loop."""

    steps: int = 20
    """RL steps (rollout batches)."""
    prompts_per_step: int = 32
    """Prompts per rollout batch (each sampled group_size times), over all data-parallel ranks."""
    minibatches: int = 4
    """Optimizer steps per rollout batch (paper §5.1: 4)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward micro-batch (without a token budget)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget per micro-batch (input tokens; slime's max-tokens-per-gpu, verl's dynamic batch size): the
    sequences of a minibatch go into balanced micro-batches of at most this many tokens, as many as needed
    (the same count on every data-parallel rank). 0 = micro_batch_size sequences per micro-batch. Needs
    batch_layout=packed. The policy loss is the full-minibatch loss however sequences are grouped; the router aux
    loss keeps megatron's semantics, a mean over micro-batches of each micro-batch's load-balancing loss, so the
    grouping changes its gradient (as micro_batch_size does)."""
    batch_layout: str = "packed"
    """packed: the sequences of a micro-batch concatenated into one THD row (no padding compute) | padded: one
    row per sequence, padded to the longest possible (the reference)."""
    balance_data_parallel: bool = True
    """With batch_layout=packed and data parallelism: re-deal each minibatch's sequences over the replicas for
    balanced token counts (same sequence count each; batching/dp_balance.py)."""
    logprob_path: str = "fused"
    """fused: log-probs of response tokens from the final hidden states, without [tokens, vocab] logits |
    logits: megatron's output layer materialises all logits (the reference)."""
    seed: int = 1234
    """Seed for model init, sampling and data order."""
    run_dir: str = "runs/gspo"
    """Where metrics, plots and checkpoints go."""
    ckpt_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept."""
    save_final: bool = True
    """Write a checkpoint when training ends."""
    async_save: bool = False
    """Periodic checkpoints (ckpt_every) are written in the background (megatron-LM's --async-save): the step
    that saves stages the model and optimizer tensors in host memory and forks a writer process per rank, and
    training goes on; the checkpoint becomes `iter_N` / `latest` at the first step boundary after every rank's
    writer finished (checkpoint/manager.py). Costs host memory for one copy of each rank's share while it is
    written (on a GPU pinned memory, which PyTorch keeps cached afterwards). The final checkpoint and the one a
    stop signal writes are waited for. megatron's writers report through a process started with the `spawn`
    method, which imports the main module again: a script that runs the trainer itself must guard its entry
    point with `if __name__ == "__main__":` (the megatron-gspo CLI does). A writer that dies without reporting
    (an OOM-killed child) fails the checkpoint on every rank."""
    async_save_timeout_s: float = 1800.0
    """Seconds a background checkpoint's writer may run (from the save that started it) before it is killed and
    that checkpoint fails on every rank with one line: a deadlocked or stopped writer shows no other sign, and the
    wait for it would never end (0: no limit). The 30B recipe's optimizer shards take minutes, not half an hour."""
    progress: bool = True
    """Show a progress bar."""
    hang_warning_s: float = 600.0
    """Warn, on each rank, when one phase of a step (generate, update, ...) has run this many seconds: the logs
    then show where each rank waits and which one is slow (0 disables)."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "minibatches", "micro_batch_size", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be >= 1")
        if self.ckpt_every < 0:
            raise ValueError(f"trainer.ckpt_every={self.ckpt_every} must be >= 0")
        if not self.async_save_timeout_s >= 0:
            raise ValueError(f"trainer.async_save_timeout_s={self.async_save_timeout_s} must be >= 0 (0: no limit)")
        if not self.hang_warning_s >= 0:
            raise ValueError(f"trainer.hang_warning_s={self.hang_warning_s} must be >= 0 (0 disables)")
        if self.batch_layout not in ("packed", "padded"):
            raise ValueError(f"trainer.batch_layout={self.batch_layout!r} must be packed or padded")
        if self.logprob_path not in ("fused", "logits"):
            raise ValueError(f"trainer.logprob_path={self.logprob_path!r} must be fused or logits")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"trainer.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0")
        if self.max_tokens_per_micro_batch and self.batch_layout != "packed":
            raise ValueError("trainer.max_tokens_per_micro_batch needs trainer.batch_layout=packed")


@dataclass
class SFTConfig:
    """Cold-start supervised fine-tuning (the paper starts RL from a cold-start SFT model)."""

    max_steps: int = 400
    """Upper bound on SFT steps."""
    batch_size: int = 128
    """Sequences per step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    target_accuracy: float = 0.3
    """Stop once held-out greedy accuracy reaches this (0 disables; REFERENCE.md §8: stop on accuracy)."""
    eval_every: int = 25
    """Steps between held-out checks."""
    eval_prompts: int = 128
    """Held-out prompts for the stopping check."""

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.batch_size < 1 or self.lr <= 0 or self.eval_every < 1:
            raise ValueError("sft.max_steps, sft.batch_size, sft.eval_every must be >= 1 and sft.lr > 0")
        if not 0 <= self.target_accuracy <= 1:
            raise ValueError(f"sft.target_accuracy={self.target_accuracy} must be in [0, 1]")


@dataclass
class RunConfig:
    """Everything a `megatron-gspo train | sft | eval` run needs."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10))
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    moe: dict = field(default_factory=dict)
    """MoE options (routing replay, drift measurement); validated by megatron_gspo.moe when used."""
    sglang: dict = field(default_factory=dict)
    """SGLang engine options (rollout.engine=sglang); validated by megatron_gspo.rollout when used."""
    vllm: dict = field(default_factory=dict)
    """vLLM engine options (rollout.engine=vllm): the fields of rollout/vllm/config.py VLLMConfig, validated
    (unknown keys and bad values named) when the engine is built."""

    def __post_init__(self) -> None:
        asked = self.rollout.correction
        correction = asked.resolved()
        if correction.level == "token" and make_policy_loss(self.loss).sequence_level:
            # GSPO's loss only sees per-sequence log-prob sums: per-token weights would be silently ignored.
            named = "rollout.correction.level=token" if asked.preset is None else (
                f"rollout.correction.preset={asked.preset} (level=token)")
            raise ValueError(
                f"{named} has no effect with loss.algorithm={self.loss.algorithm} (a "
                "sequence-level loss); use rollout.correction.level=sequence, or loss.algorithm=gspo_token or grpo"
            )
        if correction.active and self.rollout.old_logprobs == "engine":
            # pi_old IS the engine's then: the weight pi_prox / pi_behav would be 1 and nothing would be corrected.
            raise ValueError(
                "rollout.correction needs rollout.old_logprobs=recompute (the correction weighs the trainer's "
                "recomputed log-probs against the engine's); with old_logprobs=engine set rollout.correction.level=off "
                "and no preset or mask band"
            )
        max_key, max_len = ("multiturn.max_total_tokens", self.multiturn.max_total_tokens) if (
            self.multiturn.enabled) else ("rollout.max_new_tokens", self.rollout.max_new_tokens)
        if self.loss.overlong_buffer > max_len:
            raise ValueError(
                f"loss.overlong_buffer={self.loss.overlong_buffer} must be <= {max_key}={max_len} (the penalty "
                "ramps over the last overlong_buffer tokens)"
            )
        drift_rows, t = MoEConfig.from_dict(self.moe).drift_sample_sequences, self.trainer
        if drift_rows > t.micro_batch_size and drift_rows % t.micro_batch_size and not t.max_tokens_per_micro_batch:
            # The drift sample goes through the trainer's micro-batches, which hold micro_batch_size sequences each.
            raise ValueError(
                f"moe.drift_sample_sequences={drift_rows} must be a multiple of trainer.micro_batch_size="
                f"{t.micro_batch_size} (or at most it), or set trainer.max_tokens_per_micro_batch"
            )
        r, p = self.rollout, self.parallel
        if r.mode != "sync" and p.tp * p.pp * p.cp > 1:  # training/producer.py: no collectives in its thread
            raise ValueError(f"rollout.mode={r.mode} needs parallel.tp=parallel.pp=parallel.cp=1: a model replica "
                             "over several ranks receives its rollouts by broadcast, a collective the producer "
                             "thread must not run beside training; set rollout.mode=sync")
        if r.mode != "sync" and self.sglang.get("colocated", False):
            raise ValueError(f"rollout.mode={r.mode} cannot run with sglang.colocated=true (the servers and the "
                             "update share the GPU memory in turns); set rollout.mode=sync or sglang.colocated=false")
        if self.multiturn.enabled and self.multiturn.max_total_tokens > r.max_new_tokens:
            # A trajectory's tokens, the model's and the environment's, are trained in one sequence of
            # prompt + rollout.max_new_tokens.
            raise ValueError(
                f"multiturn.max_total_tokens={self.multiturn.max_total_tokens} exceeds rollout.max_new_tokens="
                f"{r.max_new_tokens}, the response room of a training sequence; raise rollout.max_new_tokens"
            )
        if self.multiturn.enabled and self.multiturn.advantage != "trajectory" and self.loss.algorithm == "gspo":
            raise ValueError(f"multiturn.advantage={self.multiturn.advantage} gives each token its turn's advantage, "
                             "but loss.algorithm=gspo takes one per trajectory (the sequence ratio, Eq.5); set "
                             "loss.algorithm=gspo_token (Eq.13-14) or multiturn.advantage=trajectory")
        if r.engine == "local" and r.local.backend == "megatron" and r.local.dtype not in (None, self.model.dtype):
            raise ValueError(f"rollout.local.dtype={r.local.dtype} differs from model.dtype={self.model.dtype}, but "
                             "rollout.local.backend=megatron samples with the trainer's own parameters; use "
                             "rollout.local.backend=hf or auto")
        if r.engine == "vllm" and r.old_logprobs == "engine":
            mode = self.vllm.get("logprobs_mode", VLLMConfig.logprobs_mode)
            problem = engine_logprobs_problem(mode, r.temperature, r.top_p, r.top_k)
            if problem:  # pi_old would not be the distribution the trainer's ratio divides by (paper §5.4)
                raise ValueError(problem)

    def to_dict(self) -> dict:
        """Plain nested dict (YAML-serialisable)."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true / false. (YAML 1.1 reads `moe.routing_replay: off` as False.)"""


_Loader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass

def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key.sub=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {item!r} has an empty key")
    value = _yaml_load(raw) if raw.strip() else ""
    return key.split("."), value


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"override {'.'.join(path)}: {part} is not a section")
        node = child
    node[path[-1]] = value


def _resolve_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _coerce(value: Any, tp: Any, key: str) -> Any:
    tp = _resolve_type(tp)
    if value is None or tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a section (mapping), got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-4" (no dot) as a string; users write learning rates that way.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}={value!r} must be a string")
        return value
    if typing.get_origin(tp) is tuple or tp is tuple:
        return tuple(value) if isinstance(value, (list, tuple)) else value
    if tp is dict or typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return value
    return value


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(
            f"unknown config key {where}{unknown[0]}; known keys under {prefix or 'the top level'}: "
            f"{', '.join(sorted(known))}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def load_run_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """RunConfig from a YAML file (optional) plus `key.sub=value` overrides; errors name the offending key."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            loaded = _yaml_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: invalid YAML ({err})") from err
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections")
        tree = loaded
    for item in overrides:
        keys, value = _parse_override(item)
        _set_path(tree, keys, value)
    return _build(RunConfig, tree)


def dump_run_config(cfg: RunConfig, path: str | Path) -> None:
    """Writes the resolved config (what the run actually used) as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
