"""Running the engine: models loaded, the engines that serve them, and the hooks that measure them.

Importing this module loads torch and the kernels. The types a request is built from, and the
engine's errors and config, are in ``protoserve.engine.api``, which loads neither. Code outside
``engine/`` imports the engine through these two modules only.
"""

from __future__ import annotations

import os
from pathlib import Path

from protoserve.engine.async_engine import AsyncEngine
from protoserve.engine.embedding.model import EmbeddingModel
from protoserve.engine.embedding.worker import EmbeddingWorker
from protoserve.engine.execution.device import resolve_device
from protoserve.engine.execution.profiling import FusedStepCall, all_position_logits, timed_fused_steps
from protoserve.engine.llm import LLM, Completion
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.footprint import Footprint, estimate_footprint
from protoserve.engine.loader.gguf_checkpoint import GGUFCheckpoint
from protoserve.engine.loader.hf_checkpoint import open_hf_checkpoint
from protoserve.engine.loader.load import LoadedModel, load_model
from protoserve.engine.lora.adapter import CONFIG_FILE as ADAPTER_CONFIG_FILE
from protoserve.engine.lora.adapter import PROJECTIONS as LORA_PROJECTIONS
from protoserve.engine.lora.adapter import WEIGHTS_FILE as ADAPTER_WEIGHTS_FILE
from protoserve.engine.lora.adapter import AdapterError
from protoserve.engine.lora.adapter import projection_shapes as lora_projection_shapes
from protoserve.engine.lora.adapter import tensor_name as adapter_tensor_name
from protoserve.engine.lora.stack import (
    AdapterInfo,
    AdapterInUseError,
    AdapterStack,
    UnknownAdapterError,
    adapter_problems,
)
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.kv_cache import resolve_kv_dtype
from protoserve.engine.models.moe import MoEBlock, MoEConfig, per_token_forward
from protoserve.engine.parallel.launch import run_worker_rank, torchrun_worker_rank
from protoserve.engine.sampling.constraints.compiler import GrammarCompiler
from protoserve.engine.sampling.constraints.masks import MaskFiller
from protoserve.engine.tokenizer.chat_template import ChatTemplateError
from protoserve.engine.tokenizer.tokenizer import Tokenizer, byte_level_alphabet

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "LORA_PROJECTIONS",
    "LLM",
    "AdapterError",
    "AdapterInUseError",
    "AdapterInfo",
    "AdapterStack",
    "AsyncEngine",
    "ChatTemplateError",
    "Completion",
    "EmbeddingModel",
    "EmbeddingWorker",
    "Footprint",
    "FusedStepCall",
    "GrammarCompiler",
    "LLMEngine",
    "LoadedModel",
    "MaskFiller",
    "MoEBlock",
    "MoEConfig",
    "Tokenizer",
    "UnknownAdapterError",
    "adapter_problems",
    "adapter_tensor_name",
    "all_position_logits",
    "byte_level_alphabet",
    "estimate_footprint",
    "load_model",
    "lora_projection_shapes",
    "per_token_forward",
    "read_model_config",
    "resolve_device",
    "resolve_kv_dtype",
    "run_worker_rank",
    "timed_fused_steps",
    "torchrun_worker_rank",
]


def read_model_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The shape of the checkpoint at ``path`` (a GGUF file or a Hugging Face directory), read from its
    metadata and headers alone: no weight is loaded. Raises ModelLoadError where it cannot be read."""
    source = Path(path)
    if source.is_dir():
        return open_hf_checkpoint(source).config
    if source.is_file():
        return GGUFCheckpoint(source).config
    raise ModelLoadError(source, "no such file or directory")
