"""Triton kernel tests: on a CUDA device when there is one, else under Triton's CPU interpreter.

``TRITON_INTERPRET=1`` is set by tests/conftest.py before anything imports triton (it decides its
standard library's mode when first imported), unless a CUDA device is present or the variable is
already set; here again for a run of this folder alone. The ``device`` fixture is the one place that picks where the tensors live: CUDA when
it is available and the interpreter is off, else the CPU (which the interpreter runs on).
Without triton installed every module here skips (each starts with ``pytest.importorskip``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    from protoserve.kernels.triton import interpreting

    if interpreting():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("no CUDA device and TRITON_INTERPRET is off: set TRITON_INTERPRET=1 to run the kernels on the CPU")
