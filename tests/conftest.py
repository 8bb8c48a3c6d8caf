"""Shared session fixtures: real protoserve servers with the real default model.

Fixture API (all session-scoped and started lazily, on first use):

``live_server`` -> :class:`LiveServer`
    ``protoserve serve`` in a subprocess, auth off. ``.grpc_target`` is
    "127.0.0.1:PORT"; ``.http_port`` is the REST gateway's port, or None when
    the gateway is not available; ``.process`` is the Popen; ``.log_path`` holds
    its stderr. ``.channel()`` opens a grpc.aio channel (close it yourself),
    ``.sync_channel()`` a blocking one.

``live_server_auth`` -> :class:`LiveServer`
    The same with auth on: ``.api_keys`` are the accepted keys and
    ``.metadata(key=..., user_id=...)`` builds call metadata.

``spawn_server`` -> callable(*extra_args, env=None, wait_ready=True) -> LiveServer
    A private server process for tests that stop it (signals, drain); killed at
    session end if still running.

``inproc_server`` -> :class:`InProcessServer`
    A ServerApp in this process on a background event-loop thread, with the
    real engine reachable as ``.engine`` (for KV-cache checks via
    ``.engine.stats()``) and a small queue (``max_num_seqs=2``, ``max_queue=2``)
    so load shedding is easy to trigger. ``.auth_target`` is a second server on
    the same engine with auth on (``.api_keys``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os

# Where no CUDA device is present, tests/kernels_triton runs Triton's kernels under its CPU
# interpreter. Triton decides its standard library's mode when it is first imported, and the test
# modules collected before that folder import it through transformers: so the switch is set here,
# in the first conftest, before anything imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shared_ssl_context import share_the_default_ssl_context

from protoserve.engine.execution.omp_policy import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch loads: the suite shares 2 cores with live servers
share_the_default_ssl_context()

# Servers started by the suite (subprocesses inherit this) keep their identity secret in a
# throwaway data dir, never in the real ~/.local/share/protoserve.
os.environ["PROTOSERVE_DATA_DIR"] = tempfile.mkdtemp(prefix="protoserve-test-data-")
atexit.register(shutil.rmtree, os.environ["PROTOSERVE_DATA_DIR"], ignore_errors=True)

REPO = Path(__file__).resolve().parents[1]
LOAD_TIMEOUT_S = 180.0
_LISTEN_RE = re.compile(r"protoserve listening on (\S+) \(grpc\)(?:, http on \S+:(\d+))?")
TEST_API_KEYS = ("test-key-alpha", "test-key-beta")


def free_port() -> int:
    """A port that was free a moment ago (for the HTTP gateway, which cannot report its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A protoserve server process."""

    grpc_target: str
    http_port: int | None
    process: subprocess.Popen
    log_path: Path
    api_keys: tuple[str, ...] = ()
    stdout_lines: list[str] = field(default_factory=list)
    data_dir: Path | None = None  # its $PROTOSERVE_DATA_DIR (the identity secret, RAG's documents)

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.grpc_target)

    def sync_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.grpc_target)

    def metadata(self, key: str | None = None, user_id: str | None = None) -> tuple[tuple[str, str], ...]:
        """Call metadata with a bearer key (the first one by default when auth is on) and a user id."""
        md: list[tuple[str, str]] = []
        key = key if key is not None else (self.api_keys[0] if self.api_keys else None)
        if key:
            md.append(("authorization", f"Bearer {key}"))
        if user_id is not None:
            md.append(("x-user-id", user_id))
        return tuple(md)

    def health(self, service: str = "") -> int | None:
        """grpc.health.v1 status now, or None when the server does not answer."""
        with self.sync_channel() as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=2
                )
            except grpc.RpcError:
                return None
        return reply.status

    def wait_serving(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != health_pb2.HealthCheckResponse.SERVING:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout}s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the process and wait for it; kills it after ``timeout``. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server_process(
    *extra_args: str,
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    api_keys: tuple[str, ...] = (),
    attempts: int = 3,
) -> LiveServer:
    """Run ``protoserve serve --port 0`` and wait for its listen line (and for SERVING if asked)."""
    log_file = tempfile.NamedTemporaryFile(prefix="protoserve-", suffix=".log", delete=False)
    args = [
        sys.executable,
        "-m",
        "protoserve.server.cli",
        "serve",
        "--port",
        "0",
        "--http-port",
        str(free_port()),
        "--no-progress",
        *extra_args,
    ]
    # A data directory of its own (identity secret, RAG store) unless the test names one: a RAG store
    # is open in one process at a time, and tests run several servers at once.
    data_dir = tempfile.mkdtemp(prefix="protoserve-server-data-", dir=os.environ["PROTOSERVE_DATA_DIR"])
    process = subprocess.Popen(
        args,
        cwd=REPO,
        env={**os.environ, "PROTOSERVE_DATA_DIR": data_dir, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
    )
    lines: list[str] = []
    found = threading.Event()
    match: list[re.Match[str]] = []

    def read_stdout() -> None:
        # Keeps draining stdout for the process's whole life so it never blocks on a full pipe.
        for line in process.stdout:
            lines.append(line)
            m = _LISTEN_RE.search(line)
            if m and not match:
                match.append(m)
                found.set()
        found.set()

    threading.Thread(target=read_stdout, daemon=True).start()
    if not found.wait(LOAD_TIMEOUT_S) or not match:
        process.kill()
        log = Path(log_file.name).read_text(errors="replace")
        # The HTTP port free_port() saw free can be taken before the server binds it (another test's
        # server, a tensor-parallel server's ranks opening their own ports): start again on another.
        if attempts > 1 and "(HTTP): address already in use" in log:
            return start_server_process(*extra_args, env=env, wait_ready=wait_ready, api_keys=api_keys,
                                        attempts=attempts - 1)
        raise RuntimeError(f"server printed no listen line:\n{log}")
    target, http = match[0].group(1), match[0].group(2)
    server = LiveServer(
        grpc_target=target,
        http_port=int(http) if http else None,
        process=process,
        log_path=Path(log_file.name),
        api_keys=api_keys,
        stdout_lines=lines,
        data_dir=Path((env or {}).get("PROTOSERVE_DATA_DIR", data_dir)),
    )
    if wait_ready:
        server.wait_serving()
    return server


@pytest.fixture(scope="session")
def live_server():
    """The shared real server, auth off."""
    server = start_server_process()
    yield server
    # Killed, not drained: calls tests left open would hold a drain for the whole grace period.
    server.stop(signal.SIGKILL)


@pytest.fixture
def clean_log(live_server) -> Iterator[None]:
    """The live server logs no traceback while the test runs."""
    start = live_server.log_path.stat().st_size
    yield
    with live_server.log_path.open("rb") as log:
        log.seek(start)
        written = log.read().decode(errors="replace")
    assert "Traceback" not in written, written[-3000:]


@pytest.fixture(scope="session")
def live_server_auth():
    """The shared real server with auth on (keys in ``.api_keys``)."""
    keys = TEST_API_KEYS
    server = start_server_process(env={"PROTOSERVE_API_KEYS": ",".join(keys)}, api_keys=keys)
    yield server
    server.stop(signal.SIGKILL)


# Servers spawn_server started, each with whether it lives for the session (a session-scoped fixture
# started it and says so) or is killed when its test module ends. Each server holds about 1 GB: kept to
# the session's end, the suite's would not fit in the machine's memory. Said by the caller, not guessed
# from a fixture-setup hook: pytest runs a session fixture's setup hooks through the session's plugins,
# which under pytest-xdist's workers leave out tests/conftest.py, and its server was then killed early.
_SPAWNED: list[tuple[LiveServer, bool]] = []


@pytest.fixture(scope="session")
def spawn_server():
    """Start private server processes. One started with ``for_session=True`` (by a session-scoped
    fixture) lives until the session ends; any other is killed when its test module ends
    (``_module_servers``)."""

    def spawn(*extra_args: str, env: dict[str, str] | None = None, wait_ready: bool = True,
              for_session: bool = False) -> LiveServer:
        server = start_server_process(*extra_args, env=env, wait_ready=wait_ready)
        _SPAWNED.append((server, for_session))
        return server

    yield spawn
    for server, _ in _SPAWNED:
        server.stop(signal.SIGKILL, timeout=5)


@pytest.fixture(scope="module", autouse=True)
def _module_servers() -> Iterator[None]:
    """Kill the servers this module's tests and fixtures spawned once the module is done."""
    first = len(_SPAWNED)
    yield
    for server, for_session in _SPAWNED[first:]:
        if not for_session:
            server.stop(signal.SIGKILL, timeout=5)


class InProcessServer:
    """ServerApps on a private event loop in a background thread, sharing one real engine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="inproc-server", daemon=True)
        self._thread.start()
        self.engine: Any = None
        self.apps: list[Any] = []
        self.grpc_target = ""
        self.auth_target = ""
        self.api_keys = TEST_API_KEYS

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = LOAD_TIMEOUT_S) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Call a function on the server's loop (engine state is owned by that thread)."""

        async def invoke() -> Any:
            return fn()

        return self.run(invoke())

    def kv_all_free(self) -> bool:
        stats = self.call(self.engine.stats)
        return stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0 and stats.waiting == 0

    def wait_kv_free(self, timeout: float = 5.0) -> float:
        """Seconds until every KV block is free again; fails after ``timeout``."""
        start = time.monotonic()
        while not self.kv_all_free():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"KV not freed within {timeout}s: {self.call(self.engine.stats)}")
            time.sleep(0.01)
        return time.monotonic() - start

    async def _start(self) -> None:
        from protoserve.engine.async_engine import AsyncEngine
        from protoserve.engine.config import EngineConfig
        from protoserve.engine.loader.default_model import default_model_path
        from protoserve.server.app import ServerApp, ServerConfig
        from protoserve.server.models.served_model import ModelCard
        from protoserve.server.security.auth import Authenticator

        path = default_model_path()
        config = EngineConfig(max_num_seqs=2, max_queue=2)
        self.engine = await asyncio.to_thread(
            AsyncEngine.from_pretrained, path, config=config, progress=False
        )
        self.engine.start()
        card = ModelCard("float32", "none", os.fspath(path))
        for auth in (Authenticator(), Authenticator(self.api_keys)):
            app = ServerApp(ServerConfig(port=0, http_port=None, grace_period_s=2.0), auth=auth)
            await app.start()
            await app.attach_engine(self.engine, card)
            self.apps.append(app)
        self.grpc_target, self.auth_target = (a.grpc_target for a in self.apps)

    async def _stop(self) -> None:
        for app in self.apps:
            await app.stop()
        if self.engine is not None:
            await self.engine.shutdown()

    def start(self) -> None:
        self.run(self._start())

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self._stop(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def inproc_server():
    """Real engine + servers in this process (auth off at ``.grpc_target``, on at ``.auth_target``)."""
    server = InProcessServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


# `make test-fast` leaves out the tests marked live: those in a *_live.py file and those that use one of
# these fixtures (or a fixture built on one). Other files that start processes of their own (the CLI's)
# say so with `pytestmark = pytest.mark.live`.
LIVE_FIXTURES = frozenset({"live_server", "live_server_auth", "spawn_server", "inproc_server"})


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as each item is collected: `-m "not live"` deselects in pytest_collection_modifyitems, which
    # runs before a trylast implementation of it, so a mark added there would select nothing out.
    if item.path.name.endswith("_live.py") or LIVE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.live)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # `make test`'s second run (`-m serial`) would otherwise import every test module, ~20 s, to keep
    # one file's tests: a module that never names the mark cannot hold a test carrying it.
    if (config.getoption("markexpr") == "serial" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "mark.serial" not in collection_path.read_text(encoding="utf-8") or None
    return None


@pytest.hookimpl(trylast=True)  # after tests/fuzz/conftest.py gives schemathesis' items their own ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: set[str] = set()
    for item in items:
        # pytest-xdist schedules by node id: of two items with one id it runs one and drops the other.
        if item.nodeid in seen:
            raise pytest.UsageError(f"two tests have the node id {item.nodeid!r}: pytest-xdist would run one")
        seen.add(item.nodeid)
    # pytest-xdist hands whole files to its workers in this order (`make test` turns off its own
    # reordering, which puts files with many tests first): files with a slow test first, then files
    # that start servers, then unit files. Its reordering left two-test files of a minute or more
    # (the wheel, tensor parallelism) for the end, where one worker ran them while the other idled.
    rank: dict[Path, int] = {}
    for item in items:
        here = 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("live") else 2
        rank[item.path] = min(here, rank.get(item.path, here))
    items.sort(key=lambda item: rank[item.path])
