"""MetricsService: GetMetrics and ``GET /v1/metrics`` count a known workload exactly; WatchMetrics streams."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from obs_stack import MODEL_NAME, auth_headers, grpc_metadata, parse_metrics, sample

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc, metrics_pb2, metrics_pb2_grpc

MAX_TOKENS = 5
LATENCIES = (
    "time_to_first_token",
    "inter_token_latency",
    "e2e_request_latency",
    "request_queue_time",
    "request_prefill_time",
    "request_decode_time",
)


@pytest.fixture
def channel(obs):
    with grpc.insecure_channel(obs.grpc_target) as ch:
        yield ch


def snapshot(channel) -> metrics_pb2.MetricsSnapshot:
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    return stub.GetMetrics(metrics_pb2.GetMetricsRequest(), metadata=grpc_metadata(), timeout=30).snapshot


def generate(channel, prompt: str, max_tokens: int = MAX_TOKENS) -> pb.GenerateResponse:
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    return stub.Generate(request, metadata=grpc_metadata(), timeout=60)


def test_get_metrics_counts_the_workload(obs, channel):
    before = snapshot(channel)
    responses = [generate(channel, "y" * n) for n in (4, 9, 13)]
    after = snapshot(channel)

    assert after.model == MODEL_NAME and after.timestamp >= before.timestamp
    assert after.requests_by_finish_reason["length"] - before.requests_by_finish_reason["length"] == 3
    assert after.requests_by_status["OK"] - before.requests_by_status["OK"] == 3
    prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
    assert after.prompt_tokens_total - before.prompt_tokens_total == prompt_tokens
    assert after.generation_tokens_total - before.generation_tokens_total == 3 * MAX_TOKENS
    assert after.e2e_request_latency.count - before.e2e_request_latency.count == 3
    assert after.inter_token_latency.count - before.inter_token_latency.count == 3 * (MAX_TOKENS - 1)
    for name in LATENCIES:
        summary = getattr(after, name)
        assert summary.count > 0, name
        assert 0 <= summary.p50 <= summary.p90 <= summary.p99, name
        assert summary.mean >= 0, name
    # Each request's e2e time is within the summary's range.
    e2e = [r.stats.e2e_time_s for r in responses]
    assert after.e2e_request_latency.p99 >= min(e2e)
    assert after.generation_throughput > 0 and after.prompt_throughput > 0
    assert after.num_requests_running == 0 and after.num_requests_waiting == 0
    assert 0 <= after.kv_cache_usage <= 1


def test_http_snapshot_and_prometheus_agree_with_get_metrics(obs, channel):
    generate(channel, "agree")
    grpc_view = snapshot(channel)
    reply = httpx.get(obs.http_url + "/v1/metrics", headers=auth_headers(), timeout=30)
    assert reply.status_code == 200
    http_view = reply.json()["snapshot"]
    # Nothing ran in between: the counters are the same (int64 travels as a JSON string).
    assert http_view["model"] == MODEL_NAME
    assert http_view["requests_by_status"] == {k: str(v) for k, v in grpc_view.requests_by_status.items()}
    assert int(http_view["generation_tokens_total"]) == grpc_view.generation_tokens_total
    assert int(http_view["e2e_request_latency"]["count"]) == grpc_view.e2e_request_latency.count
    prom = parse_metrics(httpx.get(obs.http_url + "/metrics").text)
    assert sample(prom, "protoserve_generation_tokens_total", model_name=MODEL_NAME) == (
        grpc_view.generation_tokens_total
    )
    assert sample(prom, "protoserve_request_status_total", model_name=MODEL_NAME, status="OK") == (
        grpc_view.requests_by_status["OK"]
    )


def test_watch_metrics_streams_updates(obs, channel):
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    stream = stub.WatchMetrics(metrics_pb2.WatchMetricsRequest(interval_ms=100), metadata=grpc_metadata(), timeout=60)
    try:
        first = next(stream).snapshot
        generate(channel, "watched", max_tokens=2)
        for _ in range(50):
            latest = next(stream).snapshot
            if latest.requests_by_status["OK"] == first.requests_by_status["OK"] + 1:
                break
        else:
            raise AssertionError("no snapshot showed the new request")
        assert latest.timestamp > first.timestamp
        assert latest.generation_tokens_total == first.generation_tokens_total + 2
    finally:
        stream.cancel()


def test_watch_metrics_over_http_and_its_interval_check(obs, channel):
    url = obs.http_url + "/v1/metrics:watch?interval_ms=100"
    events = []
    with httpx.stream("GET", url, headers=auth_headers(), timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line.removeprefix("data:"))["snapshot"])
            if len(events) == 2:
                break
    assert events[0]["model"] == MODEL_NAME and events[1]["timestamp"] > events[0]["timestamp"]

    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    with pytest.raises(grpc.RpcError) as error:
        next(stub.WatchMetrics(metrics_pb2.WatchMetricsRequest(interval_ms=10), metadata=grpc_metadata()))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_need_a_key_when_auth_is_on(channel):
    stub = metrics_pb2_grpc.MetricsServiceStub(channel)
    with pytest.raises(grpc.RpcError) as error:
        stub.GetMetrics(metrics_pb2.GetMetricsRequest(), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
