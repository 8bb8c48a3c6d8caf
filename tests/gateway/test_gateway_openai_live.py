"""The official ``openai`` client (sync and async) against the live gateway and server with the real model.

The gateway here is the one ``protoserve serve --http-port`` starts (through
``protoserve.gateway.app.start_gateway``), in front of the real engine and default model.
Also raw HTTP checks of the real SSE framing.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

# Few tokens per call: the suite must stay fast on a loaded 2-core CPU box.
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


@pytest.fixture(scope="module")
def client(base_url: str):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as sync_client:
        yield sync_client


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


CHAT = [{"role": "user", "content": "Name three colours."}]


def test_models_list_and_retrieve(client, model):
    listed = client.models.list()
    # The chat model, then the embedding model (issue 46: every served model is listed).
    assert [m.id for m in listed.data] == [model, "all-MiniLM-L6-v2"]
    assert listed.data[0].object == "model" and listed.data[0].owned_by == "protoserve"
    retrieved = client.models.retrieve(model)
    assert retrieved.id == model and retrieved.created == listed.data[0].created
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.code == "model_not_found"


def test_chat_completion_and_its_stream_agree(client, model):
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= MAX_TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: streaming changes nothing
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_completions_with_prompt_string_and_list(client, model):
    single = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=2, temperature=0
    )
    assert single.object == "text_completion" and single.id.startswith("cmpl-")
    assert len(single.choices) == 1 and single.choices[0].index == 0 and single.choices[0].text
    several = client.completions.create(
        model=model, prompt=["One, two,", "Red, green,"], max_tokens=2, temperature=0
    )
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text != several.choices[1].text


def test_completions_stream_with_usage(client, model):
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    unary = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0
    )
    assert text == unary.choices[0].text
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[
        0
    ].finish_reason == "length"


def test_n_choices_and_seed_reproducibility(client, model):
    params = dict(model=model, messages=CHAT, max_tokens=4, temperature=1.0, n=3, seed=1234)
    first = client.chat.completions.create(**params)
    again = client.chat.completions.create(**params)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    completions = client.completions.create(
        model=model, prompt="Hello", max_tokens=3, n=2, seed=7, temperature=1.0
    )
    repeat = client.completions.create(
        model=model, prompt="Hello", max_tokens=3, n=2, seed=7, temperature=1.0
    )
    assert [c.index for c in completions.choices] == [0, 1]
    assert [c.text for c in completions.choices] == [c.text for c in repeat.choices]


def test_stop_string_ends_the_choice(client, model):
    prompt = "Count: 1, 2, 3, 4,"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 2, free
    stop = words[1]
    stopped = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.text and free.startswith(choice.text)


def test_logprobs_in_chat_and_completions(client, model):
    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for position in content:
        assert position.logprob <= 0 and len(position.top_logprobs) == 2
        assert position.top_logprobs[0].logprob >= position.top_logprobs[1].logprob
        assert position.token == position.top_logprobs[0].token  # greedy picks the most likely
    completion = client.completions.create(
        model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0 and all(len(top) == 2 for top in logprobs.top_logprobs)


def test_bad_parameter_is_a_bad_request_error(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=CHAT, temperature=-1)
    assert exc.value.status_code == 400
    assert "temperature" in exc.value.message
    assert exc.value.param == "temperature"
    assert exc.value.type == "invalid_request_error"
    # A streaming request fails the same way, before any event.
    with pytest.raises(openai.BadRequestError) as stream_exc:
        client.completions.create(model=model, prompt="x", max_tokens=-5, stream=True)
    assert stream_exc.value.param == "max_tokens"
    # Wrong JSON types never reach the server; the gateway names the field.
    with pytest.raises(openai.BadRequestError) as type_exc:
        client.completions.create(model=model, prompt="x", extra_body={"top_k": "many"})
    assert type_exc.value.param == "top_k" and "expected an integer" in type_exc.value.message


async def test_async_client_concurrent_calls(base_url, model):
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:

        async def streamed() -> str:
            stream = await client.chat.completions.create(
                model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        unary, streamed_text, completion = await asyncio.gather(
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0),
            streamed(),
            client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0),
        )
        assert streamed_text == unary.choices[0].message.content
        assert completion.choices[0].text
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=model, prompt="x", top_p=7)


# ------------------------------------------------------------------ raw HTTP on the real server


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(event.startswith(b"data: ") and b"\n" not in event for event in events), raw
    return [event.removeprefix(b"data: ") for event in events]


def test_real_sse_framing(base_url, model):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        body = {"model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": True}
        openai_stream = http.post("/v1/completions", json=body)
        native_stream = http.post("/v1/generate:stream", json={"prompt": "Hi", "sampling": {"max_tokens": 2}})
    assert openai_stream.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = _events(openai_stream.content)
    assert events[-1] == b"[DONE]"
    assert all(json.loads(event)["object"] == "text_completion" for event in events[:-1])
    *native, native_done = _events(native_stream.content)
    assert native_done == b"[DONE]"  # native streams end as OpenAI's do
    native = [json.loads(event) for event in native]
    assert all("delta" in event for event in native[:-1])
    assert native[-1]["final"]["usage"]["completion_tokens"] == 2


def test_real_server_errors_in_native_style(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        bad = http.post("/v1/generate", json={"prompt": "x", "sampling": {"temperature": -2}})
        missing = http.get("/v1/inference/models/nope")
    assert bad.status_code == 400
    details = {d["@type"].rsplit(".", 1)[1]: d for d in bad.json()["details"]}
    assert details["ErrorInfo"]["reason"] == "INVALID_PARAMETER"
    assert details["BadRequest"]["field_violations"][0]["field"] == "sampling.temperature"
    assert missing.status_code == 404 and missing.json()["code"] == 5
