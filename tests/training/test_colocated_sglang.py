"""The trainer with colocated SGLang servers (a fake server, SGLang's shapes and assertions): 2 data-parallel
ranks, file weight sync, memory released after generation and resumed before the sync (issue 16 items 4, 5)."""

from __future__ import annotations

import time

from tests.distributed import run_distributed
from tests.rollout.sglang.fake_server import FakeSGLang
from tests.training.test_end_to_end import MINI


def colocated_step(url: str, run_dir: str, sync_dir: str) -> dict:
    """One RL step of the tiny task (DP=2) against colocated servers; rank 1 generates later than rank 0."""
    import torch.distributed as dist

    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_gspo.yaml", [
        *MINI, f"trainer.run_dir={run_dir}", "trainer.steps=1", "trainer.save_final=false", "eval.max_prompts=4",
        "eval.n=1", "rollout.engine=sglang", "sglang.mode=attach", f"sglang.urls=[{url}]", "sglang.colocated=true",
        "sglang.weight_sync=disk", f"sglang.weight_sync_dir={sync_dir}", "sglang.backoff_s=0.05",
    ])
    trainer = GSPOTrainer(cfg)
    try:
        if dist.get_rank() == 1:  # this rank's rollouts start, and end, later than rank 0's
            generate = trainer.generate

            def late(*args, **kwargs):
                time.sleep(1.0)
                return generate(*args, **kwargs)

            trainer.generate = late
        summary = trainer.train()
        return {"steps": summary["steps"], "version": trainer.rt.engine.weight_version}
    finally:
        trainer.close()


def test_colocated_data_parallel_step_releases_only_an_idle_server(tmp_path):
    server = FakeSGLang(vocab_size=16).start()
    server.generate_delay_s = 0.05
    try:
        args = (server.url, str(tmp_path / "run"), str(tmp_path / "weights"))
        results = run_distributed(colocated_step, *args, world_size=2, timeout=400)
    finally:
        server.stop()
    assert [r["steps"] for r in results] == [1, 1] and [r["version"] for r in results] == [1, 1]
    assert server.release_violations == []  # on main: rank 1's rollouts reached released memory
    paths = server.paths()
    release = paths.index("/release_memory_occupation")
    # every training rollout (2 ranks x 4 prompts x 4 samples) was back before the release
    assert paths[:release].count("/generate") >= 2 * 4 * 4 and paths.count("/release_memory_occupation") == 1
    after = paths[release:]
    assert after[:3] == ["/release_memory_occupation", "/resume_memory_occupation", "/pause_generation"]
    assert "/update_weights_from_disk" in after and server.weight_version == "1"
