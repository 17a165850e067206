"""HF <-> Megatron conversion end to end: random tiny Qwen3MoeForCausalLM models saved by transformers in several
safetensors shards -> hf-to-megatron -> logits equal transformers' (fp32, 1e-4) in one process and in 2-rank
TP=2 (sequence parallel) / EP=2 / PP=2 (+ virtual pipeline) layouts; checkpoints written by those layouts load in
one process; megatron-to-hf gives back identical tensors and a directory transformers loads."""

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint.helpers import (
    layouts_job,
    read_safetensors_dir,
    reload_job,
    save_random_hf_model,
    single_process_job,
    token_ids,
)
from tests.distributed import run_distributed

LAYOUTS = {
    "tp2": dict(tp=2, sequence_parallel=True),
    "ep2": dict(ep=2),
    "pp2": dict(pp=2),
}
ATOL = 1e-4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Paths of every artefact, plus the transformers reference logits."""
    root = tmp_path_factory.mktemp("convert")
    names = [f"{kind}_{what}" for kind in ("main", "odd") for what in ("hf", "ck", "back")]
    names += ["bf16_ck", "bf16_back", "tokenizer", "scratch"]
    names += [f"{n}_{what}" for n in LAYOUTS for what in ("ck", "back", "hf_out")]
    paths = {name: str(root / name) for name in names}
    tok = Path(paths["tokenizer"])
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {"type": "WordLevel"}}')
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    ref = {kind: save_random_hf_model(kind, Path(paths[f"{kind}_hf"]), seed=1) for kind in ("main", "odd")}
    return paths, ref


@pytest.fixture(scope="module")
def single(work):
    paths, _ = work
    return run_distributed(single_process_job, paths, world_size=1)[0]


@pytest.fixture(scope="module")
def layouts(work, single):
    paths, _ = work
    per_rank = run_distributed(layouts_job, LAYOUTS, paths, world_size=2)
    run_distributed(reload_job, paths, sorted(LAYOUTS), world_size=1)
    return {name: [r[name] for r in per_rank] for name in LAYOUTS}


def _assert_same_tensors(got_dir, want_dir, dtype=None):
    got, want = read_safetensors_dir(got_dir), read_safetensors_dir(want_dir)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        expected = value if dtype is None else value.to(dtype)
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), f"{name} differs after the round trip"


def test_hf_checkpoint_is_sharded(work):
    paths, _ = work
    index = json.loads((Path(paths["main_hf"]) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 5


@pytest.mark.parametrize("kind", ["main", "odd"])
def test_single_process_logits_match_transformers(work, single, kind):
    _, ref = work
    got = single[f"{kind}_logits"]
    assert got.shape == ref[kind].shape
    assert ref[kind].abs().max() > 0.1
    torch.testing.assert_close(got, ref[kind], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["main", "odd"])
def test_round_trip_gives_identical_tensors_and_a_loadable_model(work, single, kind):
    from transformers import Qwen3MoeForCausalLM

    paths, ref = work
    back = Path(paths[f"{kind}_back"])
    _assert_same_tensors(back, paths[f"{kind}_hf"])
    model = Qwen3MoeForCausalLM.from_pretrained(back).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(token_ids(kind)).logits
    torch.testing.assert_close(logits, ref[kind], atol=1e-6, rtol=0)


def test_megatron_to_hf_writes_index_shards_config_and_tokenizer(work, single):
    from transformers import AutoConfig

    paths, _ = work
    back = Path(paths["main_back"])
    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in back.glob("*.safetensors")) and len(shards) > 5
    assert all((back / s).stat().st_size <= 300_000 + 10_000 for s in shards)  # + safetensors header
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (back / name).read_text() == (Path(paths["tokenizer"]) / name).read_text()
    config = AutoConfig.from_pretrained(back).to_dict()
    original = AutoConfig.from_pretrained(paths["main_hf"]).to_dict()
    differing = {k for k in set(config) | set(original) if config.get(k) != original.get(k)}
    assert differing == {"_name_or_path"}, {k: (original.get(k), config.get(k)) for k in differing}
    assert not list(back.parent.glob(".main_back*")), "temporary directory left behind"


def test_bf16_conversion_round_trips_the_bf16_weights(work, single):
    paths, _ = work
    info = json.loads((Path(paths["bf16_ck"]) / "megatron_gspo.json").read_text())
    assert info["dtype"] == "bfloat16" and info["format_version"] == 1
    _assert_same_tensors(paths["bf16_back"], paths["main_hf"], dtype=torch.bfloat16)


def test_model_io_errors_are_clear(single):
    e = single["errors"]
    assert "num_hidden_layers: checkpoint 4, model 2" in e["config_mismatch"]
    assert "num_experts_per_tok: checkpoint 2, model 3" in e["config_mismatch"]
    assert "does not exist" in e["missing_dir"]
    assert "unreadable or corrupt" in e["corrupt"]
    assert e["iter_dir_equal"]
    # fields of the source config.json that ModelConfig does not model follow the weights into later checkpoints
    assert e["iter_info"]["step"] == 3 and e["iter_info"]["hf_config_extras"]["initializer_range"] == 0.02
    assert "not a megatron-gspo model checkpoint" in e["run_dir"] and "iter_0000003" in e["run_dir"]
    assert "disk full" in e["failed_save"]
    assert e["after_failed_save"] and e["siblings"] == ["iter_0000003"]
    assert e["replaced_info"]["step"] == 4 and e["replaced_siblings"] == ["iter_0000003"]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_logits_match_transformers(work, layouts, name):
    _, ref = work
    results = layouts[name]
    expected = {"main_logits": "main"}
    if name != "tp2":  # a single KV head cannot be split over TP
        expected["odd_logits"] = "odd"
    if name == "pp2":
        expected["vpp_logits"] = "main"
    assert {k for r in results for k in r} == set(expected)
    for key, kind in expected.items():
        got = [r[key] for r in results if r[key] is not None]
        assert got, f"{name}: no rank produced {key}"
        for g in got:
            torch.testing.assert_close(g, ref[kind], atol=ATOL, rtol=0, msg=f"{name} {key}")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_checkpoint_written_by_layout_loads_in_one_process(work, layouts, name):
    paths, _ = work
    info = json.loads((Path(paths[f"{name}_ck"]) / "megatron_gspo.json").read_text())
    assert info["layout"]["world_size"] == 2 and info["layout"][name[:2]] == 2
    _assert_same_tensors(paths[f"{name}_back"], paths["main_hf"])


def test_megatron_to_hf_from_a_pipeline_layout(work, layouts):
    paths, _ = work
    _assert_same_tensors(paths["pp2_hf_out"], paths["main_hf"])
