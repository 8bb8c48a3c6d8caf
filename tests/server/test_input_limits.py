"""Issue 21, items 1 and 3: no prompt stalls the server, and no echo of user input outgrows a status.

Item 1 runs against in-process servers on the real engine, so the test can see
(and hold) the tokenizer: a long prompt is tokenized on a worker thread while
the event loop keeps answering, and a prompt the context cannot hold is refused
without being tokenized at all. Item 3 runs against the live server process and
its gateway, with the issue's inputs (model names of 3-5 KB, a 3 MB one in the
request log).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_status_helpers import failure_of
from server_engine_double import EngineDouble

from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import openai_pb2_grpc
from protoserve.server.app import ServerApp, ServerConfig
from protoserve.server.errors import MAX_MESSAGE_BYTES, MAX_VIOLATIONS
from protoserve.server.limits import (
    MAX_CHAT_NAME_CHARS,
    MAX_MODEL_NAME_CHARS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.models.served_model import ModelCard, ServedModel
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

MiB = 1024 * 1024
HUGE = 20_000_000  # the 20 MB prompt
BIG_APP_MESSAGE_BYTES = 24 * MiB  # room for HUGE in one message
LONG = 100_000  # long enough for a worker thread, short enough to tokenize in a blink
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]
SETTLE_S = 60.0  # how long a test waits for something that must happen (not a speed bound)


# -- fixtures ---------------------------------------------------------------------------------


class TokenizerProbe:
    """Wraps the shared engine tokenizer: records every text of LONG+ characters it encodes, and
    can hold such encodes until released."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.encoded: list[int] = []  # lengths of the long texts encoded
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def wrap(self, name: str):
        original = getattr(self.tokenizer, name)

        def encode(text: str, *args, **kwargs):
            if len(text) >= LONG:
                self.encoded.append(len(text))
                self.started.set()
                self.release.wait(SETTLE_S)
            return original(text, *args, **kwargs)

        return encode


@pytest.fixture
def probe(inproc_server, monkeypatch) -> TokenizerProbe:
    probe = TokenizerProbe(inproc_server.engine.tokenizer)
    for name in ("encode", "encode_unlocked"):
        monkeypatch.setattr(probe.tokenizer, name, probe.wrap(name))
    yield probe
    probe.release.set()


@pytest.fixture(scope="module")
def big_app(inproc_server):
    """A server on the in-process engine that reads requests up to 24 MiB, so a 20 MB prompt reaches it."""
    app = ServerApp(ServerConfig(port=0, http_port=None, max_message_bytes=BIG_APP_MESSAGE_BYTES))

    async def start():
        await app.start()
        await app.attach_engine(inproc_server.engine, ModelCard("float32", "none", "default"))

    inproc_server.run(start())
    yield app
    inproc_server.run(app.stop())


@pytest_asyncio.fixture(loop_scope="function")
async def big(big_app):
    async with grpc.aio.insecure_channel(big_app.grpc_target, options=CHANNEL_OPTIONS) as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch), openai_pb2_grpc.OpenAIServiceStub(ch)


@pytest_asyncio.fixture(loop_scope="function")
async def inproc_stub(inproc_server):
    async with grpc.aio.insecure_channel(inproc_server.grpc_target, options=CHANNEL_OPTIONS) as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch)


@pytest_asyncio.fixture(loop_scope="function")
async def live(live_server):
    async with live_server.channel() as ch:
        yield inference_pb2_grpc.InferenceServiceStub(ch), openai_pb2_grpc.OpenAIServiceStub(ch)


def _short_generate() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=2, temperature=0))


# -- item 1: tokenizing off the event loop ------------------------------------------------------


@pytest.mark.parametrize("kind", ["prompt", "chat"])
async def test_long_prompt_is_tokenized_while_the_server_keeps_answering(inproc_stub, probe, kind):
    """While a long prompt sits in the tokenizer (held there by the probe), health checks and a
    short Generate on the same server are answered; before, tokenizing blocked the event loop."""
    text = "All work and no play makes Jack a dull boy. " * (LONG // 40)
    if kind == "prompt":
        request = pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(max_tokens=1))
    else:
        request = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]))
    probe.release.clear()
    big = inproc_stub.Generate(request)  # under way from here: grpc.aio starts a call when it is made
    assert await asyncio.to_thread(probe.started.wait, SETTLE_S), (
        "the long prompt never reached the tokenizer"
    )
    health = await asyncio.wait_for(inproc_stub.CheckHealth(pb.CheckHealthRequest()), SETTLE_S)
    short = await asyncio.wait_for(inproc_stub.Generate(_short_generate()), SETTLE_S)
    assert health.status == pb.SERVING_STATUS_SERVING
    assert short.choices[0].token_ids
    assert not big.done()  # both answered while the long prompt was still being tokenized
    probe.release.set()
    # ~25K tokens: more than the context, which the engine reports once it has them.
    failure = await failure_of(big)
    assert failure.code == grpc.StatusCode.OUT_OF_RANGE and failure.reason == "CONTEXT_LENGTH_EXCEEDED"
    assert probe.encoded  # it was really tokenized, on the path the probe held


async def test_prompt_that_cannot_be_served_is_refused_before_tokenizing(big, big_app, probe):
    """The issue's 20 MB prompt, every way in, is over the text cap whatever the policy; 2 MB is under
    it but cannot fit the context. Both are refused without the tokenizer ever seeing them."""
    stub, openai_stub = big
    frontend = big_app.models.all()[0]
    limit, cap = frontend.max_model_len, frontend.max_prompt_bytes
    huge = "x" * HUGE
    for policy in pb.ContextPolicy.values():
        failure = await failure_of(stub.Generate(pb.GenerateRequest(prompt=huge, context_policy=policy)))
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"prompt"}
        assert str(cap) in failure.message
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content=huge)])
    failure = await failure_of(stub.Generate(pb.GenerateRequest(chat=chat)))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"chat.messages"}
    failure = await failure_of(stub.Tokenize(pb.TokenizeRequest(text=huge)))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"text"}
    completion = oa.CreateCompletionRequest(model=frontend.name)
    completion.prompt.string_value = huge
    failure = await failure_of(openai_stub.CreateCompletion(completion))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"prompt"}

    long = "x" * (2 * MiB)  # a token is at most 81 bytes of SmolLM2 text: at least 25K tokens
    for policy in (pb.CONTEXT_POLICY_UNSPECIFIED, pb.CONTEXT_POLICY_REJECT):
        failure = await failure_of(stub.Generate(pb.GenerateRequest(prompt=long, context_policy=policy)))
        assert failure.code == grpc.StatusCode.OUT_OF_RANGE and failure.reason == "CONTEXT_LENGTH_EXCEEDED"
        assert str(limit) in failure.message
        assert failure.details["ErrorInfo"].metadata["max_model_len"] == str(limit)
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content=long)])
    stream = stub.GenerateStream(pb.GenerateStreamRequest(request=pb.GenerateRequest(chat=chat)))
    assert (await failure_of(stream)).code == grpc.StatusCode.OUT_OF_RANGE
    completion.prompt.string_value = long
    failure = await failure_of(openai_stub.CreateCompletion(completion))
    assert failure.code == grpc.StatusCode.OUT_OF_RANGE and str(limit) in failure.message
    assert probe.encoded == []
    assert (await stub.CheckHealth(pb.CheckHealthRequest())).status == pb.SERVING_STATUS_SERVING


async def test_truncating_policies_still_take_text_over_the_context():
    """Text the context cannot hold is refused untokenized only under the policies that would refuse it
    anyway; a truncating policy gets it tokenized and passed on (engine double: 1 byte a token, 64 max)."""
    engine = EngineDouble()
    app = ServerApp(ServerConfig(port=0, http_port=None))
    await app.start()
    await app.attach_engine(engine, ModelCard("float32", "none", "double"))
    try:
        async with grpc.aio.insecure_channel(app.grpc_target) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            text = "y" * (3 * engine.max_model_len)
            failure = await failure_of(stub.Generate(pb.GenerateRequest(prompt=text)))
            assert failure.code == grpc.StatusCode.OUT_OF_RANGE and engine.submitted == []
            request = pb.GenerateRequest(
                prompt=text,
                sampling=pb.SamplingParams(max_tokens=1),
                context_policy=pb.CONTEXT_POLICY_TRUNCATE_LEFT,
            )
            await stub.Generate(request)
            assert [len(r.prompt_token_ids) for r in engine.submitted] == [len(text)]
    finally:
        await app.stop()


async def test_message_over_the_limit_is_resource_exhausted(big, inproc_stub):
    """grpc refuses a request larger than the server's max message size before any handler runs."""
    stub, _ = big
    failure = await failure_of(stub.Generate(pb.GenerateRequest(prompt="x" * (BIG_APP_MESSAGE_BYTES + MiB))))
    assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The default (16 MiB) on the other in-process server.
    failure = await failure_of(inproc_stub.Generate(pb.GenerateRequest(prompt="x" * (17 * MiB))))
    assert failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await stub.CheckHealth(pb.CheckHealthRequest())).status == pb.SERVING_STATUS_SERVING


def test_max_message_bytes_flag(spawn_server):
    """``--max-message-bytes`` sets what the server reads: past it RESOURCE_EXHAUSTED, under it the handler
    answers (here OUT_OF_RANGE: 900 KB of text cannot fit SmolLM2's context)."""
    server = spawn_server("--no-http", "--max-message-bytes", str(MiB))

    async def main():
        async with grpc.aio.insecure_channel(server.grpc_target, options=CHANNEL_OPTIONS) as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            over = await failure_of(stub.Generate(pb.GenerateRequest(prompt="x" * (2 * MiB))))
            under = await failure_of(stub.Generate(pb.GenerateRequest(prompt="x" * 900_000)))
            return over.code, under.code

    assert asyncio.run(main()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE)


def test_a_body_over_max_message_bytes_is_413_at_the_gateway_not_a_rate_limit(spawn_server):
    """grpc's own size refusal is a bare RESOURCE_EXHAUSTED; through the gateway it is the body's size
    (413, invalid_request_error), never a 429 telling the caller to slow down."""
    server = spawn_server("--max-message-bytes", str(MiB))
    response = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": "x" * (2 * MiB), "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "retry-after" not in response.headers


# -- item 3: echoes cut short, text fields capped -----------------------------------------------


def _assert_short(failure) -> None:
    assert len(failure.message.encode()) <= MAX_MESSAGE_BYTES
    for value in failure.details["ErrorInfo"].metadata.values():
        assert len(value) < 200


@pytest.mark.parametrize("size", [3_000, 5_000])
async def test_long_unknown_model_name_is_not_found_with_a_short_message(live, size):
    stub, openai_stub = live
    name = "m" * size
    calls = [
        stub.Generate(pb.GenerateRequest(model=name, prompt="hi")),
        stub.GenerateStream(pb.GenerateStreamRequest(request=pb.GenerateRequest(model=name, prompt="hi"))),
        stub.GetModel(pb.GetModelRequest(name=name)),
        stub.Tokenize(pb.TokenizeRequest(model=name, text="hi")),
        openai_stub.RetrieveModel(oa.RetrieveModelRequest(model=name)),
        openai_stub.CreateChatCompletion(
            oa.CreateChatCompletionRequest(
                model=name, messages=[oa.ChatCompletionRequestMessage(role="user")]
            )
        ),
    ]
    for call in calls:
        failure = await failure_of(call)
        assert failure.code == grpc.StatusCode.NOT_FOUND and failure.reason == "MODEL_NOT_FOUND"
        _assert_short(failure)
        assert (
            f"({size} bytes)" in failure.message
            and f"at most {MAX_MODEL_NAME_CHARS} characters" in failure.message
        )


def test_long_unknown_model_name_through_the_gateway_is_404(live_server):
    base = f"http://127.0.0.1:{live_server.http_port}"
    name = "m" * 5_000
    with httpx.Client(base_url=base, timeout=SETTLE_S) as http:
        chat = http.post(
            "/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "hi"}]}
        )
        completion = http.post("/v1/completions", json={"model": name, "prompt": "hi"})
        retrieve = http.get(f"/v1/models/{name}")
    for response in (chat, completion, retrieve):
        assert response.status_code == 404, response.text[:300]
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["type"] == "not_found_error"
        assert len(error["message"]) < 400


def _request_log_line(live_server, marker: str) -> str:
    """The request log line holding ``marker`` (the line is written as the call ends)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        with open(live_server.log_path, encoding="utf-8", errors="replace") as log:
            for line in log:
                if marker in line and '"request_finished"' in line:
                    return line
        time.sleep(0.1)
    raise AssertionError(f"no request log line with {marker}")


async def test_request_log_line_stays_short(live, live_server):
    """A 3 MB model name, and a 3 MB request id, leave short lines in the request log."""
    stub, _ = live
    marker = f"limits-{uuid.uuid4().hex}"
    failure = await failure_of(
        stub.Generate(pb.GenerateRequest(model="m" * 3_000_000, prompt="hi", request_id=marker))
    )
    assert failure.code == grpc.StatusCode.NOT_FOUND
    line = _request_log_line(live_server, marker)
    assert len(line) < 2_000 and json.loads(line[line.index("{") :])["status"] == "NOT_FOUND"
    long_id = f"{marker}-id-" + "i" * 3_000_000
    failure = await failure_of(stub.Generate(pb.GenerateRequest(prompt="hi", request_id=long_id)))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"request_id"}
    line = _request_log_line(live_server, f"{marker}-id-")
    assert len(line) < 2_000


async def test_text_fields_over_their_caps_are_invalid_argument(live):
    stub, openai_stub = live
    too_long_id = "r" * (MAX_REQUEST_ID_CHARS + 1)
    cases = [
        (stub.Generate(pb.GenerateRequest(prompt="hi", request_id=too_long_id)), {"request_id"}),
        (
            stub.GenerateStream(
                pb.GenerateStreamRequest(request=pb.GenerateRequest(prompt="hi", request_id=too_long_id))
            ),
            {"request_id"},
        ),
        (stub.Cancel(pb.CancelRequest(request_id="c" * 5_000)), {"request_id"}),
        (
            stub.Batch(pb.BatchRequest(requests=[pb.GenerateRequest(prompt="hi", request_id=too_long_id)])),
            {"requests[0].request_id"},
        ),
        (
            stub.Generate(
                pb.GenerateRequest(
                    prompt="hi", sampling=pb.SamplingParams(stop=["s" * (MAX_STOP_STRING_CHARS + 1)])
                )
            ),
            {"sampling.stop"},
        ),
        (
            stub.Generate(
                pb.GenerateRequest(
                    prompt="hi", sampling=pb.SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
                )
            ),
            {"sampling.stop"},
        ),
        (
            stub.Generate(
                pb.GenerateRequest(
                    chat=pb.ChatInput(
                        messages=[
                            pb.ChatMessage(role="user", content="hi", name="n" * (MAX_CHAT_NAME_CHARS + 1))
                        ]
                    )
                )
            ),
            {"chat.messages[0].name"},
        ),
    ]
    chat = oa.CreateChatCompletionRequest(
        messages=[oa.ChatCompletionRequestMessage(role="user", name="n" * (MAX_CHAT_NAME_CHARS + 1))]
    )
    chat.messages[0].content.string_value = "hi"
    cases.append((openai_stub.CreateChatCompletion(chat), {"messages[0].name"}))
    completion = oa.CreateCompletionRequest()
    completion.prompt.string_value = "hi"
    completion.stop.string_value = "s" * (MAX_STOP_STRING_CHARS + 1)
    cases.append((openai_stub.CreateCompletion(completion), {"stop"}))
    for call, fields in cases:
        failure = await failure_of(call)
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT, failure.message
        assert failure.fields == fields
        _assert_short(failure)


async def test_many_violations_stay_within_the_trailers(live):
    """A status naming hundreds of bad fields would overflow 8 KB of trailers: the first few go, and a count."""
    stub, _ = live
    messages = [pb.ChatMessage(role=f"robot-{'r' * 200}-{i}", content="x") for i in range(1_000)]
    failure = await failure_of(stub.Generate(pb.GenerateRequest(chat=pb.ChatInput(messages=messages))))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(failure.details["BadRequest"].field_violations) == MAX_VIOLATIONS
    assert f"and {1_000 - MAX_VIOLATIONS} more" in failure.message
    ids = ["d" * MAX_REQUEST_ID_CHARS] * 2 + [f"{i}" * MAX_REQUEST_ID_CHARS for i in range(10)] * 2
    failure = await failure_of(
        stub.Batch(pb.BatchRequest(requests=[pb.GenerateRequest(prompt="hi", request_id=i) for i in ids]))
    )
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and "repeated" in failure.message
    _assert_short(failure)


def test_a_model_name_over_the_cap_cannot_be_served():
    engine = EngineDouble()
    engine.model_name = "n" * (MAX_MODEL_NAME_CHARS + 1)
    with pytest.raises(ValueError, match=str(MAX_MODEL_NAME_CHARS)):
        ModelRegistry().add(ServedModel(engine, ModelCard("float32", "none", "double")))
