"""Single-stream decode against the memory bandwidth: bytes per token, the probe and the figure."""

from __future__ import annotations

import pytest

from bench import machine_peak, memory_bandwidth
from bench.figures import Figure
from bench.machine_peak import FIGURE as PEAK_FIGURE
from bench.roofline import DecodeBytes, LinearWork, RooflineInputs, roofline_figures
from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.loader.gguf_checkpoint import GGUFCheckpoint
from protoserve.engine.models.config import ModelConfig

TINY = ModelConfig(
    architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
)  # fmt: skip


def test_bytes_per_token_of_the_served_layout() -> None:
    d = DecodeBytes.of(TINY)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 96  # q, o; k, v; gate, up, down multiply-adds
    body = 2 * per_layer * 20 // 32  # Q4_1: 16 bytes of codes, a float16 scale and min per 32 weights
    head = 300 * 64 + 300 * 4  # int8 codes, a float16 scale and min per channel
    norms = (2 * 2 + 1) * 64 * 4 + 64 * 4  # float32 norms and the embedding row
    assert d.weights == body + head + norms
    assert d.kv_per_position == 2 * 2 * 32 * 2  # K and V, 2 layers, 2 heads x 16, bfloat16
    assert d.per_token(10) == d.weights + 10 * d.kv_per_position
    # float32 K/V doubles the cache's share; int8 layers store a byte a weight.
    assert DecodeBytes.of(TINY, kv_bytes=4).kv_per_position == 2 * d.kv_per_position
    assert (
        DecodeBytes.of(TINY, layers="int8").weights - d.weights
        == 2 * per_layer - body + 2 * (64 + 32 * 2 + 64 + 2 * 96 + 64) * 4
    )


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"layers": "int3"}, "layers"), ({"head": "fp8"}, "head"), ({"kv_bytes": 1}, "kv_bytes")],
)
def test_bad_layouts_are_errors_naming_the_field(kw, field) -> None:
    with pytest.raises(ValueError, match=field):
        DecodeBytes.of(TINY, **kw)
    with pytest.raises(ValueError, match="context"):
        DecodeBytes.of(TINY).per_token(0)


def test_smollm2_reads_about_95_mb_a_token() -> None:
    d = DecodeBytes.of(GGUFCheckpoint(default_model_path()).config)
    assert 94e6 < d.weights < 96e6  # the int4 layers' 66 MB and the int8 head's 28 MB
    assert d.kv_per_position == 2 * 30 * 192 * 2


def _inputs(decode_bytes: DecodeBytes | None) -> RooflineInputs:
    return RooflineInputs(
        work=LinearWork.of(TINY),
        serving_prompt_len=64,
        serving_max_tokens=64,
        int8_dot_variant=True,
        amx=False,
        decode_bytes=decode_bytes,
        decode_context=8,
    )


def test_decode_figures_take_their_share_of_the_bandwidth() -> None:
    d = DecodeBytes.of(TINY)
    figures = [Figure(memory_bandwidth.FIGURE, 40.0, "GB/s", "machine"), Figure(PEAK_FIGURE, 400.0, "GMAC/s", "machine"),
               Figure("decode.grpc", 1000.0, "tok/s", "decode"), Figure("decode.engine.paired", None, "tok/s", "decode"),
               Figure("decode.sse", 900.0, "tok/s", "decode")]  # fmt: skip
    out = {f.name: f for f in roofline_figures(figures, _inputs(d))}
    assert sorted(out) == ["roofline.decode.engine.paired", "roofline.decode.grpc"]
    grpc = out["roofline.decode.grpc"]
    assert grpc.value == pytest.approx(1000.0 * d.per_token(8) / 40e9)
    assert grpc.details["ceiling_tokens_per_s"] == pytest.approx(40e9 / d.per_token(8), rel=1e-3)
    assert "decode.engine.paired was not measured" in out["roofline.decode.engine.paired"].note
    # Without a bandwidth figure the decode rooflines are skipped with the reason; without the
    # served layout's bytes there are none.
    skipped = roofline_figures(figures[1:], _inputs(d))
    assert all(f.value is None and "memory_bandwidth was not measured" in f.note for f in skipped)
    assert roofline_figures(figures, _inputs(None)) == []


def test_a_long_decode_is_held_to_the_k_v_it_adds() -> None:
    """SmolLM2 at 4,096: 93.6 MB more K/V than the 32-token decode at 43.3 GB/s is 2.17 ms beside a
    3.24 ms short step (309 tok/s), so the long decode keeps at most 0.60 of the short one's speed."""
    d = DecodeBytes.of(GGUFCheckpoint(default_model_path()).config)
    figures = [Figure(memory_bandwidth.FIGURE, 43.3, "GB/s", "machine"),
               Figure("long_context.protoserve.decode.short", 309.0, "tok/s", "long_context"),
               Figure("long_context.self.decode.4096", 0.53, "x", "long_context"),
               Figure("long_context.self.decode.512", None, "x", "long_context")]  # fmt: skip
    out = {f.name: f for f in roofline_figures(figures, _inputs(d))}
    ceiling = out["roofline.long_context.self.decode.4096"]
    extra_s = (4096 - 32) * d.kv_per_position / 43.3e9
    assert ceiling.value == pytest.approx((1 / 309) / (1 / 309 + extra_s))
    assert 0.59 < ceiling.value < 0.61 and ceiling.unit == "x"
    assert ceiling.details["extra_kv_mb"] == pytest.approx(93.6, abs=0.05)
    assert ceiling.details["of_ceiling"] == pytest.approx(0.53 / ceiling.value, abs=1e-3)
    # A ratio that was not measured still has its ceiling; without the short decode there is none.
    assert "of_ceiling" not in out["roofline.long_context.self.decode.512"].details
    assert out["roofline.long_context.self.decode.512"].value > ceiling.value
    without_short = {f.name: f for f in roofline_figures([figures[0], *figures[2:]], _inputs(d))}
    assert "the short decode was not measured" in without_short["roofline.long_context.self.decode.4096"].note


def test_the_bandwidth_probe_measures_a_positive_rate() -> None:
    if machine_peak.compiler() is None:
        pytest.skip("no C compiler")
    bw = memory_bandwidth.measure(threads=2, size=64 << 20, repeats=1)
    assert bw.threads == 2 and bw.gbps > 0
    with pytest.raises(ValueError, match="threads"):
        memory_bandwidth.measure(threads=0)
