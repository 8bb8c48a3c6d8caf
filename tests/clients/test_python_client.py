"""protoserve_client (sync Client and AsyncClient) against a live server with the real default model.

Everything runs on the shared auth-on server (``live_server_auth``), so every
call also proves the API key reaches the server. Decoding on CPU is slow, so
generations are a few tokens long and one greedy reference result is shared.
"""

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
GREEDY = {"max_tokens": 4, "temperature": 0.0}
# Long enough that a run always outlives the deadlines and cancels below.
ENDLESS = {"max_tokens": 512, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(live_server_auth):
    return live_server_auth


@pytest.fixture(scope="module")
def target(server) -> str:
    return server.grpc_target


@pytest.fixture(scope="module")
def api_key(server) -> str:
    return server.api_keys[0]


@pytest.fixture(scope="module")
def client(target: str, api_key: str) -> Iterator[Client]:
    with Client(target, api_key=api_key, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client: Client) -> GenerateResult:
    """The greedy result for PROMPT; greedy decoding is deterministic, so every path must reproduce it."""
    return client.generate(PROMPT, request_id="py-reference", **GREEDY)


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
    assert default.max_model_len > 0 and default.vocab_size > 0 and default.architecture
    assert client.get_model(default.name) == default

    with pytest.raises(ProtoserveError) as info:
        client.get_model("no-such-model")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.reason == "MODEL_NOT_FOUND"


def test_generate_result_is_typed(reference: GenerateResult) -> None:
    r = reference
    assert r.request_id == "py-reference" and r.model
    assert r.text and r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert r.usage.completion_tokens == len(r.choices[0].token_ids) <= GREEDY["max_tokens"]
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.stats.e2e_time_s > 0 and r.stats.generated_tokens == r.usage.completion_tokens
    assert r.raw.choices[0].text == r.text


def test_generate_from_token_ids_and_chat(client: Client, reference: GenerateResult) -> None:
    ids = client.tokenize(PROMPT).token_ids
    by_ids = client.generate(token_ids=ids, max_tokens=1, temperature=0.0)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].token_ids == reference.choices[0].token_ids[:1]

    messages = [{"role": "user", "content": "Say hello."}]
    if client.list_models()[0].has_chat_template:
        chat = client.generate(messages=messages, max_tokens=1)
        assert chat.usage.prompt_tokens == len(client.tokenize(messages=messages).token_ids)
    else:
        with pytest.raises(ProtoserveError) as info:
            client.generate(messages=messages, max_tokens=1)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.reason == "NO_CHAT_TEMPLATE"


def test_stream_yields_deltas_then_final(client: Client, reference: GenerateResult) -> None:
    with client.stream(PROMPT, **GREEDY) as stream:
        events = list(stream)
    deltas = [e for e in events if isinstance(e, StreamDelta)]
    assert deltas and isinstance(events[-1], StreamFinal)
    assert sum(isinstance(e, StreamFinal) for e in events) == 1
    assert {e.request_id for e in events} == {stream.request_id}
    assert "".join(d.text for d in deltas) == reference.text
    assert tuple(t for d in deltas for t in d.token_ids) == reference.choices[0].token_ids
    final = stream.final
    assert final is events[-1] and final.finish_reason == reference.finish_reason
    assert final.usage == reference.usage


def test_cancel_reaches_only_the_owner(target: str, api_key: str) -> None:
    """x-user-id reaches the server: only the user who started a request can cancel it."""
    with (
        Client(target, api_key=api_key, user_id="alice", timeout=120) as alice,
        Client(target, api_key=api_key, user_id="bob", timeout=120) as bob,
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


def test_batch_returns_results_and_errors_in_order(client: Client, reference: GenerateResult) -> None:
    results = client.batch(
        [
            {"prompt": PROMPT, **GREEDY},
            generate_request(PROMPT, max_tokens=-1),
            {"prompt": PROMPT, "model": "no-such-model", **GREEDY},
        ]
    )
    assert len(results) == 3
    ok, bad, missing = results
    assert isinstance(ok, GenerateResult) and ok.text == reference.text
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


def test_deadline_exceeded_is_mapped(target: str, api_key: str, client: Client) -> None:
    with pytest.raises(ProtoserveError) as info:
        client.generate(PROMPT, timeout=0.3, **ENDLESS)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    with pytest.raises(ProtoserveError) as info:
        list(client.stream(PROMPT, timeout=0.3, **ENDLESS))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    # The client-wide default applies when a call sets none.
    with Client(target, api_key=api_key, timeout=0.3) as hurried, pytest.raises(ProtoserveError) as info:
        hurried.generate(PROMPT, **ENDLESS)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_missing_or_wrong_api_key_is_unauthenticated(target: str) -> None:
    for key in (None, "wrong-key"):
        with Client(target, api_key=key, timeout=30) as stranger, pytest.raises(ProtoserveError) as info:
            stranger.list_models()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.reason == "UNAUTHENTICATED"


# --- async ------------------------------------------------------------------


async def test_async_generate_stream_and_small_rpcs(
    target: str, api_key: str, reference: GenerateResult
) -> None:
    async with AsyncClient(target, api_key=api_key, timeout=120) as client:
        assert (await client.health()).serving
        model = (await client.list_models())[0]
        assert (await client.get_model(model.name)) == model

        one = await client.generate(PROMPT, max_tokens=1, temperature=0.0)
        assert one.choices[0].token_ids == reference.choices[0].token_ids[:1]

        stream = client.stream(PROMPT, **GREEDY)
        events = [e async for e in stream]
        assert "".join(e.text for e in events if isinstance(e, StreamDelta)) == reference.text
        assert isinstance(events[-1], StreamFinal) and stream.final is events[-1]

        tok = await client.tokenize("Hello world")
        assert await client.detokenize(tok.token_ids) == "Hello world"

        results = await client.batch([{"prompt": PROMPT, "max_tokens": -1}])
        assert isinstance(results[0], ProtoserveError)
        _expect_invalid_max_tokens(results[0])

    async with AsyncClient(target, api_key="wrong-key") as stranger:
        with pytest.raises(ProtoserveError) as info:
            await stranger.list_models()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_async_errors_deadline_and_cancel(target: str, api_key: str) -> None:
    async with (
        AsyncClient(target, api_key=api_key, user_id="carol", timeout=120) as carol,
        AsyncClient(target, api_key=api_key, user_id="dave", timeout=120) as dave,
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
