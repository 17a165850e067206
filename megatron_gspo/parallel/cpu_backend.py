"""Makes megatron-core 0.16.x run on a CPU with the gloo backend.

megatron-core assumes CUDA throughout: it allocates small bookkeeping tensors with `device="cuda"`, keeps its
model-parallel RNG streams in CUDA generators, overlaps communication on CUDA streams and asserts CUDA tensor
types in a few optimizer paths. None of that is essential to the math, so on a machine without CUDA we redirect
it to the CPU. Every patch below says why it exists; all of them are applied by one explicit call, `apply()`,
only when CUDA is absent, and only for the megatron-core versions they were written and tested against. One
megatron bug is not about the CPU but about transformer-engine being absent (a GPU without TE hits it too): its
fix, `apply_without_te()`, is applied on every machine by `parallel.initialize`, under the same version check (with
a second one of that kind: the distributed optimizer's checkpoint load into torch's Adam).

Mechanism: megatron-core's own modules get a module-scoped stand-in for `torch` (`_CpuTorch`, in cpu_stand_ins.py)
whose tensor factories and `torch.cuda` namespace map CUDA onto the CPU, and whose `torch.distributed` does a
collective over a one-rank group without gloo (`_CpuDistributed`). Code outside megatron-core (ours, torch itself,
user code) is untouched. A handful of functions that cannot be fixed that way are replaced one by one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys

import torch

from megatron_gspo.parallel.cpu_stand_ins import _CpuDistributed, _CpuTorch

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.0", "0.16.1")
"""megatron-core releases these patches were written and tested against."""

# megatron-core modules that are imported before patching so their `torch` global can be redirected.
_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router_replay",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.mlp",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.inference.contexts.static_context",
    "megatron.core.dist_checkpointing.strategies.torch",
    # asynchronous checkpoint saves: a CUDA sync before forking the writer, the D2H staging's sync, and the
    # all-reduces of "is every rank's writer done" / "did any fail" on int tensors of the current device
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
)

_applied = False


def _cpu_rng_tracker_add(self, name, seed):
    """CudaRNGStatesTracker.add on the CPU generator (the CUDA generators do not exist)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


@contextlib.contextmanager
def _cpu_rng_tracker_fork(self, name="model-parallel-rng"):
    """CudaRNGStatesTracker.fork on the CPU generator: swap the named state in, and back out afterwards."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    orig = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)


def _cuda_type_name(real_type, *args, **kwargs):
    """`Tensor.type()` as megatron-core expects it of a device tensor: 'torch.BFloat16Tensor' reads
    'torch.cuda.BFloat16Tensor'. With arguments it is the real conversion (`t.type(torch.float)`)."""
    if args or kwargs:
        return real_type(*args, **kwargs)
    name = real_type()
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def _cuda_type_names(tensors):
    """Within the block, `t.type()` of these CPU tensors names the CUDA tensor type of the same dtype.

    megatron-core sorts optimizer parameters by `param.type()` string ('torch.cuda.BFloat16Tensor' gets an fp32
    main copy, 'torch.cuda.FloatTensor' is used as is, anything else is a TypeError) and asserts fp32 gradients the
    same way. A method call on the tensor cannot be redirected by the module-scoped `torch` stand-in, so the answer
    is shadowed on these tensor objects only (an instance attribute; the class, other tensors and torch itself are
    untouched) and removed on exit. The dtype in the name is the real one, so the sorting is megatron's own.
    """
    shadowed = []
    try:
        for t in tensors:
            if t is None or t.is_cuda or "type" in vars(t):
                continue
            t.type = functools.partial(_cuda_type_name, t.type)
            shadowed.append(t)
        yield
    finally:
        for t in shadowed:
            del t.type


def _optimizer_params(optimizer) -> list:
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]] if optimizer else []


def _with_cuda_type_names(fn, tensors_of):
    """`fn` with `_cuda_type_names(tensors_of(*args, **kwargs))` around each call (megatron's code runs unchanged)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names(tensors_of(*args, **kwargs)):
            return fn(*args, **kwargs)

    wrapper.__wrapped_for_cpu__ = fn
    return wrapper


def _float16_optimizer_tensors(self, optimizer, *args, **kwargs) -> list:
    """Float16OptimizerWithFloat16Params.__init__(self, optimizer, config, grad_scaler, init_state_fn)."""
    return _optimizer_params(optimizer)


def _clip_tensors(parameters, *args, **kwargs) -> list:
    """clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False): the fp32 main
    gradients it asserts to be 'torch.cuda.FloatTensor'."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if not isinstance(parameters, (list, tuple)):
        return []  # a one-pass iterable is megatron's to consume (its callers pass lists)
    return [p.grad for p in parameters]


def _version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


def needed() -> bool:
    """True when there is no usable CUDA device, i.e. when `apply()` would patch."""
    return not torch.cuda.is_available()


def apply(force: bool = False) -> bool:
    """Patches megatron-core for CPU + gloo. Returns True when patches are in place.

    A no-op (returning False) when CUDA is available, unless `force`. Idempotent: a second call only redirects
    megatron-core modules imported since the first one. Raises RuntimeError for an untested megatron-core version.
    """
    global _applied
    if not force and not needed():
        return False
    version = _version()
    if version not in TESTED_VERSIONS:
        raise RuntimeError(
            f"megatron-gspo's CPU backend supports megatron-core {', '.join(TESTED_VERSIONS)}, found {version}; "
            "install megatron-core==0.16.1 (pip install 'megatron-core==0.16.1') or run on a CUDA machine"
        )
    for name in _MODULES:
        importlib.import_module(name)
    _redirect_loaded_modules()
    if _applied:
        return True

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random as tp_random

    # The model-parallel RNG tracker keeps per-stream states of CUDA generators; use CPU generator states.
    tp_random.CudaRNGStatesTracker.add = _cpu_rng_tracker_add
    tp_random.CudaRNGStatesTracker.fork = _cpu_rng_tracker_fork
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    apply_without_te()  # the CPU never has transformer-engine

    _patch_one_rank_grad_buffer()
    _patch_reset_temporary_tensors()

    # bf16 / fp16 mixed precision (Float16OptimizerWithFloat16Params: fp32 main params and grads): its constructor
    # sorts parameters by their CUDA tensor-type name and raises TypeError for CPU ones; gradient clipping asserts
    # `grad.type() == 'torch.cuda.FloatTensor'`. Both run unchanged with those names answered for the tensors they
    # inspect (their CUDA factories and multi-tensor helpers already land on the CPU through the stand-in `torch`;
    # without apex / TE megatron uses its own torch implementations of multi_tensor_applier / scale / l2norm).
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _with_cuda_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__, _float16_optimizer_tensors
    )
    # The distributed optimizer sorts the same way (its constructor, before it swaps the model params for their
    # shards in the torch optimizer's param groups, so the tensors to name are the model params).
    distrib_optimizer.DistributedOptimizer.__init__ = _with_cuda_type_names(
        distrib_optimizer.DistributedOptimizer.__init__, _float16_optimizer_tensors
    )
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32, _clip_tensors)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip

    _applied = True
    log.info("megatron-core %s patched for CPU + gloo", version)
    return True


def apply_without_te() -> bool:
    """Works around a megatron-core 0.16.x bug that hits every machine without transformer-engine, CUDA or not.

    `moe_utils` imports `te_general_gemm` inside its `try: import transformer_engine` block, so a failed import
    leaves the name undefined, while `RouterGatingLinearFunction` (every MoE router's gating GEMM, forward and
    backward) tests `te_general_gemm is not None` and raises NameError. Defining it as None selects megatron's own
    torch.mm path, which is what it means to do without TE. Called by `parallel.initialize` on every machine;
    a no-op (False) when TE imported (the name exists) or for megatron-core versions it was not checked against.
    Not a CPU patch, but a megatron patch all the same, so it lives here; so do the two other patches for
    megatron without apex / TE (`_patch_torch_adam_step`, `_patch_thd_rope`).
    """
    if _version() not in TESTED_VERSIONS:
        return False
    from megatron.core.transformer.moe import moe_utils

    patched = _patch_torch_adam_step()
    patched = _patch_thd_rope() or patched
    if hasattr(moe_utils, "te_general_gemm"):
        return patched
    moe_utils.te_general_gemm = None
    log.info("megatron-core %s without transformer-engine: router gating uses torch.mm", _version())
    return True


def _patch_torch_adam_step() -> bool:
    """Lets megatron-core 0.16.x's DistributedOptimizer load a checkpoint into torch's Adam (no apex / TE).

    Without apex / TE the distributed optimizer steps a torch AdamW, whose per-param state holds a "step" tensor
    beside the moments. Two things go wrong in `DistributedOptimizer.load_state_dict` then:
    - it sets the step of every param to ONE shared tensor (`s["step"] = step` in a loop), which torch's
      `load_state_dict` keeps shared; AdamW increments each param's step in place, so after a resume one
      optimizer step adds the number of params to the count and the bias correction is wrong from then on;
    - `load_parameter_state_from_fully_reshardable` hands `_set_main_param_and_optimizer_states` the loaded param
      and moments only (it skips "step" on purpose), and that function copies every key of the torch state from
      them: KeyError 'step'.
    The wrappers pass the step the state already holds (the checkpoint's) to the copy, and give every param its
    own copy of the step after the load. With apex / TE (FusedAdam keeps the step in its param groups) nothing is
    patched."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or hasattr(cls.load_state_dict, "__wrapped_for_cpu__"):
        return False
    set_states_original = cls._set_main_param_and_optimizer_states
    load_original = cls.load_state_dict

    @functools.wraps(set_states_original)
    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            current = self._get_main_param_and_optimizer_states(model_param)
            if "step" in current:
                tensors = {**tensors, "step": current["step"].detach().clone()}
        return set_states_original(self, model_param, tensors)

    @functools.wraps(load_original)
    def load_state_dict(self, state_dict):
        out = load_original(self, state_dict)
        inner = getattr(self, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()
        return out

    set_states.__wrapped_for_cpu__ = set_states_original
    load_state_dict.__wrapped_for_cpu__ = load_original
    cls._set_main_param_and_optimizer_states = set_states
    cls.load_state_dict = load_state_dict
    log.info("megatron-core %s without apex / TE: distributed-optimizer loads keep torch Adam's step", _version())
    return True


def _patch_thd_rope() -> bool:
    """megatron's unfused RoPE for packed (THD) sequences without its per-sequence Python loop.

    Without TE's fused RoPE (the local spec), `rope_utils._apply_rotary_pos_emb_thd` reads `cu_seqlens` to the
    host and concatenates one slice `freqs[:len_j]` per sequence, for queries and keys in every layer of every
    packed forward: on small RL steps a visible share of the CPU time (tools/profile_step.py). With one
    context-parallel rank and `freqs` over the longest sequence (megatron's "CASE 2"), the same rows come from one
    gather, freqs[i - start_j] for token i of sequence j, and go through megatron's own `_apply_rotary_pos_emb_bshd`
    unchanged: the same values bit for bit (tests/parallel/test_cpu_backend.py). Any other case runs megatron's
    function."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd
    if hasattr(original, "__wrapped_for_cpu__"):
        return False

    # The positions of the last `cu_seqlens` seen: queries and keys of every layer of one packed forward share
    # that tensor, so they are computed (and `cu_seqlens[-1]` read to the host) once per forward, not twice per
    # layer. Keyed by the tensor object and its version counter (an in-place change invalidates the entry).
    # One (tensor, version, total, positions) entry, read and replaced as a whole. Inference tensors have no
    # version counter (torch.inference_mode): their positions are computed every time.
    last: list = [None]

    def positions_of(cu_seqlens, total):
        cached = not cu_seqlens.is_inference()
        entry = last[0]
        if cached and entry is not None and entry[0] is cu_seqlens and entry[1:3] == (cu_seqlens._version, total):
            return entry[3]
        if int(cu_seqlens[-1]) != total:
            positions = None
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=total)
            positions = torch.arange(total, device=cu_seqlens.device) - starts
        if cached:
            last[0] = (cu_seqlens, cu_seqlens._version, total, positions)
        return positions

    @functools.wraps(original)
    def thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
            cp_group=None):
        total = t.shape[0]
        if cp_group is None or cp_group.size() != 1 or freqs.dim() < 1 or freqs.size(0) == total:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        positions = positions_of(cu_seqlens, total)
        if positions is None or positions.device != t.device:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[positions], rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale,
        ).squeeze(1)

    thd.__wrapped_for_cpu__ = original
    rope_utils._apply_rotary_pos_emb_thd = thd
    return True


def _patch_one_rank_grad_buffer() -> None:
    """megatron's grad buffers bound torch's `_coalescing_manager`, `all_gather_into_tensor` and
    `reduce_scatter_tensor` at import, before the stand-in `torch`: they get the stand-in's one-rank shortcuts
    (`_CpuDistributed`). A buffer that switched to its fp32-accumulating reduce-scatter keeps it."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    real = torch.distributed
    shims = _CpuDistributed(real)
    if pgb._coalescing_manager is real._coalescing_manager:
        pgb._coalescing_manager = shims._coalescing_manager
    if pgb.dist_all_gather_func is real.all_gather_into_tensor:
        pgb.dist_all_gather_func = shims.all_gather_into_tensor
    if pgb.dist_reduce_scatter_func is real.reduce_scatter_tensor:
        pgb.dist_reduce_scatter_func = shims.reduce_scatter_tensor


def _patch_reset_temporary_tensors() -> None:
    """`finalize_model_grads` calls `reset_model_temporary_tensors` after every backward: a walk over every module
    of every chunk (~200 on the tiny model) whose body acts only with a router expert bias or the global aux loss.
    Without either the walk does nothing, so it is skipped; with either it runs unchanged."""
    # the package exports the function under the module's name: the module itself comes from sys.modules
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = fmg.reset_model_temporary_tensors
    if hasattr(original, "__wrapped_for_cpu__"):
        return

    @functools.wraps(original)
    def reset(config, model):
        if config.moe_router_enable_expert_bias or "global_aux_loss" in (config.moe_router_load_balancing_type or ""):
            return original(config, model)
        return None

    reset.__wrapped_for_cpu__ = original
    fmg.reset_model_temporary_tensors = reset


def _redirect_loaded_modules() -> None:
    cpu_torch = None
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        if getattr(module, "torch", None) is torch:
            cpu_torch = cpu_torch or _CpuTorch(torch)
            module.torch = cpu_torch


def is_applied() -> bool:
    """Whether `apply()` has patched megatron-core in this process."""
    return _applied
