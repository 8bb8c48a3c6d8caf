"""The device the engine runs on: the one place a name from EngineConfig.device becomes a torch.device.

"cpu" runs the C++ kernels of kernels/cpu; "cuda" runs the Triton kernels of kernels/triton on torch
CUDA tensors. Everything below the engine follows the tensors' device from here on
(engine/models/device_ops.py picks each operation's kernel by it), so no other module asks which
device it is on.
"""

from __future__ import annotations

import torch

from protoserve.engine.config import DEVICES
from protoserve.kernels import triton as triton_kernels


class DeviceUnavailableError(ValueError):
    """The configured device cannot run here (no CUDA device, or no triton to build its kernels)."""


def resolve_device(name: str) -> torch.device:
    """``name`` ("cpu" or "cuda") as the torch.device to load the model and KV pool on."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "device \"cuda\" needs a CUDA device, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}{'' if torch.version.cuda else ', a build without CUDA'})"
        )
    if not triton_kernels.available():
        raise DeviceUnavailableError("device \"cuda\" runs the Triton kernels of kernels/triton: install triton")
    if triton_kernels.interpreting():
        raise DeviceUnavailableError("device \"cuda\" cannot run with TRITON_INTERPRET set (the kernels would "
                                     "run in the CPU interpreter): unset it")
    return torch.device("cuda", torch.cuda.current_device())
