"""Rank 0's steps to the other ranks: each ForwardBatch broadcast as two integer tensors.

A message is a fixed-size int64 header (the operation, the payload's length, then per
ForwardBatch field its kind, dtype, device and shape) and one int64 payload holding every
field's values in field order. Every field of a ForwardBatch is integer state (tensors, lists
of ints, None), so the receiver rebuilds the batch exactly: each tensor in its dtype and, where
rank 0's was on an accelerator, on the receiver's own ``device``. Messages go over a gloo group
on the CPU whatever the activations' backend: they are small, and a worker waiting for the next
step then blocks in a CPU receive rather than on an accelerator stream.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import torch
import torch.distributed as dist

from protoserve.engine.execution.forward_batch import ForwardBatch

STEP, SHUTDOWN = 1, 2
# A field's kind on the wire.
NONE, TENSOR, INT_LIST, INT = 0, 1, 2, 3
DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 4
FIELD_WORDS = 4 + MAX_DIMS  # kind, dtype, on an accelerator, ndim, dims
FIELDS = tuple(f.name for f in dataclasses.fields(ForwardBatch))
HEADER_WORDS = 2 + FIELD_WORDS * len(FIELDS)  # operation, payload length, fields


def encode(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one step; TypeError naming a field that is not integer state."""
    header = [0] * HEADER_WORDS
    header[0] = STEP
    parts: list[torch.Tensor] = []
    for i, name in enumerate(FIELDS):
        value = getattr(batch, name)
        word = 2 + i * FIELD_WORDS
        if value is None:
            header[word] = NONE
        elif isinstance(value, torch.Tensor):
            if value.dtype not in DTYPES or value.dim() > MAX_DIMS:
                raise TypeError(f"ForwardBatch.{name}: cannot broadcast a {value.dtype} tensor of "
                                f"{value.dim()} dims (integer tensors of at most {MAX_DIMS} dims)")
            header[word : word + 4] = [TENSOR, DTYPES.index(value.dtype), int(value.device.type != "cpu"), value.dim()]
            header[word + 4 : word + 4 + value.dim()] = list(value.shape)
            parts.append(value.detach().reshape(-1).to("cpu", torch.int64))
        elif isinstance(value, list) and all(type(v) is int for v in value):
            header[word] = INT_LIST
            header[word + 3] = len(value)
            parts.append(torch.tensor(value, dtype=torch.int64))
        elif type(value) is int:
            header[word] = INT
            parts.append(torch.tensor([value], dtype=torch.int64))
        else:
            raise TypeError(f"ForwardBatch.{name}: cannot broadcast a {type(value).__name__}")
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    header[1] = payload.numel()
    return torch.tensor(header, dtype=torch.int64), payload


def decode(header: torch.Tensor, payload: torch.Tensor, device: torch.device | None = None) -> ForwardBatch:
    """The ForwardBatch ``encode`` was given; accelerator tensors land on ``device``."""
    words = header.tolist()
    values: dict[str, object] = {}
    offset = 0
    for i, name in enumerate(FIELDS):
        kind, dtype, on_device, ndim, *dims = words[2 + i * FIELD_WORDS : 2 + (i + 1) * FIELD_WORDS]
        if kind == NONE:
            values[name] = None
        elif kind == TENSOR:
            shape = dims[:ndim]
            n = math.prod(shape)
            t = payload[offset : offset + n].to(DTYPES[dtype]).reshape(shape)
            values[name] = t.to(device) if on_device and device is not None else t
            offset += n
        elif kind == INT_LIST:
            values[name] = payload[offset : offset + ndim].tolist()
            offset += ndim
        else:
            values[name] = int(payload[offset])
            offset += 1
    return ForwardBatch(**values)


class StepChannel:
    """Broadcasts from rank 0 over ``group`` (a gloo group); one message at a time."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device
        self._lock = threading.Lock()  # the step thread and a shutdown from another thread

    def send(self, batch: ForwardBatch) -> None:
        header, payload = encode(batch)
        with self._lock:
            dist.broadcast(header, src=0, group=self.group)
            dist.broadcast(payload, src=0, group=self.group)

    def send_shutdown(self, timeout: float | None = None) -> bool:
        """Tell the other ranks to stop; False when a step held the channel past ``timeout`` seconds."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
            header[0] = SHUTDOWN
            dist.broadcast(header, src=0, group=self.group)
            return True
        finally:
            self._lock.release()

    def receive(self) -> ForwardBatch | None:
        """The next step's batch, or None when rank 0 shut the ranks down."""
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        if int(header[0]) == SHUTDOWN:
            return None
        payload = torch.empty(int(header[1]), dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.group)
        return decode(header, payload, self.device)
