"""The weight-loading progress bar: drawn on a terminal, left out of logs.

tqdm redraws its bar with carriage returns; written to a file or a pipe (a
server's log) those frames pile up into one long line, so off a terminal there
is no bar at all (tqdm's ``disable=None``: off when its stream is not a TTY).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def tensor_progress(
    iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str, enabled: bool = True
) -> tqdm:
    """A bar counting tensors, shown only when ``enabled`` and stderr is a terminal."""
    return tqdm(iterable, total=total, desc=desc, unit="tensor", disable=None if enabled else True)
