"""Every Triton kernel compiles for an H100 / H200 (sm_90), here, without a GPU.

The interpreter tests check what the kernels compute; this checks that the GPU build of the same
source goes through (the native bfloat16 ``tl.dot`` paths only the GPU takes, branch typing, dot
shape minimums), down to a cubin with triton's bundled ptxas, within sm_90's shared memory. See
``triton_cuda_compile.py``. One architecture only: a cold build of all 24 variants takes ~35 s on
this machine's CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")
pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA back end")

SCRIPT = Path(__file__).with_name("triton_cuda_compile.py")


def test_every_kernel_compiles_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "90"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 24
    failed = {name: why for name, why in results.items() if why != "ok"}
    assert not failed, failed
