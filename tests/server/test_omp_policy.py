"""OpenMP's passive waiting is the engine process's choice (engine/execution/omp_policy.py), made by the
``protoserve`` entry point before torch loads; importing the server or the gateway (a process of its own
when it runs apart) leaves the environment as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMPORT_THEN_PRINT = (
    "import os, sys\n"
    "for name in sys.argv[1:]:\n"
    "    __import__(name)\n"
    "print(os.environ.get('OMP_WAIT_POLICY', 'unset'))\n"
)
MAIN_THEN_PRINT = (
    "import os\n"
    "from protoserve.server.cli import main\n"
    "try:\n"
    "    main(['--help'])\n"
    "except SystemExit:\n"
    "    pass\n"
    "print(os.environ.get('OMP_WAIT_POLICY', 'unset'))\n"
)


def policy_after(probe: str, *args: str, policy: str | None = None) -> str:
    """OMP_WAIT_POLICY as ``python -c probe args`` leaves it, started with ``policy`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # tests/conftest.py sets it here
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", probe, *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


def test_importing_the_server_and_the_gateway_sets_no_wait_policy() -> None:
    modules = ("protoserve.server", "protoserve.server.app", "protoserve.gateway.app")
    assert policy_after(IMPORT_THEN_PRINT, *modules) == "unset"


def test_the_protoserve_command_prefers_passive_waiting_unless_told_otherwise() -> None:
    assert policy_after(MAIN_THEN_PRINT) == "PASSIVE"
    assert policy_after(MAIN_THEN_PRINT, policy="ACTIVE") == "ACTIVE"
