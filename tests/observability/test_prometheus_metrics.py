"""``GET /metrics``: after a known workload the counters move by exactly its requests and tokens.

The stack is shared by the session, so every check compares a scrape before
and after the workload.
"""

from __future__ import annotations

import grpc
import httpx
from obs_stack import API_KEYS, MODEL_NAME, auth_headers, grpc_metadata, parse_metrics, sample

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

MAX_TOKENS = 6


def scrape(url: str):
    reply = httpx.get(url, timeout=30)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return parse_metrics(reply.text)


def delta(before, after, name: str, **labels: str) -> float:
    """How much a series of the model moved."""
    return sample(after, name, model_name=MODEL_NAME, **labels) - sample(before, name, model_name=MODEL_NAME, **labels)


def test_counters_and_histograms_match_the_workload(obs):
    url = obs.http_url + "/metrics"
    before = scrape(url)
    prompt_tokens = 0
    # Five InferenceService requests of different prompt lengths...
    for length in range(3, 8):
        body = {"prompt": "x" * length, "sampling": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}
        reply = httpx.post(obs.http_url + "/v1/generate", json=body, headers=auth_headers(), timeout=60)
        assert reply.status_code == 200, reply.text
        prompt_tokens += reply.json()["usage"]["prompt_tokens"]
    # ...and one OpenAI completion of two prompts: one request, two engine requests.
    body = {"model": MODEL_NAME, "prompt": ["ab", "abcd"], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    reply = httpx.post(obs.http_url + "/v1/completions", json=body, headers=auth_headers(), timeout=60)
    assert reply.status_code == 200, reply.text
    prompt_tokens += reply.json()["usage"]["prompt_tokens"]
    after = scrape(url)

    requests, engine_requests = 6, 7
    assert delta(before, after, "protoserve_request_success_total", finished_reason="length") == requests
    assert delta(before, after, "protoserve_request_status_total", status="OK") == requests
    assert delta(before, after, "protoserve_prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "protoserve_generation_tokens_total") == engine_requests * MAX_TOKENS
    assert delta(before, after, "protoserve_prefix_cache_queries_total") == prompt_tokens
    for histogram in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        assert delta(before, after, f"protoserve_{histogram}_count") == engine_requests, histogram
        assert delta(before, after, f"protoserve_{histogram}_sum") >= 0
    # One interval between each pair of consecutive tokens.
    assert delta(before, after, "protoserve_inter_token_latency_seconds_count") == engine_requests * (
        MAX_TOKENS - 1
    )
    assert delta(before, after, "protoserve_e2e_request_latency_seconds_bucket", le="+Inf") == engine_requests
    # The gateway's own series (per route, not per model) live in the same registry.
    route = {"route": "/v1/generate", "method": "POST", "status": "200"}
    gateway_requests = "protoserve_gateway_requests_total"
    assert sample(after, gateway_requests, **route) - sample(before, gateway_requests, **route) == 5
    # Idle again: nothing running or waiting, and the KV gauge is a share.
    assert sample(after, "protoserve_num_requests_running", model_name=MODEL_NAME) == 0
    assert sample(after, "protoserve_num_requests_waiting", model_name=MODEL_NAME) == 0
    assert 0.0 <= sample(after, "protoserve_kv_cache_usage_perc", model_name=MODEL_NAME) <= 1.0
    assert ("protoserve_num_preemptions_total", frozenset({("model_name", MODEL_NAME)})) in after
    assert ("protoserve_num_fair_preemptions_total", frozenset({("model_name", MODEL_NAME)})) in after
    assert ("protoserve_prefix_cache_hits_total", frozenset({("model_name", MODEL_NAME)})) in after


def test_failures_are_counted_by_status(obs):
    url = obs.http_url + "/metrics"
    before = scrape(url)
    invalid = {"prompt": "x", "sampling": {"temperature": -1}}
    assert httpx.post(obs.http_url + "/v1/generate", json=invalid, headers=auth_headers()).status_code == 400
    # Refused before any request starts: a wrong key, and OpenAI parameter checks.
    wrong_key = auth_headers(key="not-a-key")
    assert httpx.post(obs.http_url + "/v1/generate", json={"prompt": "x"}, headers=wrong_key).status_code == 401
    bad_openai = {"model": MODEL_NAME, "prompt": "x", "top_k": -5}
    assert httpx.post(obs.http_url + "/v1/completions", json=bad_openai, headers=auth_headers()).status_code == 400
    after = scrape(url)
    assert delta(before, after, "protoserve_request_status_total", status="INVALID_ARGUMENT") == 2
    assert delta(before, after, "protoserve_request_status_total", status="UNAUTHENTICATED") == 1
    assert delta(before, after, "protoserve_request_success_total", finished_reason="error") == 3
    assert delta(before, after, "protoserve_request_status_total", status="OK") == 0
    assert all(key not in httpx.get(url).text for key in API_KEYS)


def test_metrics_port_serves_the_server_registry(obs):
    """``--metrics-port``: the same metrics on a port of their own (here a second server on the engine)."""
    app = obs.run(obs.start_app(metrics_port=0))
    url = f"http://127.0.0.1:{app.metrics_port}/metrics"
    assert sample(scrape(url), "protoserve_request_status_total", model_name=MODEL_NAME, status="OK") == 0
    with grpc.insecure_channel(app.grpc_target) as channel:
        request = pb.GenerateRequest(prompt="abc", sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
        inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, metadata=grpc_metadata(), timeout=60)
    after = scrape(url)
    assert sample(after, "protoserve_request_status_total", model_name=MODEL_NAME, status="OK") == 1
    assert sample(after, "protoserve_num_requests_running", model_name=MODEL_NAME) == 0


def test_names_are_prometheus_clean_with_runtime_collectors_and_no_created_series(obs):
    """Underscore names whatever the scraper negotiates; process and Python collectors; no ``*_created``."""
    text = httpx.get(obs.http_url + "/metrics", timeout=30).text
    openmetrics = httpx.get(
        obs.http_url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}, timeout=30
    )
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    for exposition in (text, openmetrics.text):
        names = {name for name, _ in parse_metrics(exposition)}
        assert "protoserve_generation_tokens_total" in names
        assert not [name for name in names if ":" in name or name.endswith("_created")]
        assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= names
        assert any(name.startswith("python_gc_") for name in names)
    queue_capacity = sample(parse_metrics(text), "protoserve_queue_capacity", model_name=MODEL_NAME)
    assert queue_capacity == obs.engine.engine.config.max_queue
    # Per-identity series are opt-in (a series per identity).
    assert "protoserve_identity_requests_total" not in text


def test_identity_usage_is_exported_when_asked_for(obs):
    app = obs.run(obs.start_app(metrics_port=0, metrics_identity_usage=True))
    url = f"http://127.0.0.1:{app.metrics_port}/metrics"
    with grpc.insecure_channel(app.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for user, requests in (("ana", 2), ("bo", 1)):
            for _ in range(requests):
                request = pb.GenerateRequest(prompt="abc", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
                stub.Generate(request, metadata=grpc_metadata(user_id=user), timeout=60)
    after = scrape(url)
    by_identity = {
        dict(labels)["identity"]: value
        for (name, labels), value in after.items()
        if name == "protoserve_identity_requests_total"
    }
    assert sorted(by_identity.values()) == [1, 2]
    for identity, requests in by_identity.items():
        assert sample(after, "protoserve_identity_output_tokens_total", identity=identity) == 3 * requests
        assert sample(after, "protoserve_identity_input_tokens_total", identity=identity) == 3 * requests
