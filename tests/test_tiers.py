"""``make test-fast`` (``-m "not live and not slow"``) leaves out every test that starts a server.

tests/conftest.py marks them ``live``; the mark must be in place when pytest deselects by mark, in its
own pytest_collection_modifyitems. Added in a trylast implementation of that hook, after the
deselection, it once let all ~900 live tests into the fast tier. Checked through a real collection.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIVE_BY_NAME = "tests/gateway/test_cors_live.py"  # a *_live.py file
LIVE_BY_FIXTURE = "tests/server/test_cancellation_and_auth.py"  # its tests take live_server
UNIT = "tests/engine/test_sampling_fields.py"


def collected_files(marks: str) -> set[str]:
    """The files of the tests pytest selects with ``-m marks`` out of the three above."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         "-m", marks, LIVE_BY_NAME, LIVE_BY_FIXTURE, UNIT],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}


def test_the_fast_tier_selects_no_live_test() -> None:
    assert collected_files("not live and not slow") == {UNIT}


def test_the_live_tier_has_both_kinds_of_live_test() -> None:
    assert collected_files("live") == {LIVE_BY_NAME, LIVE_BY_FIXTURE}
