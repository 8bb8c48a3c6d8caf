"""ServerProcess: ``protoserve serve`` in a subprocess on loopback ports, ready for load.

Started the way a user starts it (the CLI, default engine settings, the REST
gateway in the same process); the harness only chooses ports, dtype and
quantization, and pins the thread count so the server computes with as many
threads as the in-process measurements it is compared with.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.resources import DEFAULT_VARIANT, Variant, model_args

REPO = Path(__file__).resolve().parents[1]
LISTEN_RE = re.compile(r"protoserve listening on (\S+) \(grpc\)(?:, http on \S+:(\d+))?")
START_TIMEOUT_S = 300.0  # torch import + model load on a busy 2-core machine


def free_port() -> int:
    """A loopback port that was free a moment ago (the gateway cannot report the one it bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running server: gRPC target, gateway base URL and the log file of its stderr."""

    process: subprocess.Popen
    grpc_target: str
    http_base_url: str | None
    log_path: Path
    stdout_lines: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls, log_path: Path, variant: Variant = DEFAULT_VARIANT, threads: int = 2, speculative: bool = False,
        data_dir: Path | None = None, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
    ) -> ServerProcess:
        """Start the server and wait until it listens and its health says SERVING; ``speculative`` False
        turns serve's default n-gram speculation off (``--speculative-ngram 0``); ``data_dir``: its own
        $PROTOSERVE_DATA_DIR (a RAG store is open in one process at a time), else this process's;
        ``extra_args`` and ``env``: more flags and environment, for a section's own setup."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable, "-m", "protoserve.server.cli", "serve",
            "--host", "127.0.0.1", "--port", "0", "--http-port", str(free_port()),
            "--dtype", variant.dtype, "--quantization", variant.quantization,
            "--kv-cache-dtype", variant.kv_cache_dtype, "--no-progress", *model_args(),
            "--activation-precision", variant.activation_precision,
            *([] if speculative else ["--speculative-ngram", "0"]), *extra_args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(env or {})}
        if data_dir is not None:
            env["PROTOSERVE_DATA_DIR"] = str(data_dir)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        lines: list[str] = []
        found = threading.Event()
        match: list[re.Match[str]] = []

        def read_stdout() -> None:
            # Drains stdout for the process's whole life so it never blocks on a full pipe.
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                m = LISTEN_RE.search(line)
                if m and not match:
                    match.append(m)
                    found.set()
            found.set()

        threading.Thread(target=read_stdout, name="server-stdout", daemon=True).start()
        if not found.wait(START_TIMEOUT_S) or not match:
            process.kill()
            process.wait()
            raise RuntimeError(f"server printed no listen line; log:\n{log_tail(log_path)}")
        target, http_port = match[0].group(1), match[0].group(2)
        server = cls(
            process=process,
            grpc_target=target,
            http_base_url=f"http://127.0.0.1:{http_port}" if http_port else None,
            log_path=log_path,
            stdout_lines=lines,
        )
        try:
            server.wait_serving(START_TIMEOUT_S)
        except BaseException:
            server.stop()
            raise
        return server

    def wait_serving(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.grpc_target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.process.returncode}; log:\n{log_tail(self.log_path)}"
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass  # not answering yet: still importing or loading
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"server not SERVING after {timeout:.0f}s; log:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.2)

    def model_name(self) -> str:
        """The default model's name, as OpenAI requests must give it."""
        import grpc

        from protoserve.v1 import inference_pb2, inference_pb2_grpc

        with grpc.insecure_channel(self.grpc_target) as channel:
            reply = inference_pb2_grpc.InferenceServiceStub(channel).ListModels(
                inference_pb2.ListModelsRequest(), timeout=30
            )
        return reply.models[0].name

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL after ``timeout``; returns the exit code."""
        return stop_process(self.process, timeout)


def stop_process(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (any server the bench starts)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def log_tail(path: Path, chars: int = 4000) -> str:
    """The end of a server's log, for an error message."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
