"""Weight-only int8 / int4: rounding, packed kernels, bytes, bad group sizes, and quality on SmolLM2."""

from __future__ import annotations

import copy

import pytest
import torch
from decoder_test_helpers import Driver, all_at_once, greedy_generate, paged_cache

from protoserve.engine.loader.load import load_model
from protoserve.engine.models.kv_cache import PagedKVCache
from protoserve.engine.models.linear import (
    Int4Linear,
    Int8Linear,
    Linear,
    check_int4_shape,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_linears,
)


def _linear(in_features: int, out_features: int, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(in_features, out_features, bias=True)
    lin.weight.data.normal_(generator=g)
    lin.bias.data.normal_(generator=g)
    return lin


def test_int8_rounding() -> None:
    w = torch.randn(96, 576) * torch.rand(96, 1)  # channels of different scales
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16 and q.abs().max() <= 127
    err = (dequantize_int8(q, scales) - w).abs()
    assert (err <= scales.float()[:, None] * 0.5 + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_rounding(group_size: int) -> None:
    w = torch.randn(48, 256) + torch.linspace(-2, 2, 256)
    w[3, :group_size] = 0.25  # a constant group: scale 0, every code 0, the value exact
    q, scales, mins = quantize_int4(w, group_size)
    assert q.min() >= 0 and q.max() <= 15
    assert scales.dtype == mins.dtype == torch.float16 and scales.shape == (48, 256 // group_size)
    back = dequantize_int4(q, scales, mins, group_size)
    assert torch.equal(back[3, :group_size], w[3, :group_size])
    err = (back - w).abs().reshape(48, -1, group_size)
    # Half a step, plus the float16 rounding of the min and of 15 steps.
    assert (err <= 0.52 * scales.float()[..., None] + 1e-3 * w.abs().amax()).all()


def test_int4_gives_back_q4_1_blocks_exactly() -> None:
    """Weights dequantized from GGUF Q4_1 (float16 d and m per 32 values, codes spanning 0..15, as
    llama.cpp's quantizer makes them) quantize back to the same codes, scales and mins."""
    g = torch.Generator().manual_seed(3)
    n, k = 64, 576
    codes = torch.randint(0, 16, (n, k), generator=g)
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every block's min and max, as Q4_1's own rounding leaves them
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, k // 32, generator=g) * 0.2).half()
    w = dequantize_int4(codes, d, m, 32)  # float32, as the GGUF loader dequantizes
    q, scales, mins = quantize_int4(w, 32)
    assert torch.equal(q, codes.to(torch.int32))
    assert torch.equal(scales, d) and torch.equal(mins, m)
    assert torch.equal(dequantize_int4(q, scales, mins, 32), w)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_kernel_matches_dequantized_matmul(mode: str) -> None:
    """The real packed kernels compute x @ dequant(W).T (in bfloat16) + b."""
    lin = _linear(576, 192)
    if mode == "int8":
        q = Int8Linear.from_linear(lin)
        w = dequantize_int8(q.weight_int8, q.scales)
    else:
        q = Int4Linear.from_linear(lin, 64)
        w = dequantize_int4(*quantize_int4(lin.weight, 64), 64)
    x = torch.randn(7, 576)
    ref = x.to(torch.bfloat16).float() @ w.t() + lin.bias
    out = q(x)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_bad_group_size_is_a_clear_error(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("llama")  # hidden 64
    with pytest.raises(ValueError, match=r"group size 128 does not divide in_features=64"):
        load_model(path, quantization="int4", group_size=128, progress=False)
    with pytest.raises(ValueError, match=r"must be one of"):
        load_model(path, quantization="int4", group_size=48, progress=False)
    with pytest.raises(ValueError, match=r"in_features=576 of mlp.down_proj.*one of \[32, 64\]"):
        check_int4_shape(1536, 576, 128, "mlp.down_proj")


def test_failed_quantization_leaves_model_untouched() -> None:
    model = torch.nn.Sequential(_linear(64, 32), _linear(96, 32))
    with pytest.raises(ValueError):
        quantize_linears(model, "int4", 64, skip=())  # 64 does not divide 96
    assert all(isinstance(m, Linear) for m in model)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_bytes_reported(tiny_checkpoint, mode: str) -> None:
    path, _ = tiny_checkpoint("llama")
    full = load_model(path, progress=False)
    q = load_model(path, quantization=mode, progress=False)
    assert full.linear_bytes_before == full.linear_bytes_after == q.linear_bytes_before
    ratio = q.linear_bytes_after / q.linear_bytes_before
    # int8: 1 byte per weight + a bf16 scale per channel; int4/32: half a byte + 2 bf16 per 32 weights.
    expected = 0.25 if mode == "int8" else 0.125 + 4 / (32 * 4)
    assert expected <= ratio <= expected + 0.02, ratio
    assert q.weight_bytes_after < q.weight_bytes_before == full.weight_bytes_before
    print(f"tiny {mode}: linear bytes {q.linear_bytes_before} -> {q.linear_bytes_after} ({ratio:.3f})")


# -- quality on the real model -----------------------------------------------------------------

QUALITY_BOUNDS = {  # (mode, group size): (min top-1 agreement, max mean |logit error|)
    ("int8", None): (0.85, 0.5),
    # Groups of 32 give back the GGUF's own Q4_1 weights: measured 0.938 / 0.050, its two misses near-ties
    # (the float32 model's top-2 margins 0.012 and 0.076 with the attention's 64-key blocks; 1.000 / 0.049
    # with 16-key blocks, 0.938 / 0.193 when int4 was quantized with bfloat16 scales and zeros).
    ("int4", 32): (0.9, 0.15),
    ("int4", 64): (0.4, 3.0),  # real 4-bit rounding error: the GGUF's Q4_1/32 grid does not fit groups of 64
}


@pytest.mark.usefixtures("one_thread")
def test_quantized_smollm2_quality(smollm2, smollm2_chat) -> None:
    """Along the float32 model's greedy continuation (teacher-forced), how often each quantized model
    picks the same token and how far its logits are; int8 also generates freely."""
    prompt, continuation = smollm2_chat
    full = smollm2.model
    seq = prompt + continuation
    positions = slice(len(prompt) - 1, len(seq) - 1)  # the 32 positions that chose the continuation

    def logits(model) -> torch.Tensor:
        return Driver(model, paged_cache(model, num_blocks=16, block_size=16)).run([seq], all_at_once)[0][
            positions
        ]

    ref = logits(full)
    for (mode, group), (min_agree, max_err) in QUALITY_BOUNDS.items():
        model = copy.deepcopy(full)
        report = quantize_linears(model, mode, group or 32)
        out = logits(model)
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        err = (out - ref).abs().mean().item()
        line = (
            f"SmolLM2 {mode}{'/' + str(group) if group else ''}: linear bytes {report.linear_bytes_before} -> "
            f"{report.linear_bytes_after} ({report.linear_bytes_after / report.linear_bytes_before:.3f}); "
            f"greedy top-1 agreement {agree:.3f}, mean |logit error| {err:.3f}"
        )
        if mode == "int8":
            free = greedy_generate(model, [prompt], len(continuation))[0]
            same = next(
                (i for i, (a, b) in enumerate(zip(free, continuation, strict=True)) if a != b), len(free)
            )
            line += f", free-running greedy identical for {same}/{len(free)} tokens"
        print(line)
        assert agree >= min_agree and err <= max_err
        del model
    # What load_model serves: int4/32 layers plus the int8 LM head, within the same bounds.
    model = copy.deepcopy(full)
    quantize_linears(model, "int4", 32, head_int8=True)
    assert isinstance(model.lm_head, Int8Linear)
    out = logits(model)
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (out - ref).abs().mean().item()
    print(f"SmolLM2 int4/32 + int8 head: greedy top-1 agreement {agree:.3f}, mean |logit error| {err:.3f}")
    assert agree >= 0.9 and err <= 0.15  # measured 0.969 / 0.075


SERVED_BOUNDS = {  # what load_model serves on the CPU kernels: (min top-1 agreement, max mean |logit error|)
    # int4_dot layers (quantized in the kernels' Q4_1 form, so the GGUF's own Q4_1 weights come back
    # exactly) + int8_dot head: measured 1.000 / 0.056 (bfloat16 K/V: see below); in bfloat16
    # scale-and-zero form they were 0.906 / 0.187.
    "int4": (0.95, 0.12),
    "int8": (0.85, 0.5),  # measured 0.938 / 0.164 (int8_dot)
}
FALLBACK_BOUNDS = (0.85, 0.5)  # without the kernels, PyTorch's weight-only ops: int4 0.969 / 0.075, int8 0.938 / 0.167


def _decisive_flips(out: torch.Tensor, ref: torch.Tensor, margin: float) -> list[tuple[int, float]]:
    """Positions whose greedy token differs from the reference's although the reference's top two
    logits were at least ``margin`` apart, with that margin: flips that are not near-ties."""
    top2 = ref.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    flipped = (out.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    return [(i, margins[i].item()) for i in flipped if margins[i] >= margin]


def _served_bounds(mode: str) -> tuple[float, float]:
    from protoserve.kernels.cpu import packed_linear

    return SERVED_BOUNDS[mode] if packed_linear.available() else FALLBACK_BOUNDS


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", sorted(SERVED_BOUNDS))
def test_served_quantized_smollm2_quality(smollm2, smollm2_path, smollm2_chat, mode: str) -> None:
    """The model load_model returns for --quantization (packed for the CPU kernels: on a VNNI CPU the
    integer-dot formats, which also round activations to int8 codes plus fine codes), against float32 along its greedy
    continuation."""
    from protoserve.kernels.cpu import packed_linear

    prompt, continuation = smollm2_chat
    seq = prompt + continuation
    positions = slice(len(prompt) - 1, len(seq) - 1)

    def logits(model) -> torch.Tensor:
        return Driver(model, paged_cache(model, num_blocks=16, block_size=16)).run([seq], all_at_once)[0][
            positions
        ]

    ref = logits(smollm2.model)
    served = load_model(smollm2_path, quantization=mode, progress=False).model
    formats = {m.packed.format for m in served.modules() if getattr(m, "packed", None) is not None}
    if packed_linear.int8_dot_available():
        assert formats == {f"{mode}_dot", "int8_dot"}
    out = logits(served)
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (out - ref).abs().mean().item()
    print(f"SmolLM2 served {mode} ({sorted(formats)}): greedy top-1 agreement {agree:.3f}, mean |logit error| {err:.3f}")
    min_agree, max_err = _served_bounds(mode)
    assert agree >= min_agree and err <= max_err


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_served_int4_with_low_precision_kv_cache_quality(smollm2, smollm2_path, smollm2_chat, kv_dtype) -> None:
    """--quantization int4 --kv-cache-dtype bfloat16 / int8: K and V rounded to bf16, or to int8 codes with
    a scale per token and KV head, on top of the int4 layers, against float32 weights and float32 K/V
    along the greedy continuation."""
    prompt, continuation = smollm2_chat
    seq = prompt + continuation
    positions = slice(len(prompt) - 1, len(seq) - 1)

    def logits(model, kv_dtype: torch.dtype) -> torch.Tensor:
        c = model.config
        cache = PagedKVCache(c.num_layers, 16, 16, c.num_kv_heads, c.head_dim, kv_dtype)
        return Driver(model, cache).run([seq], all_at_once)[0][positions]

    ref = logits(smollm2.model, torch.float32)
    served = load_model(smollm2_path, quantization="int4", progress=False).model
    fp32_kv = logits(served, torch.float32)
    out = logits(served, kv_dtype)
    assert not torch.equal(out, fp32_kv)  # the low-precision pools really were used
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (out - ref).abs().mean().item()
    print(f"SmolLM2 served int4, {kv_dtype} K/V: greedy top-1 agreement {agree:.3f}, mean |logit error| {err:.3f}")
    # Rounded K/V move every logit a little (error 0.056 -> 0.060 with bf16), which can swap the
    # reference's near-ties: measured two flips in 32 with bf16, where its top two logits were 0.012 and
    # 0.045 apart. A token the reference chose by a clear margin must not change.
    _, max_err = _served_bounds("int4")
    assert agree >= 0.9 and err <= max_err
    assert not _decisive_flips(out, ref, margin=0.1)
