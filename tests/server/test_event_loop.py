"""The server's event loop: uvloop by default where installed, asyncio on request, a clear error otherwise."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protoserve.server.runtime.event_loop import EventLoopUnavailable, loop_factory, loop_name

REPO = Path(__file__).resolve().parents[2]


def test_auto_and_uvloop_build_uvloop_loops() -> None:
    import uvloop  # a declared dependency on every platform but Windows

    for choice in ("auto", "uvloop"):
        factory = loop_factory(choice)
        assert factory is uvloop.new_event_loop
        loop = factory()
        try:
            assert isinstance(loop, uvloop.Loop) and loop_name(loop) == "uvloop"
        finally:
            loop.close()


def test_asyncio_choice_keeps_the_standard_loop() -> None:
    assert loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=None) as runner:
        assert loop_name(runner.get_loop()) == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes `import uvloop` raise ImportError
    assert loop_factory("auto") is None
    with pytest.raises(EventLoopUnavailable, match="uvloop is not installed"):
        loop_factory("uvloop")
    with pytest.raises(ValueError, match="event loop must be one of"):
        loop_factory("trio")


def test_serve_asking_for_a_missing_uvloop_exits_2_before_loading(tmp_path: Path) -> None:
    # A uvloop that fails to import shadows the installed one.
    (tmp_path / "uvloop.py").write_text("raise ImportError('not here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "protoserve.server.cli", "serve", "--event-loop", "uvloop", "--port", "0", "--no-http"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "uvloop is not installed" in done.stderr
    assert "listening" not in done.stdout


def test_the_live_server_runs_on_uvloop(live_server) -> None:
    # The whole suite's gRPC, gateway, OpenAI-client and shutdown tests then run against uvloop.
    assert "protoserve.server.app: event loop: uvloop" in live_server.log_path.read_text(errors="replace")
