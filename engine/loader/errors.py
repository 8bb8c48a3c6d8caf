"""The one exception type every loader raises for a checkpoint it cannot use."""

from __future__ import annotations

import os


class ModelLoadError(Exception):
    """A checkpoint that cannot be loaded: names the file and the problem.

    Raised for missing files, unknown architectures, unsupported quantization
    types, truncated or corrupt files and tensor shape mismatches, so callers
    catch one type and never get a silently wrong model.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
