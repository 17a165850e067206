"""Per-turn R3 across a multi-turn trajectory with a weight update between turns (issue 28; verl #6054's bug).

The real in-process engine (tiny Qwen3-MoE, megatron backend, routes recorded) generates 3-turn trajectories; before
each later turn the engine gets new weights (the routers re-drawn, a new version), as a trainer's sync between two
turns of an episode would do. Each stitched route row must equal the top-k that the version owning the row gives,
computed independently with transformers' Qwen3-MoE (router logits of a teacher-forced pass over the trajectory);
the old pairing (the last turn's prefill record for every row, all under the newest weights) must fail that check.
"""

import pytest
import torch

from megatron_gspo.data import CharTokenizer, PromptItem
from megatron_gspo.rollout.multiturn import MultiTurnConfig, MultiTurnRollouts
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import run_distributed
from tests.rollout.multiturn.test_driver import ALPHABET, EchoEnv

VERSIONS = 3  # one per model turn of EchoEnv's 3-turn episodes


class UpdatingEngine:
    """The real engine; before every generate call after the first, loads version `call`'s weights into the model
    and syncs the engine to them (when `update`). Records each call's outputs."""

    def __init__(self, engine, chunks, states, update: bool):
        self.engine, self.chunks, self.states, self.update = engine, chunks, states, update
        self.weight_version, self.outputs = engine.weight_version, []

    def generate(self, prompts, sampling):
        from megatron_gspo.models.hf_state import load_hf_state_dict

        if self.update and self.outputs:
            version = len(self.outputs)
            load_hf_state_dict(self.chunks, self.states[version])
            self.engine.update_weights(self.chunks, version)
        outs = self.engine.generate(prompts, sampling)
        self.outputs.append(outs)
        return outs


def _states(cfg):
    """HF state dicts of each version: version 0's random model, later versions with every router re-drawn."""
    from tests.models.parity import hf_state_dict

    base = hf_state_dict(cfg)
    states = [base]
    g = torch.Generator().manual_seed(11)
    for _ in range(1, VERSIONS):
        state = dict(base)
        for name, w in base.items():
            if name.endswith("mlp.gate.weight"):
                state[name] = torch.randn(w.shape, generator=g) * w.std() * 4
        states.append(state)
    return states


def _reference_experts(cfg, state, ids, k):
    """[len(ids) - 1, layers, k] sorted top-k expert ids of a teacher-forced transformers pass under `state`."""
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM(cfg.to_hf_config()).float().eval()
    hf.load_state_dict(state)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    rows = len(ids) - 1
    experts = torch.stack([x.reshape(len(ids), -1)[:rows].topk(k, -1).indices for x in out.router_logits], 1)
    return experts.sort(-1).values


def _engine_rank():
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.rollout.local import LocalEngine
    from tests.models.parity import tiny_config

    cfg = tiny_config(vocab_size=len(ALPHABET) + 2)
    initialize(ParallelConfig(), seed=5)
    chunks = build_model(cfg, ParallelConfig())
    states = _states(cfg)
    tok = CharTokenizer(ALPHABET)
    items = [PromptItem("12*34=", "408"), PromptItem("05+07=", "12")]
    prompts = [tok.encode(it.prompt) for it in items]
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, n=3, seed=7)
    result = {}
    try:
        for case, update in (("updated", True), ("single", False)):
            load_hf_state_dict(chunks, states[0])
            base = LocalEngine(chunks, cfg, pad_id=tok.pad_id)
            engine = UpdatingEngine(base, chunks, states, update)
            mt = MultiTurnRollouts(engine, tok, EchoEnv, MultiTurnConfig(env="echo", max_turns=3, max_total_tokens=40))
            rollouts = mt.generate(items, prompts, sampling)
            calls = [(list(o.prompt_ids), list(o.response_ids), o.routed_experts) for outs in engine.outputs
                     for o in outs]
            result[case] = []
            for r in rollouts:
                ids = r.prompt_ids + r.response_ids
                # the old driver's record: the last turn's, a prefill of the whole trajectory
                last = [routed for p, resp, routed in calls if p + resp == ids][0]
                refs = {v: _reference_experts(cfg, states[v], ids, cfg.num_experts_per_tok) for v in
                        set(r.route_versions)}
                result[case].append(dict(r=r, last=last, refs=refs))
            base.close()
    finally:
        shutdown()
    return result


@pytest.fixture(scope="module")
def result():
    return run_distributed(_engine_rank, world_size=1, timeout=600)[0]


def _pairing_errors(routed, route_versions, refs):
    """Rows whose experts differ from the top-k of the version they are paired with."""
    routed = routed.long().sort(-1).values
    return [row for row, v in enumerate(route_versions) if not torch.equal(routed[row], refs[v][row])]


def test_routes_stitched_per_turn_under_weight_updates_between_turns(result):
    spanning = 0
    for i, case in enumerate(result["updated"]):
        r, refs = case["r"], case["refs"]
        turns = r.extra["route_turns"]
        rows = len(r.prompt_ids) + len(r.response_ids) - 1
        assert r.routed_experts.shape[0] == rows == len(r.route_versions)
        # turns tile the rows in order: each starts where the previous ended, the first at 0, the last at the end
        assert turns[0][0] == 0 and turns[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(turns, turns[1:]))
        # turn k sampled under version k; its model tokens carry it, and so do the environment tokens before it
        assert [v for _, _, v in turns] == list(range(len(turns)))
        model_versions = [v for v, m in zip(r.versions, r.loss_mask) if m]
        assert sorted(set(model_versions)) == list(range(r.extra["turns"]))
        assert r.weight_version == 0
        # every row pairs with the version that owns it
        assert _pairing_errors(r.routed_experts, r.route_versions, refs) == [], i
        if r.extra["turns"] > 1:
            spanning += 1
            newest = max(r.route_versions)
            assert r.token_versions is not None
            # the unversioned pairing: the last turn's prefill record for every row, under the newest weights. It
            # is the newest version's routing (so the check can tell), and wrong on rows of the earlier turns.
            assert _pairing_errors(case["last"], [newest] * rows, refs) == [], i
            wrong = _pairing_errors(case["last"], r.route_versions, refs)
            earlier = [row for row, v in enumerate(r.route_versions) if v < newest]
            assert wrong and set(wrong) <= set(earlier), (i, wrong[:5])
            print(f"trajectory {i}: {r.extra['turns']} turns, route turns {turns}; last-turn record wrong on "
                  f"{len(wrong)} of {len(earlier)} earlier-version rows")
    assert spanning >= 2, "too few multi-turn trajectories to test anything; change the seed"


def test_single_version_trajectories_keep_one_version(result):
    for i, case in enumerate(result["single"]):
        r = case["r"]
        assert r.token_versions is None and r.weight_version == 0 and set(r.route_versions) == {0}
        assert all(v == 0 for _, _, v in r.extra["route_turns"])
        assert _pairing_errors(r.routed_experts, r.route_versions, case["refs"]) == [], i
        # the same routing as the last turn's full record (one version: stitching changes nothing)
        assert torch.equal(r.routed_experts.long().sort(-1).values, case["last"].long().sort(-1).values), i
