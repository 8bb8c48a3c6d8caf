"""protoserve_client (sync Client and AsyncClient) against a live server with the real default model.

Everything runs on the shared auth-on server (``live_server_auth``), so every
call also proves the API key reaches the server. Decoding on CPU is slow, so
generations are a few tokens long and one greedy reference result is shared.
RAG documents belong to the caller (API key and ``x-user-id``), so each RAG
test works as a user id of its own and sees no other test's documents.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import Iterator

import grpc
import pytest

from protoserve_client import (
    AgentAnswer,
    AgentStopReason,
    AgentToolCall,
    AgentToolResult,
    AsyncClient,
    Client,
    Document,
    FinishReason,
    GenerateResult,
    ProtoserveError,
    RagCitations,
    RagDelta,
    RagFinal,
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


# --- embeddings, RAG and agent runs -------------------------------------------

EMBEDDING_DIMENSIONS = 384  # all-MiniLM-L6-v2, the server's default embedding model
DOCUMENTS = [
    Document(
        "volcanoes",
        "Mount Etna is an active volcano on the east coast of Sicily. Its eruptions send lava down its slopes.",
        {"topic": "geology"},
    ),
    Document(
        "bread",
        "Sourdough bread rises because wild yeast and lactic acid bacteria ferment the dough for hours.",
        {"topic": "cooking"},
    ),
]
QUESTION = "Which volcano is on the coast of Sicily?"
RAG_GREEDY = {"max_tokens": 8, "temperature": 0.0}


def _user() -> str:
    """A user id no other test uses, so its documents are its own."""
    return f"py-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def user_client(target: str, api_key: str) -> Iterator[Client]:
    with Client(target, api_key=api_key, user_id=_user(), timeout=120) as c:
        yield c


def _expect_invalid_field(err: ProtoserveError, field: str) -> None:
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.reason == "INVALID_PARAMETER"
    assert [v.field for v in err.field_violations] == [field], err.field_violations


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_embed_returns_unit_vectors_that_rank_by_meaning(client: Client) -> None:
    texts = ["A cat sits on the mat.", "A kitten is sitting on a rug.", "Interest rates rose sharply."]
    result = client.embed(texts)
    assert result.dimensions == EMBEDDING_DIMENSIONS and result.model
    assert len(result.vectors) == len(texts)
    for vector in result.vectors:
        assert len(vector) == EMBEDDING_DIMENSIONS
        assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, abs_tol=1e-4)
    cat, kitten, rates = result.vectors
    assert _cosine(cat, kitten) > _cosine(cat, rates) + 0.2
    assert result.prompt_tokens > len(texts)  # every input adds [CLS] and [SEP]
    assert client.embed(texts[:1]).vectors[0] == pytest.approx(cat, abs=1e-5)

    with pytest.raises(TypeError, match="not one string"):
        client.embed("one text")  # type: ignore[arg-type]
    with pytest.raises(ProtoserveError) as info:
        client.embed([""])
    _expect_invalid_field(info.value, "texts[0]")


def test_documents_index_search_get_list_delete(user_client: Client, target: str, api_key: str) -> None:
    c = user_client
    indexed = c.index_documents([DOCUMENTS[0], {"document_id": "bread", "text": DOCUMENTS[1].text}])
    assert [d.document_id for d in indexed] == ["volcanoes", "bread"]
    assert all(d.chunks == 1 and d.tokens > 10 and not d.replaced for d in indexed)
    # Indexing an id again replaces it, metadata included.
    (again,) = c.index_documents([DOCUMENTS[1]], chunk_tokens=64, overlap_tokens=8)
    assert again.replaced and again.document_id == "bread"

    hits = c.search_documents(QUESTION, top_k=2)
    assert [h.document_id for h in hits] == ["volcanoes", "bread"]
    best = hits[0]
    assert best.score > hits[1].score and 0.3 < best.score <= 1.0
    assert best.text == DOCUMENTS[0].text[best.start : best.end] and best.metadata == {"topic": "geology"}
    assert [h.document_id for h in c.search_documents(QUESTION, filter={"topic": "cooking"})] == ["bread"]
    assert c.search_documents(QUESTION, min_score=0.99) == []

    stored = c.get_document("volcanoes")
    assert stored.document_id == "volcanoes" and stored.text == DOCUMENTS[0].text
    assert stored.metadata == {"topic": "geology"} and stored.info.bytes == len(DOCUMENTS[0].text.encode())
    assert [ch.chunk_index for ch in stored.chunks] == [0] and stored.chunks[0].text == stored.text

    page = c.list_documents(page_size=1)
    assert [d.document_id for d in page.documents] == ["volcanoes"] and page.next_page_token
    assert [d.document_id for d in c.iter_documents(page_size=1)] == ["volcanoes", "bread"]
    assert c.list_documents().next_page_token == ""

    # Another caller sees none of it.
    with Client(target, api_key=api_key, user_id=_user(), timeout=60) as stranger:
        assert stranger.search_documents(QUESTION) == []
        assert list(stranger.iter_documents()) == []
        with pytest.raises(ProtoserveError) as info:
            stranger.get_document("volcanoes")
        assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.reason == "DOCUMENT_NOT_FOUND"

    result = c.delete_documents(["volcanoes", "never-indexed"])
    assert result.deleted == ["volcanoes"] and result.not_found == ["never-indexed"]
    with pytest.raises(ProtoserveError) as info:
        c.get_document("volcanoes")
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert [d.document_id for d in c.iter_documents()] == ["bread"]


def test_bad_rag_input_names_the_field(user_client: Client) -> None:
    with pytest.raises(ProtoserveError) as info:
        user_client.search_documents(QUESTION, top_k=0)
    _expect_invalid_field(info.value, "top_k")
    with pytest.raises(ProtoserveError) as info:
        user_client.retrieve_and_generate(QUESTION, top_k=0, max_tokens=1)
    _expect_invalid_field(info.value, "top_k")
    with pytest.raises(ProtoserveError) as info:
        user_client.index_documents([{"document_id": "a", "text": "  "}])
    _expect_invalid_field(info.value, "documents[0].text")
    with pytest.raises(ProtoserveError) as info:
        user_client.index_documents([DOCUMENTS[0]], chunk_tokens=8)
    _expect_invalid_field(info.value, "chunking.chunk_tokens")
    with pytest.raises(ProtoserveError) as info:
        user_client.list_documents(page_token="not-a-token")
    _expect_invalid_field(info.value, "page_token")
    # Mistakes the client can see never reach the server.
    with pytest.raises(TypeError, match=r"documents\[0\]: unknown keys \['id'\]"):
        user_client.index_documents([{"id": "a", "text": "b"}])
    with pytest.raises(TypeError, match="missing text"):
        user_client.index_documents([{"document_id": "a"}])
    with pytest.raises(TypeError, match="not one string"):
        user_client.delete_documents("volcanoes")  # type: ignore[arg-type]


def test_retrieve_and_generate_cites_the_chunks_it_was_given(
    user_client: Client, target: str, api_key: str
) -> None:
    user_client.index_documents(DOCUMENTS)
    answer = user_client.retrieve_and_generate(QUESTION, top_k=1, **RAG_GREEDY)
    assert answer.answer and answer.request_id and answer.model
    assert answer.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert 0 < answer.usage.completion_tokens <= RAG_GREEDY["max_tokens"]
    # The prompt holds the system message with the chunk, so it is longer than the chunk's text.
    assert answer.usage.prompt_tokens > 30
    [citation] = answer.citations
    assert citation.number == 1 and citation.chunk.document_id == "volcanoes"
    assert citation.chunk.text == DOCUMENTS[0].text

    with user_client.retrieve_and_generate_stream(QUESTION, top_k=2, **RAG_GREEDY) as stream:
        events = list(stream)
    assert isinstance(events[0], RagCitations) and isinstance(events[-1], RagFinal)
    assert all(isinstance(e, RagDelta) for e in events[1:-1]) and len(events) > 2
    assert [c.chunk.document_id for c in events[0].citations] == ["volcanoes", "bread"]
    assert [c.number for c in events[0].citations] == [1, 2]
    assert len({e.request_id for e in events}) == 1
    assert stream.citations is events[0] and stream.final is events[-1]
    assert stream.answer == "".join(e.text for e in events if isinstance(e, RagDelta))
    assert stream.final.usage.completion_tokens <= RAG_GREEDY["max_tokens"]

    # A caller with no documents still gets an answer, with no citations.
    with Client(target, api_key=api_key, user_id=_user(), timeout=60) as stranger:
        nobody = stranger.retrieve_and_generate(QUESTION, max_tokens=2)
    assert nobody.citations == [] and nobody.usage.completion_tokens > 0


def test_run_agent_calls_the_calculator_and_answers(client: Client) -> None:
    tools = {t.name: t for t in client.list_tools()}
    assert "calculator" in tools and tools["calculator"].description
    assert tools["calculator"].parameters["type"] == "object"

    with client.run_agent(
        [{"role": "user", "content": "Use the calculator to compute 17*23."}],
        tools=["calculator"],
        tool_choice="required",
        max_steps=2,
        temperature=0.0,
        max_tokens=60,
    ) as run:
        events = list(run)
    answer = events[-1]
    assert isinstance(answer, AgentAnswer) and run.answer is answer
    assert sum(isinstance(e, AgentAnswer) for e in events) == 1
    assert run.run_id.startswith("run-") and {e.run_id for e in events} == {run.run_id}
    # tool_choice "required" makes the first step call the tool; its result follows the call.
    calls = [e for e in events if isinstance(e, AgentToolCall)]
    results = {e.id: e for e in events if isinstance(e, AgentToolResult)}
    assert calls and calls[0].step == 1 and calls[0].name == "calculator"
    # Greedy decoding makes this the model's call every time, so the tool really ran.
    assert json.loads(calls[0].arguments) == {"expression": "17*23"}
    result = results[calls[0].id]
    assert (result.name, result.content, result.is_error) == ("calculator", "391", False)
    assert events[0].step == 1 and events[0].usage is not None and events[0].usage.completion_tokens > 0
    assert answer.steps <= 2 and answer.stop_reason in (AgentStopReason.ANSWERED, AgentStopReason.MAX_STEPS)
    assert answer.run_usage.completion_tokens >= events[0].usage.completion_tokens
    elapsed = [e.elapsed_s for e in events]
    assert elapsed == sorted(elapsed) and all(e.duration_s >= 0 for e in events)

    with pytest.raises(ProtoserveError) as info:
        list(client.run_agent([{"role": "user", "content": "hi"}], tool_choice="always", max_tokens=1))
    _expect_invalid_field(info.value, "tool_choice")


async def test_async_rag_and_agent(target: str, api_key: str) -> None:
    async with AsyncClient(target, api_key=api_key, user_id=_user(), timeout=120) as client:
        result = await client.embed(["hello world"])
        assert result.dimensions == EMBEDDING_DIMENSIONS and len(result.vectors[0]) == EMBEDDING_DIMENSIONS

        assert [d.document_id for d in await client.index_documents(DOCUMENTS)] == ["volcanoes", "bread"]
        hits = await client.search_documents(QUESTION, top_k=1)
        assert [h.document_id for h in hits] == ["volcanoes"]
        assert (await client.get_document("bread")).text == DOCUMENTS[1].text
        assert [d.document_id async for d in client.iter_documents(page_size=1)] == ["volcanoes", "bread"]
        with pytest.raises(ProtoserveError) as info:
            await client.search_documents(QUESTION, top_k=0)
        _expect_invalid_field(info.value, "top_k")

        stream = client.retrieve_and_generate_stream(QUESTION, top_k=1, **RAG_GREEDY)
        events = [e async for e in stream]
        assert isinstance(events[0], RagCitations) and isinstance(events[-1], RagFinal)
        assert stream.answer and stream.final is events[-1]

        run = client.run_agent(
            [{"role": "user", "content": "Use the calculator to compute 2+2."}],
            tools=["calculator"],
            tool_choice="required",
            max_steps=1,
            temperature=0.0,
            max_tokens=40,
        )
        agent_events = [e async for e in run]
        assert isinstance(agent_events[0], AgentToolCall) and isinstance(agent_events[-1], AgentAnswer)
        assert run.answer is agent_events[-1] and run.answer.stop_reason is AgentStopReason.MAX_STEPS
        assert "calculator" in {t.name for t in await client.list_tools()}

        deleted = await client.delete_documents(["volcanoes", "bread"])
        assert deleted.deleted == ["volcanoes", "bread"] and deleted.not_found == []
        assert [d async for d in client.iter_documents()] == []
