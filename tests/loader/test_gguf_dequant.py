"""Dequantizers: bit-exact against the gguf package's numpy reference, on synthetic and real tensors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.gguf_checkpoint import open_gguf
from protoserve.engine.loader.gguf_dequant import SUPPORTED_TYPES, dequantize

T = GGMLQuantizationType

# Byte ranges of each block's float16 scale fields. Random bytes there would
# often be NaN/inf, which proves nothing, so tests write real scales into them.
_F16_FIELDS: dict[GGMLQuantizationType, list[tuple[int, int]]] = {
    T.Q8_0: [(0, 2)],
    T.Q4_0: [(0, 2)],
    T.Q4_1: [(0, 2), (2, 4)],
    T.Q5_0: [(0, 2)],
    T.Q5_1: [(0, 2), (2, 4)],
    T.Q2_K: [(80, 82), (82, 84)],
    T.Q3_K: [(108, 110)],
    T.Q4_K: [(0, 2), (2, 4)],
    T.Q5_K: [(0, 2), (2, 4)],
    T.Q6_K: [(208, 210)],
}
_BLOCK_TYPES = [t for t in SUPPORTED_TYPES if GGML_QUANT_SIZES[t][0] > 1]
_FLOAT_TYPES = [t for t in SUPPORTED_TYPES if GGML_QUANT_SIZES[t][0] == 1]


def _random_blocks(qtype: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes with finite, sign-varied float16 scales."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for start, stop in _F16_FIELDS[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, start:stop] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def test_every_listed_type_is_supported():
    required = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"}
    assert required <= {t.name for t in SUPPORTED_TYPES}
    assert set(_F16_FIELDS) == set(_BLOCK_TYPES)


@pytest.mark.parametrize("qtype", _BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    blocks = _random_blocks(qtype, n_blocks=96, seed=int(qtype))
    rows = 6
    shape = (rows, 96 * block_size // rows)
    ours = dequantize(blocks.reshape(rows, -1), qtype, shape)
    reference = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    assert np.array_equal(ours.numpy(), reference)
    # A meaningful comparison: the values are not all equal (e.g. all zero).
    assert ours.std() > 0


@pytest.mark.parametrize(
    "qtype", [t for t in _BLOCK_TYPES if t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)], ids=lambda t: t.name
)
def test_quantized_floats_roundtrip_like_reference(qtype):
    """Data quantized by gguf's own quantizer: ours equals the reference and approximates the input."""
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((16, 256)).astype(np.float32)
    packed = gguf.quants.quantize(weights, qtype)
    ours = dequantize(packed, qtype, weights.shape).numpy()
    assert np.array_equal(ours, gguf.quants.dequantize(packed, qtype))
    step = np.abs(weights).max() / 7  # coarsest grid is 4-bit
    assert np.abs(ours - weights).max() < step


@pytest.mark.parametrize("qtype", _FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types_match_reference(qtype):
    rng = np.random.default_rng(3)
    values = rng.standard_normal((8, 64)).astype(np.float32)
    values[0, :4] = [np.inf, -np.inf, 0.0, -0.0]
    raw = values if qtype == T.F32 else gguf.quants.quantize(values, qtype)
    ours = dequantize(raw, qtype, values.shape).numpy()
    reference = gguf.quants.dequantize(raw, qtype).reshape(values.shape)
    assert np.array_equal(ours, reference)
    assert np.array_equal(np.signbit(ours), np.signbit(reference))


def test_q4_0_hand_built_block():
    """Independent of the reference: byte j holds element j (low nibble) and j + 16 (high nibble)."""
    d = np.float16(0.5)
    qs = np.array([(j % 16) | ((15 - j % 16) << 4) for j in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([d]).view(np.uint8), qs])
    expected = [0.5 * (j - 8) for j in range(16)] + [0.5 * (15 - j - 8) for j in range(16)]
    assert dequantize(block, T.Q4_0, (32,)).tolist() == expected


def test_q8_0_hand_built_block():
    d = np.float16(0.25)
    q = np.arange(-16, 16, dtype=np.int8)
    block = np.concatenate([np.array([d]).view(np.uint8), q.view(np.uint8)])
    assert dequantize(block, T.Q8_0, (1, 32)).flatten().tolist() == [0.25 * v for v in range(-16, 16)]


def test_result_does_not_alias_input():
    values = np.ones((2, 32), dtype=np.float32)
    out = dequantize(values, T.F32, (2, 32))
    out.add_(1)
    assert values[0, 0] == 1.0


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.F64, T.I8, T.TQ1_0], ids=lambda t: t.name)
def test_unsupported_type_names_tensor_and_type(qtype):
    with pytest.raises(ModelLoadError) as info:
        dequantize(
            np.zeros(64, np.uint8), qtype, (1, 256), tensor_name="blk.3.ffn_up.weight", source="m.gguf"
        )
    message = str(info.value)
    assert "m.gguf" in message and "blk.3.ffn_up.weight" in message and qtype.name in message


def test_wrong_byte_count_is_model_load_error():
    blocks = _random_blocks(T.Q4_1, 4, seed=1)
    with pytest.raises(ModelLoadError, match="needs 100 bytes but has 80"):
        dequantize(blocks, T.Q4_1, (5, 32), tensor_name="t", source="x.gguf")


def test_row_not_multiple_of_block_is_model_load_error():
    with pytest.raises(ModelLoadError, match="block size 256"):
        dequantize(np.zeros(144, np.uint8), T.Q4_K, (2, 128), tensor_name="t", source="x.gguf")


@pytest.fixture(scope="module")
def smollm2_reader():
    return open_gguf(default_model_path())


def test_real_smollm2_tensors_match_reference(smollm2_reader):
    """One tensor of every type the file uses (Q8_0 embeddings, Q4_1 linears, F32 norms)."""
    seen: dict[str, str] = {}
    for tensor in smollm2_reader.tensors:
        name = tensor.tensor_type.name
        if name in seen and not tensor.name.startswith("blk.29."):
            continue
        seen.setdefault(name, tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        ours = dequantize(tensor.data, tensor.tensor_type, shape, tensor_name=tensor.name)
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        assert np.array_equal(ours.numpy(), reference), tensor.name
    assert set(seen) == {"Q8_0", "Q4_1", "F32"}
