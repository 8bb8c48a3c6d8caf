"""The Node client's own test suite (node --test clients/node/test/) against the live server.

It runs on the shared auth-on server with a valid key, so the suite also checks
that the Node client's metadata reaches the server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODE_TESTS = REPO / "clients" / "node" / "test"


@pytest.fixture(scope="module")
def node() -> str:
    path = shutil.which("node")
    # node and `npm ci` are part of `make install`: their absence fails the suite rather than skipping it.
    assert path is not None, "node is not installed"
    assert (REPO / "node_modules" / "@grpc" / "grpc-js").is_dir(), "node_modules is missing: run `make install` (npm ci)"
    return path


def test_node_client_suite_passes(node: str, live_server_auth) -> None:
    env = {
        **os.environ,
        "PROTOSERVE_GRPC_TARGET": live_server_auth.grpc_target,
        "PROTOSERVE_API_KEY": live_server_auth.api_keys[0],
    }
    proc = subprocess.run(
        [node, "--test", "--test-reporter=tap", str(NODE_TESTS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    # Every test must have run: a missing target makes the suite skip, not fail.
    assert "# skipped 0" in report and "# fail 0" in report, report
    assert "# pass 0" not in report, report
