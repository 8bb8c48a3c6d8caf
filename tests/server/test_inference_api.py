"""InferenceService against the live server (real default model, real grpc.aio channel)."""

from __future__ import annotations

import grpc
import pytest_asyncio
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status_helpers import failure_of, read_all

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPT = "The capital of France is"


def greedy(prompt: str = PROMPT, max_tokens: int = 8, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    )


@pytest_asyncio.fixture(loop_scope="function")
async def channel(live_server):
    async with live_server.channel() as ch:
        yield ch


@pytest_asyncio.fixture(loop_scope="function")
async def stub(channel):
    return inference_pb2_grpc.InferenceServiceStub(channel)


async def test_generate_unary(stub):
    response = await stub.Generate(greedy())
    assert response.request_id.startswith("req-")
    assert response.model
    [choice] = response.choices
    assert choice.text and len(choice.token_ids) <= 8
    assert choice.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert response.usage.completion_tokens == len(choice.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.stats.e2e_time_s > 0 and response.stats.generated_tokens == len(choice.token_ids)


async def test_generate_stream_matches_unary(stub):
    unary = await stub.Generate(greedy())
    request = greedy()
    request.request_id = "stream-me"
    events = await read_all(stub.GenerateStream(pb.GenerateStreamRequest(request=request)))
    deltas = [e.delta for e in events if e.HasField("delta")]
    assert all(e.request_id == "stream-me" for e in events)
    assert len(deltas) >= 2, "tokens must arrive as separate deltas, not all at the end"
    assert "".join(d.text for d in deltas) == unary.choices[0].text
    assert [t for d in deltas for t in d.token_ids] == list(unary.choices[0].token_ids)
    final = events[-1].final
    assert final.choices[0].finish_reason == unary.choices[0].finish_reason
    assert final.usage == unary.usage or final.usage.completion_tokens == unary.usage.completion_tokens
    assert final.model == unary.model


async def test_generate_n_logprobs_stop_and_token_ids(stub):
    tokens = await stub.Tokenize(pb.TokenizeRequest(text=PROMPT))
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=tokens.token_ids),
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.8, seed=7, n=3, logprobs=True, top_logprobs=2),
    )
    response = await stub.Generate(request)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert len(choice.logprobs) == len(choice.token_ids)
        for position, token_id in zip(choice.logprobs, choice.token_ids, strict=True):
            assert position.chosen.token_id == token_id and position.chosen.logprob <= 0
            assert len(position.top) == 2 and position.top[0].logprob >= position.top[1].logprob
    assert response.usage.prompt_tokens == len(tokens.token_ids)
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in response.choices)


async def test_stop_string_is_cut(stub):
    base = await stub.Generate(greedy(max_tokens=8))
    text = base.choices[0].text
    stop = text.strip().split()[1] if len(text.strip().split()) > 1 else text.strip()[:2]
    response = await stub.Generate(greedy(max_tokens=8, stop=[stop]))
    choice = response.choices[0]
    assert stop not in choice.text and text.startswith(choice.text)
    assert choice.finish_reason == pb.FINISH_REASON_STOP and choice.stop_reason == stop


async def test_chat_input(stub):
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Say hello.")])
    response = await stub.Generate(
        pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=3, temperature=0))
    )
    assert response.choices[0].token_ids
    rendered = await stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert response.usage.prompt_tokens == len(rendered.token_ids)


async def test_batch_runs_items_and_reports_errors_per_item(stub):
    ok_a = greedy("One two three", max_tokens=4)
    ok_b = greedy(PROMPT, max_tokens=4)
    bad = greedy(max_tokens=4)
    bad.sampling.top_p = 2.0
    unknown = greedy(max_tokens=4)
    unknown.model = "no-such-model"
    response = await stub.Batch(pb.BatchRequest(requests=[ok_a, bad, ok_b, unknown]))
    kinds = [r.WhichOneof("result") for r in response.results]
    assert kinds == ["response", "error", "response", "error"]
    solo = await stub.Generate(greedy(PROMPT, max_tokens=4))
    assert response.results[2].response.choices[0].token_ids == solo.choices[0].token_ids
    assert response.results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "requests[1].sampling.top_p" in response.results[1].error.message
    assert response.results[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]


async def test_tokenize_detokenize_roundtrip(stub):
    tokens = await stub.Tokenize(pb.TokenizeRequest(text="Hello, world! Ünïcödé ✓"))
    assert len(tokens.token_ids) == len(tokens.tokens) > 3
    assert tokens.max_model_len > 0
    text = await stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids))
    assert text.text == "Hello, world! Ünïcödé ✓"
    failure = await failure_of(stub.Detokenize(pb.DetokenizeRequest(token_ids=[-1, 10**9])))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"token_ids"}


async def test_models_and_health(stub, channel):
    listed = await stub.ListModels(pb.ListModelsRequest())
    model, embedding = listed.models  # the chat model, then the embedding model
    assert (model.kind, embedding.kind) == ("chat", "embedding")
    assert model.architecture == "llama" and model.vocab_size > 0 and model.max_model_len > 0
    assert model.has_chat_template and model.source.endswith(".gguf") and model.dtype == "float32"
    assert model.quantization == "int4"  # --quantization auto: the default GGUF is Q4_1
    assert model.kv_cache_dtype == "bfloat16"  # --kv-cache-dtype auto: quantized weights keep bf16 K/V
    # SmolLM2-135M: dense, 30 global layers, every parameter active.
    assert list(model.layer_pattern) == ["global"] * 30 and model.sliding_window == 0
    assert model.num_active_parameters == model.num_parameters > 100_000_000
    assert (model.num_experts, model.experts_per_token) == (0, 0)
    got = await stub.GetModel(pb.GetModelRequest(name=model.name))
    assert got.model == model
    health = await stub.CheckHealth(pb.CheckHealthRequest())
    assert health.status == pb.SERVING_STATUS_SERVING and list(health.models) == [model.name, embedding.name]
    standard = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert standard.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def one(request):
        call = stub.ServerReflectionInfo()
        await call.write(request)
        await call.done_writing()
        return await call.read()

    reply = await one(reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in reply.list_services_response.service}
    assert {
        "protoserve.v1.InferenceService",
        "protoserve.openai.v1.OpenAIService",
        "grpc.health.v1.Health",
    } <= names
    reply = await one(
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="protoserve.v1.InferenceService")
    )
    proto = descriptor_pb2.FileDescriptorProto.FromString(
        reply.file_descriptor_response.file_descriptor_proto[0]
    )
    assert proto.package == "protoserve.v1"
