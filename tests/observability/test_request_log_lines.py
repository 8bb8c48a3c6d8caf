"""The request log: one JSON line per finished request on ``protoserve.requests``, no text, no keys."""

from __future__ import annotations

import json
import logging
import threading
import uuid

import grpc
import httpx
import pytest
from obs_stack import API_KEYS, MODEL_NAME, auth_headers, grpc_metadata

from protoserve.server.calls.request_scope import operation_of
from protoserve.server.observability.request_log import LOGGER_NAME
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPT = "a prompt that must not be logged"


class _Lines(logging.Handler):
    """The request log's lines. A line is written as its request closes on the server, which can be
    just after the client has its answer: readers wait for the lines they expect."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._arrived = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._arrived:
            self.lines.append(record.getMessage())
            self._arrived.notify_all()

    def wait_for(self, count: int, timeout: float = 30.0) -> list[str]:
        """The first `count` lines, once written; fails if they are not within `timeout` seconds."""
        with self._arrived:
            assert self._arrived.wait_for(lambda: len(self.lines) >= count, timeout), (
                f"{len(self.lines)} request log lines, expected {count}: {self.lines}"
            )
            return list(self.lines)

    def records(self, count: int) -> list[dict]:
        return [json.loads(line) for line in self.wait_for(count)]


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
        yield inference_pb2_grpc.InferenceServiceStub(channel)


def test_one_line_per_finished_request(obs, stub, request_log):
    user = f"log-{uuid.uuid4().hex[:8]}"
    request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    response = stub.Generate(request, metadata=grpc_metadata(user_id=user), timeout=60)
    [line] = request_log.wait_for(1)
    record = json.loads(line)
    assert record["request_id"] == response.request_id
    assert record["identity"] == obs.app.auth.identity_for(API_KEYS[0], user).id
    assert record["method"] == "/protoserve.v1.InferenceService/Generate"
    assert record["model"] == MODEL_NAME and record["operation"] == "text_completion"
    assert (record["status"], record["status_code"]) == ("OK", 0)
    assert record["finish_reason"] == "length" and record["choice_finish_reasons"] == ["length"]
    assert record["prompt_tokens"] == response.usage.prompt_tokens
    assert record["output_tokens"] == 4
    for timing in ("queue_time_s", "time_to_first_token_s", "prefill_time_s", "decode_time_s", "e2e_time_s"):
        assert record[timing] >= 0, timing
    assert record["e2e_time_s"] >= record["time_to_first_token_s"] > 0
    assert PROMPT not in line and API_KEYS[0] not in line and user not in line


def test_failures_and_batches(obs, stub, request_log):
    bad = pb.GenerateRequest(prompt="x", request_id="bad-one", sampling=pb.SamplingParams(temperature=-1))
    with pytest.raises(grpc.RpcError):
        stub.Generate(bad, metadata=grpc_metadata(), timeout=60)
    batch = pb.BatchRequest(
        requests=[
            pb.GenerateRequest(prompt="one", request_id="item-1", sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)),
            pb.GenerateRequest(prompt="two", request_id="item-2", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)),
        ]
    )
    stub.Batch(batch, metadata=grpc_metadata(), timeout=60)
    # Refused before any request opened: OpenAI's parameter checks and a wrong key.
    bad_openai = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_k": -5}
    httpx.post(obs.http_url + "/v1/chat/completions", json=bad_openai, headers=auth_headers(), timeout=30)
    httpx.post(obs.http_url + "/v1/generate", json={"prompt": "x"}, headers=auth_headers("wrong"), timeout=30)

    failed, first, second, chat, unauthenticated = request_log.records(5)
    assert failed["request_id"] == "bad-one"
    assert (failed["status"], failed["finish_reason"]) == ("INVALID_ARGUMENT", "error")
    assert "sampling.temperature" in failed["error"] and failed["output_tokens"] == 0
    # Batch items are requests of their own, each with its own line.
    items = {r["request_id"]: r for r in (first, second)}
    assert {r["method"] for r in items.values()} == {"/protoserve.v1.InferenceService/Batch"}
    assert (items["item-1"]["output_tokens"], items["item-2"]["output_tokens"]) == (2, 3)
    assert chat["method"] == "/protoserve.openai.v1.OpenAIService/CreateChatCompletion"
    assert (chat["operation"], chat["status"], chat["model"]) == ("chat", "INVALID_ARGUMENT", MODEL_NAME)
    assert (unauthenticated["status"], unauthenticated["identity"]) == ("UNAUTHENTICATED", "")


def test_failed_openai_calls_log_the_model_asked_for_and_a_request_id(obs, request_log):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    calls = [
        ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {**chat, "model": "no-such-model", "stream": True}),
        ("/v1/chat/completions", {**chat, "model": MODEL_NAME, "top_k": -5}),
    ]
    for path, body in calls:
        reply = httpx.post(obs.http_url + path, json=body, headers=auth_headers(), timeout=30)
        assert reply.status_code in (400, 404), reply.text
    records = request_log.records(len(calls))
    assert [r["status"] for r in records] == ["NOT_FOUND"] * 3 + ["INVALID_ARGUMENT"]
    assert [r["model"] for r in records] == ["no-such-model"] * 3 + [MODEL_NAME]
    ids = [r["request_id"] for r in records]
    assert all(ids) and len(set(ids)) == len(ids), ids
    # The metrics still label by loaded models only: no label value comes from the caller.
    assert "no-such-model" not in httpx.get(obs.http_url + "/metrics", timeout=30).text


def test_operation_names():
    chat = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")]))
    text = pb.GenerateRequest(prompt="hi")
    generate = "/protoserve.v1.InferenceService/Generate"
    assert operation_of(generate, chat) == "chat"
    assert operation_of(generate, text) == "text_completion"
    assert operation_of("/protoserve.v1.InferenceService/GenerateStream", pb.GenerateStreamRequest(request=chat)) == "chat"
    assert operation_of("/protoserve.v1.InferenceService/Batch", pb.BatchRequest(requests=[chat, text])) == (
        "text_completion"
    )
    assert operation_of("/protoserve.v1.InferenceService/Batch", pb.BatchRequest(requests=[chat])) == "chat"


def test_a_hang_up_after_tokens_logs_their_real_timings(obs, stub, request_log):
    """A client that leaves after 5 tokens: the line has the first token's time and the decode time."""
    request = pb.GenerateRequest(prompt="hang up", sampling=pb.SamplingParams(max_tokens=100_000, ignore_eos=True))
    stream = stub.GenerateStream(pb.GenerateStreamRequest(request=request), metadata=grpc_metadata(), timeout=60)
    tokens = 0
    for response in stream:
        tokens += len(response.delta.token_ids)
        if tokens >= 5:
            break
    stream.cancel()
    [record] = request_log.records(1)
    assert (record["status"], record["finish_reason"]) == ("CANCELLED", "cancelled")
    assert record["output_tokens"] >= 5
    assert record["time_to_first_token_s"] > 0 and record["decode_time_s"] > 0
    # The server's e2e spans the engine's arrival-to-abort (first token + decode) and more.
    assert record["e2e_time_s"] >= record["time_to_first_token_s"] + record["decode_time_s"]
    assert record["prefill_time_s"] > 0 and record["queue_time_s"] >= 0
    assert record["choice_finish_reasons"] == ["cancelled"]
