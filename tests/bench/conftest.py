"""Make the repository's ``bench`` package importable in these tests.

The editable install only exposes the shipped packages (engine, server, ...);
``bench`` is a repo-only tool run as ``python -m bench.run`` from the root, so
the root goes first on sys.path here (ahead of this ``tests/bench`` directory,
which would otherwise be picked up as a namespace package of the same name).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
if REPO not in sys.path:
    sys.path.insert(0, REPO)
