"""A real Prometheus scraping a live ``protoserve serve``: the names, rules and dashboard work as shipped.

Prometheus (Debian's ``prometheus`` package, which ships ``promtool``; ``make
install`` installs it where apt-get runs as root) scrapes the server's gateway
``/metrics`` every second with the rules of ``deploy/prometheus/`` loaded.
After a known workload, PromQL answers its exact token and request counts, the
same figures GetMetrics reports; every rule expression and every panel query
of ``deploy/grafana/protoserve.json`` returns data; ``promtool`` finds nothing
to complain about in a live ``/metrics`` and the rules pass their unit tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from protoserve.server.observability.metrics import TOKEN_LATENCY_BUCKETS
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc, metrics_pb2, metrics_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
RULES_TEST = PROMETHEUS_DIR / "tests" / "protoserve-rules.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "protoserve.json"

MODEL = "tiny-prom"
JOB = "protoserve"  # the job name the alerting rules expect
MAX_TOKENS = 5
USERS = ("ana", "bo")
GRPC_PROMPTS = ("a", "abc", "abcde", "abcdefg", "xy", "xyz")  # alternately ana's and bo's
HTTP_PROMPTS = ("hello", "hi")  # through the gateway, no user id
DEADLINE_S = 90.0
# Grafana's $__rate_interval: wide enough to hold the whole workload on a slow machine.
RATE_INTERVAL = "5m"


def free_port() -> int:
    """A port that was free a moment ago (Prometheus cannot report the one it picked for port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_prometheus() -> None:
    """Skip only where the binaries are missing and ``make install`` could not have installed them."""
    missing = [binary for binary in ("prometheus", "promtool") if shutil.which(binary) is None]
    if not missing:
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(f"{' and '.join(missing)} not on PATH though apt-get can install them here: run `make install`")
    pytest.skip(
        f"{' and '.join(missing)} not on PATH and not installable here: `make install` installs Debian's "
        "prometheus package only where apt-get runs as root"
    )


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=PROMETHEUS_DIR
    )


@dataclass
class Prometheus:
    """A Prometheus process with its own port and storage; ``query`` runs PromQL over its HTTP API."""

    url: str
    process: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, workdir: Path, target: str) -> Prometheus:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in RULE_FILES],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target]}]}],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        log_path = workdir / "prometheus.log"
        for _ in range(3):  # the free port may be taken by the time Prometheus binds it
            port = free_port()
            with log_path.open("w") as log:
                process = subprocess.Popen(
                    [
                        "prometheus",
                        f"--config.file={config_path}",
                        f"--storage.tsdb.path={workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--log.level=warn",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            prometheus = cls(f"http://127.0.0.1:{port}", process, log_path)
            if prometheus._wait_ready():
                return prometheus
            prometheus.stop()
        raise RuntimeError(f"Prometheus did not start:\n{log_path.read_text()[-3000:]}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def query(self, promql: str) -> list[dict[str, Any]]:
        reply = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        """The value of a query answering one series; None while it answers none."""
        result = self.query(promql)
        assert len(result) <= 1, (promql, result)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, expected: float) -> float | None:
        """Poll until the query answers ``expected`` (or the deadline passes); the last answer."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            value = self.value(promql)
            if value == expected or time.monotonic() > deadline:
                return value
            time.sleep(0.5)

    def rules(self) -> list[dict[str, Any]]:
        reply = httpx.get(self.url + "/api/v1/rules", timeout=10).json()
        return [rule for group in reply["data"]["groups"] for rule in group["rules"]]


@dataclass
class Workload:
    """What the test sent, and what came back."""

    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    ok_requests: int = 0
    invalid_requests: int = 0


@dataclass
class Stack:
    server: Any  # tests.conftest.LiveServer
    metrics_port: int
    prometheus: Prometheus
    workload: Workload

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"


def generate_grpc(server: Any, work: Workload, prompt: str, user_id: str) -> None:
    with server.sync_channel() as channel:
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        reply = stub.Generate(request, metadata=server.metadata(user_id=user_id), timeout=60)
    work.ttfts.append(reply.stats.time_to_first_token_s)
    work.prompt_tokens += reply.usage.prompt_tokens
    work.ok_requests += 1


def generate_http(server: Any, work: Workload, prompt: str) -> None:
    body = {"prompt": prompt, "sampling": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}
    reply = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    work.ttfts.append(reply.json()["stats"]["time_to_first_token_s"])
    work.prompt_tokens += reply.json()["usage"]["prompt_tokens"]
    work.ok_requests += 1


def run_workload(server: Any, prometheus: Prometheus) -> Workload:
    """gRPC calls of two users, gateway calls without one, and one refused call.

    One of each kind goes first and is scraped before the rest: the gateway's
    and the identities' series appear with their first request, and a series'
    first sample is what rate() counts from.
    """
    work = Workload()
    generate_grpc(server, work, GRPC_PROMPTS[0], USERS[0])
    generate_http(server, work, HTTP_PROMPTS[0])
    invalid = {"prompt": "x", "sampling": {"temperature": -1}}  # so the error panels have a status
    reply = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/generate", json=invalid, timeout=60)
    assert reply.status_code == 400, reply.text
    work.invalid_requests += 1
    first = 'protoserve_gateway_requests_total{route="/v1/generate", status="400"}'
    assert prometheus.wait_for(first, 1) == 1
    for i, prompt in enumerate(GRPC_PROMPTS[1:], start=1):
        generate_grpc(server, work, prompt, USERS[i % 2])
    for prompt in HTTP_PROMPTS[1:]:
        generate_http(server, work, prompt)
    return work


@pytest.fixture(scope="module")
def stack(spawn_server, tiny_obs_model, tmp_path_factory) -> Iterator[Stack]:
    """Server (tiny model, per-identity usage on) + Prometheus scraping it; the workload already run."""
    require_prometheus()
    server = spawn_server(
        "--model", str(tiny_obs_model), "--model-name", MODEL, "--metrics-port", "0", "--metrics-identity-usage"
    )
    found = re.search(r"metrics on \S+:(\d+)", "".join(server.stdout_lines))
    assert found, server.stdout_lines
    prometheus = Prometheus.start(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{server.http_port}")
    try:
        assert prometheus.wait_for(f'up{{job="{JOB}"}}', 1) == 1, prometheus.log_path.read_text()[-3000:]
        # A fresh server: every figure below is the workload's alone.
        assert prometheus.wait_for(f'protoserve_generation_tokens_total{{model_name="{MODEL}"}}', 0) == 0
        workload = run_workload(server, prometheus)
        stack = Stack(server, int(found.group(1)), prometheus, workload)
        # Scraped after the last request: every request counted and the engine idle.
        expected = f'protoserve_request_status_total{{model_name="{MODEL}", status="OK"}}'
        assert prometheus.wait_for(expected, workload.ok_requests) == workload.ok_requests
        yield stack
    finally:
        prometheus.stop()
        server.stop()


def model_value(stack: Stack, metric: str, **labels: str) -> float | None:
    selector = ", ".join([f'model_name="{MODEL}"', *(f'{k}="{v}"' for k, v in labels.items())])
    return stack.prometheus.value(f"{metric}{{{selector}}}")


def test_promql_counts_the_workload_exactly(stack: Stack):
    work, generated = stack.workload, stack.workload.ok_requests * MAX_TOKENS
    assert model_value(stack, "protoserve_generation_tokens_total") == generated
    assert model_value(stack, "protoserve_prompt_tokens_total") == work.prompt_tokens
    assert model_value(stack, "protoserve_request_status_total", status="INVALID_ARGUMENT") == work.invalid_requests
    assert model_value(stack, "protoserve_request_success_total", finished_reason="length") == work.ok_requests
    assert model_value(stack, "protoserve_time_to_first_token_seconds_count") == work.ok_requests
    assert model_value(stack, "protoserve_inter_token_latency_seconds_count") == work.ok_requests * (MAX_TOKENS - 1)
    # Drained: nothing running or waiting, no KV block held.
    assert stack.prometheus.wait_for(f'protoserve_num_requests_running{{model_name="{MODEL}"}}', 0) == 0
    assert model_value(stack, "protoserve_num_requests_waiting") == 0
    assert stack.prometheus.wait_for(f'protoserve_kv_cache_usage_perc{{model_name="{MODEL}"}}', 0) == 0
    # Per identity (ana's and bo's gRPC calls, the gateway's anonymous ones): the same tokens, split.
    by_identity = stack.prometheus.query("protoserve_identity_output_tokens_total")
    assert sorted(float(r["value"][1]) for r in by_identity) == [2 * MAX_TOKENS, 3 * MAX_TOKENS, 3 * MAX_TOKENS]
    assert stack.prometheus.value("sum(protoserve_identity_input_tokens_total)") == work.prompt_tokens
    # The gateway's per-route series share the scrape.
    gateway = 'protoserve_gateway_requests_total{route="/v1/generate", method="POST", status="200"}'
    assert stack.prometheus.value(gateway) == len(HTTP_PROMPTS)
    # The runtime collectors are there.
    assert stack.prometheus.value(f'process_resident_memory_bytes{{job="{JOB}"}}') > 0
    assert stack.prometheus.query(f'python_info{{job="{JOB}"}}')


def bucket_bounds(seconds: float) -> tuple[float, float]:
    """The histogram bucket holding an observation: (lower, upper]."""
    lower = 0.0
    for upper in (*TOKEN_LATENCY_BUCKETS, math.inf):
        if seconds <= upper:
            return lower, upper
        lower = upper
    raise AssertionError("unreachable: the last bucket is +Inf")


def test_ttft_median_from_histogram_quantile_lies_in_the_measured_range(stack: Stack):
    """histogram_quantile interpolates inside the bucket of the true median, so it lies in that bucket."""
    ttfts = sorted(stack.workload.ttfts)
    median = ttfts[math.ceil(len(ttfts) / 2) - 1]  # nearest rank, as GetMetrics computes it
    # Counts since the start (the server is fresh), so no rate() extrapolation skews the buckets.
    p50 = stack.prometheus.value(
        f'histogram_quantile(0.5, sum by (le) (protoserve_time_to_first_token_seconds_bucket{{model_name="{MODEL}"}}))'
    )
    assert p50 is not None
    low, high = bucket_bounds(median)
    assert low <= p50 <= high, (p50, ttfts)
    assert bucket_bounds(ttfts[0])[0] <= p50 <= bucket_bounds(ttfts[-1])[1]


def test_get_metrics_agrees_with_prometheus(stack: Stack):
    with stack.server.sync_channel() as channel:
        snap = metrics_pb2_grpc.MetricsServiceStub(channel).GetMetrics(metrics_pb2.GetMetricsRequest(), timeout=30)
    snap = snap.snapshot
    assert snap.model == MODEL
    counters = {
        "protoserve_prompt_tokens_total": snap.prompt_tokens_total,
        "protoserve_generation_tokens_total": snap.generation_tokens_total,
        "protoserve_prefix_cache_queries_total": snap.prefix_cache_queries,
        "protoserve_prefix_cache_hits_total": snap.prefix_cache_hits,
        "protoserve_num_preemptions_total": snap.preemptions_total,
        "protoserve_num_fair_preemptions_total": snap.fair_preemptions_total,
        "protoserve_num_requests_running": snap.num_requests_running,
        "protoserve_num_requests_waiting": snap.num_requests_waiting,
        "protoserve_kv_cache_usage_perc": snap.kv_cache_usage,
    }
    for metric, figure in counters.items():
        assert model_value(stack, metric) == figure, metric
    assert snap.generation_tokens_total == stack.workload.ok_requests * MAX_TOKENS
    for reason, count in snap.requests_by_finish_reason.items():
        assert model_value(stack, "protoserve_request_success_total", finished_reason=reason) == count, reason
    for status, count in snap.requests_by_status.items():
        assert model_value(stack, "protoserve_request_status_total", status=status) == count, status
    assert dict(snap.requests_by_status) == {"OK": stack.workload.ok_requests, "INVALID_ARGUMENT": 1}
    for key in ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time"):
        summary, name = getattr(snap, key), f"protoserve_{key}_seconds"
        assert model_value(stack, name + "_count") == summary.count, key
        assert model_value(stack, name + "_sum") == pytest.approx(summary.mean * summary.count), key


def results_with_data(prometheus: Prometheus, promql: str) -> list[dict[str, Any]]:
    """The series a query answers, asserting at least one has a finite value."""
    result = prometheus.query(promql)
    assert any(math.isfinite(float(r["value"][1])) for r in result), (promql, result)
    return result


# `signal OP threshold`: the only shape the alerting rules use, so each can be evaluated with `bool`.
ALERT_SHAPE = re.compile(r"^(?P<signal>.+?)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<threshold>[0-9.e+-]+)$", re.S)


def shipped_rules() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rules = [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
             for rule in group["rules"]]
    return [r for r in rules if "record" in r], [r for r in rules if "alert" in r]


def test_every_rule_loads_and_its_expression_returns_data(stack: Stack):
    recording, alerting = shipped_rules()
    assert len(recording) >= 14 and {r["alert"] for r in alerting} == {
        "ProtoserveInstanceDown", "ProtoserveTimeToFirstTokenHigh", "ProtoserveQueueSaturated",
        "ProtoserveKVCacheNearlyFull", "ProtoserveErrorRatioHigh",
    }
    for rule in recording:
        results_with_data(stack.prometheus, rule["expr"])
    # A healthy server fires no alert, so each is evaluated as `signal OP bool threshold`: 0 or 1 per series.
    for rule in alerting:
        shape = ALERT_SHAPE.match(rule["expr"].strip())
        assert shape, rule["expr"]
        results_with_data(stack.prometheus, f"({shape['signal']}) {shape['op']} bool {shape['threshold']}")
    # Prometheus loaded the files and evaluates every rule without error; recorded series exist.
    deadline = time.monotonic() + DEADLINE_S
    while True:
        loaded = stack.prometheus.rules()
        unevaluated = [r["name"] for r in loaded if r.get("lastEvaluation", "").startswith("0001")]
        if not unevaluated or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(loaded) == len(recording) + len(alerting)
    assert [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []
    for rule in recording:
        results_with_data(stack.prometheus, rule["record"])


def dashboard_queries() -> tuple[list[tuple[str, str]], list[str]]:
    """(panel title, expr) of every panel target, and every template variable query."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    targets = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return targets, variables


def test_every_dashboard_query_returns_data(stack: Stack):
    targets, variables = dashboard_queries()
    assert len(targets) >= 20
    values = {
        "$__rate_interval": RATE_INTERVAL,
        "$job": JOB,
        "$instance": f"127.0.0.1:{stack.server.http_port}",
        "$model_name": MODEL,
    }

    def substitute(expr: str) -> str:
        for name, value in values.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, expr
        return expr

    for title, expr in targets:
        assert results_with_data(stack.prometheus, substitute(expr)), title
    for query in variables:
        metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", query).groups()
        result = stack.prometheus.query(substitute(metric))
        assert result and all(label in r["metric"] for r in result), query


def test_promtool_finds_nothing_to_lint_in_live_metrics(stack: Stack):
    for url in (stack.http_url + "/metrics", f"http://127.0.0.1:{stack.metrics_port}/metrics"):
        exposition = httpx.get(url, timeout=30).text
        assert "protoserve_generation_tokens_total" in exposition and "_created" not in exposition
        checked = promtool("check", "metrics", stdin=exposition)
        assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", ""), url


def test_promtool_checks_and_unit_tests_the_rules():
    require_prometheus()
    checked = promtool("check", "rules", *map(str, RULE_FILES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(RULES_TEST))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
    example = promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert example.returncode == 0, example.stdout + example.stderr
