"""kernels/cpu/argmax.cpp against NumPy's argmax: the first maximum, the first NaN, any row width."""

from __future__ import annotations

import math

import pytest
import torch

from protoserve.kernels.cpu import argmax as am
from protoserve.kernels.cpu import extension

pytestmark = pytest.mark.skipif(not extension.cpu_supported(), reason="the CPU kernels need AVX-512 or AVX2")


def kernel(x: torch.Tensor) -> list[int]:
    return extension.load("argmax").argmax_rows(x).tolist()


@pytest.mark.parametrize("width", [1, 7, 16, 17, 49152, 49155])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_matches_numpy(rows: int, width: int) -> None:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width))
    assert kernel(x) == am.reference_argmax_rows(x)


def test_ties_go_to_the_first_maximum_in_body_and_tail() -> None:
    x = torch.zeros(4, 40)
    x[0, [3, 5, 20]] = 2.0  # three equal maxima in the vector body
    x[1, [33, 38]] = 2.0  # two in the tail (40 = 2 vectors + 8)
    x[2, [35, 10]] = 2.0  # one in each: the body's comes first
    x[3] = -0.0
    x[3, 9] = 0.0  # -0.0 == 0.0: the first of them
    assert kernel(x) == am.reference_argmax_rows(x) == [3, 33, 10, 0]


def test_nan_and_infinities_as_numpy() -> None:
    x = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    x[0, 12] = math.nan
    x[0, 30] = math.inf  # NumPy: the first NaN wins over any number
    x[1, 45] = math.nan  # in the tail
    x[2] = -math.inf  # every value -inf: index 0
    x[3, 7] = math.inf
    x[3, 40] = math.inf
    x[4, 2] = math.nan
    x[4, 44] = math.nan
    assert kernel(x) == am.reference_argmax_rows(x) == [12, 45, 0, 7, 2]


def test_strided_rows_and_the_wrapper() -> None:
    x = torch.randn(64, 2 * 1000, generator=torch.Generator().manual_seed(2))[:, ::2]  # not contiguous
    assert kernel(x) == am.reference_argmax_rows(x.contiguous()) == am.argmax_rows(x)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(x.double())
