"""protoserve_client (sync Client and AsyncClient) against the live server with the real default model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from protoserve_client import (
    AsyncClient,
    Client,
    FinishReason,
    GenerateResult,
    ProtoserveError,
    StreamDelta,
    StreamFinal,
    generate_request,
)

PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 6, "temperature": 0.0}
# Long enough that a run always outlives the deadlines and cancels below.
ENDLESS = {"max_tokens": 256, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(live_server) -> str:
    return live_server.grpc_target


@pytest.fixture(scope="module")
def client(target: str) -> Iterator[Client]:
    with Client(target, timeout=60) as c:
        yield c


def _expect_invalid_max_tokens(err: ProtoserveError) -> None:
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.status is not None and err.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (err.reason, err.domain) == ("INVALID_PARAMETER", "protoserve")
    assert any(v.field.endswith("max_tokens") for v in err.field_violations), err.field_violations


# --- sync -------------------------------------------------------------------


def test_health_and_models(client: Client) -> None:
    health = client.health()
    assert health.serving and health.status == "serving" and health.models
    models = client.list_models()
    default = models[0]
    assert default.name == health.models[0]
    assert default.max_model_len > 0 and default.vocab_size > 0 and default.num_parameters > 0
    assert client.get_model(default.name) == default

    with pytest.raises(ProtoserveError) as info:
        client.get_model("no-such-model")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.reason == "MODEL_NOT_FOUND"


def test_generate_greedy_is_typed_and_deterministic(client: Client) -> None:
    first = client.generate(PROMPT, request_id="py-unary", **GREEDY)
    assert isinstance(first, GenerateResult) and first.request_id == "py-unary" and first.model
    assert first.text and first.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert first.usage.completion_tokens == len(first.choices[0].token_ids) <= GREEDY["max_tokens"]
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.stats.e2e_time_s > 0 and first.stats.generated_tokens == first.usage.completion_tokens
    assert first.raw.choices[0].text == first.text
    again = client.generate(PROMPT, **GREEDY)
    assert again.choices[0].token_ids == first.choices[0].token_ids


def test_generate_from_token_ids_and_chat(client: Client) -> None:
    ids = client.tokenize(PROMPT).token_ids
    by_ids = client.generate(token_ids=ids, **GREEDY)
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.text

    messages = [{"role": "user", "content": "Say hello."}]
    if client.list_models()[0].has_chat_template:
        chat = client.generate(messages=messages, **GREEDY)
        assert chat.usage.prompt_tokens == len(client.tokenize(messages=messages).token_ids)
    else:
        with pytest.raises(ProtoserveError) as info:
            client.generate(messages=messages, **GREEDY)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.reason == "NO_CHAT_TEMPLATE"


def test_stream_yields_deltas_then_final(client: Client) -> None:
    unary = client.generate(PROMPT, **GREEDY)
    with client.stream(PROMPT, **GREEDY) as stream:
        events = list(stream)
    deltas = [e for e in events if isinstance(e, StreamDelta)]
    assert deltas and isinstance(events[-1], StreamFinal)
    assert sum(isinstance(e, StreamFinal) for e in events) == 1
    assert {e.request_id for e in events} == {stream.request_id}
    # Greedy decoding: the streamed pieces add up to the unary result.
    assert "".join(d.text for d in deltas) == unary.text
    assert tuple(t for d in deltas for t in d.token_ids) == unary.choices[0].token_ids
    final = stream.final
    assert final is events[-1] and final.finish_reason == unary.finish_reason
    assert final.usage == unary.usage


def test_cancel_reaches_only_the_owner(target: str) -> None:
    """x-user-id reaches the server: only the user who started a request can cancel it."""
    with (
        Client(target, user_id="alice", timeout=60) as alice,
        Client(target, user_id="bob", timeout=60) as bob,
    ):
        stream = alice.stream(PROMPT, **ENDLESS)
        assert isinstance(next(stream), StreamDelta)  # running now

        with pytest.raises(ProtoserveError) as info:
            bob.cancel(stream.request_id)
        assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.reason == "REQUEST_NOT_FOUND"

        assert alice.cancel(stream.request_id) is True
        rest = list(stream)
        assert isinstance(rest[-1], StreamFinal) and rest[-1].finish_reason is FinishReason.CANCELLED
        assert rest[-1].usage.completion_tokens < ENDLESS["max_tokens"]
        # A finished request is remembered: a late cancel is a plain "no".
        assert alice.cancel(stream.request_id) is False


def test_batch_returns_results_and_errors_in_order(client: Client) -> None:
    results = client.batch(
        [
            {"prompt": PROMPT, **GREEDY},
            generate_request(PROMPT, max_tokens=-1),
            {"prompt": PROMPT, "model": "no-such-model", **GREEDY},
        ]
    )
    assert len(results) == 3
    ok, bad, missing = results
    assert isinstance(ok, GenerateResult) and ok.text == client.generate(PROMPT, **GREEDY).text
    assert isinstance(bad, ProtoserveError)
    _expect_invalid_max_tokens(bad)
    assert isinstance(missing, ProtoserveError)
    assert missing.code == grpc.StatusCode.NOT_FOUND and missing.reason == "MODEL_NOT_FOUND"


def test_tokenize_detokenize_round_trip(client: Client) -> None:
    tok = client.tokenize("Hello world, how are you?")
    assert tok.token_ids and len(tok.tokens) == len(tok.token_ids)
    assert tok.max_model_len == client.list_models()[0].max_model_len
    assert client.detokenize(tok.token_ids) == "Hello world, how are you?"


def test_invalid_argument_details_are_decoded(client: Client) -> None:
    with pytest.raises(ProtoserveError) as info:
        client.generate(PROMPT, max_tokens=-1)
    _expect_invalid_max_tokens(info.value)
    assert "INVALID_ARGUMENT" in str(info.value) and info.value.message

    with pytest.raises(ProtoserveError) as info:
        list(client.stream(PROMPT, max_tokens=-1))
    _expect_invalid_max_tokens(info.value)


def test_deadline_exceeded_is_mapped(target: str, client: Client) -> None:
    with pytest.raises(ProtoserveError) as info:
        client.generate(PROMPT, timeout=0.3, **ENDLESS)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    with pytest.raises(ProtoserveError) as info:
        list(client.stream(PROMPT, timeout=0.3, **ENDLESS))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    # The client-wide default applies when a call sets none.
    with Client(target, timeout=0.3) as hurried, pytest.raises(ProtoserveError) as info:
        hurried.generate(PROMPT, **ENDLESS)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server is still healthy afterwards.
    assert client.generate(PROMPT, **GREEDY).text


# --- auth -------------------------------------------------------------------


def test_api_key_reaches_the_server(live_server_auth) -> None:
    target = live_server_auth.grpc_target
    with Client(target, api_key=live_server_auth.api_keys[0], timeout=60) as good:
        assert good.list_models()
        assert good.generate(PROMPT, **GREEDY).text
    for key in (None, "wrong-key"):
        with Client(target, api_key=key, timeout=60) as bad, pytest.raises(ProtoserveError) as info:
            bad.list_models()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.reason == "UNAUTHENTICATED"


# --- async ------------------------------------------------------------------


async def test_async_generate_stream_and_small_rpcs(target: str) -> None:
    async with AsyncClient(target, timeout=60) as client:
        health = await client.health()
        assert health.serving
        model = (await client.list_models())[0]
        assert (await client.get_model(model.name)) == model

        result = await client.generate(PROMPT, **GREEDY)
        assert result.text and result.usage.completion_tokens > 0

        stream = client.stream(PROMPT, **GREEDY)
        events = [e async for e in stream]
        assert "".join(e.text for e in events if isinstance(e, StreamDelta)) == result.text
        assert isinstance(events[-1], StreamFinal) and stream.final is events[-1]

        tok = await client.tokenize("Hello world")
        assert await client.detokenize(tok.token_ids) == "Hello world"

        results = await client.batch([{"prompt": PROMPT, **GREEDY}, {"prompt": PROMPT, "max_tokens": -1}])
        assert isinstance(results[0], GenerateResult) and results[0].text == result.text
        assert isinstance(results[1], ProtoserveError)
        _expect_invalid_max_tokens(results[1])


async def test_async_errors_deadline_and_cancel(target: str) -> None:
    async with (
        AsyncClient(target, user_id="carol", timeout=60) as carol,
        AsyncClient(target, user_id="dave", timeout=60) as dave,
    ):
        with pytest.raises(ProtoserveError) as info:
            await carol.generate(PROMPT, max_tokens=-1)
        _expect_invalid_max_tokens(info.value)

        with pytest.raises(ProtoserveError) as info:
            await carol.generate(PROMPT, timeout=0.3, **ENDLESS)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

        with pytest.raises(ProtoserveError) as info:
            async for _ in carol.stream(PROMPT, timeout=0.3, **ENDLESS):
                pass
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

        # Cancel from another task while this one reads the stream.
        stream = carol.stream(PROMPT, **ENDLESS)
        assert isinstance(await anext(stream), StreamDelta)
        with pytest.raises(ProtoserveError) as info:
            await dave.cancel(stream.request_id)
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        cancel = asyncio.create_task(carol.cancel(stream.request_id))
        rest = [e async for e in stream]
        assert await cancel is True
        assert isinstance(rest[-1], StreamFinal) and rest[-1].finish_reason is FinishReason.CANCELLED
