"""Our SGLang engine against SGLang's own code, for every release we support (rollout/sglang/versions.py).

The SGLang releases live in .venv-sglang-conformance (`make sglang-conformance-env`, which `make test` builds:
tools/sglang_conformance_env.sh; no GPU packages). The test drives the engine through every call it makes
(generation with seeds and R3, abort, disk / shm and NCCL weight sync in both weight-update protocols, memory
release / resume, group destroy) against fake servers of that release, captures each request, and hands them with
our server and router command lines (the engine's and the launch scripts') to tests/rollout/sglang/sglang_harness.py
inside that environment. There SGLang validates each body with the request type its HTTP handler declares (and,
for /generate, what its tokenizer manager does next), parses the command lines with ServerArgs' and the router's
parsers, and builds /generate answers with its tokenizer manager, which we then decode. Multi-turn trajectories
ride along (multiturn_trajectories.py): every turn's request validated, then the trajectories generated again from
SGLang's answers to them. A real sglang-router (its Rust binary runs on a CPU) is started in front of a fake server
to see what it forwards.

When the next SGLang release changes any of it, this fails in CI instead of on a cluster.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from megatron_gspo.rollout.sglang import SGLangConfig, SGLangEngine
from megatron_gspo.rollout.sglang.launch import router_command, server_command
from megatron_gspo.rollout.sglang.protocol import RoutingSpec, SGLangResponseError, decode_generate_response
from megatron_gspo.rollout.sglang.server_info import ServerInfo
from megatron_gspo.rollout.sglang.versions import SGLANG_ROUTER, TESTED_SGLANG
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import free_port
from tests.rollout.server.test_transport import named_weights
from tests.rollout.sglang import multiturn_trajectories as multiturn
from tests.rollout.sglang.fake_server import FakeSGLang
from tests.rollout.sglang.test_weight_sync import RecordingGroup

ROOT = Path(__file__).resolve().parents[3]
ENV = ROOT / ".venv-sglang-conformance"
ENV_PYTHON = ENV / "venv" / "bin" / "python"
HARNESS = Path(__file__).with_name("sglang_harness.py")
ROUTES = dict(num_experts=8, num_moe_layers=3, moe_topk=2)
SPEC = RoutingSpec(num_layers=3, topk=2, num_experts=8)

pytestmark = pytest.mark.skipif(
    not (ENV / ".installed").exists() and not os.environ.get("CI"),
    reason="no .venv-sglang-conformance: run `make sglang-conformance-env` (make test builds it; in CI this never skips)",
)


def sglang_path(version: str) -> str:
    return os.pathsep.join([str(ENV / f"sglang-{version}"), str(ENV / f"sglang-router-{SGLANG_ROUTER}")])


def write_model(directory: Path) -> Path:
    """config.json of the tiny Qwen3-MoE (what ServerArgs resolves; no weights are read)."""
    from megatron_gspo.models.config import preset

    config = preset("tiny").to_hf_config()
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------- what we send


def drive_engine(version: str, tmp: Path) -> dict:
    """Every request kind the engine sends to a server of `version`, captured; plus /generate specs to answer."""
    r3 = version != "0.5.9"  # refused there (test_server_info.py)
    servers = [FakeSGLang(version=version, num_layers=3, num_experts=8).start() for _ in range(2)]
    urls = [s.url for s in servers]
    base = dict(mode="attach", urls=urls, backoff_s=0.01, max_retries=1, request_timeout_s=20)
    try:
        engine = SGLangEngine(SGLangConfig(**base, **(dict(return_routed_experts=True, **ROUTES) if r3 else {}),
                                           deterministic_inference=True, context_length=4096))
        engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=4, n=2, seed=3, temperature=0.8,
                                                             top_p=0.9, top_k=5, stop_token_ids=(1, 2)))
        engine.generate([[3, 4]], SamplingParams(max_new_tokens=2, temperature=0.0))
        engine._run(engine._abort({"run-1-0-0-0": urls[0]}))
        engine.close()

        disk = SGLangEngine(SGLangConfig(**base, weight_sync="disk", weight_sync_dir=str(tmp / "weights")))
        disk.push_weights(iter(named_weights()), version=1)
        disk.close()

        for s in servers:
            s.join_groups = False
        nccl = SGLangEngine(SGLangConfig(**base, tp_size=2), group_factory=RecordingGroup)
        nccl.push_weights(iter(named_weights()), version=2)
        nccl.close()  # leaves the group: /destroy_weights_update_group

        colocated = SGLangEngine(SGLangConfig(**base, colocated=True, weight_sync="shm"))
        colocated.release_memory()
        colocated.resume_memory()
        colocated.release_memory(["kv_cache", "weights"])
        colocated.resume_memory(["kv_cache", "weights"])
        colocated.close()
    finally:
        for s in servers:
            s.stop()
    requests = [[path, payload] for s in servers for path, payload in s.calls]
    generates = [payload for path, payload in requests if path == "/generate"]
    responses = []
    for payload, finish in zip(generates, ("stop", "length", "abort", "stop")):
        output = [9, 11, 1] if finish == "stop" else [9, 11]
        routes = None
        if payload.get("return_routed_experts"):
            routes = dict(num_tokens=len(payload["input_ids"]) + len(output) - 1, layers=3, topk=2, experts=8)
        responses.append(dict(payload=payload, output_ids=output, logprobs=[-0.5, -0.25, -2.0][: len(output)],
                              finish=finish, routes=routes))
    return {"requests": requests, "responses": responses}


FULL = dict(
    python="python", model_path="MODEL", num_servers=2, tp_size=2, base_gpu_id=2, mem_fraction=0.45,
    host="0.0.0.0", port_base=31000, colocated=True, weight_sync="shm", deterministic_inference=True,
    context_length=4096, return_routed_experts=True, **ROUTES, extra_server_args=["--dtype", "bfloat16"],
)


def engine_commands(model: Path) -> tuple[list[list[str]], list[list[str]]]:
    """Our server command lines (after `-m sglang.launch_server`) and router command line."""
    servers = []
    for fields in (dict(model_path="MODEL"), FULL):
        cfg = SGLangConfig(**fields)
        for i in range(cfg.num_servers):
            argv = server_command(cfg, i)[3:]
            servers.append([str(model) if a == "MODEL" else a for a in argv])
    router = router_command(SGLangConfig(model_path="m", router=True), ["http://a:30000", "http://b:30000"])[3:]
    return servers, [router]


def launch_script_commands(tmp: Path, model: Path) -> tuple[list[list[str]], list[list[str]]]:
    """The server and router command lines launch/ prints (DRY_RUN=1) for disaggregated + colocated jobs."""
    from tests.launch.test_scripts import FOUR_NODES, LAUNCH, SCONTROL

    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "scontrol").write_text(SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    common = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp), "DRY_RUN": "1", "SLURM_SUBMIT_DIR": str(tmp),
              "CONFIG": "c.yaml", "SGLANG_MODEL_PATH": str(model), **FOUR_NODES}
    jobs = [
        dict(ROLLOUT_MODE="disaggregated", ROLLOUT_NODES="1", SGLANG_TP="4", SGLANG_ROUTER="1",
             SGLANG_DETERMINISTIC="1"),
        dict(ROLLOUT_MODE="colocated", SGLANG_TP="8", ROUTING_REPLAY="r3", SGLANG_MEM_FRACTION="0.35"),
    ]
    servers: list[list[str]] = []
    routers: list[list[str]] = []
    for job in jobs:
        proc = subprocess.run(["bash", str(LAUNCH / "train.sbatch")], env={**common, **job}, cwd=tmp,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        for line in proc.stdout.splitlines():
            if not line.strip().startswith("+ "):
                continue
            argv = shlex.split(line.strip()[2:])
            argv = argv[: argv.index(">")] if ">" in argv else argv
            for module, out in (("sglang.launch_server", servers), ("sglang_router.launch_router", routers)):
                if module in argv:
                    out.append(argv[argv.index(module) + 1 :])
    assert servers and routers
    return servers, routers


def run_harness(version: str, spec: dict, tmp: Path) -> subprocess.Popen:
    (tmp / f"in-{version}.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=sglang_path(version), OMP_NUM_THREADS="1")
    log = open(tmp / f"harness-{version}.log", "w")  # noqa: SIM115 - closed by the fixture
    return subprocess.Popen(
        [str(ENV_PYTHON), str(HARNESS), str(tmp / f"in-{version}.json"), str(tmp / f"out-{version}.json")],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """version -> (what we sent, SGLang's verdicts); both releases' harnesses run at once."""
    tmp = tmp_path_factory.mktemp("conformance")
    model = write_model(tmp / "model")
    servers, routers = engine_commands(model)
    script_servers, script_routers = launch_script_commands(tmp, model)
    captured, procs, turns = {}, {}, {}
    for version in TESTED_SGLANG:
        captured[version] = drive_engine(version, tmp / version)
        spec = dict(captured[version], model_path=str(model), server_commands=servers + script_servers,
                    router_commands=routers + script_routers)
        if version == multiturn.VERSION:  # multi-turn trajectories' requests and answers ride along
            turns[version] = multiturn.first_pass()
            spec["requests"] = spec["requests"] + [["/generate", p] for p in turns[version]["requests"]]
            spec["responses"] = spec["responses"] + turns[version]["responses"]
        procs[version] = run_harness(version, spec, tmp)
    out = {}
    for version, proc in procs.items():
        code = proc.wait(timeout=600)
        log = (tmp / f"harness-{version}.log").read_text()
        assert code == 0, f"SGLang {version} harness failed:\n{log[-4000:]}"
        report = json.loads((tmp / f"out-{version}.json").read_text())
        assert report["version"] == version
        if version in turns:  # the engine's verdicts first, the multi-turn ones apart
            n, m = len(captured[version]["requests"]), len(captured[version]["responses"])
            turns[version].update(verdicts=report["requests"][n:], answers=report["responses"][m:])
            report["requests"], report["responses"] = report["requests"][:n], report["responses"][:m]
            report["multiturn"] = turns[version]
        out[version] = (captured[version], report, len(servers))
    return out


# ----------------------------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("version", TESTED_SGLANG)
def test_every_request_is_what_sglangs_handler_accepts(reports, version):
    captured, report, _ = reports[version]
    verdicts = report["requests"]
    assert len(verdicts) == len(captured["requests"]) > 20
    bad = [(v["path"], v.get("error")) for v in verdicts if not v["ok"]]
    assert bad == []
    ignored = [(v["path"], v["ignored_keys"]) for v in verdicts if v.get("ignored_keys")]
    assert ignored == []  # a key SGLang's type lacks would be dropped silently
    paths = {v["path"] for v in verdicts}
    expected = {
        "/server_info", "/health_generate", "/generate", "/abort_request", "/pause_generation",
        "/continue_generation", "/flush_cache", "/update_weights_from_disk", "/init_weights_update_group",
        "/update_weights_from_distributed", "/destroy_weights_update_group", "/release_memory_occupation",
        "/resume_memory_occupation",
    }
    session = {"/begin_weight_update", "/end_weight_update"}
    assert paths == (expected | session if version == "0.5.23" else expected)
    by_path = {}
    for v in verdicts:
        by_path.setdefault(v["path"], []).append(v)
    # no update asks SGLang to flush itself (0.5.9 asserts, 0.5.23 fails the update, when requests still run)
    for path in ("/update_weights_from_disk", "/update_weights_from_distributed"):
        assert all(v["defaults"]["flush_cache"] is False for v in by_path[path])
    (init,) = by_path["/init_weights_update_group"][:1]
    assert init["fields"]["backend"] == "nccl"
    seeded = [v for v in by_path["/generate"] if "sampling_seed" in v["fields"]["sampling_params"]]
    assert len(seeded) == 4


@pytest.mark.parametrize("version", TESTED_SGLANG)
def test_command_lines_parse_with_sglangs_own_parsers(reports, version):
    _, report, n_engine = reports[version]
    bad = [(c["argv"], c.get("error")) for c in report["server_commands"] + report["router_commands"] if not c["ok"]]
    assert bad == []
    plain, *_, full = report["server_commands"][:n_engine]
    assert plain["args"]["skip_tokenizer_init"] and not plain["args"]["enable_return_routed_experts"]
    args = full["args"]
    assert args["tp_size"] == 2 and args["base_gpu_id"] == 4 and args["port"] == 31001
    assert args["mem_fraction_static"] == 0.45 and args["context_length"] == 4096 and args["dtype"] == "bfloat16"
    for flag in ("skip_tokenizer_init", "enable_return_routed_experts", "enable_memory_saver",
                 "enable_deterministic_inference"):
        assert args[flag] is True, flag
    # what our /server_info reader takes from SGLang's /server_info of that server
    info = ServerInfo.from_json("http://x:31001", full["server_info"])
    assert info.version == version and info.skip_tokenizer_init and info.return_routed_experts
    assert info.memory_saver and info.deterministic_inference and info.context_length == 4096
    assert info.weight_update_session == (version == "0.5.23")
    router = report["router_commands"][0]["args"]
    assert router["worker_urls"] == ["http://a:30000", "http://b:30000"] and router["port"] == 29000
    scripts = report["server_commands"][n_engine:]
    assert any(c["args"]["enable_deterministic_inference"] for c in scripts)  # SGLANG_DETERMINISTIC=1
    colocated = [c for c in scripts if c["args"]["enable_memory_saver"]]
    assert colocated and all(c["args"]["mem_fraction_static"] == 0.35 for c in colocated)
    assert all(c["args"]["enable_return_routed_experts"] for c in colocated)  # ROUTING_REPLAY=r3


@pytest.mark.parametrize("version", TESTED_SGLANG)
def test_we_decode_the_answers_sglang_builds(reports, version):
    captured, report, _ = reports[version]
    assert len(report["responses"]) == 4
    for spec, answer in zip(captured["responses"], report["responses"]):
        assert answer["ok"], answer.get("trace")
        body, prompt = answer["body"], spec["payload"]["input_ids"]
        routing = SPEC if spec["routes"] is not None else None
        rollout = decode_generate_response(body, url="http://x:1", prompt_ids=prompt, routing=routing)
        assert rollout.response_ids == spec["output_ids"] and rollout.finish_reason == spec["finish"]
        assert rollout.logprobs == spec["logprobs"] and rollout.weight_version == 0
        if routing is not None and spec["finish"] != "abort":
            assert rollout.routed_experts.tolist() == answer["routes"]  # [prompt + response - 1, layers, topk]
    if version == "0.5.9":  # its routed experts with --skip-tokenizer-init: why R3 is refused there
        spec = dict(captured["responses"][0])
        body = report["responses"][0]["body"]
        assert "routed_experts" not in body["meta_info"] or body["meta_info"]["routed_experts"] == {}


def test_multi_turn_through_sglangs_own_requests_and_answers(reports):
    """Multi-turn trajectories (multiturn_trajectories.py): every turn's /generate body is what SGLang's handler
    accepts, and the trajectories generated again from the answers SGLang's tokenizer manager builds for those
    very requests are the same: token ids in and out across turns, per-turn routes stitched from each turn's own
    record."""
    mt = reports[multiturn.VERSION][1]["multiturn"]
    first, requests, answers = mt["first"], mt["requests"], mt["answers"]
    assert any(r.extra["turns"] > 1 for r in first), "no multi-turn trajectory: change the seed"
    assert [(v["ok"], v.get("ignored_keys") or []) for v in mt["verdicts"]] == [(True, [])] * len(requests)
    assert all(a["ok"] for a in answers), [a.get("trace") for a in answers if not a["ok"]]
    canned = {multiturn.key(p): a["body"] for p, a in zip(requests, answers)}
    routes_of = {multiturn.key(p): a["routes"] for p, a in zip(requests, answers)}

    second, sent = multiturn.trajectories(multiturn.CannedSGLang, canned)
    assert len(sent) == len(requests)
    for r1, r2 in zip(first, second):
        # The same trajectories from SGLang's own answers: ids, log-probs, masks, turns.
        assert (r2.response_ids, r2.logprobs, r2.loss_mask) == (r1.response_ids, r1.logprobs, r1.loss_mask)
        assert r2.extra["turn_starts"] == r1.extra["turn_starts"]
    # Token in, token out: each turn's request is exactly the ids of everything before it (no re-tokenisation),
    # and SGLang's answer to it is the turn's tokens in the trajectory.
    turns: dict[int, list] = {}
    for payload in sent:
        i, k = multiturn.turn_of(payload, canned[multiturn.key(payload)]["output_ids"], second)
        turns.setdefault(i, []).append((k, payload))
    for i, r in enumerate(second):
        assert sorted(k for k, _ in turns[i]) == list(range(r.extra["turns"]))
    stitched = 0
    for i, r in enumerate(second):
        rows = r.routed_experts.tolist()
        assert len(rows) == len(r.prompt_ids) + len(r.response_ids) - 1
        for (start, end, _), (_, payload) in zip(r.extra["route_turns"], sorted(turns[i], key=lambda t: t[0]),
                                                strict=True):
            record = routes_of[multiturn.key(payload)]
            # Per turn: the rows from the previous turn's end come from this turn's own record, the prefix not.
            assert rows[start:end] == record[start:end]
            if start:
                assert record[:start] != rows[:start]
                stitched += 1
    assert stitched > 0


def test_sglang_0_5_9_routed_experts_are_unusable_and_named(tmp_path):
    """The answer 0.5.9 builds for an R3 request with --skip-tokenizer-init (issue 16 item 3): `{}`."""
    model = write_model(tmp_path / "model")
    payload = {"rid": "r", "input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
               "logprob_start_len": -1, "stream": False, "return_routed_experts": True}
    spec = dict(model_path=str(model), responses=[dict(payload=payload, output_ids=[9, 1], logprobs=[-0.5, -1.0],
                                                         finish="stop", routes=dict(num_tokens=4, layers=3, topk=2,
                                                                                    experts=8))])
    proc = run_harness("0.5.9", spec, tmp_path)
    assert proc.wait(timeout=600) == 0, (tmp_path / "harness-0.5.9.log").read_text()[-3000:]
    (answer,) = json.loads((tmp_path / "out-0.5.9.json").read_text())["responses"]
    assert answer["ok"], answer.get("trace")
    assert answer["body"]["meta_info"]["routed_experts"] == {}
    with pytest.raises(SGLangResponseError, match=r"is a JSON object, not base64: SGLang 0\.5\.9"):
        decode_generate_response(answer["body"], url="http://x:1", prompt_ids=[3, 4, 5], routing=SPEC)


def test_a_sample_across_a_weight_update_is_as_old_as_its_oldest_tokens(tmp_path):
    """SGLang 0.5.23 tags each output token with the weight version that sampled it (spans over the output,
    srt/utils/weight_versions.py) and reports `weight_version` = the newest span's. The answer its tokenizer
    manager builds for a sample whose tokens 0-1 came from version 3 and 2-4 from version 4 decodes to per-token
    versions and the oldest version (staleness counts from it)."""
    model = write_model(tmp_path / "model")
    payload = {"rid": "r", "input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True,
               "logprob_start_len": -1, "stream": False}
    spec = dict(model_path=str(model), responses=[dict(payload=payload, output_ids=[9, 1, 2, 6, 7],
                                                         logprobs=[-0.5, -1.0, -0.25, -2.0, -0.75], finish="length",
                                                         routes=None, weight_versions=[["3", 0, 2], ["4", 2, 5]])])
    proc = run_harness("0.5.23", spec, tmp_path)
    assert proc.wait(timeout=600) == 0, (tmp_path / "harness-0.5.23.log").read_text()[-3000:]
    (answer,) = json.loads((tmp_path / "out-0.5.23.json").read_text())["responses"]
    assert answer["ok"], answer.get("trace")
    assert answer["body"]["meta_info"]["weight_version"] == "4"  # SGLang's own field: the newest
    rollout = decode_generate_response(answer["body"], url="http://x:1", prompt_ids=[3, 4, 5])
    assert rollout.weight_version == 3 and rollout.token_versions == [3, 3, 4, 4, 4]


# -------------------------------------------------------------------------------------------- the router


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"router {url} not healthy after {timeout_s} s")
        time.sleep(0.3)


def test_real_sglang_router_in_front_of_a_server(tmp_path):
    """Our router command line starts sglang-router; generation through it works, and it forwards /generate
    without `return_routed_experts` (issue 16 item 2: why R3 with a router is refused in SGLangConfig)."""
    server = FakeSGLang(num_layers=3, num_experts=8).start()
    port = free_port()
    cfg = SGLangConfig(model_path="m", router=True, router_port=port, python=str(ENV_PYTHON))
    argv = router_command(cfg, [server.url])
    env = dict(os.environ, PYTHONPATH=str(ENV / f"sglang-router-{SGLANG_ROUTER}"))
    with open(tmp_path / "router.log", "w") as log:
        router = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        engine = SGLangEngine(SGLangConfig(mode="attach", urls=[server.url], router_url=url, backoff_s=0.05,
                                           deterministic_inference=True))
        try:
            sampling = SamplingParams(max_new_tokens=3, n=2, seed=5)
            first = engine.generate([[3, 4, 5]], sampling)
            assert [r.response_ids for r in first] == [r.response_ids for r in engine.generate([[3, 4, 5]], sampling)]
            assert {r.extra["server"] for r in first} == {url}
        finally:
            engine.close()
        forwarded = [p for path, p in server.calls if path == "/generate"]
        assert len(forwarded) == 4 and all(p["sampling_params"]["sampling_seed"] for p in forwarded)
        assert all(p["return_logprob"] is True and p["input_ids"] == [3, 4, 5] for p in forwarded)

        from megatron_gspo.rollout.sglang.protocol import build_generate_payload

        r3 = build_generate_payload([3, 4, 5], SamplingParams(max_new_tokens=2), rid="r3", return_routed_experts=True)
        request = urllib.request.Request(url + "/generate", data=json.dumps(r3).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            body = json.loads(resp.read())
        received = [p for path, p in server.calls if path == "/generate"][-1]
        assert "return_routed_experts" not in received and "routed_experts" not in body["meta_info"]
    finally:
        os.killpg(router.pid, 15)
        router.wait(timeout=30)
        server.stop()


@pytest.mark.parametrize("version", TESTED_SGLANG)
def test_sglangs_own_process_group_joins_ours_and_receives_the_broadcast(version):
    """The weight-update rendezvous for real: SGLang's `init_custom_process_group` (server rank 1) and our trainer
    end (rank 0, hosting the store: weight_sync.host_update_store, bound before the server hears its port, and
    update_group_store, the NCCL group's layout) meet, over gloo, and a broadcast tensor arrives. The fake server
    only copies the store layout by hand."""
    import torch

    from megatron_gspo.rollout.sglang.weight_sync import host_update_store
    from tests.rollout.sglang.gloo_group import join_gloo_group

    name = SGLangConfig.group_name
    store = host_update_store(master_address="127.0.0.1", master_port=0, world_size=2, timeout_s=60)
    port = store.port  # bound before the server hears it, as the engine does
    sent = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8 - 0.5
    env = dict(os.environ, PYTHONPATH=sglang_path(version), OMP_NUM_THREADS="1")
    argv = [str(ENV_PYTHON), str(HARNESS), "join-group", str(port), name, json.dumps(list(sent.shape))]
    server = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        group = join_gloo_group(store=store, master_address="127.0.0.1", world_size=2, group_name=name,
                                timeout_s=60, device=torch.device("cpu"))  # fmt: skip
        group.broadcast(sent)
        out, err = server.communicate(timeout=60)
        group.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == sent.tolist()


DEAD_TRAINER = """
import sys, time, torch
from megatron_gspo.rollout.sglang.weight_sync import host_update_store
from tests.rollout.sglang.gloo_group import join_gloo_group

store = host_update_store(master_address="127.0.0.1", master_port=0, world_size=2, timeout_s=60)
print(store.port, flush=True)
group = join_gloo_group(store=store, master_address="127.0.0.1", world_size=2, group_name=sys.argv[1],
                        timeout_s=60, device=torch.device("cpu"))
group.broadcast(torch.full((2, 3), 7.0))
print("sent", flush=True)
time.sleep(600)
"""


def test_sglangs_weight_updater_after_its_trainer_is_killed():
    """What SGLang 0.5.23's own WeightUpdater (model_runner_components/weight_updater.py) does when the trainer
    of its group is killed with kill -9 and a resumed trainer inits the same group name: the init is refused
    (torch's "group name has already been created", caught: [false, message], HTTP 400), the destroy our engine
    sends on a resumed attach (engine.py `_undo_dead_trainer`) frees the name, and the next init and broadcast
    work. Over gloo, the trainers real processes (the killed one SIGKILLed after one broadcast)."""
    import threading

    import torch

    from megatron_gspo.rollout.sglang.weight_sync import host_update_store
    from tests.rollout.sglang.gloo_group import join_gloo_group

    name = SGLangConfig.group_name
    env = dict(os.environ, PYTHONPATH=sglang_path("0.5.23"), OMP_NUM_THREADS="1")
    argv = [str(ENV_PYTHON), str(HARNESS), "weight-updater", name]
    server = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    trainer_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    trainer = subprocess.Popen([sys.executable, "-c", DEAD_TRAINER, name], env=trainer_env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def ask(command: str):
        server.stdin.write(command + "\n")  # type: ignore[union-attr]
        server.stdin.flush()  # type: ignore[union-attr]
        line = server.stdout.readline()  # type: ignore[union-attr]
        assert line, server.stderr.read()[-3000:]  # type: ignore[union-attr]
        return json.loads(line)

    try:
        assert json.loads(server.stdout.readline() or "null") == ["ready"], server.stderr.read()[-3000:]
        port = int(trainer.stdout.readline())  # type: ignore[arg-type, union-attr]
        assert ask(f"init {port}") == [True, "Succeeded to initialize custom process group."]
        assert ask("recv [2, 3]") == [[7.0] * 3] * 2
        assert trainer.stdout.readline().strip() == "sent"  # type: ignore[union-attr]
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)

        store = host_update_store(master_address="127.0.0.1", master_port=0, world_size=2, timeout_s=60)
        success, message = ask(f"init {store.port}")
        assert not success and "The specified group name has already been created" in message
        assert ask("destroy") == [True, "Succeeded to destroy custom process group."]
        joined: list = []
        join = threading.Thread(target=lambda: joined.append(join_gloo_group(
            store=store, master_address="127.0.0.1", world_size=2, group_name=name, timeout_s=60,
            device=torch.device("cpu"))))  # fmt: skip
        join.start()
        assert ask(f"init {store.port}") == [True, "Succeeded to initialize custom process group."]
        join.join(timeout=60)
        sent = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
        receiving = threading.Thread(target=lambda: joined.append(ask("recv [2, 3]")))
        receiving.start()
        joined[0].broadcast(sent)
        receiving.join(timeout=60)
        assert joined[1] == sent.tolist()
        assert ask("destroy") == [True, "Succeeded to destroy custom process group."]
        assert ask("destroy") == [False, "The group to be destroyed does not exist."]
        joined[0].close()
    finally:
        for proc in (server, trainer):
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


def test_sglangs_pause_and_model_update_lock_decide_what_a_resume_may_send():
    """SGLang 0.5.23's own TokenizerManager, one generation running: /ready's check says paused only when paused;
    /end_weight_update on an unpaused server waits for the writer lock and holds every new generation behind it
    (why `_undo_dead_trainer` sends it only when /ready answers 503); paused, it returns at once; and
    /continue_generation takes no lock (what a release without /ready still gets)."""
    env = dict(os.environ, PYTHONPATH=sglang_path("0.5.23"), OMP_NUM_THREADS="1")
    run = subprocess.run([str(ENV_PYTHON), str(HARNESS), "pause-locks"], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "ready_running": True,
        "end_unpaused_returned": False,
        "new_generation_admitted": False,
        "continue_unpaused_returned": True,
        "ready_paused": False,
        "end_paused_returned": True,
    }


def test_conformance_environment_holds_the_pinned_releases():
    """The env is built from versions.py, the pins setup.py's rollout extras use (issue 16 item 9)."""
    listed = (ENV / ".installed").read_text().split()
    assert listed[: len(TESTED_SGLANG)] == list(TESTED_SGLANG) and listed[-1] == SGLANG_ROUTER
    for version in TESTED_SGLANG:
        assert (ENV / f"sglang-{version}" / f"sglang-{version}.dist-info").is_dir()
    assert sys.version_info[:2] == (3, 11)
