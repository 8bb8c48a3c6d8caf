"""ModelService.LoadModel / UnloadModel and idle eviction on live servers.

One server serves SmolLM2 with auth on (a user and an admin key) under a 2 GiB memory budget:
Gemma 3 270M with its default 512 MiB KV pool does not fit beside SmolLM2 (refused before any weight
is read), with a 256-block pool it does; it is then chatted to through the official openai client
(greedy output equal to a server serving it alone) and unloaded during a stream. Another serves
SmolLM2 with ``--model-idle-timeout``: it is evicted, and the next request loads it again.
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import openai
import pytest
from grpc_status_helpers import failure_of

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc, metrics_pb2, metrics_pb2_grpc, models_pb2_grpc
from protoserve.v1 import models_pb2 as mpb

USER, ADMIN = "models-user-key", "models-admin-key"
SMOL, GEMMA = "SmolLM2-135M-Instruct", "gemma3-270m"
BUDGET = 2 * 1024**3
PROMPTS = ("What is the capital of France?", "Name three colours.")
WAIT_S = 300.0


@pytest.fixture(scope="module")
def server(spawn_server):
    srv = spawn_server("--no-embedding-model", "--memory-budget", str(BUDGET),
                       env={"PROTOSERVE_API_KEYS": USER, "PROTOSERVE_ADMIN_KEYS": ADMIN})
    yield srv
    srv.stop()


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def snapshot(server, key: str = ADMIN) -> metrics_pb2.MetricsSnapshot:
    with server.sync_channel() as ch:
        stub = metrics_pb2_grpc.MetricsServiceStub(ch)
        return stub.GetMetrics(metrics_pb2.GetMetricsRequest(), metadata=md(key), timeout=30).snapshot


def memory_of(server, key: str = ADMIN) -> dict[str, metrics_pb2.ModelMemory]:
    return {m.name: m for m in snapshot(server, key).models}


def greedy_chat(base_url: str, model: str, key: str = "unused") -> list[str]:
    oa = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    return [
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], temperature=0,
                                   max_tokens=16).choices[0].message.content
        for p in PROMPTS
    ]


def test_loading_and_unloading_need_an_admin_key(server):
    with server.sync_channel() as ch:
        stub = models_pb2_grpc.ModelServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadModel(mpb.LoadModelRequest(model=GEMMA), metadata=md(USER), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin key" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.UnloadModel(mpb.UnloadModelRequest(name=SMOL), metadata=md(USER), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    base = f"http://127.0.0.1:{server.http_port}"
    reply = httpx.post(f"{base}/v1/models", json={"model": GEMMA}, headers={"authorization": f"Bearer {USER}"})
    assert reply.status_code == 403, reply.text
    reply = httpx.delete(f"{base}/v1/models/{SMOL}", headers={"authorization": f"Bearer {USER}"})
    assert reply.status_code == 403, reply.text
    assert [m.name for m in snapshot(server).models] == [SMOL]  # nothing loaded or unloaded


def test_a_load_over_the_memory_budget_is_refused_before_loading(server):
    before = snapshot(server)
    assert before.memory_budget_bytes == BUDGET
    smol = memory_of(server)[SMOL]
    assert before.memory_reserved_bytes == smol.weight_bytes + smol.kv_pool_bytes > 0
    with server.sync_channel() as ch:
        stub = models_pb2_grpc.ModelServiceStub(ch)
        call = stub.LoadModel.future(mpb.LoadModelRequest(model=GEMMA), metadata=md(ADMIN), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            call.result()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "memory budget" in err.value.details() and "max_kv_blocks" in err.value.details()
    reply = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/models", json={"model": GEMMA},
                       headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert reply.status_code == 429, reply.text
    info = [d for d in reply.json()["details"] if d.get("reason")]
    assert info[0]["reason"] == "MEMORY_BUDGET_EXCEEDED"
    assert int(info[0]["metadata"]["needed_bytes"]) > int(info[0]["metadata"]["free_bytes"])
    assert snapshot(server).memory_reserved_bytes == before.memory_reserved_bytes
    assert [m.name for m in snapshot(server).models] == [SMOL]


def test_bad_load_requests_name_the_field(server):
    with server.sync_channel() as ch:
        stub = models_pb2_grpc.ModelServiceStub(ch)
        for request, field in (
            (mpb.LoadModelRequest(), "model"),
            (mpb.LoadModelRequest(model="/no/such/model.gguf"), "model"),
            (mpb.LoadModelRequest(model=GEMMA, served_model_names=["smol", ""]), "served_model_names"),
            (mpb.LoadModelRequest(model=GEMMA, max_kv_blocks=0), "max_kv_blocks"),
            (mpb.UnloadModelRequest(name=SMOL, grace_s=-1), "grace_s"),
        ):
            method = stub.UnloadModel if isinstance(request, mpb.UnloadModelRequest) else stub.LoadModel
            with pytest.raises(grpc.RpcError) as err:
                method(request, metadata=md(ADMIN), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert field in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # a name already served
            stub.LoadModel(mpb.LoadModelRequest(model=GEMMA, served_model_names=[SMOL]), metadata=md(ADMIN),
                           timeout=60)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as err:  # the only generative model
            stub.UnloadModel(mpb.UnloadModelRequest(name=SMOL), metadata=md(ADMIN), timeout=60)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def gemma_loaded(server):
    with server.sync_channel() as ch:
        stub = models_pb2_grpc.ModelServiceStub(ch)
        request = mpb.LoadModelRequest(model=GEMMA, served_model_names=[GEMMA, "gemma"], max_kv_blocks=256)
        return stub.LoadModel(request, metadata=md(ADMIN), timeout=WAIT_S)


def test_a_loaded_model_serves_like_a_server_serving_it_alone(server, gemma_loaded, spawn_server):
    assert gemma_loaded.model.name == GEMMA and list(gemma_loaded.model.aliases) == ["gemma"]
    assert gemma_loaded.model.kind == "chat" and gemma_loaded.load_seconds > 0
    memory = memory_of(server)
    assert list(memory) == [SMOL, GEMMA]
    assert memory[GEMMA].kv_blocks_total == 256 and memory[GEMMA].resident
    assert memory[GEMMA].weight_bytes == gemma_loaded.weight_bytes > 0
    assert snapshot(server).memory_reserved_bytes <= BUDGET
    listed = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=USER).models.list()
    assert [m.id for m in listed] == [SMOL, GEMMA]
    alone = spawn_server("--model", GEMMA, "--no-embedding-model")
    expected = greedy_chat(f"http://127.0.0.1:{alone.http_port}/v1", GEMMA)
    alone.stop()
    base_url = f"http://127.0.0.1:{server.http_port}/v1"
    assert greedy_chat(base_url, "gemma", key=USER) == expected
    assert greedy_chat(base_url, SMOL, key=USER) != expected  # the other model still answers as itself


def resident_bytes(server) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics").text
    return float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))


def test_unloading_during_a_stream_ends_it_and_frees_the_pool(server, gemma_loaded):
    reserved = snapshot(server).memory_reserved_bytes
    rss = resident_bytes(server)

    async def scenario():
        async with server.channel() as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            request = pb.GenerateRequest(model=GEMMA, prompt="Tell me a very long story about a dragon.",
                                         sampling=pb.SamplingParams(temperature=0.0, max_tokens=2000,
                                                                    ignore_eos=True))
            stream = stub.GenerateStream(pb.GenerateStreamRequest(request=request), metadata=md(USER),
                                         timeout=WAIT_S)
            first = await stream.read()  # the stream is under way
            assert first.WhichOneof("event") is not None
            unload = models_pb2_grpc.ModelServiceStub(ch).UnloadModel(
                mpb.UnloadModelRequest(name="gemma", grace_s=0), metadata=md(ADMIN), timeout=WAIT_S
            )
            failure = await failure_of(stream)
            return failure, await unload

    failure, unloaded = asyncio.run(scenario())
    assert failure.code == grpc.StatusCode.UNAVAILABLE
    assert failure.reason == "MODEL_UNLOADED" and GEMMA in failure.message
    assert unloaded.cancelled_requests == 1
    assert unloaded.freed_bytes == gemma_loaded.weight_bytes + gemma_loaded.kv_pool_bytes
    after = snapshot(server)
    assert [m.name for m in after.models] == [SMOL]  # its KV blocks are gone with it
    assert after.memory_reserved_bytes == reserved - unloaded.freed_bytes
    # The process hands most of it back to the system (weights and pool are large mmap'd tensors).
    assert resident_bytes(server) < rss - unloaded.freed_bytes / 2
    with server.sync_channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            inference_pb2_grpc.InferenceServiceStub(ch).Generate(
                pb.GenerateRequest(model="gemma", prompt="Hi"), metadata=md(USER), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "Traceback" not in server.log()


def listed_names(server) -> list[str]:
    with server.sync_channel() as ch:
        return [m.name for m in inference_pb2_grpc.InferenceServiceStub(ch).ListModels(
            pb.ListModelsRequest(), metadata=md(USER), timeout=30).models]


def test_unloading_drains_a_stream_that_finishes_within_the_grace_period(server):
    # A second SmolLM2 under its own name, with a small pool, so it fits beside whatever is loaded.
    drained, max_tokens = "smol-drain", 400
    # Loaded through the REST route this time (POST /v1/models).
    reply = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/models",
                       json={"model": "smollm2-135m-instruct", "served_model_names": [drained], "max_kv_blocks": 32},
                       headers={"authorization": f"Bearer {ADMIN}"}, timeout=WAIT_S)
    assert reply.status_code == 200, reply.text
    loaded = reply.json()
    assert loaded["model"]["name"] == drained and loaded["model"]["kind"] == "chat"

    async def scenario():
        async with server.channel() as ch:
            request = pb.GenerateRequest(model=drained, prompt="Tell me a very long story about a dragon.",
                                         sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    ignore_eos=True))
            stream = inference_pb2_grpc.InferenceServiceStub(ch).GenerateStream(
                pb.GenerateStreamRequest(request=request), metadata=md(USER), timeout=WAIT_S)
            events = [await stream.read()]  # under way
            unload = models_pb2_grpc.ModelServiceStub(ch).UnloadModel(
                mpb.UnloadModelRequest(name=drained, grace_s=WAIT_S), metadata=md(ADMIN), timeout=WAIT_S)
            while drained in await asyncio.to_thread(listed_names, server):  # routing stops at once
                await asyncio.sleep(0.05)
            while (event := await stream.read()) is not grpc.aio.EOF:
                events.append(event)
            return events, await unload

    events, unloaded = asyncio.run(scenario())
    final = events[-1].final
    assert events[-1].WhichOneof("event") == "final"
    # The stream ran on after its model left the listing, to its full length.
    assert final.usage.completion_tokens == max_tokens
    assert final.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(e.delta.token_ids) for e in events if e.WhichOneof("event") == "delta") == max_tokens
    assert unloaded.cancelled_requests == 0
    assert unloaded.freed_bytes == int(loaded["weight_bytes"]) + int(loaded["kv_pool_bytes"]) > 0
    assert drained not in memory_of(server)


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--memory-budget", "-5", "a positive number of bytes"),
        ("--memory-budget", "2GiB", "a positive number of bytes"),
        ("--model-idle-timeout", "0", "a positive number of seconds"),
        ("--model-idle-timeout", "nan", "a positive number of seconds"),
    ],
)
def test_bad_budget_and_idle_timeout_flags_are_usage_errors(flag, value, needle):
    from protoserve.server import exit_codes
    from tests.server.test_cli_errors import assert_one_line_error, serve

    assert_one_line_error(serve("--no-http", flag, value), exit_codes.USAGE, f"argument {flag}", needle)


@pytest.fixture(scope="module")
def idle_server(spawn_server):
    srv = spawn_server("--no-embedding-model", "--model-idle-timeout", "1")
    yield srv
    srv.stop()


def generate(server) -> pb.GenerateResponse:
    with server.sync_channel() as ch:
        return inference_pb2_grpc.InferenceServiceStub(ch).Generate(
            pb.GenerateRequest(prompt="The capital of France is",
                               sampling=pb.SamplingParams(temperature=0.0, max_tokens=12)),
            timeout=WAIT_S,
        )


def wait_resident(server, resident: bool) -> None:
    deadline = time.monotonic() + WAIT_S
    while memory_of(server)[SMOL].resident != resident:
        assert time.monotonic() < deadline, f"{SMOL} never became resident={resident}"
        time.sleep(0.2)


def load_count(server) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics").text
    pattern = r"^protoserve_model_load_seconds_count\{model_name=\"" + SMOL + r"\"\} (\S+)$"
    match = re.search(pattern, text, re.M)
    assert match, text[:2000]
    return float(match.group(1))


def test_an_idle_model_is_evicted_and_its_next_request_reloads_it(idle_server):
    first = generate(idle_server)
    assert first.stats.model_load_seconds == 0
    wait_resident(idle_server, False)
    evicted = memory_of(idle_server)[SMOL]
    assert (evicted.weight_bytes, evicted.kv_blocks_total) == (0, 0)
    assert load_count(idle_server) == 1
    again = generate(idle_server)  # waits for the load
    assert again.choices[0].text == first.choices[0].text
    assert again.stats.model_load_seconds > 0
    assert load_count(idle_server) == 2
    assert "Traceback" not in idle_server.log()
    # Listed and described all along: eviction is not unloading.
    with idle_server.sync_channel() as ch:
        assert [m.name for m in inference_pb2_grpc.InferenceServiceStub(ch).ListModels(
            pb.ListModelsRequest(), timeout=30).models] == [SMOL]
