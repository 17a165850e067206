"""`megatron-gspo demo --multi-turn`: GSPO teaches a tiny MoE to use a calculator tool
(examples/tiny_moe_calculator.yaml).

Cold start: SFT on transcripts of the config's task in which a share (`--tool-share`) of the prompts is solved with
the tool (`12*34=` -> `12*34?408=408`) and the rest answered directly (`408`), so the model knows both ways and
calls the tool on about that share of prompts. Then GSPO on multi-turn trajectories (the environment's tokens
never trained on), rewarded by the environment for the exact answer. Prints the held-out tool-call rate and
accuracy before and after RL.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from megatron_gspo.data.prompts import TASK_PREFIX
from megatron_gspo.data.tasks import make_task

DEMO_MULTITURN_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_calculator.yaml"


def write_transcripts(task_name: str, seed: int, sizes: dict[str, int], tool_share: float, out_dir: Path) -> dict:
    """jsonl files of SFT transcripts per split: a `tool_share` of each split's prompts solved with the calculator."""
    task = make_task(task_name, seed=seed)
    rng = random.Random(f"transcripts/{task_name}/{seed}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, size in sizes.items():
        path = out_dir / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for it in task.items(split, size):
                tool = rng.random() < tool_share
                answer = f"{it.prompt[:-1]}?{it.answer}={it.answer}" if tool else it.answer
                f.write(json.dumps({"prompt": it.prompt, "answer": answer}) + "\n")
        paths[split] = path
    return paths


def run_multiturn_demo(config: str | None, run_dir: Path, overrides: list[str], tool_share: float,
                       clear) -> dict:
    """SFT cold start, then GSPO with the calculator; returns the summary (and prints it)."""
    from megatron_gspo.cli.cold_start import sft_then_rl
    from megatron_gspo.training.config import load_run_config

    if not 0 <= tool_share <= 1:
        raise ValueError(f"--tool-share={tool_share} must be in [0, 1]")
    path = config or DEMO_MULTITURN_CONFIG
    start = time.time()
    cfg = load_run_config(path, [f"trainer.run_dir={run_dir}", *overrides])
    if not cfg.multiturn.enabled or not cfg.data.train.startswith(TASK_PREFIX):
        raise ValueError("demo --multi-turn needs multiturn.env set and data.train=task:<name>")
    clear(run_dir)
    task = cfg.data.train[len(TASK_PREFIX) :]
    files = write_transcripts(task, cfg.data.seed, {"train": cfg.data.train_size, "heldout": cfg.data.heldout_size},
                              tool_share, run_dir / "sft_data")
    sft, trainer, summary, rl_cfg = sft_then_rl(
        path, run_dir, overrides, sft_overrides=[f"data.train={files['train']}", f"data.heldout={files['heldout']}"]
    )
    if trainer.rt.is_logging_rank:
        rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
        before, after = rows[0], rows[-1]
        summary.update(tool_call_rate_before=before.get("eval_tool_call_rate"),
                       tool_call_rate_after=after.get("eval_tool_call_rate"), sft_steps=sft["sft_steps"],
                       sft_seconds=sft["sft_seconds"], total_seconds=time.time() - start)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        n = rl_cfg.eval.n
        print(
            f"\nmulti-turn demo ({rl_cfg.multiturn.env} tool, task {task}): cold-start SFT {sft['sft_steps']} steps "
            f"({sft['sft_seconds']:.0f} s), GSPO {summary['steps']} steps ({summary['wall_seconds']:.0f} s), total "
            f"{summary['total_seconds']:.0f} s\n"
            f"held-out tool-call rate: before RL {before['eval_tool_call_rate']:.3f} -> after RL "
            f"{after['eval_tool_call_rate']:.3f}\n"
            f"held-out accuracy (avg@{n}): before RL {summary['eval_accuracy_before']:.3f} -> after RL "
            f"{summary['eval_accuracy_after']:.3f} "
            f"({100 * (summary['eval_accuracy_after'] - summary['eval_accuracy_before']):+.1f} points)"
        )
    return summary
