"""load_model: a GGUF file or a Hugging Face directory -> a ready Decoder (+ tokenizer).

The one entry point the engine uses. It picks the format from the path (a
``.gguf`` file or a directory; None means the default SmolLM2 GGUF), checks
every tensor's name and shape against what the decoder expects, builds the
decoder on the meta device and assigns the loaded tensors (no second copy of
the weights), then applies weight-only quantization if asked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from protoserve.engine.execution.device import resolve_device
from protoserve.engine.loader.auto_quantization import AUTO, mode_for_gguf_tensors
from protoserve.engine.loader.catalogue import ModelKind, resolve_model
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.heap import release_freed_memory
from protoserve.engine.loader.hf_checkpoint import (
    GENERATION_CONFIG_FILE,
    load_hf_tensors,
    open_hf_checkpoint,
    read_generation_config,
)
from protoserve.engine.loader.packed_checkpoint import load_packed_tensors, module_grids
from protoserve.engine.loader.sampling_defaults import gguf_sampling_defaults, hf_sampling_defaults
from protoserve.engine.models import families
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.decoder import Decoder
from protoserve.engine.models.device_ops import ops_for
from protoserve.engine.models.families.summary import ModelSummary, model_summary, parameter_count
from protoserve.engine.models.linear import (
    DEFAULT_INT4_GROUP_SIZE,
    DEVICE_ONLY_MODES,
    INT4_GROUP_SIZES,
    QUANTIZATION_MODES,
    Int4Grid,
    quantize_linears,
)

if TYPE_CHECKING:
    from protoserve.engine.tokenizer.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A loaded model and what was measured while loading it."""

    model: Decoder
    config: ModelConfig
    tokenizer: Tokenizer | None  # None for a directory without tokenizer.json (e.g. tiny test checkpoints)
    source: Path
    format: str  # "gguf" or "hf"
    dtype: torch.dtype
    quantization: str  # "none", "int8" or "int4"
    group_size: int | None  # int4 only
    weight_bytes_before: int  # all weights in `dtype`, before quantization (tied embedding once)
    weight_bytes_after: int  # all weights as served
    linear_bytes_before: int  # the quantizable linear layers only (not embeddings, norms, lm_head)
    linear_bytes_after: int
    load_seconds: float
    # Parameters by their logical (Hugging Face) shapes, however they are stored; a tied embedding once.
    num_parameters: int = 0
    # The checkpoint's recommended sampling values, by SamplingParams field (engine/loader/sampling_defaults.py).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the weights live

    def summary(self) -> ModelSummary:
        """Family, parameter counts and layer pattern, as GetModel reports them."""
        return model_summary(self.config)


def load_model(
    path: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
    quantization: str = "none",
    group_size: int | None = None,
    progress: bool = True,
    deterministic: bool = True,
    load_tokenizer: bool = True,
    device: str = "cpu",
    shard: Callable[[Decoder], None] | None = None,
) -> LoadedModel:
    """Load a model for serving.

    ``path``: a ``.gguf`` file, a Hugging Face directory (config.json +
    safetensors), an installed model's short name (engine/loader/catalogue.py),
    or None for the default, SmolLM2-135M-Instruct.
    ``quantization``: ``none``, ``int8`` (per output channel), ``int4``
    (groups of ``group_size`` input columns, default 32) or ``auto``: the checkpoint's own
    precision (engine/loader/auto_quantization.py; int8 where the layers'
    shapes do not take int4), reported in ``LoadedModel.quantization``. A GPTQ/AWQ directory is
    dequantized on load (engine/loader/packed_checkpoint.py); int4 in its own group size, as
    ``auto`` picks, keeps its codes.
    ``deterministic``: batch-invariant kernels (see engine/models/linear.py); switch later with
    ``model.set_deterministic``. ``device``: "cpu" packs the weights for the C++ kernels, "cuda"
    moves them onto the GPU for the Triton kernels (engine/execution/device.py). Raises ModelLoadError
    for a bad checkpoint and ValueError for bad options (including a group size the model's layers
    cannot take, or a device this machine lacks).
    """
    target = resolve_device(device)  # before the slow part: a missing GPU fails at once
    if quantization in DEVICE_ONLY_MODES:
        if ops_for(target).fp8_linear is None:
            raise ValueError(f"quantization {quantization} has no kernel on device {device}: it is served on "
                             "device cuda (the Triton kernels)")
        from protoserve.kernels.triton.fp8_matmul import check_fp8_device

        check_fp8_device(target)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if quantization not in (*QUANTIZATION_MODES, AUTO):
        raise ValueError(f"quantization must be one of {(*QUANTIZATION_MODES, AUTO)}, got {quantization!r}")
    if group_size is None:
        group_size = DEFAULT_INT4_GROUP_SIZE
    if quantization in ("int4", AUTO) and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    torch_dtype = DTYPES[dtype]
    started = time.perf_counter()
    resolved = resolve_model(path)
    if resolved.kind == ModelKind.EMBEDDING:
        raise ModelLoadError(resolved.name, "is an embedding model, not a generative one (serve it with --embedding-model)")
    source = resolved.path

    from protoserve.engine.tokenizer.tokenizer import Tokenizer

    grids: dict[str, Int4Grid | None] = {}  # a packed checkpoint's int4 grids, by Hugging Face layer name
    if source.is_dir():
        fmt = "hf"
        stored = "none"  # float safetensors
        ckpt = open_hf_checkpoint(source)
        config = ckpt.config
        if ckpt.quantization is None:
            weights = load_hf_tensors(ckpt, families.hf_shapes(config), progress=progress)
        else:
            packed = load_packed_tensors(ckpt, families.hf_shapes(config), progress=progress)
            weights, grids, stored = packed.weights, packed.grids, packed.stored_mode()
            if quantization == AUTO and stored == "int4":
                group_size = packed.group_size() or group_size  # the checkpoint's own groups, not the float default
        convert = families.get(config.architecture).hf_weight
        weights = {name: convert(config, name, tensor) for name, tensor in weights.items()}
        tokenizer = (
            Tokenizer.from_hf_dir(source)
            if load_tokenizer and (source / "tokenizer.json").is_file()
            else None
        )
        sampling_defaults = hf_sampling_defaults(read_generation_config(source), source / GENERATION_CONFIG_FILE)
    elif source.is_file():
        from protoserve.engine.loader.gguf_checkpoint import GGUFCheckpoint

        fmt = "gguf"
        gguf = GGUFCheckpoint(source)
        stored = mode_for_gguf_tensors((t.name, t.tensor_type.name) for t in gguf.reader.tensors)
        config = gguf.config
        weights = dict(gguf.iter_weights(dtype=torch_dtype, progress=progress))
        check_weights(weights, families.hf_shapes(config), source)
        tokenizer = Tokenizer.from_gguf(gguf.reader, source) if load_tokenizer else None
        sampling_defaults = gguf_sampling_defaults(gguf.reader, source)
    else:
        raise ModelLoadError(source, "no such file or directory")
    split = families.get(config.architecture).split_weight
    weights = {part: t for name, tensor in weights.items() for part, t in split(config, name, tensor).items()}
    # The card's values fill in what the file leaves out; the file's own win.
    sampling_defaults = {**resolved.card_sampling_defaults, **sampling_defaults}
    family_template = families.get(config.architecture).chat_template
    if tokenizer is not None and not tokenizer.has_chat_template and family_template is not None:
        tokenizer.set_chat_template(family_template)  # the checkpoint has none: the family's published one

    with torch.device("meta"):
        model = Decoder(config, torch_dtype)
    model.load_hf_weights(weights)
    del weights  # the model holds what it keeps; quantization below frees the rest
    model.eval()
    before = model.weight_bytes()
    mode = stored if quantization == AUTO else quantization
    int4_grids = module_grids(model, grids) if mode == "int4" and grids else None
    try:
        report = quantize_linears(model, mode, group_size, head_int8=True, int4_grids=int4_grids)
    except ValueError as e:
        if quantization != AUTO or mode != "int4":
            raise ValueError(f"{source}: {e}") from e
        # A layer's shape does not take int4 groups: auto keeps the file's precision at 8 bits instead.
        mode = "int8"
        report = quantize_linears(model, mode, group_size, head_int8=True)
    if shard is not None:  # tensor parallelism: this rank's slice of the final weights (engine/parallel)
        shard(model)
    model.set_deterministic(deterministic)
    if ops_for(target).pack_layout == "cpu":
        model.pack_for_kernels()
    else:
        model.to_device(target)
    release_freed_memory()  # the float32 tensors quantization and packing replaced
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        source=source,
        format=fmt,
        dtype=torch_dtype,
        quantization=mode,
        group_size=report.group_size,
        weight_bytes_before=before,
        weight_bytes_after=model.weight_bytes(),
        linear_bytes_before=report.linear_bytes_before,
        linear_bytes_after=report.linear_bytes_after,
        load_seconds=time.perf_counter() - started,
        num_parameters=parameter_count(config),
        sampling_defaults=sampling_defaults,
        device=target,
    )


def check_weights(
    weights: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], source: Path
) -> None:
    """Every expected tensor present with its shape; ModelLoadError naming ``source`` otherwise."""
    for name, shape in expected.items():
        if name not in weights:
            raise ModelLoadError(source, f"missing tensor {name!r}")
        if tuple(weights[name].shape) != tuple(shape):
            raise ModelLoadError(
                source, f"tensor {name!r} has shape {list(weights[name].shape)}, expected {list(shape)}"
            )
