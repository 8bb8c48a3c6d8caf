"""deploy/k8s/tls, the TLS overlay, validated offline: its JSON patches applied to the base manifests give
objects the Kubernetes schemas accept, whose flags the server takes and whose files sit where they are
mounted; its Envoy ConfigMap is the launcher's render and Envoy accepts it with real certificate files."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml
from test_k8s_manifests import OBJECTS, _validate

from protoserve.gateway.envoy import launcher
from protoserve.server.cli import build_parser
from tests.server.tls_certs import issue, make_ca

OVERLAY = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "tls"
KUSTOMIZATION = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
CONFIGMAP = OVERLAY / "envoy-configmap.yaml"


def _pointer(doc: object, path: str) -> tuple[object, str]:
    *parents, last = path.lstrip("/").split("/")
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc, last


def _apply(doc: dict, operations: list[dict]) -> dict:
    """RFC 6902 add/remove/replace, as kustomize applies them."""
    doc = copy.deepcopy(doc)
    for op in operations:
        parent, key = _pointer(doc, op["path"])
        if isinstance(parent, list):
            if op["op"] == "add":
                parent.insert(len(parent) if key == "-" else int(key), op["value"])
            elif op["op"] == "remove":
                del parent[int(key)]
            else:
                parent[int(key)] = op["value"]
        else:
            assert op["op"] == "add" or key in parent, op  # remove/replace need what they name
            if op["op"] == "remove":
                del parent[key]
            else:
                parent[key] = op["value"]
    return doc


def _patched() -> dict[tuple[str, str], dict]:
    objects = dict(OBJECTS)
    for patch in KUSTOMIZATION["patches"]:
        target = patch.get("target")
        if target is None:
            continue  # the ConfigMap, a strategic-merge patch: checked on its own below
        key = (target["kind"], target["name"])
        objects[key] = _apply(objects[key], yaml.safe_load((OVERLAY / patch["path"]).read_text()))
    return objects


PATCHED = _patched()


def test_the_overlay_builds_on_the_base_and_names_every_patch():
    assert KUSTOMIZATION["resources"] == [".."]
    listed = {p["path"] for p in KUSTOMIZATION["patches"]}
    assert listed == {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize(
    "key", [("Deployment", "protoserve"), ("Deployment", "envoy"), ("Service", "envoy"), ("Service", "protoserve-grpc")]
)
def test_patched_objects_match_the_kubernetes_schema(key):
    _validate(PATCHED[key])


def _container(name: str) -> dict:
    return PATCHED[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]


def _mounted(deployment: str, path: str) -> str:
    """The Secret mounted over ``path`` in ``deployment``'s pod."""
    spec = PATCHED[("Deployment", deployment)]["spec"]["template"]["spec"]
    mount = next(m for m in _container(deployment)["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"]


def test_replicas_serve_tls_from_their_secret_and_probe_over_https():
    container = _container("protoserve")
    args = build_parser().parse_args(container["args"])
    assert args.tls_cert_file and args.tls_key_file and args.tls_client_ca_file is None
    assert _mounted("protoserve", args.tls_cert_file) == _mounted("protoserve", args.tls_key_file) == "protoserve-tls"
    http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert args.http_port == http_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in container[probe]  # the kubelet's gRPC probe speaks no TLS
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}


def _envoy_config() -> dict:
    return yaml.safe_load(yaml.safe_load(CONFIGMAP.read_text())["data"]["envoy.yaml"])


def test_envoy_listens_with_tls_where_its_pod_and_service_say():
    config = _envoy_config()
    listener = config["static_resources"]["listeners"][0]
    container = _container("envoy")
    assert [p["containerPort"] for p in container["ports"]] == [listener["address"]["socket_address"]["port_value"]]
    assert PATCHED[("Service", "envoy")]["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "https"}]
    context = listener["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"]
    files = [context["tls_certificates"][0]["certificate_chain"]["filename"]]
    for cluster in config["static_resources"]["clusters"][:2]:
        upstream = cluster["transport_socket"]["typed_config"]
        files.append(upstream["common_tls_context"]["validation_context"]["trusted_ca"]["filename"])
        assert upstream["sni"] == "protoserve-headless"
    assert {_mounted("envoy", f) for f in files} == {"envoy-tls"}


def test_the_configmap_is_the_launchers_render(capsys):
    text = CONFIGMAP.read_text()
    command = text.splitlines()[0].removeprefix("# Generated by: ")
    launcher.main(shlex.split(command)[3:])
    assert capsys.readouterr().out == text, f"{CONFIGMAP} is stale: run {command}"


def test_envoy_accepts_the_configmap_with_real_files(tmp_path):
    pytest.importorskip("envoy")
    ca = make_ca()
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    issue(ca, "envoy").write(tmp_path / "tls.crt", tmp_path / "tls.key")
    descriptor = tmp_path / "protoserve.binpb"
    descriptor.write_bytes(launcher.descriptor_set_with_error_details(launcher.generated_descriptor_set()))
    text = yaml.safe_load(CONFIGMAP.read_text())["data"]["envoy.yaml"]
    text = text.replace("/etc/envoy-descriptors/protoserve.binpb", str(descriptor))
    launcher.validate_config(text.replace("/etc/envoy-tls/", f"{tmp_path}/"))
