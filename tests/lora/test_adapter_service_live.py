"""AdapterService, GenerateRequest.adapter and the OpenAI routes' adapter models on a live server.

One ``protoserve serve`` process with the default SmolLM2 model, auth on (a user key and an admin
key) and ``--lora a=...`` at start; adapters are written in PEFT's format for SmolLM2-135M's
shapes (random, large enough to change greedy output).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import openai
import pytest
from smollm2_adapters import write_adapter

from protoserve.v1 import adapters_pb2 as apb
from protoserve.v1 import adapters_pb2_grpc, inference_pb2_grpc
from protoserve.v1 import inference_pb2 as pb

USER, ADMIN = "lora-user-key", "lora-admin-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {"a": write_adapter(root / "a", 1), "b": write_adapter(root / "b", 2, targets=("k_proj", "o_proj")),
            "bad_rank": write_adapter(root / "bad", 3, r=4, targets=("q_proj",)),
            "huge": root / "huge"}


@pytest.fixture(scope="module")
def server(spawn_server, adapters):
    # A config that claims r=8 over r=4 tensors: shapes that do not match.
    cfg = json.loads((adapters["bad_rank"] / "adapter_config.json").read_text())
    (adapters["bad_rank"] / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    srv = spawn_server("--lora", f"a={adapters['a']}", "--max-loras", "2", "--no-embedding-model",
                       env={"PROTOSERVE_API_KEYS": USER, "PROTOSERVE_ADMIN_KEYS": ADMIN})
    yield srv
    srv.stop()


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def generate(channel, adapter: str = "", max_tokens: int = 8, key: str = USER) -> pb.GenerateResponse:
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    req = pb.GenerateRequest(prompt=PROMPT, adapter=adapter,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return stub.Generate(req, metadata=md(key), timeout=120)


def test_admin_key_required(server) -> None:
    with server.sync_channel() as ch:
        stub = adapters_pb2_grpc.AdapterServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.ListAdapters(apb.ListAdaptersRequest(), metadata=md(USER), timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin key" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.ListAdapters(apb.ListAdaptersRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        [a] = stub.ListAdapters(apb.ListAdaptersRequest(), metadata=md(ADMIN), timeout=30).adapters
        assert (a.name, a.rank, list(a.target_modules)) == ("a", 8, ["q_proj", "v_proj", "down_proj"])
        assert a.base_model and a.resident


def test_generate_under_adapter(server) -> None:
    with server.sync_channel() as ch:
        base = generate(ch).choices[0].text
        with_a = generate(ch, "a").choices[0].text
        assert with_a != base
        assert generate(ch, "a").choices[0].text == with_a  # deterministic, prefix cache or not
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, "nope")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "adapter" in err.value.details() and "'nope'" in err.value.details()


def test_malformed_adapter_invalid_argument_and_server_keeps_serving(server, adapters) -> None:
    with server.sync_channel() as ch:
        stub = adapters_pb2_grpc.AdapterServiceStub(ch)
        for path, problem in ((adapters["bad_rank"], "has shape [4, 576], the base model needs [8, 576]"),
                              (adapters["huge"], "does not exist")):
            with pytest.raises(grpc.RpcError) as err:
                stub.LoadAdapter(apb.LoadAdapterRequest(name="bad", path=str(path)), metadata=md(ADMIN), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert problem in err.value.details()
        names = [a.name for a in stub.ListAdapters(apb.ListAdaptersRequest(), metadata=md(ADMIN), timeout=30).adapters]
        assert names == ["a"]
        assert generate(ch, "a", max_tokens=2).usage.completion_tokens == 2


def test_openai_models_and_completions_by_adapter_name(server, adapters) -> None:
    with server.sync_channel() as ch:
        stub = adapters_pb2_grpc.AdapterServiceStub(ch)
        loaded = stub.LoadAdapter(apb.LoadAdapterRequest(name="b", path=str(adapters["b"])), metadata=md(ADMIN),
                                  timeout=60).adapter
        assert loaded.name == "b" and list(loaded.target_modules) == ["k_proj", "o_proj"]
        native = {n: generate(ch, n).choices[0].text for n in ("", "a", "b")}
    assert len(set(native.values())) == 3
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=USER, max_retries=0,
                           timeout=120)
    models = {m.id: m for m in client.models.list().data}
    base = loaded.base_model
    assert set(models) == {base, "a", "b"}
    assert models["a"].parent == base and models["b"].parent == base
    assert getattr(models[base], "parent", None) is None  # omitted for the base model, as vLLM's null
    assert client.models.retrieve("b").parent == base
    for name, model in (("", base), ("a", "a"), ("b", "b")):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0)
        assert out.choices[0].text == native[name], name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)


def test_unload_in_use_is_failed_precondition(server, adapters) -> None:
    with server.sync_channel() as ch:
        stub = adapters_pb2_grpc.AdapterServiceStub(ch)
        stub.LoadAdapter(apb.LoadAdapterRequest(name="c", path=str(adapters["b"])), metadata=md(ADMIN), timeout=60)
        infer = inference_pb2_grpc.InferenceServiceStub(ch)
        req = pb.GenerateRequest(prompt=PROMPT, adapter="c", sampling=pb.SamplingParams(temperature=0.0,
                                                                                        max_tokens=200))
        stream = infer.GenerateStream(pb.GenerateStreamRequest(request=req), metadata=md(USER), timeout=120)
        next(iter(stream))  # the request is running: it holds the adapter
        with pytest.raises(grpc.RpcError) as err:
            stub.UnloadAdapter(apb.UnloadAdapterRequest(name="c"), metadata=md(ADMIN), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "in use by 1 request" in err.value.details()
        stream.cancel()
        for _ in range(100):  # the engine lets go of it within a step or so
            try:
                stub.UnloadAdapter(apb.UnloadAdapterRequest(name="c"), metadata=md(ADMIN), timeout=30)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                threading.Event().wait(0.1)
        else:
            raise AssertionError("adapter b still in use after its request was cancelled")
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, "c")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.UnloadAdapter(apb.UnloadAdapterRequest(name="c"), metadata=md(ADMIN), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
