"""The integer-dot kernels' "fast" activation precision (kernels/cpu/int8_dot_linear.cpp with
``fine=False``): coarse int8 codes only, as llama.cpp's Q8 activations.

Fast must give the coarse-only reference product (to float32 rounding), differ from exact, stay
batch invariant (a row alone, in 17- and 64-row batches, around the AMX 16-row groups, on 1 or 2
threads), and leave exact (the default) untouched.
"""

from __future__ import annotations

import pytest
import torch

from protoserve.kernels.cpu import extension
from protoserve.kernels.cpu import packed_linear as pl

pytestmark = pytest.mark.skipif(
    not (extension.cpu_supported() and pl.int8_dot_available()), reason="the integer-dot kernels need AVX-512 or AVX2"
)

DOT_FORMATS = ["int4_dot", "int8_dot"]


def _weights(fmt: str, n: int, k: int, g: torch.Generator) -> pl.PackedWeight:
    if fmt == "int8_dot":
        return pl.pack_int8_dot(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g))
    group = 64 if k % 64 == 0 else 32
    return pl.pack_int4_dot(
        torch.randint(0, 16, (n, k), generator=g),
        torch.rand(n, k // group, generator=g) * 0.01,
        torch.randn(n, k // group, generator=g) * 0.05,
        group,
    )


@pytest.mark.parametrize("fmt", DOT_FORMATS)
@pytest.mark.parametrize("shape", [(577, 576), (576, 1536), (49, 32)], ids=str)
def test_fast_matches_the_coarse_only_reference(fmt: str, shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n * 3 + k)
    weight = _weights(fmt, n, k, g)
    bias = torch.randn(n, generator=g)
    for rows in (1, 4, 5, 17, 64):
        x = torch.randn(rows, k, generator=g)
        x[rows // 2, :32] = 0.0  # an all-zero block (scale 0)
        b = bias if rows % 2 else None
        got = pl.packed_linear(x, weight, b, fine=False)
        coarse = pl.reference_linear(x, weight, b, fine=False)
        torch.testing.assert_close(got, coarse, rtol=1e-4, atol=1e-4 * k**0.5)
        # and it is the coarse product, not the exact one: the two references are far apart here
        # (except where every block is zero: one row of K = 32)
        exact = pl.reference_linear(x, weight, b)
        assert (got - coarse).abs().max() <= (exact - coarse).abs().max() / 10


@pytest.mark.parametrize("fmt", DOT_FORMATS)
def test_fast_differs_from_exact_and_costs_accuracy(fmt: str) -> None:
    """Against the float-activation product: exact stays under 0.1% of the output scale, fast is
    several times further (the coarse codes' rounding) but still within ~1%."""
    g = torch.Generator().manual_seed(11)
    weight = _weights(fmt, 512, 576, g)
    x = torch.randn(16, 576, generator=g)
    float_product = (x.double() @ pl.unpack(weight).double().T).float()
    scale = float_product.abs().max()
    exact = pl.packed_linear(x, weight)
    fast = pl.packed_linear(x, weight, fine=False)
    assert not torch.equal(exact, fast)
    exact_err = ((exact - float_product).abs().max() / scale).item()
    fast_err = ((fast - float_product).abs().max() / scale).item()
    print(f"{fmt}: max error / output scale: exact {exact_err:.2e}, fast {fast_err:.2e}")
    assert exact_err < 1e-3 and 3 * exact_err < fast_err < 2e-2


@pytest.mark.parametrize("fmt", DOT_FORMATS)
def test_exact_is_the_default_and_unchanged_by_fast_calls(fmt: str) -> None:
    """The mode travels with each call: a fast call in between leaves the next exact call's bits alone."""
    g = torch.Generator().manual_seed(12)
    weight = _weights(fmt, 100, 576, g)
    x = torch.randn(37, 576, generator=g)
    default = pl.packed_linear(x, weight)
    pl.packed_linear(x, weight, fine=False)
    assert torch.equal(pl.packed_linear(x, weight, fine=True), default)
    torch.testing.assert_close(default, pl.reference_linear(x, weight), rtol=1e-4, atol=1e-4 * 576**0.5)


@pytest.mark.parametrize("fmt", DOT_FORMATS)
@pytest.mark.parametrize("rows", [16, 17, 33, 64, 80])
def test_fast_rows_are_bit_identical_alone_and_batched(fmt: str, rows: int) -> None:
    """Row counts on the vector register tiles and around the AMX 16-row groups and 32-row panels
    (where the CPU has AMX: whole groups on tiles, the tail on VNNI): each row batched equals it alone."""
    g = torch.Generator().manual_seed(100 + rows)
    weight = _weights(fmt, 100, 576, g)  # 7 channel vectors: a short last channel tile
    bias = torch.randn(100, generator=g)
    x = torch.randn(rows, 576, generator=g)
    x[rows // 2, :32] = 0.0
    batched = pl.packed_linear(x, weight, bias, fine=False)
    for i in range(rows):
        assert torch.equal(pl.packed_linear(x[i : i + 1], weight, bias, fine=False)[0], batched[i]), i
    perm = torch.randperm(rows, generator=g)
    assert torch.equal(pl.packed_linear(x[perm], weight, bias, fine=False), batched[perm])


@pytest.mark.parametrize("fmt", DOT_FORMATS)
def test_fast_rows_do_not_depend_on_the_thread_count(fmt: str) -> None:
    g = torch.Generator().manual_seed(13)
    weight = _weights(fmt, 1536, 576, g)
    x = torch.randn(70, 576, generator=g)
    full = pl.packed_linear(x, weight, fine=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(pl.packed_linear(x, weight, fine=False), full)
    finally:
        torch.set_num_threads(threads)


def test_float_packs_ignore_the_precision() -> None:
    g = torch.Generator().manual_seed(14)
    weight = pl.pack_dense(torch.randn(64, 96, generator=g))
    x = torch.randn(5, 96, generator=g)
    assert torch.equal(pl.packed_linear(x, weight, fine=False), pl.packed_linear(x, weight))
