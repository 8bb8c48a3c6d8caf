"""Hostile and edge input to the LoRA admin API, and what ordinary callers see of adapters, on a live server.

One ``protoserve serve`` (SmolLM2, auth on with a user and an admin key, ``--lora a=...``, two slots).
The inputs are those that once gave a 500, a traceback, an unusable name or a leaked server path:
a deeply nested adapter_config.json, over-long and unreadable paths, names without rules, an idle
adapter whose files changed, every slot pinned; and the ``model`` OpenAI responses name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from smollm2_adapters import write_adapter

from protoserve.v1 import adapters_pb2 as apb
from protoserve.v1 import adapters_pb2_grpc, inference_pb2_grpc
from protoserve.v1 import inference_pb2 as pb

USER, ADMIN = "lora-input-user-key", "lora-input-admin-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapter-input")


@pytest.fixture(scope="module")
def server(spawn_server, root):
    srv = spawn_server("--lora", f"a={write_adapter(root / 'a', 1)}", "--max-loras", "2", "--no-embedding-model",
                       env={"PROTOSERVE_API_KEYS": USER, "PROTOSERVE_ADMIN_KEYS": ADMIN})
    yield srv
    srv.stop()


@pytest.fixture
def new_log(server) -> Iterator[Callable[[], str]]:
    """What the server logs during the test (read with the returned function); never a traceback."""
    start = server.log_path.stat().st_size

    def read() -> str:
        with server.log_path.open("rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")

    yield read
    assert "Traceback" not in read(), read()[-3000:]


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    """The gateway, as an admin."""
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}",
                      headers={"authorization": f"Bearer {ADMIN}"}, timeout=120) as client:
        yield client


@pytest.fixture
def user(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=USER, max_retries=0,
                         timeout=120)


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def adapters_of(server) -> dict[str, apb.Adapter]:
    with server.sync_channel() as ch:
        listed = adapters_pb2_grpc.AdapterServiceStub(ch).ListAdapters(apb.ListAdaptersRequest(), metadata=md(ADMIN),
                                                                      timeout=30).adapters
    return {a.name: a for a in listed}


def load(http: httpx.Client, name: str, path: Path) -> None:
    reply = http.post("/v1/adapters", json={"name": name, "path": str(path)})
    assert reply.status_code == 200, reply.text


def unload(http: httpx.Client, name: str) -> None:
    reply = http.delete(f"/v1/adapters/{name.replace('/', '%2F')}")
    assert reply.status_code == 200, reply.text


def detail(body: dict, kind: str) -> dict:
    [found] = [d for d in body["details"] if d["@type"].endswith(f"google.rpc.{kind}")]
    return found


def rpc_failure(err: grpc.RpcError) -> tuple[grpc.StatusCode, str, str, list]:
    """(code, message, ErrorInfo reason, [RetryInfo]) of a failed gRPC call."""
    info, retry = error_details_pb2.ErrorInfo(), []
    for d in rpc_status.from_call(err).details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            d.Unpack(info)
        elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry.append(error_details_pb2.RetryInfo())
            d.Unpack(retry[-1])
    return err.code(), err.details(), info.reason, retry


def generate(server, adapter: str, max_tokens: int = 2) -> pb.GenerateResponse:
    with server.sync_channel() as ch:
        req = pb.GenerateRequest(prompt=PROMPT, adapter=adapter,
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return inference_pb2_grpc.InferenceServiceStub(ch).Generate(req, metadata=md(USER), timeout=120)


def _deep_config(path: Path) -> Path:
    write_adapter(path, 3)
    cfg = (path / "adapter_config.json").read_text()
    (path / "adapter_config.json").write_text(cfg[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return path


def _symlink_loop(path: Path) -> Path:
    path.mkdir()
    os.symlink(path / "b", path / "a")
    os.symlink(path / "a", path / "b")
    return path / "a"


@pytest.mark.parametrize(
    ("name", "path", "field", "problem"),
    [
        ("deep", _deep_config, "path", "adapter_config.json: nests deeper than 16 levels"),
        ("long-path", lambda p: "/" + "x" * 100_000, "path", "is 100001 characters; a path is at most 4096"),
        ("long-component", lambda p: p.parent / ("n" * 300), "path", "too long for the file system"),
        ("loop", _symlink_loop, "path", "too many levels of symbolic links"),
        ("missing", lambda p: p / "nope", "path", "does not exist"),
        ("nul", lambda p: f"{p}\x00x", "path", "NUL"),
        ("n" * 100_000, lambda p: p, "name", "is 100000 characters; an adapter name is 1 to 128 characters"),
        ("n" * 129, lambda p: p, "name", "is 129 characters"),
        ("two words", lambda p: p, "name", "'two words' is not a valid adapter name"),
        ("../up", lambda p: p, "name", "is not a valid adapter name"),
        ("org//x", lambda p: p, "name", "is not a valid adapter name"),
        ("org/.x", lambda p: p, "name", "is not a valid adapter name"),
        ("", lambda p: p, "name", "is required"),
    ],
    ids=["deep-config", "100KB-path", "long-component", "symlink-loop", "missing", "nul", "100K-name",
         "129-name", "space", "dot-dot", "empty-part", "dot-part", "empty-name"],
)
def test_hostile_load_is_400_naming_the_field(server, http, user, new_log, tmp_path, name, path, field,
                                               problem) -> None:
    where = path(tmp_path / "adapter")
    reply = http.post("/v1/adapters", json={"name": name, "path": str(where)})
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert body["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert detail(body, "ErrorInfo")["reason"] == "INVALID_PARAMETER"
    [violation] = detail(body, "BadRequest")["field_violations"]
    assert violation["field"] == field and problem in violation["description"], violation
    assert len(reply.content) < 4096
    assert set(adapters_of(server)) == {"a"}
    assert {m.id for m in user.models.list().data if getattr(m, "parent", None)} == {"a"}


def test_names_of_the_documented_charset_load_list_serve_and_unload(server, http, user, new_log, root) -> None:
    path = write_adapter(root / "charset", 4)
    for name in ("org/tuned-v1.2:ft_x", "N" * 128):
        load(http, name, path)
        listed = {m.id: m for m in user.models.list().data}
        assert listed[name].parent == user.models.retrieve(name).parent  # /v1/models/org%2F... routes
        out = user.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert out.model == name
        unload(http, name)  # DELETE /v1/adapters/org%2Ftuned-v1.2:ft_x
        assert name not in {m.id for m in user.models.list().data}


def test_responses_name_the_adapter_the_request_named(server, user) -> None:
    base = next(m.id for m in user.models.list().data if not getattr(m, "parent", None))
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0.0}
    for model in ("a", base):
        assert user.chat.completions.create(model=model, **chat).model == model
        chunks = list(user.chat.completions.create(model=model, stream=True,
                                                   stream_options={"include_usage": True}, **chat))
        assert chunks and {c.model for c in chunks} == {model}
        assert user.completions.create(model=model, prompt=PROMPT, max_tokens=3).model == model
        chunks = list(user.completions.create(model=model, prompt=PROMPT, max_tokens=3, stream=True))
        assert chunks and {c.model for c in chunks} == {model}
    # The native response's model is the base model: GenerateRequest names the adapter apart.
    assert generate(server, "a").model == base


@contextlib.contextmanager
def holding(server, adapter: str) -> Iterator[None]:
    """A running request under ``adapter`` (so its slot is pinned) for the block's duration."""
    with server.sync_channel() as ch:
        req = pb.GenerateRequest(prompt=PROMPT, adapter=adapter, sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=2000, ignore_eos=True))
        stream = inference_pb2_grpc.InferenceServiceStub(ch).GenerateStream(
            pb.GenerateStreamRequest(request=req), metadata=md(USER), timeout=300)
        next(iter(stream))  # admitted: the adapter is pinned
        try:
            yield
        finally:
            stream.cancel()


def test_all_slots_pinned_is_adapter_slots_busy(server, http, user, new_log, root) -> None:
    load(http, "p", write_adapter(root / "p", 5))
    load(http, "q", write_adapter(root / "q", 6))
    try:
        with holding(server, "a"), holding(server, "p"):
            with pytest.raises(openai.RateLimitError) as err:
                user.completions.create(model="q", prompt=PROMPT, max_tokens=2)
            assert err.value.status_code == 429 and int(err.value.response.headers["retry-after"]) >= 1
            assert err.value.code == "adapter_slots_busy"
            assert "all 2 (max_loras)" in err.value.message and "queue" not in err.value.message
            with pytest.raises(grpc.RpcError) as rpc:
                generate(server, "q")
            code, _, reason, retry = rpc_failure(rpc.value)
            assert (code, reason, len(retry)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "ADAPTER_SLOTS_BUSY", 1)
        for _ in range(100):  # the cancelled requests let go of their slots within a step or so
            try:
                assert generate(server, "q").usage.completion_tokens == 2
                break
            except grpc.RpcError as exc:
                assert rpc_failure(exc)[2] == "ADAPTER_SLOTS_BUSY"
                threading.Event().wait(0.1)
        else:
            raise AssertionError("slots still pinned after their requests were cancelled")
    finally:
        for name in ("p", "q"):
            with contextlib.suppress(AssertionError):
                unload(http, name)


def test_changed_files_of_an_idle_adapter(server, http, user, new_log, root) -> None:
    path = write_adapter(root / "s", 7)
    load(http, "s", path)
    load(http, "t", write_adapter(root / "t", 8))
    try:
        generate(server, "a")
        generate(server, "t")  # the two slots now hold a and t: s is read back on its next use
        assert not adapters_of(server)["s"].resident
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 3}))
        with pytest.raises(openai.BadRequestError) as err:
            user.chat.completions.create(model="s", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert err.value.code == "adapter_reload_needed"
        assert "'s' must be reloaded" in err.value.message
        assert str(root) not in err.value.response.text  # no server path for an ordinary caller
        with pytest.raises(grpc.RpcError) as rpc:
            generate(server, "s")
        code, message, reason, _ = rpc_failure(rpc.value)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_RELOAD_NEEDED")
        assert str(root) not in message
        assert adapters_of(server)["s"].needs_reload
        assert "must be reloaded" in new_log() and str(path) in new_log()  # the admin's detail, logged
        # What the admin does: unload and load it again (here from fresh files).
        unload(http, "s")
        shutil.rmtree(path)
        load(http, "s", write_adapter(path, 7))
        assert not adapters_of(server)["s"].needs_reload
        assert user.chat.completions.create(model="s", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2).model == "s"
    finally:
        for name in ("s", "t"):
            with contextlib.suppress(AssertionError):
                unload(http, name)
