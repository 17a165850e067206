"""Runs INSIDE the SGLang conformance environment (.venv-sglang-conformance, tools/sglang_conformance_env.sh), with
one SGLang release and sglang-router importable: checks what our engine sends against SGLang's own code.

    python tests/rollout/sglang/sglang_harness.py IN.json OUT.json

IN.json: {"requests": [[path, payload], ...], "server_commands": [[argv...]], "router_commands": [[argv...]],
"responses": [{"payload", "output_ids", "logprobs", "finish", "routes": {"num_tokens", "layers", "topk", "experts",
"offset" (optional)}}]}.
OUT.json: one verdict per request / command line, and the response bodies SGLang builds for `responses`.

How each piece is SGLang's own:
- requests: the request type of each endpoint is read from SGLang's http_server.py (the first parameter's
  annotation of the function registered for the path; the module itself is not imported: it would start the
  whole server stack), then the body is validated with pydantic's TypeAdapter of that type, which is what FastAPI
  does for a body parameter. Keys the type does not have are reported (FastAPI drops them silently). /generate
  bodies also go through what the tokenizer manager does with them: `normalize_batch_and_arguments()`,
  `SamplingParams(**sampling_params)` with `normalize` / `verify`, and from 0.5.23 the JSON contract gate
  (`generate_contract_error`) the handler runs first.
- command lines: `ServerArgs.add_cli_args` + `parse_args` (and `ServerArgs.from_cli_args` where it runs without
  a GPU, 0.5.23; its `resolved_dict()` is what /server_info returns), the router's `parse_router_args`.
- responses: `TokenizerManager._handle_batch_output` (the code that builds /generate answers) run on a
  BatchTokenIDOutput as the scheduler sends it (finish reason from SGLang's FINISH_* classes, int32 routed
  experts), the answer then serialised as the HTTP layer does (FastAPI's jsonable_encoder in 0.5.9, orjson from
  0.5.23, whose handler returns ORJSON), so 0.5.9's raw routed-experts tensor becomes what a client sees.

GPU-only modules are stubbed (STUBS), for imports made from SGLang's own files only; nothing of SGLang is edited.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any

STUBS = {
    "sgl_kernel": "CUDA kernels (0.5.9)",
    "torchvision": "its PyPI build is compiled against CUDA torch and cannot load next to CPU torch",
    "tvm_ffi": "apache-tvm-ffi kernel bindings (0.5.23's communication kernels)",
}
"""Modules SGLang imports that need a GPU build: empty stand-ins, visible only to imports from SGLang's files."""


class _AnyMeta(type):
    """A stand-in class: any attribute is another stand-in, calling it returns it (decorators keep working)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (_Any,), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def __getitem__(cls, key: Any) -> Any:
        return cls

    def __iter__(cls):
        return iter(())


class _Any(metaclass=_AnyMeta):
    pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (_Any,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves STUBS to imports whose nearest non-importlib frame is a file of the sglang packages."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in STUBS and _imported_from_sglang():
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        return _StubModule(spec.name)

    def exec_module(self, module: Any) -> None:
        module.__path__ = []
        module.__version__ = "0.0.0"


def _imported_from_sglang() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen") or "/importlib/" in name or name == __file__:
            frame = frame.f_back
            continue
        return "/sglang/" in name or "/sglang_router/" in name
    return False


# ------------------------------------------------------------------------------------------------ requests


def endpoint_types(http_server: Path) -> dict[str, str]:
    """Path -> name of the request type its handler declares (first parameter's annotation), from the source."""
    tree = ast.parse(http_server.read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        annotation = node.args.args[0].annotation if node.args.args else None
        if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Annotated":
            annotation = annotation.slice.elts[0]  # type: ignore[attr-defined]
        for dec in node.decorator_list:
            if (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and getattr(dec.func.value, "id", None) == "app"
                and dec.args
                and isinstance(dec.args[0], ast.Constant)
            ):
                found[dec.args[0].value] = ast.unparse(annotation) if annotation is not None else "-"
    return found


def type_fields(cls: Any) -> set[str]:
    """Field names of a dataclass (0.5.9) or msgspec Struct (0.5.23) request type."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import msgspec

    return {f.name for f in msgspec.structs.fields(cls)}


def plain(value: Any) -> Any:
    """JSON-able view of a parsed request's field."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return repr(value)


def check_request(path: str, payload: Any, types_by_path: dict[str, str], io_struct: Any) -> dict:
    """Validates one body as SGLang's handler for `path` parses it."""
    from pydantic import TypeAdapter

    verdict: dict[str, Any] = {"path": path, "ok": False}
    name = types_by_path.get(path)
    if name is None:
        verdict["error"] = f"SGLang has no handler for {path}"
        return verdict
    verdict["type"] = name
    if not hasattr(io_struct, name):  # no body parameter (e.g. /flush_cache: none, or a query parameter)
        verdict.update(ok=payload in (None, {}), fields={})
        if not verdict["ok"]:
            verdict["error"] = f"{path} takes no body, got {payload!r}"
        return verdict
    cls = getattr(io_struct, name)
    verdict["ignored_keys"] = sorted(set(payload or {}) - type_fields(cls))
    try:
        obj = TypeAdapter(cls).validate_python(payload if payload is not None else {})
    except Exception as e:  # noqa: BLE001 - the verdict carries it
        verdict["error"] = f"{type(e).__name__}: {e}"
        return verdict
    verdict["fields"] = {f: plain(getattr(obj, f)) for f in sorted(type_fields(cls)) if f in (payload or {})}
    verdict["defaults"] = {
        f: plain(getattr(obj, f)) for f in ("flush_cache", "abort_all_requests", "selector") if hasattr(obj, f)
    }
    if path == "/generate":
        try:
            generate_checks(payload, obj)
        except Exception as e:  # noqa: BLE001
            verdict["error"] = f"{type(e).__name__}: {e}"
            return verdict
    verdict["ok"] = True
    return verdict


def generate_checks(payload: dict, obj: Any) -> None:
    """What happens to a /generate body after parsing: the 0.5.23 contract gate, normalisation, sampling params."""
    try:
        from sglang.srt.entrypoints.api_contract import generate_contract_error
    except ImportError:  # before the contract gate (0.5.9)
        generate_contract_error = None
    if generate_contract_error is not None and (error := generate_contract_error(payload)) is not None:
        raise ValueError(f"contract: {error}")
    obj.normalize_batch_and_arguments()
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(**(obj.sampling_params or {}))  # an unknown key is a TypeError, as in the server
    params.normalize(None)  # --skip-tokenizer-init: no tokenizer
    params.verify(1 << 20)


# --------------------------------------------------------------------------------------------- command lines


def parse_server_args(argv: list[str]) -> Any:
    """argparse.Namespace of a launch_server command line (after `-m sglang.launch_server`), SGLang's parser."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


MODEL_PATH = "."
"""A Hugging Face directory with the test model's config.json (IN.json's model_path): what ServerArgs resolves."""


def default_server_args() -> Any:
    """ServerArgs of a server started with --skip-tokenizer-init and defaults otherwise, on `--device cpu` (their
    resolution looks for an accelerator; the device matters to the scheduler, not to the answers built here).
    Where that still fails (0.5.9), the values are SGLang's from_cli_args mapping without the resolution step."""
    from sglang.srt.server_args import ServerArgs

    argv = ["--model-path", MODEL_PATH, "--skip-tokenizer-init", "--device", "cpu"]
    try:
        return ServerArgs.from_cli_args(parse_server_args(argv))
    except Exception:  # noqa: BLE001 - "No accelerator ... is available"

        class Unresolved(ServerArgs):  # type: ignore[misc, valid-type]
            def __post_init__(self) -> None:
                pass

        return Unresolved.from_cli_args(parse_server_args(argv))


def check_server_command(argv: list[str]) -> dict:
    """Parses a launch_server command line with ServerArgs' parser; /server_info's shape from what it builds."""
    from sglang.srt.server_args import ServerArgs

    verdict: dict[str, Any] = {"argv": argv, "ok": False}
    try:
        ns = parse_server_args(argv)
    except SystemExit:
        verdict["error"] = "ServerArgs' parser refused the command line"
        return verdict
    verdict["args"] = {k: plain(v) for k, v in vars(ns).items()}
    verdict["args"]["tp_size"] = getattr(ns, "tp_size", getattr(ns, "tensor_parallel_size", None))
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except Exception as e:  # noqa: BLE001 - 0.5.9 needs an accelerator to build ServerArgs
        verdict["constructed"] = f"{type(e).__name__}: {e}"
        info = dict(vars(ns))  # 0.5.9's /server_info is dataclasses.asdict(server_args): the same names
    else:
        verdict["constructed"] = "ok"
        resolved = getattr(server_args, "resolved_dict", None)
        info = resolved() if callable(resolved) else dataclasses.asdict(server_args)
    from sglang.version import __version__

    info["version"] = __version__
    verdict["server_info"] = {k: plain(v) for k, v in info.items()}
    verdict["ok"] = True
    return verdict


def check_router_command(argv: list[str]) -> dict:
    """Parses a launch_router command line (after `-m sglang_router.launch_router`) with the router's parser."""
    from sglang_router.launch_router import parse_router_args

    verdict: dict[str, Any] = {"argv": argv, "ok": False}
    try:
        args = parse_router_args(argv)
    except SystemExit:
        verdict["error"] = "the router's parser refused the command line"
        return verdict
    verdict["args"] = {k: plain(getattr(args, k)) for k in ("worker_urls", "host", "port", "policy")}
    verdict["ok"] = True
    return verdict


# ------------------------------------------------------------------------------------------------ responses


def build_response(spec: dict, io_struct: Any) -> dict:
    """The /generate answer SGLang's tokenizer manager builds for one finished request, as a client receives it."""
    import torch
    from pydantic import TypeAdapter
    from sglang.srt.managers import schedule_batch, tokenizer_manager

    obj = TypeAdapter(io_struct.GenerateReqInput).validate_python(spec["payload"])
    obj.normalize_batch_and_arguments()
    rid = obj.rid
    finish = spec["finish"]
    if finish == "stop":
        reason = schedule_batch.FINISH_MATCHED_TOKEN(matched=spec["output_ids"][-1]).to_json()
    elif finish == "length":
        reason = schedule_batch.FINISH_LENGTH(length=len(spec["output_ids"])).to_json()
    else:
        reason = schedule_batch.FINISH_ABORT(message="Abort before prefill").to_json()
    routes = spec.get("routes")
    experts = None
    if routes is not None:
        n, layers, topk, num = routes["num_tokens"], routes["layers"], routes["topk"], routes["experts"]
        # int32, as SGLang's routed-experts capturer records them; `offset` tells records of one prefix apart
        experts = ((torch.arange(n * layers * topk, dtype=torch.int32) * 7 + routes.get("offset", 0)) % num).reshape(
            n, layers, topk)
    values = {
        "rids": [rid],
        "finished_reasons": [reason],
        "output_ids": [list(spec["output_ids"])],
        "prompt_tokens": [len(obj.input_ids)],
        "completion_tokens": [len(spec["output_ids"])],
        "cached_tokens": [0],
        "reasoning_tokens": [0],
        "retraction_counts": [0],
        "output_token_logprobs_val": [list(spec["logprobs"])],
        "output_token_logprobs_idx": [list(spec["output_ids"])],
        "routed_experts": [experts] if experts is not None else None,
    }
    if spec.get("weight_versions") is not None:  # [[version, start, end], ...]: SGLang >= 0.5.23's scheduler spans
        from sglang.srt.utils.weight_versions import WeightVersionSpan

        spans = [WeightVersionSpan(version=v, start=a, end=b) for v, a, b in spec["weight_versions"]]
        values["weight_versions"] = [spans]
    recv = construct(io_struct.BatchTokenIDOutput, values)
    manager = tokenizer_manager.TokenizerManager.__new__(tokenizer_manager.TokenizerManager)
    state = construct_state(tokenizer_manager, obj)
    for name, value in manager_attributes(manager, rid, state).items():
        setattr(manager, name, value)
    result = manager._handle_batch_output(recv)
    if asyncio.iscoroutine(result):
        asyncio.run(result)
    (out,) = state.out_list
    return {"body": http_encode(out), "routes": experts.tolist() if experts is not None else None}


def construct(cls: Any, values: dict) -> Any:
    """A batch output of one request: the given fields, every other one empty for that request."""
    import msgspec

    if dataclasses.is_dataclass(cls):
        fields = [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                  for f in dataclasses.fields(cls)]
    else:
        fields = [(f.name, f.required) for f in msgspec.structs.fields(cls)]
    kwargs = {}
    for name, required in fields:
        if name in values:
            kwargs[name] = values[name]
        elif required:
            kwargs[name] = [] if name.startswith(("input_", "output_")) or name.endswith("_val") else [None]
    return cls(**kwargs)


def construct_state(tokenizer_manager: Any, obj: Any) -> Any:
    """The manager's ReqState of the request, as it makes one when the request arrives."""
    cls = tokenizer_manager.ReqState
    known: dict[str, Any] = {"out_list": [], "finished": False, "event": asyncio.Event(), "obj": obj,
                             "created_time": time.time()}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        if f.name in known:
            kwargs[f.name] = known[f.name]
        elif f.name == "time_stats":  # 0.5.23
            kwargs[f.name] = tokenizer_manager.APIServerReqTimeStats()
        else:
            raise TypeError(f"ReqState field {f.name!r} is new: teach the harness its value")
    return cls(**kwargs)


def manager_attributes(manager: Any, rid: str, state: Any) -> dict:
    """What `_handle_batch_output` reads from the manager for a plain generation with --skip-tokenizer-init."""
    server_args = default_server_args()
    try:  # 0.5.23: process-wide config, published by the HTTP server before it builds the tokenizer manager
        from sglang.srt.runtime_context import publish
    except ImportError:
        pass
    else:
        publish(server_args, role="tokenizer")
    attrs: dict[str, Any] = {
        "rid_to_state": {rid: state},
        "server_args": server_args,
        "enable_metrics": False,
        "skip_tokenizer_init": True,
        "log_requests": False,
        "dump_requests_folder": "",
        "crash_dump_folder": None,
        "enable_trace": False,
        "enable_lora": False,
        "incremental_streaming_output": False,
    }
    config_value = getattr(type(manager), "config_value", None)
    if config_value is not None:  # 0.5.23 reads live settings through config_value(name)
        attrs["config_value"] = lambda name: {"weight_version": "default"}.get(name)
    return attrs


def http_encode(out: dict) -> Any:
    """The answer as a client decodes it: 0.5.9's handler returns the dict (FastAPI's jsonable_encoder), later ones
    return orjson of it (`orjson_response`; a tensor there would be an error, so it is encoded first)."""
    import fastapi.encoders
    from sglang.version import __version__

    major_minor_patch = tuple(int(x) for x in __version__.split(".")[:3])
    if major_minor_patch < (0, 5, 10):
        return json.loads(json.dumps(fastapi.encoders.jsonable_encoder(out)))
    import orjson

    return json.loads(orjson.dumps(out, option=orjson.OPT_NON_STR_KEYS))


# ------------------------------------------------------------------------------------------------------ main


def join_group(argv: list[str]) -> None:
    """`join-group PORT GROUP_NAME SHAPE_JSON`: SGLang's own server end of the weight-update group (its
    `init_custom_process_group`, called as its model runner calls it: tcp:// init method, rank 1 of 2, over gloo
    instead of NCCL), then one float32 tensor received the way `update_weights_from_distributed` receives each
    weight (an async broadcast from rank 0, then wait); prints the tensor as JSON."""
    sys.meta_path.insert(0, _StubFinder())
    import torch
    from sglang.srt.utils.common import init_custom_process_group

    port, group_name, shape = int(argv[0]), argv[1], json.loads(argv[2])
    group = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name=group_name
    )
    weight = torch.empty(shape, dtype=torch.float32)
    torch.distributed.broadcast(weight, src=0, group=group, async_op=True).wait()
    print(json.dumps(weight.tolist()), flush=True)
    # Out without the interpreter's teardown: a live gloo group's threads, destroyed at exit, abort it now and
    # then ("terminate called without an active exception", SIGABRT: seen once in a CI-like run). A real SGLang
    # server keeps the group for its lifetime.
    sys.stderr.flush()
    os._exit(0)


def weight_updater(argv: list[str]) -> None:
    """`weight-updater GROUP_NAME`: SGLang 0.5.23's own model-runner WeightUpdater (what its scheduler calls for
    /init_weights_update_group, /update_weights_from_distributed's receive and /destroy_weights_update_group),
    driven one command a line from stdin, one JSON answer a line on stdout:
    `init PORT` -> [success, message] (rank 1 of 2, over gloo instead of NCCL); `recv SHAPE_JSON` -> the float32
    tensor received from rank 0, or [false, message]; `destroy` -> [success, message]. The default process group it
    asserts is a one-rank gloo group (a real server's is its TP group)."""
    sys.meta_path.insert(0, _StubFinder())
    warnings.simplefilter("ignore")
    import torch
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    updater = WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={}, get_model=None,
        update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None,
    )  # fmt: skip
    name = argv[0]
    print(json.dumps(["ready"]), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "init":
            answer: Any = updater.init_weights_update_group("127.0.0.1", int(arg), 1, 2, name, backend="gloo")
        elif command == "recv":
            try:
                ((_, weight),) = updater.receive_weights_from_distributed(
                    names=["w"], dtypes=["float32"], shapes=[json.loads(arg)], group_name=name
                )
                answer = weight.tolist()
            except Exception as e:  # its scheduler's catch (scheduler_components/weight_updater.py:209-211)
                answer = [False, f"Failed to receive weights: {e}"]
        else:
            answer = updater.destroy_weights_update_group(name)
        print(json.dumps(answer), flush=True)
    sys.stderr.flush()
    os._exit(0)  # as join_group: no teardown of live gloo groups


def pause_locks(argv: list[str]) -> None:
    """`pause-locks`: what SGLang 0.5.23's own TokenizerManager does with the calls a resumed engine may send
    (engine.py `_undo_dead_trainer`), on a bare instance with its own locks (utils/aio_rwlock.py) while one
    generation holds the model-update reader lock as `generate_request` does (tokenizer_manager.py:941). Prints
    one JSON object: `is_ready` (what GET /ready answers 200 for) running and paused; whether /end_weight_update's
    handler (`_weight_update_session_call`) returned within 0.3 s, unpaused and paused; whether a new generation
    got the reader lock meanwhile; whether /continue_generation's handler returned."""
    sys.meta_path.insert(0, _StubFinder())
    warnings.simplefilter("ignore")
    import asyncio
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import ContinueGenerationReqInput
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.utils.aio_rwlock import RWLock

    async def scenario() -> dict:
        manager = TokenizerManager.__new__(TokenizerManager)
        manager.is_pause, manager.is_pause_cond, manager.model_update_lock = False, asyncio.Condition(), RWLock()
        manager.gracefully_exit, manager.server_status = False, ServerStatus.Up
        manager.auto_create_handle_loop = lambda: None

        async def to_scheduler(obj: Any) -> list:  # the scheduler answers at once
            return [SimpleNamespace(success=True, message="ok")]

        manager._async_dispatch_to_scheduler = to_scheduler
        lock = manager.model_update_lock
        out: dict = {"ready_running": manager.is_ready()}
        generation = lock.reader_lock
        await generation.__aenter__()
        end = asyncio.ensure_future(manager._weight_update_session_call(to_scheduler, None))
        await asyncio.sleep(0.3)
        out["end_unpaused_returned"] = end.done()
        newer = asyncio.ensure_future(lock.acquire_reader())
        await asyncio.sleep(0.3)
        out["new_generation_admitted"] = newer.done()
        resume = asyncio.ensure_future(manager.continue_generation(ContinueGenerationReqInput()))
        await asyncio.sleep(0.3)
        out["continue_unpaused_returned"] = resume.done()
        await generation.__aexit__(None, None, None)
        await asyncio.wait_for(asyncio.gather(end, newer, resume), 5)
        await lock.release_reader()
        manager.is_pause = True  # as /pause_generation sets it (tokenizer_manager.py:2268-2269)
        out["ready_paused"] = manager.is_ready()
        await generation.__aenter__()
        end = asyncio.ensure_future(manager._weight_update_session_call(to_scheduler, None))
        await asyncio.sleep(0.3)
        out["end_paused_returned"] = end.done()
        await generation.__aexit__(None, None, None)
        return out

    print(json.dumps(asyncio.run(scenario())), flush=True)


def main(argv: list[str]) -> None:
    global MODEL_PATH
    if argv and argv[0] == "join-group":
        return join_group(argv[1:])
    if argv and argv[0] == "weight-updater":
        return weight_updater(argv[1:])
    if argv and argv[0] == "pause-locks":
        return pause_locks(argv[1:])
    warnings.simplefilter("ignore")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the model is a local directory; nothing is downloaded
    sys.meta_path.insert(0, _StubFinder())
    spec = json.loads(Path(argv[0]).read_text())
    MODEL_PATH = spec.get("model_path", MODEL_PATH)
    started = time.monotonic()
    import sglang
    from sglang.srt.managers import io_struct
    from sglang.version import __version__

    http_server = Path(sglang.__file__).parent / "srt" / "entrypoints" / "http_server.py"
    types_by_path = endpoint_types(http_server)
    report: dict[str, Any] = {"version": __version__, "stubs": sorted(STUBS)}
    report["requests"] = [check_request(p, body, types_by_path, io_struct) for p, body in spec.get("requests", [])]
    report["server_commands"] = [check_server_command(a) for a in spec.get("server_commands", [])]
    report["router_commands"] = [check_router_command(a) for a in spec.get("router_commands", [])]
    responses = []
    for item in spec.get("responses", []):
        try:
            responses.append({"ok": True, **build_response(item, io_struct)})
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            import traceback

            responses.append({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
    report["responses"] = responses
    report["seconds"] = round(time.monotonic() - started, 1)
    Path(argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
