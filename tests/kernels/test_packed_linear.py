"""kernels/cpu/linear.cpp and int8_dot_linear.cpp: every weight format against a float64
reference, and batch invariance.

The kernel must give the reference product (to float32 rounding) for float32,
bfloat16, int8 and int4 weights and the integer-dot int4_dot / int8_dot ones
(whose reference rounds the activations to int8 per 32 values the same way),
odd output sizes (padding to blocks of 4 or 16), biases and all row counts
around its register tiles and 64-row panel; and a row's output must be
bit-identical alone, in any batch, and with 1 or 2 threads. Where the CPU has
AMX, the integer-dot formats run whole 16-row groups on AMX tiles and the rest
on VNNI: the same bits, which the batched-vs-alone checks compare.
"""

from __future__ import annotations

import pytest
import torch

from protoserve.kernels.cpu import extension
from protoserve.kernels.cpu import packed_linear as pl

pytestmark = pytest.mark.skipif(not extension.cpu_supported(), reason="the CPU kernels need AVX-512 or AVX2")


def _weights(fmt: str, n: int, k: int, g: torch.Generator) -> pl.PackedWeight:
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == "float32":
        return pl.pack_dense(w)
    if fmt == "bfloat16":
        return pl.pack_dense(w.bfloat16())
    if fmt in ("int8", "int8_dot"):
        pack = pl.pack_int8 if fmt == "int8" else pl.pack_int8_dot
        return pack(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g))
    group = 64 if k % 64 == 0 else 32
    return (pl.pack_int4 if fmt == "int4" else pl.pack_int4_dot)(
        torch.randint(0, 16, (n, k), generator=g),
        torch.rand(n, k // group, generator=g) * 0.01,
        torch.randn(n, k // group, generator=g) * 0.05,
        group,
    )


FORMATS = ["float32", "bfloat16", "int8", "int4", "int4_dot", "int8_dot"]


def _cpu_flags() -> set[str]:
    return set(extension.cpu_flags().split())


def test_kernel_loads_on_this_machine() -> None:
    """make install builds it; a supported CPU that cannot load it is a broken install, not a skip."""
    assert pl.available()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(577, 576), (960, 576), (576, 1536), (6, 64), (49, 32)], ids=str)
def test_matches_reference(fmt: str, shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * 7 + k)
    weight = _weights(fmt, n, k, g)
    bias = torch.randn(n, generator=g)
    for rows in (1, 3, 4, 5, 17, 64, 70):
        x = torch.randn(rows, k, generator=g)
        got = pl.packed_linear(x, weight, bias if rows % 2 else None)
        want = pl.reference_linear(x, weight, bias if rows % 2 else None)
        assert got.shape == (rows, n)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unpack_inverts_pack(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 13, 64
    if fmt in ("float32", "bfloat16"):
        w = torch.randn(n, k, generator=g).to(getattr(torch, fmt))
        assert torch.equal(pl.unpack(pl.pack_dense(w)), w.float())
    elif fmt == "int8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g)
        assert torch.equal(pl.unpack(pl.pack_int8(q, s)), q.float() * s[:, None])
    elif fmt == "int8_dot":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g)
        packed = pl.pack_int8_dot(q, s)
        assert packed.scales.dtype == packed.mins.dtype == torch.float16  # as GGUF stores them
        s16 = s.half().float()  # the stored scale: float16-rounded
        torch.testing.assert_close(pl.unpack(packed), q.float() * s16[:, None], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(pl.unpack(packed), q.float() * s[:, None], rtol=1e-5, atol=1e-6)
    else:
        q = torch.randint(0, 16, (n, k), generator=g)
        s, m = torch.rand(n, 2, generator=g), torch.randn(n, 2, generator=g)
        if fmt == "int4_dot":  # float16 scales and mins: values they hold exactly
            s, m = s.half().float(), m.half().float()
        want = q.float() * s.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
        pack = pl.pack_int4 if fmt == "int4" else pl.pack_int4_dot
        assert torch.equal(pl.unpack(pack(q, s, m, 32)), want)


@pytest.mark.parametrize("shape", [(577, 576), (576, 1536), (6, 64)], ids=str)
def test_bfloat16_packs_multiply_in_bf16_where_the_cpu_has_it(shape: tuple[int, int]) -> None:
    """On AVX512-BF16 CPUs a bfloat16 pack's product is bf16(x) @ W^T accumulated in float32: within
    float32 rounding of that, and measurably not the product of the unrounded x. Elsewhere it widens
    the weights and keeps x in float32."""
    assert pl.multiplies_in_bf16() == ("avx512_bf16" in _cpu_flags() and "avx512f" in _cpu_flags())
    n, k = shape
    g = torch.Generator().manual_seed(k)
    weight = pl.pack_dense((torch.randn(n, k, generator=g) * 0.05).bfloat16())
    for rows in (1, 4, 5, 70):
        x = torch.randn(rows, k, generator=g)
        got = pl.packed_linear(x, weight)
        unrounded = (x.double() @ pl.unpack(weight).double().T).float()
        rounded = (x.bfloat16().double() @ pl.unpack(weight).double().T).float()
        want, other = (rounded, unrounded) if pl.multiplies_in_bf16() else (unrounded, rounded)
        tight = 1e-5 * k**0.5
        torch.testing.assert_close(got, want, rtol=1e-5, atol=tight)
        if rows == 70:  # enough values that some product's rounding shows
            assert (got - other).abs().max() > 10 * tight


def test_amx_tiles_are_used_where_the_cpu_and_os_offer_them() -> None:
    """A CPU with AMX-INT8 (Sapphire Rapids and later) whose kernel grants the tile state must get
    the AMX path: silently falling back to VNNI would cost batched throughput, not correctness."""
    if "amx_int8" not in _cpu_flags() or "amx_tile" not in _cpu_flags():
        assert not pl.int8_dot_amx_available()
        pytest.skip("this CPU has no AMX-INT8")
    assert pl.int8_dot_amx_available()


@pytest.mark.parametrize("fmt", ["int4_dot", "int8_dot"])
@pytest.mark.parametrize("rows", [16, 17, 33, 48, 80])
def test_amx_groups_and_vnni_tails_give_the_same_bits(fmt: str, rows: int) -> None:
    """Row counts around the 16-row AMX groups and 32-row panels: every row batched (AMX for whole
    groups, VNNI for the tail) equals the row alone (always VNNI) bit for bit."""
    g = torch.Generator().manual_seed(rows)
    weight = _weights(fmt, 100, 576, g)  # 7 channel vectors: a short last channel tile
    bias = torch.randn(100, generator=g)
    x = torch.randn(rows, 576, generator=g)
    x[rows // 2, :32] = 0.0  # an all-zero activation block (scale 0)
    batched = pl.packed_linear(x, weight, bias)
    for i in range(rows):
        assert torch.equal(pl.packed_linear(x[i : i + 1], weight, bias)[0], batched[i]), i
    torch.testing.assert_close(batched, pl.reference_linear(x, weight, bias), rtol=1e-4, atol=1e-4 * 576**0.5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_bit_identical_alone_batched_and_across_threads(fmt: str) -> None:
    g = torch.Generator().manual_seed(2)
    weight = _weights(fmt, 1536, 576, g)
    x = torch.randn(150, 576, generator=g)
    full = pl.packed_linear(x, weight)
    for i in (0, 1, 63, 64, 149):
        assert torch.equal(pl.packed_linear(x[i : i + 1], weight)[0], full[i])
    for a, b in ((3, 10), (60, 130), (0, 5)):
        assert torch.equal(pl.packed_linear(x[a:b], weight), full[a:b])
    perm = torch.randperm(150, generator=g)
    assert torch.equal(pl.packed_linear(x[perm], weight), full[perm])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(pl.packed_linear(x, weight), full)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_raise() -> None:
    weight = pl.pack_dense(torch.randn(8, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        pl.pack_dense(torch.randn(8, 24))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pl.packed_linear(torch.randn(2, 24), weight)
    with pytest.raises(RuntimeError, match="bad float32 pack"):
        pl.packed_linear(torch.randn(2, 48), weight)
    with pytest.raises(ValueError, match="multiples of 32"):
        pl.pack_int4(torch.zeros(4, 48, dtype=torch.int64), torch.ones(4, 1), torch.zeros(4, 1), 48)
    assert pl.packed_linear(torch.randn(0, 32), weight).shape == (0, 8)


def test_integer_dot_bad_inputs_and_edge_rows() -> None:
    g = torch.Generator().manual_seed(5)
    with pytest.raises(ValueError, match="multiple of 32"):
        pl.pack_int8_dot(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="-127..127"):
        pl.pack_int8_dot(torch.full((4, 32), -128, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="multiples of 32"):
        pl.pack_int4_dot(torch.zeros(4, 64, dtype=torch.int64), torch.ones(4, 1), torch.zeros(4, 1), 48)
    weight = _weights("int4_dot", 20, 64, g)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        pl.packed_linear(torch.randn(2, 48), weight)
    with pytest.raises(RuntimeError, match="bad int4 code pack"):
        pl.packed_linear(torch.randn(2, 128), weight)
    # An all-zero row (scale 0) and one huge value beside tiny ones: no NaN, the reference's rounding.
    x = torch.randn(3, 64, generator=g)
    x[0] = 0.0
    x[2, 5] = 1e4
    got = pl.packed_linear(x, weight)
    assert torch.isfinite(got).all() and torch.equal(got[0], pl.packed_linear(x[:1] * 0, weight)[0])
    torch.testing.assert_close(got, pl.reference_linear(x, weight), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("fmt", ["int4_dot", "int8_dot"])
def test_integer_dot_extreme_codes_do_not_overflow(fmt: str) -> None:
    """The largest codes against the largest activation codes of either sign, in every pattern: the
    AVX2 path adds code products in int16 (a block's 4-bit ones, an 8-bit chunk's pairs), which
    holds only within the codes' documented ranges; the sums must still be exact."""
    g = torch.Generator().manual_seed(11)
    n, k = 48, 128
    if fmt == "int4_dot":
        q = torch.where(torch.rand(n, k, generator=g) < 0.9, 15, 0)
        q[:16] = 15
        weight = pl.pack_int4_dot(q, torch.full((n, k // 32), 0.01), torch.zeros(n, k // 32), 32)
    else:
        q = torch.where(torch.rand(n, k, generator=g) < 0.5, 127, -127).to(torch.int8)
        q[:16] = 127
        q[16:32] = -127
        weight = pl.pack_int8_dot(q, torch.full((n,), 0.01))
    # Activations whose coarse codes are all +-127 (every value the block's max in size), then
    # values whose fine codes are large too.
    signs = torch.where(torch.rand(6, k, generator=g) < 0.5, -1.0, 1.0)
    signs[0], signs[1] = 1.0, -1.0
    x = torch.cat([signs * 3.0, signs * torch.rand(6, k, generator=g) * 3.0])
    exact = (x.double() @ pl.unpack(weight).double().T).float()
    got = pl.packed_linear(x, weight)
    torch.testing.assert_close(got, pl.reference_linear(x, weight), rtol=1e-5, atol=1e-3)
    assert (got - exact).abs().max() <= 1e-3 * exact.abs().max()


@pytest.mark.parametrize("fmt", ["int4_dot", "int8_dot"])
def test_integer_dot_error_from_activation_rounding_is_small(fmt: str) -> None:
    """Against the float-activation product of the same weights: coarse + fine int8 codes per 32
    values cost well under 0.1% of the output scale (coarse codes alone: ~0.4%)."""
    g = torch.Generator().manual_seed(6)
    weight = _weights(fmt, 512, 576, g)
    x = torch.randn(16, 576, generator=g)
    exact = (x.double() @ pl.unpack(weight).double().T).float()
    err = (pl.packed_linear(x, weight) - exact).abs().max() / exact.abs().max()
    assert 0 < err < 1e-3, err


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_model_layers_give_the_same_product_on_the_kernel(mode: str) -> None:
    """Linear / Int8Linear / Int4Linear before and after pack_for_kernel: the same weights.

    The PyTorch int8/int4 ops round activations to bfloat16, the kernel's float formats do not and
    its integer-dot formats (where the CPU has VNNI) round them to int8 per 32 values, so those agree
    to a few percent; float32 agrees to float32 rounding.
    """
    from protoserve.engine.models.linear import Int4Linear, Int8Linear, Linear

    g = torch.Generator().manual_seed(4)
    lin = Linear(576, 1536, bias=True)
    lin.weight.data.copy_(torch.randn(1536, 576, generator=g) * 0.05)
    lin.bias.data.copy_(torch.randn(1536, generator=g))
    layer = {"none": lambda: lin, "int8": lambda: Int8Linear.from_linear(lin),
             "int4": lambda: Int4Linear.from_linear(lin, 32)}[mode]()
    layer.deterministic = False
    x = torch.randn(9, 576, generator=g)
    before = layer(x)
    assert layer.pack_for_kernel()
    after = layer(x)
    if mode == "none":
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    else:
        assert (after - before).abs().max() <= 0.02 * before.abs().max()


def test_builds_are_kept_apart_per_cpu_feature_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """-march=native binaries are for one CPU: a home directory shared with a machine of another
    CPU (VNNI-only vs AMX) must not load the other's build."""
    here = extension.build_dir()
    assert here.parent == extension.cache_dir() / "cpu"
    monkeypatch.setattr(extension, "cpu_flags", lambda: "fpu sse avx512f avx512_vnni")
    other = extension.build_dir()
    assert other != here and other.parent == here.parent
    assert extension.build_dir() == other  # the same CPU finds its build again
