"""``protoserve serve --tensor-parallel-size N`` with a model its ranks cannot split: one line, exit 1.

The default model, SmolLM2-135M, has 9 query heads: two ranks cannot split them. The refusal comes
from the config alone, before any rank starts or loads weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protoserve.server import exit_codes

pytestmark = pytest.mark.live  # runs the CLI in a process of its own

PROTOSERVE = Path(sys.executable).with_name("protoserve")


def test_smollm2_over_two_ranks_is_one_line_naming_the_sizes_it_takes():
    done = subprocess.run(
        [str(PROTOSERVE), "serve", "--port", "0", "--no-http", "--no-progress", "--log-level", "warning",
         "--tensor-parallel-size", "2"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == exit_codes.MODEL_LOAD, done.stderr
    assert done.stderr.splitlines() == [
        "protoserve: could not load the model: tensor_parallel_size 2 does not divide the model's num_heads (9); "
        "tensor_parallel_size this model takes: 1, 3"
    ]
