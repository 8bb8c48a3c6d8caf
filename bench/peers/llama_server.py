"""LlamaServerProcess: llama.cpp's ``llama-server`` on a loopback port, ready for load.

Started as its README serves many users at once: ``-np`` parallel slots
sharing one ``-c`` context (``-np 64 -c 32768``: 512 tokens a slot, room for a
~100-token chat prompt and 64 new tokens), continuous batching (its default),
the same thread count as protoserve's server, everything else its defaults.
"""

from __future__ import annotations

import http.client
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.peers.llamacpp import peer_env
from bench.server_process import log_tail, stop_process

PARALLEL = 64
CONTEXT = 32_768
START_TIMEOUT_S = 120.0


def server_command(
    binary: Path, model: Path, threads: int, port: int, parallel: int = PARALLEL, context: int = CONTEXT,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line: the model, slots, context, threads (prompt and generation alike), loopback;
    ``extra_args`` last (a section's own flags, e.g. ``--cache-reuse``)."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if parallel < 1 or context < parallel:
        raise ValueError(f"need 1 <= parallel <= context, got parallel={parallel} context={context}")
    return [
        str(binary), "-m", str(model), "-np", str(parallel), "-c", str(context),
        "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip


def _health(port: int) -> int | None:
    """GET /health's status (200 once the model is loaded, 503 while loading), None when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@dataclass
class LlamaServerProcess:
    """A running llama-server: its base URL and the log of its output."""

    process: subprocess.Popen
    base_url: str
    log_path: Path

    @classmethod
    def start(cls, command: list[str], port: int, log_path: Path) -> LlamaServerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=peer_env())
        server = cls(process, f"http://127.0.0.1:{port}", log_path)
        deadline = time.monotonic() + START_TIMEOUT_S
        while _health(port) != 200:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {process.returncode}; log:\n{log_tail(log_path, 3000)}")
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(f"llama-server not healthy after {START_TIMEOUT_S:.0f}s; log:\n{log_tail(log_path, 3000)}")
            time.sleep(0.2)
        return server

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        return stop_process(self.process, timeout)
