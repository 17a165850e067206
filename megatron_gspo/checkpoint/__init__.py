"""Checkpoints: the trainer's (manager.py: atomic, durable, async, keep-last; trainer_contents.py: model, optimizer,
RNG and run config inside one), the megatron dist-checkpoint format shared by conversion and the trainer, streamed
HF safetensors I/O, and HF <-> Megatron conversion (`megatron-gspo convert`)."""

from megatron_gspo.checkpoint.hf_io import HFCheckpointReader, write_hf_checkpoint
from megatron_gspo.checkpoint.model_io import (
    load_model_checkpoint,
    read_checkpoint_info,
    read_model_config,
    save_model_checkpoint,
    write_model_checkpoint,
)

__all__ = [
    "HFCheckpointReader",
    "load_model_checkpoint",
    "read_checkpoint_info",
    "read_model_config",
    "save_model_checkpoint",
    "write_hf_checkpoint",
    "write_model_checkpoint",
]
