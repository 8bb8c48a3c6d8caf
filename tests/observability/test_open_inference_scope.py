"""Open Inference Protocol requests are requests like the native ones: a request log line naming the
method, model and id, the request counters, and a gRPC span with the engine's span under it.

ModelInfer is unary; ModelStreamInfer is a client stream whose requests each get their line (a
request refused inside the stream too, though the stream itself goes on and ends OK).
"""

from __future__ import annotations

import json
import logging
import threading
import time

import grpc
import httpx
import pytest
from obs_stack import MODEL_NAME, grpc_metadata, parse_metrics, sample
from opentelemetry.sdk.trace import ReadableSpan

from protoserve.open_inference import grpc_service_pb2 as oip
from protoserve.open_inference import grpc_service_pb2_grpc
from protoserve.server.observability.request_log import LOGGER_NAME

SERVICE = "/inference.GRPCInferenceService/"
MAX_TOKENS = 5
GRPC_SCOPE = "opentelemetry.instrumentation.grpc"


class _Lines(logging.Handler):
    """The request log's lines for Open Inference methods (a line is written as its request closes,
    which can be just after the client has its answer: readers wait for the lines they expect)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict] = []
        self._arrived = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        line = json.loads(record.getMessage())
        if line["method"].startswith(SERVICE):
            with self._arrived:
                self.records.append(line)
                self._arrived.notify_all()

    def wait_for(self, count: int, timeout: float = 30.0) -> list[dict]:
        with self._arrived:
            assert self._arrived.wait_for(lambda: len(self.records) >= count, timeout), self.records
            return list(self.records)


@pytest.fixture
def request_log():
    logger = logging.getLogger(LOGGER_NAME)
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def stub(obs):
    with grpc.insecure_channel(obs.grpc_target) as channel:
        yield grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)


def infer_request(request_id: str, prompt: str = "abc", *, stream: bool = False,
                  datatype: str = "BYTES") -> oip.ModelInferRequest:
    """A vLLM-backend request: the prompt and sampling parameters, as raw contents."""
    sampling = json.dumps({"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}).encode()
    request = oip.ModelInferRequest(model_name=MODEL_NAME, id=request_id)
    request.inputs.add(name="text_input", datatype=datatype, shape=[1])
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    request.raw_input_contents.extend(len(b).to_bytes(4, "little") + b for b in (prompt.encode(), sampling))
    if stream:
        request.inputs.add(name="stream", datatype="BOOL", shape=[1])
        request.raw_input_contents.append(b"\x01")
    return request


def scrape(obs) -> dict:
    return parse_metrics(httpx.get(obs.http_url + "/metrics", timeout=30).text)


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    return sample(after, name, model_name=MODEL_NAME, **labels) - sample(before, name, model_name=MODEL_NAME, **labels)


def finished_spans(obs, method: str, timeout: float = 10.0) -> list[ReadableSpan]:
    """The gRPC server spans of ``method`` (a span ends just after its call: wait for one)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in obs.spans() if s.instrumentation_scope.name == GRPC_SCOPE and s.name.endswith(method)]
        if spans or time.monotonic() > deadline:
            return spans
        time.sleep(0.01)


def engine_spans_under(obs, parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in obs.spans() if s.instrumentation_scope.name == "protoserve.engine"
            and s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_model_infer_is_logged_counted_and_traced(obs, stub, request_log, spans) -> None:
    before = scrape(obs)
    response = stub.ModelInfer(infer_request("oip-log-1"), metadata=grpc_metadata(), timeout=60)
    assert response.id == "oip-log-1" and response.outputs[0].name == "text_output"
    [line] = request_log.wait_for(1)
    assert line["method"] == SERVICE + "ModelInfer"
    assert (line["request_id"], line["model"], line["operation"]) == ("oip-log-1", MODEL_NAME, "text_completion")
    assert (line["status"], line["finish_reason"], line["output_tokens"]) == ("OK", "length", MAX_TOKENS)
    after = scrape(obs)
    assert moved(before, after, "protoserve_request_status_total", status="OK") == 1
    assert moved(before, after, "protoserve_request_success_total", finished_reason="length") == 1
    [server] = finished_spans(obs, "ModelInfer")
    [engine] = engine_spans_under(obs, server)
    assert engine.attributes["gen_ai.response.id"] == "oip-log-1"


def test_a_refused_model_infer_is_logged_and_counted(obs, stub, request_log) -> None:
    before = scrape(obs)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(infer_request("oip-log-bad", datatype="FP32"), metadata=grpc_metadata(), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [line] = request_log.wait_for(1)
    assert (line["method"], line["request_id"], line["model"]) == (SERVICE + "ModelInfer", "oip-log-bad", MODEL_NAME)
    assert line["status"] == "INVALID_ARGUMENT" and "text_input" in line["error"]
    after = scrape(obs)
    assert moved(before, after, "protoserve_request_status_total", status="INVALID_ARGUMENT") == 1


def test_each_request_of_a_stream_is_logged_counted_and_traced(obs, stub, request_log, spans) -> None:
    before = scrape(obs)
    requests = [infer_request("oip-stream-1", stream=True), infer_request("oip-stream-bad", datatype="INT32"),
                infer_request("oip-stream-2", "xyz")]
    replies = list(stub.ModelStreamInfer(iter(requests), metadata=grpc_metadata(), timeout=60))
    errors = [r.error_message for r in replies if r.error_message]
    assert len(errors) == 1 and "text_input" in errors[0], replies
    lines = {line["request_id"]: line for line in request_log.wait_for(3)}
    assert sorted(lines) == ["oip-stream-1", "oip-stream-2", "oip-stream-bad"]
    for line in lines.values():
        assert (line["method"], line["model"]) == (SERVICE + "ModelStreamInfer", MODEL_NAME)
    assert [lines[i]["status"] for i in ("oip-stream-1", "oip-stream-2")] == ["OK", "OK"]
    assert lines["oip-stream-1"]["output_tokens"] == MAX_TOKENS
    assert lines["oip-stream-bad"]["status"] == "INVALID_ARGUMENT"
    after = scrape(obs)
    assert moved(before, after, "protoserve_request_status_total", status="OK") == 2
    assert moved(before, after, "protoserve_request_status_total", status="INVALID_ARGUMENT") == 1
    [server] = finished_spans(obs, "ModelStreamInfer")
    assert sorted(s.attributes["gen_ai.response.id"] for s in engine_spans_under(obs, server)) == [
        "oip-stream-1", "oip-stream-2"]
