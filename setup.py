"""megatron-gspo: GSPO reinforcement learning for Mixture-of-Experts models on Megatron-Core."""

from setuptools import find_packages, setup

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
        "triton>=3.3",
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
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "lint": ["ruff", "mypy"],
        # GPU clusters: TE for the fused layer spec, sglang-router for load balancing. SGLang itself pins its own
        # torch / transformers and must live in a separate environment (REFERENCE.md §6): install the `rollout`
        # extra there, never into the trainer's. The TE range is megatron-core 0.16.1's own (its `dev` extra:
        # transformer-engine>=2.9.0a0,<2.12.0).
        "gpu": ["transformer-engine[pytorch]>=2.9.0a0,<2.12.0", "sglang-router"],
        "rollout": ["sglang", "sglang-router"],
    },
    entry_points={
        "console_scripts": ["megatron-gspo=megatron_gspo.cli.main:main"],
        # Inside a vLLM environment (`pip install --no-deps megatron-gspo` there): the weight-transfer backend the
        # trainer's vLLM engine uses on CPU (rollout/vllm/plugin.py). Inert where vLLM is not installed.
        "vllm.general_plugins": ["megatron_gspo=megatron_gspo.rollout.vllm.plugin:register"],
    },
)
