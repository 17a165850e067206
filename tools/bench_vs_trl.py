"""Benchmark: seconds per RL step, megatron-gspo vs TRL's GRPOTrainer configured as GSPO, same tiny task.

One RL step = rollout of a batch (P prompts x G=8 responses of at most 6 tokens) + old-policy log-probs
+ K=4 minibatch updates (one optimizer step each), on the tiny Qwen3-MoE of examples/tiny_moe_gspo.yaml
(4 layers, hidden 128, 8 experts top-2, 16-token character vocabulary), randomly initialised, fp32, CPU.

Both sides get the same model configuration (our preset's HF `Qwen3MoeConfig`; TRL builds a random
`Qwen3MoeForCausalLM` from it locally), the same prompts and answers (our `task:add3` training split, in our
order), the same character vocabulary (a `tokenizers` WordLevel tokenizer with our ids: pad 0, eos 1, then
"0123456789+-*="), the same sampling (temperature 1, no top-k / top-p, stop at eos), the same reward (our
exact_match function, called by TRL too), the same optimiser settings (Adam, lr 1e-4 with 10 warm-up steps, beta2 0.99, grad-clip 1) and thread
count. TRL (trl==1.16.0, read in `trl/trainer/grpo_trainer.py` and `grpo_config.py`) is configured as:

  importance_sampling_level="sequence"  s_i = exp(mean_t log-ratio), GSPO Eq. 7
  loss_type="grpo", beta=0             per-sequence loss averaged over sequences (Eq. 5: no length weighting;
                                       "dapo", TRL's default, would weight sequences by their token counts)
  epsilon=3e-4, epsilon_high=4e-4      the paper's clip range
  scale_rewards="group"                A_i = (r_i - mean) / std within the group (Eq. 6)
  num_generations=8, per_device_train_batch_size=8P/4, gradient_accumulation_steps=1, steps_per_generation=4,
  num_iterations=1                     the generation batch is 8P sequences (P prompts x 8; 512 at P=64); TRL
                                       generates once every steps_per_generation * num_iterations = 4 optimizer
                                       steps and feeds one 2P-sequence slice to each of them: K=4 minibatch
                                       updates per rollout batch, each slice used once, like ours. Because
                                       gradient_accumulation_steps (1) is not a multiple of that generation
                                       period, TRL computes the old-policy log-probs in a no-grad pass over the
                                       generation batch (`_generate_and_score_completions`), like our recompute.

So TRL's 4 optimizer steps are one of our RL steps. Both sizes of `--prompts` (default 8 and 64 prompts: 64 and 512
answers per RL step; the first is dominated by the per-step fixed cost, the second amortises it) run in one
invocation. Each variant runs in a fresh subprocess (ours in this environment, TRL in its own, `make bench-env`),
sizes and variants alternate within each of `--rounds` rounds, and the first
`--warmup` RL steps of each run are not timed. The time of an RL step is wall clock between the ends of
consecutive RL steps (ours: metrics written; TRL: the end of every 4th optimizer step), so everything the
loop does counts on both sides; the process CPU time over the same span is reported beside it (steadier on a
shared machine). Prints the machine load, a table and ours / TRL; asserts nothing. Usage:

  make bench-env                                        # once: builds .bench-env (TRL, accelerate, datasets)
  .venv/bin/python tools/bench_vs_trl.py                # 3 alternating rounds, 2 warm-up + 5 timed steps each
  .venv/bin/python tools/bench_vs_trl.py --rounds 1 --steps 3 --ours-overrides moe.drift_every=0
  .venv/bin/python tools/bench_vs_trl.py --prompts 8              # 64 answers per RL step only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_worker import run_worker  # tools/ is sys.path[0] when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny_moe_gspo.yaml"
GSPO = dict(clip_low=3e-4, clip_high=4e-4)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---- the shared setting (written by the driver, read by both workers) -----------------------------------------
def write_spec(work: Path, overrides: list[str]) -> Path:
    """Our run config resolved once: model config, prompts, tokenizer alphabet, sizes; saved as spec.json."""
    from megatron_gspo.algorithms import make_policy_loss
    from megatron_gspo.data.dataset import load_datasets
    from megatron_gspo.data.tokenizer import CharTokenizer
    from megatron_gspo.training.config import load_run_config

    cfg = load_run_config(CONFIG, overrides)
    if cfg.loss.algorithm != "gspo":
        raise ValueError(f"loss.algorithm={cfg.loss.algorithm!r}: the TRL comparison is of GSPO")
    loss = make_policy_loss(cfg.loss)  # the clip range actually used (the paper's unless overridden)
    train, _ = load_datasets(cfg.data)
    tok = CharTokenizer()
    hf = cfg.model.model_config().to_hf_config().to_dict()
    spec = dict(
        overrides=overrides,
        hf_config=hf,
        alphabet=tok.alphabet,
        prompts=[{"prompt": it.prompt, "answer": it.answer} for it in train],
        prompts_per_step=cfg.trainer.prompts_per_step,
        group_size=cfg.rollout.group_size,
        minibatches=cfg.trainer.minibatches,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        lr=cfg.optim.lr,
        warmup_steps=cfg.optim.warmup_steps,
        beta2=cfg.optim.beta2,
        clip_grad=cfg.optim.clip_grad,
        clip_low=loss.clip_low,
        clip_high=loss.clip_high,
        seed=cfg.trainer.seed,
        reward=cfg.data.reward,
    )
    if (spec["clip_low"], spec["clip_high"]) != (GSPO["clip_low"], GSPO["clip_high"]):
        print(f"note: clip range {spec['clip_low']} / {spec['clip_high']} (not the paper's)", file=sys.stderr)
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    return path


# ---- workers ----------------------------------------------------------------------------------------------------
def _step_times(stamps: list[tuple[float, float]], warmup: int) -> dict:
    """Wall-clock and process CPU seconds of each timed RL step, from (perf_counter, process_time) stamps taken
    at the end of every step. CPU time counts what the process computed, whatever else the cores were doing:
    on a loaded machine it is the steadier of the two."""
    pairs = list(zip(stamps[warmup - 1 :], stamps[warmup:]))
    return dict(step_s=[b[0] - a[0] for a, b in pairs], cpu_s=[b[1] - a[1] for a, b in pairs])


def worker_ours(spec: dict, args) -> dict:
    """Our trainer's own loop (`GSPOTrainer.train`), timed at each step's metrics write."""
    import torch

    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    # A fresh run directory per round: the trainer refuses to start a new run over an old one's.
    run_dir = tempfile.mkdtemp(prefix="ours.", dir=args.work)
    overrides = [
        *spec["overrides"],
        f"trainer.steps={total}",
        f"trainer.run_dir={run_dir}/run",
        "trainer.progress=false",
        "trainer.save_final=false",
        "trainer.ckpt_every=0",
        "eval.every=0",
        "eval.max_prompts=8",  # the before / after evaluations are outside the timed steps
    ]
    trainer = GSPOTrainer(load_run_config(CONFIG, overrides))
    stamps: list[float] = []
    lengths: list[float] = []
    log_step = trainer.logger.log_step

    def stamped(step, metrics):
        log_step(step, metrics)
        stamps.append((time.perf_counter(), time.process_time()))
        lengths.append(metrics["response_length"])

    trainer.logger.log_step = stamped
    try:
        trainer.train()
    finally:
        trainer.close()
    return dict(
        variant="ours",
        **_step_times(stamps, args.warmup),
        response_length=statistics.fmean(lengths[args.warmup :]),
    )


def _trl_tokenizer(alphabet: str):
    """A PreTrainedTokenizerFast with our character ids (pad 0, eos 1, then the alphabet), built locally."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def trl_reward(name: str):
    """Our reward `name` (rewards/ registry) as a TRL reward function: the same code scores both sides."""
    from megatron_gspo.rewards import get_reward  # the repository is on PYTHONPATH (bench_worker.run_worker)

    fn = get_reward(name)

    def reward(prompts, completions, answer, **kwargs):
        return [fn(c, a, {}) for c, a in zip(completions, answer)]

    reward.__name__ = name  # TRL names the logged reward after the function
    return reward


def trl_trainer(spec: dict, *, work: str, threads: int, max_steps: int, callbacks: list):
    """TRL's GRPOTrainer as GSPO on the setting of `spec` (module docstring), stopping after `max_steps`
    optimizer steps (K per RL step), logging once per RL step; the spec's reward, scored by our own function."""
    import torch
    from datasets import Dataset
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    torch.manual_seed(spec["seed"])
    tokenizer = _trl_tokenizer(spec["alphabet"])
    hf = dict(spec["hf_config"])
    hf.pop("transformers_version", None)
    hf.update(pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).float()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    dataset = Dataset.from_list(spec["prompts"])
    k, g = spec["minibatches"], spec["group_size"]
    per_step = spec["prompts_per_step"] * g  # sequences per rollout batch
    config = GRPOConfig(
        output_dir=str(Path(work) / "trl"),
        use_cpu=True,
        bf16=False,
        seed=spec["seed"],
        max_steps=max_steps,
        per_device_train_batch_size=per_step // k,
        gradient_accumulation_steps=1,
        steps_per_generation=k,
        num_iterations=1,
        num_generations=g,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_k=0,
        top_p=1.0,
        importance_sampling_level="sequence",
        loss_type="grpo",
        beta=0.0,
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        scale_rewards="group",
        learning_rate=spec["lr"],
        warmup_steps=spec["warmup_steps"],
        lr_scheduler_type="constant_with_warmup",
        adam_beta2=spec["beta2"],
        weight_decay=0.0,
        max_grad_norm=spec["clip_grad"],
        logging_steps=k,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=trl_reward(spec["reward"]),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def worker_trl(spec: dict, args) -> dict:
    """TRL's GRPOTrainer as GSPO (module docstring), timed at the end of every K-th optimizer step."""
    from transformers import TrainerCallback

    k = spec["minibatches"]
    stamps: list[float] = []
    lengths: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % k == 0:
                stamps.append((time.perf_counter(), time.process_time()))

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer = trl_trainer(spec, work=args.work, threads=args.threads, max_steps=k * (args.warmup + args.steps),
                          callbacks=[Stamp()])
    trainer.train()
    length = statistics.fmean(lengths[args.warmup :]) if lengths[args.warmup :] else float("nan")
    return dict(variant="trl", **_step_times(stamps, args.warmup), response_length=length)


# ---- driver ------------------------------------------------------------------------------------------------------
def _run(variant: str, python: str, spec_path: Path, args) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--worker", variant, "--spec", str(spec_path)]
    cmd += ["--work", str(args.work), "--threads", str(args.threads)]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    t0 = time.perf_counter()
    out = run_worker(cmd, variant, error_lines=5)
    if "error" not in out:
        out["wall_s"] = time.perf_counter() - t0
    return out


def _table(results: dict[str, list[dict]]) -> dict[str, tuple[float, float]]:
    """Prints one size's table; returns each variant's (median wall, median CPU) seconds per RL step."""
    print(
        "| variant | median wall s / RL step | min wall s | median CPU s / RL step | runs | mean response tokens |"
    )
    print("|---|---|---|---|---|---|")
    medians: dict[str, tuple[float, float]] = {}
    for variant, runs in results.items():
        errors = [r["error"] for r in runs if "error" in r]
        ok = [r for r in runs if "error" not in r]
        if not ok:
            print(f"| {variant} | failed: {errors[0][:300]} |")
            continue
        wall = [t for r in ok for t in r["step_s"]]
        cpu = [t for r in ok for t in r["cpu_s"]]
        medians[variant] = (statistics.median(wall), statistics.median(cpu))
        length = statistics.fmean(r["response_length"] for r in ok)
        cells = [variant, f"{medians[variant][0]:.3f}", f"{min(wall):.3f}", f"{medians[variant][1]:.3f}"]
        cells += [f"{len(ok)}", f"{length:.2f}"]
        print("| " + " | ".join(cells) + " |")
        for e in errors:
            print(f"  ({variant} run failed: {e[:300]})")
    return medians


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trl-python", default=str(ROOT / ".bench-env" / "bin" / "python"))
    parser.add_argument("--rounds", type=int, default=3, help="alternating (ours, TRL) pairs of fresh runs per size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed RL steps at the start of each run")
    parser.add_argument("--steps", type=int, default=5, help="timed RL steps per run")
    parser.add_argument(
        "--prompts",
        default="8,64",
        help="comma-separated prompts per RL step, one size each (x G=8 answers: 8 -> 64, 64 -> 512 answers)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per side (1: on a shared, oversubscribed machine OpenMP barriers make 2 erratic)",
    )
    parser.add_argument(
        "--ours-overrides", nargs="*", default=[], help="extra dot-list overrides (ours only)"
    )
    parser.add_argument("--variants", default="ours,trl", help="comma-separated subset of ours,trl")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step's start is not stamped)")
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        if args.worker == "ours":
            spec["overrides"] = spec["overrides"] + spec.get("ours_extra", [])
        result = (worker_ours if args.worker == "ours" else worker_trl)(spec, args)
        print(json.dumps(result), flush=True)
        return
    variants = [v for v in ("ours", "trl") if v in args.variants.split(",")]
    try:
        sizes = [int(p) for p in args.prompts.split(",")]
    except ValueError:
        parser.error(f"--prompts={args.prompts!r} must be comma-separated integers")
    if "trl" in variants and not Path(args.trl_python).exists():
        sys.exit(f"{args.trl_python} does not exist: run `make bench-env` first (or pass --trl-python)")
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl.") as tmp:
        args.work = tmp
        spec_paths: dict[int, Path] = {}
        for prompts in sizes:
            folder = Path(tmp) / f"p{prompts}"
            folder.mkdir()
            spec_path = write_spec(folder, [f"trainer.prompts_per_step={prompts}"])
            spec = json.loads(spec_path.read_text())
            spec["ours_extra"] = list(args.ours_overrides)
            spec_path.write_text(json.dumps(spec))
            spec_paths[prompts] = spec_path
        load_before = _load()
        results = {p: {v: [] for v in variants} for p in sizes}
        pythons = {"ours": sys.executable, "trl": args.trl_python}
        # Sizes and sides alternate within every round, so a change in the machine's load reaches all alike.
        for r in range(args.rounds):
            for prompts in sizes:
                for variant in variants:
                    print(f"round {r + 1}/{args.rounds}: {prompts * 8} answers, {variant} ...", file=sys.stderr,
                          flush=True)
                    results[prompts][variant].append(_run(variant, pythons[variant], spec_paths[prompts], args))
        load_after = _load()
    print(
        f"\ntiny GSPO RL step (<= 6 new tokens, K=4 minibatch updates), {args.threads} threads, "
        f"{args.rounds} alternating round(s) x {args.steps} timed steps (+{args.warmup} warm-up) per size and side"
    )
    print(f"load average (1/5/15 min): {load_before} before, {load_after} after, on {os.cpu_count()} cores")
    if args.ours_overrides:
        print(f"ours with: {' '.join(args.ours_overrides)}")
    ratios = []
    for prompts in sizes:
        print(f"\n{prompts} prompts x 8 = {prompts * 8} answers per RL step")
        medians = _table(results[prompts])
        if len(medians) == 2:
            wall_ratio = medians["ours"][0] / medians["trl"][0]
            cpu_ratio = medians["ours"][1] / medians["trl"][1]
            ratios.append(f"{prompts * 8} answers: wall x{wall_ratio:.2f}, CPU x{cpu_ratio:.2f}")
    if ratios:
        print(f"\nours / TRL per RL step (below 1: ours is faster): {'; '.join(ratios)}")


if __name__ == "__main__":
    main()
