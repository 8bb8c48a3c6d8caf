"""deploy/k8s validated offline: no cluster is reachable, so the manifests are checked against the
Kubernetes OpenAPI schemas that kubernetes-validate bundles, and against what the server really does
(flags, ports, health, metric names).
"""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from protoserve.server.cli import build_parser
from protoserve.server.observability.metrics import PREFIX, EngineCollector

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"
NOT_APPLIED = {"kustomization.yaml", "prometheus-adapter-rules.yaml"}


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _documents(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


OBJECTS = _all()


def _validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("key", sorted(OBJECTS), ids=lambda k: f"{k[0]}/{k[1]}")
def test_manifest_matches_the_kubernetes_schema(key):
    _validate(OBJECTS[key])


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriod=40),  # misspelt field
        lambda d: d["spec"].update(replicas="three"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"].update(
            port="grpc"
        ),
    ],
)
def test_the_validator_catches_mistakes(break_it):
    broken = copy.deepcopy(OBJECTS[("Deployment", "protoserve")])
    break_it(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)


def test_kustomization_applies_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - NOT_APPLIED
    assert set(kustomization["resources"]) == files


def _server() -> dict:
    return OBJECTS[("Deployment", "protoserve")]["spec"]["template"]["spec"]


def _serve_args():
    [container] = _server()["containers"]
    return build_parser().parse_args(container["args"]), container


def test_probes_are_grpc_health_on_the_grpc_port():
    args, container = _serve_args()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": args.port}, probe
    # Out of rotation at the first failed check (a drain), and long enough to load the model.
    assert container["readinessProbe"]["failureThreshold"] == 1
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_termination_grace_matches_the_drain():
    args, _ = _serve_args()
    grace = _server()["terminationGracePeriodSeconds"]
    # Kubernetes must not SIGKILL before the server's own --grace-period is over, nor wait long after.
    assert args.grace_period < grace <= args.grace_period + 15


def test_a_service_per_port_and_a_headless_one_for_envoy():
    _, container = _serve_args()
    by_port = {}
    for (kind, name), obj in OBJECTS.items():
        if kind == "Service" and obj["spec"].get("selector") == {"app.kubernetes.io/name": "protoserve"}:
            if obj["spec"].get("clusterIP") == "None":
                headless = name
                continue
            [port] = obj["spec"]["ports"]
            by_port[port["targetPort"]] = name
    assert set(by_port) == {p["name"] for p in container["ports"]}
    config = yaml.safe_load(OBJECTS[("ConfigMap", "envoy-config")]["data"]["envoy.yaml"])
    hosts = {
        e["endpoint"]["address"]["socket_address"]["address"]
        for c in config["static_resources"]["clusters"]
        if c["name"].startswith("protoserve_")
        for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]
    }
    assert hosts == {headless}


def test_envoy_reads_the_descriptor_set_its_init_container_writes():
    spec = OBJECTS[("Deployment", "envoy")]["spec"]["template"]["spec"]
    [init], [envoy] = spec["initContainers"], spec["containers"]
    written = Path(init["command"][-1])
    init_mount = next(m for m in init["volumeMounts"] if written.is_relative_to(m["mountPath"]))
    envoy_mount = next(m for m in envoy["volumeMounts"] if m["name"] == init_mount["name"])
    read = Path(envoy_mount["mountPath"]) / written.relative_to(init_mount["mountPath"])
    config = OBJECTS[("ConfigMap", "envoy-config")]["data"]["envoy.yaml"]
    assert f'proto_descriptor: "{read}"' in config
    config_mount = next(m for m in envoy["volumeMounts"] if m["name"] == "config")
    assert (
        envoy["args"][envoy["args"].index("--config-path") + 1] == f"{config_mount['mountPath']}/envoy.yaml"
    )


def test_hpa_scales_on_the_servers_queue_depth_gauge():
    hpa = OBJECTS[("HorizontalPodAutoscaler", "protoserve")]
    [metric] = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name.startswith(PREFIX)
    assert f'gauge("{name.removeprefix(PREFIX)}"' in inspect.getsource(EngineCollector.collect)
    rules = yaml.safe_load(OBJECTS[("ConfigMap", "prometheus-adapter-protoserve")]["data"]["config.yaml"])
    assert rules["rules"][0]["name"]["matches"] == name
    assert hpa["spec"]["minReplicas"] >= 2


def test_pdb_keeps_all_but_one_replica():
    pdb = OBJECTS[("PodDisruptionBudget", "protoserve")]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "protoserve"}


def test_otel_collector_receives_otlp_and_exposes_prometheus():
    config = yaml.safe_load(OBJECTS[("ConfigMap", "otel-collector-config")]["data"]["config.yaml"])
    pipelines = config["service"]["pipelines"]
    for pipeline in pipelines.values():
        for section in ("receivers", "processors", "exporters"):
            assert set(pipeline[section]) <= set(config[section]), (section, pipeline)
    assert "otlp" in pipelines["traces"]["receivers"] and "otlp" in pipelines["metrics"]["receivers"]
    assert pipelines["metrics"]["exporters"] == ["prometheus"]
    port = int(config["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1])
    service = OBJECTS[("Service", "otel-collector")]
    assert port in {p["port"] for p in service["spec"]["ports"]}
    # The replicas export to the collector's OTLP/gRPC port.
    env = {e["name"]: e.get("value") for e in _server()["containers"][0]["env"]}
    assert re.fullmatch(r"http://otel-collector:4317", env["OTEL_EXPORTER_OTLP_ENDPOINT"])


def test_memory_request_covers_the_measured_peak():
    requests = _server()["containers"][0]["resources"]["requests"]
    # 1.86 GB peak RSS while loading the default models (see the comment in the manifest).
    assert _bytes(requests["memory"]) >= 1.86e9


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6, "G": 1e9}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]i?)?", quantity)
    assert match, f"not a memory quantity: {quantity!r}"
    return float(match.group(1)) * units.get(match.group(2) or "", 1)


def test_replicas_answer_the_names_envoy_forwards():
    # Envoy passes its clients' Host on; the gateway refuses names it was not given (DNS rebinding).
    args, _ = _serve_args()
    envoy_service = next(d for d in _documents(K8S / "envoy.yaml") if d["kind"] == "Service")
    assert envoy_service["metadata"]["name"] in args.allowed_host
    assert ".svc.cluster.local" in args.allowed_host
