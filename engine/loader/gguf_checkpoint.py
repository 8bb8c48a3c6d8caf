"""Open a GGUF checkpoint: its ModelConfig and its weights under Hugging Face names.

llama.cpp's converter renames every tensor (``blk.0.attn_q.weight``) and, for
llama-family models, permutes the rows of the Q and K projections so its rope
kernel can rotate adjacent pairs. Loading undoes both, so the decoder sees the
same state dict a safetensors checkpoint of the model would give it. What
differs per family (``general.architecture``: its metadata mapping, tensor
names and per-tensor transforms) comes from engine/models/families.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.gguf_dequant import dequantize
from protoserve.engine.loader.gguf_fields import (
    ROPE_TENSORS,
    GGUFFields,
    eog_token_ids,
    llama3_rope_factors,
    metadata_value,
    torch_shape,
)
from protoserve.engine.loader.progress import tensor_progress
from protoserve.engine.models import families
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import GGUF_GLOBAL_NAMES, Family
from protoserve.engine.models.families.llama import unpermute_qk
from protoserve.engine.models.families.weights import gguf_to_hf_name

# Re-exported: the tokenizer and the tests read GGUF metadata and llama.cpp's layouts through here.
__all__ = [
    "FastGGUFReader",
    "GGUFCheckpoint",
    "eog_token_ids",
    "llama3_rope_factors",
    "load_gguf_checkpoint",
    "metadata_value",
    "open_gguf",
    "unpermute_qk",
]


def _plain_view(reader: GGUFReader) -> np.ndarray:
    """The reader's memory map as a plain ndarray, made once per reader."""
    plain = reader.__dict__.get("_plain")
    if plain is None:
        plain = reader._plain = reader.data.view(np.ndarray)  # type: ignore[attr-defined]
    return plain


class FastGGUFReader(GGUFReader):
    """GGUFReader that parses metadata from a plain ndarray view of the memory map.

    The stock reader slices its ``np.memmap`` several times per string, and
    every memmap slice runs Python-level ``__array_finalize__``; for a 49k-token
    vocabulary plus merges that is seconds of overhead. A plain ndarray over the
    same mapping yields the same bytes without it (about 3x faster to open).
    Arrays (the vocabulary, its token types, the merges) go further: the stock
    reader parses them one element at a time, two numpy slices per string,
    which took most of what was left (~0.5 s of every SmolLM2 load). Here a
    string's bytes are a memoryview slice of the mapping (``contents()`` reads
    it the same way, by ``.tobytes()``), its length a one-item uint64 array,
    and a number array is read at once and handed out as one-item slices: the
    same fields, parts and contents as the stock reader's.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        itype = int(raw_itype[0])
        alen = self._get(orig_offs + 4, np.uint64)
        count, offs = int(alen[0]), orig_offs + 12
        if itype == GGUFValueType.STRING:
            view = memoryview(_plain_view(self))
            spans: list[tuple[int, int]] = []  # (start, length) of each string's bytes
            for _ in range(count):
                if offs + 8 > len(view):
                    raise ValueError(f"the string array at offset {orig_offs} runs past the end of the file")
                length = int.from_bytes(view[offs : offs + 8], "little")
                spans.append((offs + 8, length))
                offs += 8 + length
            if offs > len(view):
                raise ValueError(f"the string array at offset {orig_offs} runs past the end of the file")
            lengths = np.array([length for _, length in spans], dtype=np.uint64)
            items: list[Any] = []
            for i, (start, length) in enumerate(spans):
                items += (lengths[i : i + 1], view[start : start + length])
            data = list(range(3, 2 + len(items), 2))
        else:
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(itype))
            if nptype is None:  # arrays of arrays: the stock reader's recursion
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, count)
            if len(values) != count:
                raise ValueError(f"the array at offset {orig_offs} runs past the end of the file")
            items = [values[i : i + 1] for i in range(count)]
            data = list(range(2, 2 + count))
            offs += int(values.nbytes)
        return offs - orig_offs, [raw_itype, alen, *items], data, [GGUFValueType.ARRAY, GGUFValueType(itype)]

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = _plain_view(self)
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Memory-map and parse a GGUF file; any unreadable file becomes ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "no such file" if not path.exists() else "not a regular file")
    try:
        reader = FastGGUFReader(path)
    except Exception as exc:  # the reader reports corruption with assorted ValueError/KeyError/IndexError
        raise ModelLoadError(path, f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes or tensor.data_offset + tensor.n_bytes > size:
            raise ModelLoadError(path, f"truncated: tensor {tensor.name!r} extends past the end of the file")
    return reader


class GGUFCheckpoint:
    """An opened GGUF checkpoint: the ModelConfig it describes and its weights under HF names.

    Opening parses metadata and validates names and shapes of every tensor;
    weights are dequantized only when iterated. The reader stays available
    (``.reader``) so the tokenizer can be built without parsing the file again.
    """

    def __init__(self, path: str | os.PathLike[str], reader: GGUFReader | None = None) -> None:
        self.path = Path(path)
        self.reader = reader if reader is not None else open_gguf(self.path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.family = _family_of(self.path, self.reader)
        self.config = self.family.config_from_gguf(
            GGUFFields(self.reader, metadata_value(self.reader, "general.architecture"), self._tensors, self.path)
        )
        # llama.cpp files some families under another's architecture (Mixtral as "llama" with experts):
        # the config names the family whose weight names and transforms apply.
        self.family = families.get(self.config.architecture)
        self._plan = _tensor_plan(self.path, self.family, self.config, self._tensors)

    @property
    def parameter_names(self) -> list[str]:
        """Hugging Face names of the weights, in file order."""
        return [name for hf_name, _ in self._plan
                for name in ([hf_name.format(e=e) for e in range(self.config.num_experts)]
                             if "{e}" in hf_name else [hf_name])]

    def iter_weights(
        self, *, dtype: torch.dtype = torch.float32, progress: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one dequantized tensor at a time (peak memory: one tensor;
        a stacked expert tensor yields each expert's slice under its own name)."""
        for hf_name, tensor in tensor_progress(self._plan, desc=f"Loading {self.path.name}", enabled=progress):
            shape = torch_shape(tensor)
            weight = dequantize(
                tensor.data, tensor.tensor_type, shape, tensor_name=tensor.name, source=self.path
            )
            if "{e}" in hf_name:
                for e, expert in enumerate(weight.unbind(0)):
                    name = hf_name.format(e=e)
                    yield name, self.family.gguf_weight(self.config, name, expert.contiguous()).to(dtype)
                continue
            yield hf_name, self.family.gguf_weight(self.config, hf_name, weight).to(dtype)

    def load_weights(
        self, *, dtype: torch.dtype = torch.float32, progress: bool = True
    ) -> dict[str, torch.Tensor]:
        """All weights as a state dict with Hugging Face parameter names."""
        return dict(self.iter_weights(dtype=dtype, progress=progress))


def load_gguf_checkpoint(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF file into ``(config, state_dict)``; every failure is ModelLoadError."""
    checkpoint = GGUFCheckpoint(path)
    return checkpoint.config, checkpoint.load_weights(dtype=dtype, progress=progress)


def _family_of(path: Path, reader: GGUFReader) -> Family:
    arch = metadata_value(reader, "general.architecture")
    if arch not in families.GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(families.GGUF_ARCHITECTURES))
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (supported: {supported})")
    return families.for_gguf_architecture(arch)


def _tensor_plan(
    path: Path, family: Family, config: ModelConfig, tensors: dict[str, ReaderTensor]
) -> list[tuple[str, ReaderTensor]]:
    """Pair each GGUF tensor with its HF name, checking names and shapes against the config."""
    expected = family.hf_shapes(config)
    plan: list[tuple[str, ReaderTensor]] = []
    covered: set[str] = set()
    for name, tensor in tensors.items():
        if name in ROPE_TENSORS:
            continue
        hf_name = gguf_to_hf_name(name, family.gguf_layer_names, GGUF_GLOBAL_NAMES)
        stacked = gguf_to_hf_name(name, family.gguf_expert_names, {})  # experts' template, "{e}" in it
        experts = [] if stacked is None else [stacked.format(e=e) for e in range(config.num_experts)]
        if stacked is not None and all(n in expected for n in experts):
            want = (config.num_experts, *expected[experts[0]])
            hf_name, names = stacked, experts
        elif hf_name is not None and hf_name in expected:
            want, names = expected[hf_name], [hf_name]
        else:
            raise ModelLoadError(path, f"unexpected tensor {name!r} for a {config.architecture} model")
        shape = torch_shape(tensor)
        if shape != want:
            raise ModelLoadError(path, f"tensor {name!r} has shape {shape}, expected {want} for {hf_name}")
        plan.append((hf_name, tensor))
        covered.update(names)
    missing = sorted(set(expected) - covered)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(path, f"missing tensors: {', '.join(missing[:5])}{more}")
    return plan
