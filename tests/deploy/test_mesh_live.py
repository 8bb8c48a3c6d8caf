"""Three replicas behind a real Envoy (the launcher's config): spread, identity affinity, one trace,
a drain without a failed call and a kill that fails only the killed replica's in-flight calls.

The tests share one mesh and run in file order: the drain stops one replica and the kill another.
"""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from mesh_load import HEALTH_CHECK_INTERVAL_S, KINDS, MixedClient, run_load

REPO = Path(__file__).resolve().parents[2]
USERS = [f"user-{i}" for i in range(24)]
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_ID = 0xB7AD6B7169203331

# The drain test times a replica's SIGTERM against a load from four clients. Twice a call failed while
# other tests loaded the two cores (once beside another pytest-xdist worker); alone it has not failed.
pytestmark = pytest.mark.serial


def _home(mesh, user: str) -> int:
    """The one replica that served ``user`` (asserts there is exactly one)."""
    homes = [i for i in mesh.alive if mesh.served(i, user)]
    assert len(homes) == 1, f"{user} was served by replicas {homes}"
    return homes[0]


def test_mixed_load_spreads_and_each_identity_stays_on_one_replica(mesh):
    outcomes = run_load(mesh.envoy.url, mesh.model, USERS, workers=4, duration_s=0.1)
    client = MixedClient(mesh.envoy.url, mesh.model)
    try:
        # Every identity sends each kind of call twice, so its home must have taken all six.
        outcomes += [client.call(kind, user) for user in USERS for kind in KINDS * 2]
    finally:
        client.close()
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    per_replica = mesh.requests_by_replica()
    assert sum(per_replica) == len(outcomes)
    assert all(count > 0 for count in per_replica), per_replica
    homes = {user: _home(mesh, user) for user in USERS}
    for user, home in homes.items():
        assert mesh.served(home, user) >= 2 * len(KINDS)
    assert set(homes.values()) == {0, 1, 2}
    mesh.homes = homes


def test_replica_memory_fits_the_manifests_request(mesh):
    """The peak RSS of each replica under this load stays below deploy/k8s's memory request."""
    deployment = yaml.safe_load((REPO / "deploy/k8s/protoserve-deployment.yaml").read_text())
    request = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
    assert request.endswith("Gi")
    for replica in mesh.replicas:
        status = Path(f"/proc/{replica.process.pid}/status").read_text()
        peak_kib = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
        assert peak_kib * 1024 < float(request.removesuffix("Gi")) * 2**30


def test_websocket_streams_through_envoy_to_the_identity_s_replica(mesh):
    """/v1/ws/completions through Envoy to a real replica's gateway: two streams multiplexed on one
    socket finish, and both land on the identity's home replica (the upgrade is hashed like any call)."""
    import json

    from websockets.sync.client import connect

    user = USERS[0]
    home = mesh.homes.get(user)
    before = mesh.served(home, user) if home is not None else None
    url = mesh.envoy.url.replace("http://", "ws://") + "/v1/ws/completions"
    body = {"model": mesh.model, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with connect(url, additional_headers={"x-user-id": user}, open_timeout=30) as ws:
        ws.send(json.dumps({"id": "a", "type": "completion", "request": {**body, "prompt": "The capital of France"}}))
        ws.send(json.dumps({"id": "b", "type": "chat.completion",
                            "request": {**body, "messages": [{"role": "user", "content": "Hi"}]}}))
        chunks: dict[str, int] = {"a": 0, "b": 0}
        done: set[str] = set()
        while done != {"a", "b"}:
            frame = json.loads(ws.recv(timeout=60))
            assert frame["type"] in ("chunk", "done"), frame
            if frame["type"] == "chunk":
                chunks[frame["id"]] += 1
            else:
                done.add(frame["id"])
    assert chunks["a"] > 0 and chunks["b"] > 0
    if home is not None:
        assert mesh.served(home, user) == before + 2


def test_responses_messages_and_v2_pass_through_envoy_as_the_gateway_serves_them(mesh):
    url = mesh.envoy.url
    responses = {"model": mesh.model, "input": "Hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=responses, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    messages = {"model": mesh.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", url + "/v1/messages", json={**messages, "stream": True}, timeout=60) as reply:
        events = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    del messages["max_tokens"]
    refused = httpx.post(url + "/v1/messages", json=messages, timeout=60)
    assert refused.status_code == 400 and refused.json()["type"] == "error", refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url + "/v2/health/live", timeout=10).status_code == 200


def test_one_trace_spans_envoy_gateway_grpc_and_engine(mesh):
    traceparent = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
    body = {"model": mesh.model, "prompt": "trace me", "max_tokens": 2}
    reply = httpx.post(
        mesh.envoy.url + "/v1/completions", json=body, headers={"traceparent": traceparent}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    trace_id = TRACE_ID.to_bytes(16, "big")
    deadline = time.monotonic() + 15  # Envoy's tracer flushes every 5 s
    while True:
        spans = mesh.collector.spans(trace_id)
        services = {service for service, _ in spans}
        if {"protoserve-envoy", "protoserve-replica"} <= services and len(spans) >= 4:
            break
        assert time.monotonic() < deadline, f"collector got {[(s, span.name) for s, span in spans]}"
        time.sleep(0.1)
    by_id = {span.span_id: (service, span) for service, span in spans}
    [envoy_span] = [span for service, span in spans if service == "protoserve-envoy"]
    assert envoy_span.parent_span_id == PARENT_ID.to_bytes(8, "big")
    # Walk up from the engine's span: engine -> gRPC server -> gateway -> Envoy -> the caller.
    [engine] = [span for service, span in spans if span.name.startswith("text_completion")]
    chain = [engine.name]
    span = engine
    while span.parent_span_id in by_id:
        service, span = by_id[span.parent_span_id]
        chain.append(f"{service}:{span.name}")
    assert span is envoy_span, chain
    assert len(chain) >= 4, chain
    assert any("POST /v1/completions" in step for step in chain), chain


def test_sigterm_drains_a_replica_without_a_failed_call(mesh):
    victim = mesh.homes[USERS[0]]
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(run_load, mesh.envoy.url, mesh.model, USERS, workers=4, duration_s=6, max_tokens=8)
        time.sleep(1.5)
        mesh.replicas[victim].process.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        outcomes = load.result()
    mesh.stopped.add(victim)
    assert mesh.replicas[victim].process.wait(30) == 0, mesh.replicas[victim].log()
    assert [o for o in outcomes if not o.ok] == []
    moved = [o for o in outcomes if o.user in _users_of(mesh, victim) and o.started > stopped_at]
    assert moved, "no call of the drained replica's identities came after the SIGTERM"
    assert mesh.envoy.healthy_hosts("protoserve_grpc") == 2


def test_kill_fails_only_the_killed_replicas_in_flight_calls(mesh):
    # The drained replica's identities moved to ring neighbours (and calls it refused while Envoy
    # had not yet seen it drain were retried on any other replica): learn every home again.
    client = MixedClient(mesh.envoy.url, mesh.model)
    try:
        mesh.homes = {user: _home_now(mesh, client, user) for user in USERS}
    finally:
        client.close()
    victim = next(i for i in mesh.alive if _users_of(mesh, i))
    victims_users = _users_of(mesh, victim)
    with ThreadPoolExecutor(1) as pool:
        # Longer generations, so some are in flight on the victim when it dies.
        load = pool.submit(
            run_load, mesh.envoy.url, mesh.model, USERS, workers=6, duration_s=6, max_tokens=24
        )
        time.sleep(2)
        mesh.replicas[victim].process.send_signal(signal.SIGKILL)
        # Gone (sockets closed) only once reaped: the kernel frees its memory before its files.
        mesh.replicas[victim].process.wait(30)
        killed_at = time.monotonic()
        outcomes = load.result()
    mesh.stopped.add(victim)
    failed = [o for o in outcomes if not o.ok]
    # Only the victim's calls fail: those in flight when it died, and those Envoy sent down its
    # dying connections in the moment before it saw them close. They fail fast and cleanly.
    for outcome in failed:
        assert outcome.user in victims_users, outcome
        assert outcome.started < killed_at + HEALTH_CHECK_INTERVAL_S, outcome
        assert outcome.code in ("UNAVAILABLE", "503"), outcome
    assert all(o.ended - o.started < 30 for o in outcomes)
    # After one health-check interval (plus the check's own time) every call lands on a live replica.
    settled = killed_at + 2 * HEALTH_CHECK_INTERVAL_S
    after = [o for o in outcomes if o.started > settled]
    assert after and all(o.ok for o in after)
    assert any(o.user in victims_users for o in after)


def _home_now(mesh, client: MixedClient, user: str) -> int:
    """The replica that serves ``user``'s next call."""
    before = {i: mesh.served(i, user) for i in mesh.alive}
    assert client.call("grpc", user).ok
    grew = [i for i in mesh.alive if mesh.served(i, user) > before[i]]
    assert len(grew) == 1, grew
    return grew[0]


def _users_of(mesh, replica: int) -> set[str]:
    return {user for user, home in mesh.homes.items() if home == replica}
