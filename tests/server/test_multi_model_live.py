"""Several models in one server: `serve --model smollm2-135m-instruct --model gemma3-270m` plus the
embedding model under an OpenAI name, checked through the official openai client, langchain-openai,
gRPC and /metrics: the listing, routing by name and alias, wrong-kind errors, greedy output equal to a
server serving the model alone, concurrent streams over both engines, and per-model metrics."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import numpy as np
import openai
import pytest
from grpc_status_helpers import failure_of
from langchain_openai import OpenAIEmbeddings

from protoserve.server import exit_codes
from protoserve.v1 import embeddings_pb2, embeddings_pb2_grpc, inference_pb2, inference_pb2_grpc

SMOL, GEMMA, MINILM = "smollm2-135m-instruct", "gemma3-270m", "all-MiniLM-L6-v2"
PROMPTS = ("What is the capital of France?", "Name three colours.")


@pytest.fixture(scope="module")
def multi(spawn_server):
    return spawn_server(
        "--model", SMOL, "--model", GEMMA,
        "--served-model-name", f"{SMOL},smol",
        "--embedding-model-name", f"{MINILM},text-embedding-3-small",
    )


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0)


def greedy_answers(server, model: str) -> list[str]:
    oa = client(server)
    return [
        oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=16
        ).choices[0].message.content
        for p in PROMPTS
    ]


def test_the_openai_client_lists_every_model_with_its_kind(multi):
    models = {m.id: m for m in client(multi).models.list()}
    assert list(models) == [SMOL, GEMMA, MINILM]
    assert [models[n].model_extra["kind"] for n in models] == ["chat", "chat", "embedding"]
    assert models[MINILM].model_extra["aliases"] == ["text-embedding-3-small"]
    assert models[SMOL].model_extra["aliases"] == ["smol"]
    assert models[GEMMA].model_extra["max_model_len"] > models[MINILM].model_extra["max_model_len"] == 256
    # An alias retrieves its model.
    assert client(multi).models.retrieve("text-embedding-3-small").id == MINILM


def test_the_models_command_lists_what_the_server_has_loaded(multi):
    from tests.loader.test_catalogue import protoserve

    result = protoserve("models", "--json", "--server", multi.grpc_target)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    loaded = [r for r in rows if r["origin"] == f"server {multi.grpc_target}"]
    assert [(r["name"], r["kind"], r["size"]) for r in loaded] == [
        (SMOL, "chat", "loaded"), (GEMMA, "chat", "loaded"), (MINILM, "embedding", "loaded")]
    assert loaded[1]["family"] == "gemma3"
    assert {"smollm2-135m-instruct", "gemma3-270m", "all-minilm-l6-v2"} <= {r["name"] for r in rows[:-3]}
    table = protoserve("models", "--server", multi.grpc_target).stdout.splitlines()
    assert any(line.split()[0] == MINILM and line.rstrip().endswith(f"server {multi.grpc_target}") for line in table)


def test_the_models_command_says_when_the_server_does_not_answer():
    from tests.loader.test_catalogue import protoserve

    result = protoserve("models", "--server", "127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.startswith("protoserve: server 127.0.0.1:1: UNAVAILABLE"), result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.splitlines()[0].split()[0] == "NAME"  # the installed models are still listed


def test_get_model_by_alias_and_list_models_over_grpc(multi):
    with multi.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        listed = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10).models
        got = stub.GetModel(inference_pb2.GetModelRequest(name="smol"), timeout=10).model
    assert [(m.name, m.kind) for m in listed] == [(SMOL, "chat"), (GEMMA, "chat"), (MINILM, "embedding")]
    assert (got.name, list(got.aliases), got.kind) == (SMOL, ["smol"], "chat")
    # The catalogue's sampling values for each chat model, not one model's for both.
    assert got.sampling_defaults.temperature == pytest.approx(0.2)
    assert listed[1].sampling_defaults.top_k == 64


def test_greedy_chat_matches_each_model_served_alone(multi, live_server, spawn_server):
    gemma_alone = spawn_server("--model", GEMMA, "--no-embedding-model")
    assert greedy_answers(multi, SMOL) == greedy_answers(live_server, "")
    assert greedy_answers(multi, "smol") == greedy_answers(live_server, "")
    assert greedy_answers(multi, GEMMA) == greedy_answers(gemma_alone, GEMMA)
    gemma_alone.stop()


def test_open_inference_routes_by_model_name_and_alias(multi):
    import tritonclient.grpc as triton

    from tests.server.test_open_inference_grpc_live import GREEDY, PROMPT, text_inputs

    def native(model: str) -> str:
        with multi.sync_channel() as channel:
            return inference_pb2_grpc.InferenceServiceStub(channel).Generate(
                inference_pb2.GenerateRequest(model=model, prompt=PROMPT, sampling=inference_pb2.SamplingParams(
                    temperature=0, max_tokens=GREEDY["max_tokens"])), timeout=60).choices[0].text

    with triton.InferenceServerClient(multi.grpc_target) as oip:
        def infer(model: str) -> str:
            inputs = text_inputs(sampling=GREEDY, exclude_input_in_output=True)
            return oip.infer(model, inputs).as_numpy("text_output")[0].decode()

        assert oip.get_model_metadata(GEMMA).name == GEMMA
        assert oip.get_model_metadata("text-embedding-3-small").name == MINILM
        smol, gemma = native(SMOL), native(GEMMA)
        assert smol != gemma  # else routing could not be told apart
        assert (infer(SMOL), infer("smol"), infer(GEMMA)) == (smol, smol, gemma)


def test_embeddings_through_langchain_under_the_openai_name(multi):
    texts = ["Paris is the capital of France.", "Photosynthesis makes sugar from light."]
    embeddings = OpenAIEmbeddings(
        model="text-embedding-3-small",
        base_url=f"http://127.0.0.1:{multi.http_port}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # its tiktoken pre-split is for OpenAI's own models
    )
    vectors = np.array(embeddings.embed_documents(texts))
    with multi.sync_channel() as channel:
        native = embeddings_pb2_grpc.EmbeddingServiceStub(channel).Embed(
            embeddings_pb2.EmbedRequest(model=MINILM, texts=texts), timeout=30
        )
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(vectors, [e.values for e in native.embeddings], atol=1e-5)


def test_a_request_of_the_wrong_kind_is_400_naming_model(multi):
    oa = client(multi)
    with pytest.raises(openai.BadRequestError) as chat_to_embedder:
        oa.chat.completions.create(model="text-embedding-3-small", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as embed_from_chat:
        oa.embeddings.create(model=GEMMA, input="hi")
    with pytest.raises(openai.NotFoundError) as unknown:
        oa.embeddings.create(model="no-such-model", input="hi")
    # An unknown name lists the names that are served.
    assert all(name in unknown.value.body["message"] for name in (SMOL, GEMMA, MINILM, "smol")), unknown.value.body
    for raised in (chat_to_embedder, embed_from_chat):
        assert raised.value.body["param"] == "model", raised.value.body
    assert "is an embedding model" in chat_to_embedder.value.body["message"]
    assert "is a chat model and does not embed" in embed_from_chat.value.body["message"]


async def test_a_request_of_the_wrong_kind_is_invalid_argument_over_grpc(multi):
    async with multi.channel() as channel:
        generate = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            inference_pb2.GenerateRequest(model=MINILM, prompt="hi"), timeout=30
        )
        embed = embeddings_pb2_grpc.EmbeddingServiceStub(channel).Embed(
            embeddings_pb2.EmbedRequest(model="smol", texts=["hi"]), timeout=30
        )
        for call in (generate, embed):
            failure = await failure_of(call)
            assert failure.code == grpc.StatusCode.INVALID_ARGUMENT, failure
            assert failure.fields == {"model"}, failure


async def test_concurrent_streams_over_both_models_all_complete(multi):
    oa = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{multi.http_port}/v1", api_key="unused", max_retries=0)

    async def stream(model: str, i: int) -> tuple[str, str, str | None]:
        chunks = await oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=24, temperature=0.7, seed=i, stream=True,
        )
        text, finish, served = "", None, ""
        async for chunk in chunks:
            served = chunk.model
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return served, text, finish

    results = await asyncio.gather(*(stream((SMOL, GEMMA)[i % 2], i) for i in range(8)))
    assert [served for served, _, _ in results] == [SMOL, GEMMA] * 4
    assert all(text and finish in ("stop", "length") for _, text, finish in results), results


def metric(text: str, name: str, model: str) -> float:
    match = re.search(rf'^{name}\{{[^}}]*model_name="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.M)
    assert match, f"{name} for {model} missing"
    return float(match.group(1))


def test_metrics_are_per_model_with_loaded_models_and_load_times(multi):
    import httpx

    url = f"http://127.0.0.1:{multi.http_port}/metrics"
    before = httpx.get(url, timeout=10).text
    client(multi).chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    after = httpx.get(url, timeout=10).text
    generated = "protoserve_generation_tokens_total"
    assert metric(after, generated, GEMMA) > metric(before, generated, GEMMA)
    assert metric(after, generated, SMOL) == metric(before, generated, SMOL)
    for model, kind in ((SMOL, "chat"), (GEMMA, "chat"), (MINILM, "embedding")):
        assert f'protoserve_model_loaded{{kind="{kind}",model_name="{model}"}} 1.0' in after
        assert metric(after, "protoserve_model_load_seconds_count", model) == 1
        assert metric(after, "protoserve_model_load_seconds_sum", model) > 0


def test_responses_and_messages_refuse_the_embedding_model_naming_model(multi):
    import httpx

    base = f"http://127.0.0.1:{multi.http_port}"
    responses = httpx.post(f"{base}/v1/responses", json={"model": MINILM, "input": "hi"}, timeout=30)
    messages = httpx.post(
        f"{base}/v1/messages",
        json={"model": "text-embedding-3-small", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert responses.status_code == 400, responses.text
    assert responses.json()["error"]["param"] == "model"
    assert messages.status_code == 400, messages.text
    assert "is an embedding model" in messages.json()["error"]["message"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--served-model-name", "a", "--served-model-name", "b"), "--served-model-name given 2 times for 1 --model"),
        (("--model", SMOL, "--model", GEMMA, "--speculative-model", "default"), "--speculative-model applies to one"),
        (("--model", SMOL, "--model", GEMMA, "--max-kv-blocks", "64", "--max-kv-blocks", "64",
          "--max-kv-blocks", "64"), "--max-kv-blocks given 3 times for 2 --model"),
    ],
)
def test_flags_that_do_not_pair_with_the_models_are_usage_errors(args, needle):
    from tests.server.test_cli_errors import assert_one_line_error, serve

    assert_one_line_error(serve(*args), exit_codes.USAGE, needle)


def test_an_embedding_model_given_as_model_is_refused_naming_the_flag():
    from tests.server.test_cli_errors import assert_one_line_error, serve

    done = serve("--no-http", "--model", "all-minilm-l6-v2", "--no-embedding-model")
    assert_one_line_error(done, exit_codes.MODEL_LOAD, "is an embedding model: serve it with --embedding-model")
