"""The Open Inference Protocol's REST side (KServe v2, Triton's generate extension) with tritonclient.http:
LLM output equal to the native Generate, embeddings equal to /v1/embeddings."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def url(live_server):
    return f"127.0.0.1:{live_server.http_port}"


@pytest.fixture(scope="module")
def client(url):
    c = triton.InferenceServerClient(url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def llm(live_server):
    with live_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        name = stub.ListModels(pb.ListModelsRequest()).models[0].name
        expected = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(**GREEDY)))
    return name, expected.choices[0].text


def inputs(binary: bool) -> list[triton.InferInput]:
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object), binary_data=binary)
    sampling = triton.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps(GREEDY).encode()], dtype=object), binary_data=binary)
    exclude = triton.InferInput("exclude_input_in_output", [1], "BOOL")
    exclude.set_data_from_numpy(np.array([True]), binary_data=binary)
    return [text, sampling, exclude]


def test_health_and_metadata(client, llm):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(llm[0])
    assert not client.is_model_ready("no-such-model")
    metadata = client.get_model_metadata(llm[0])
    assert {t["name"] for t in metadata["inputs"]} >= {"text_input", "sampling_parameters"}
    assert metadata["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [1]}]
    assert "generate" in client.get_server_metadata()["extensions"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_equals_native_greedy(client, llm, binary):
    wanted = [triton.InferRequestedOutput("text_output", binary_data=binary)]
    result = client.infer(llm[0], inputs(binary), outputs=wanted, request_id="h-1")
    assert result.get_response()["id"] == "h-1"
    [text] = result.as_numpy("text_output")
    assert (text.decode() if binary else text) == llm[1]  # JSON data comes back as str


def test_infer_default_outputs_come_binary(client, llm):
    result = client.infer(llm[0], inputs(True))  # tritonclient asks binary_data_output when naming none
    assert result.as_numpy("text_output")[0].decode() == llm[1]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_embeddings_equal_openai_embeddings(client, url, binary):
    texts = ["a cat sat on the mat", "protocol buffers"]
    models = httpx.get(f"http://{url}/v1/models", timeout=30).json()["data"]
    [embedder] = [m["id"] for m in models if m["kind"] == "embedding"]
    tensor = triton.InferInput("text_input", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary_data=binary)
    wanted = [triton.InferRequestedOutput("embedding", binary_data=binary)]
    vectors = client.infer(embedder, [tensor], outputs=wanted).as_numpy("embedding")
    assert vectors.dtype == np.float32 and vectors.shape == (2, 384)
    reference = httpx.post(f"http://{url}/v1/embeddings", json={"model": embedder, "input": texts}, timeout=60)
    expected = np.array([d["embedding"] for d in reference.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-6)


def test_generate_and_generate_stream(url, llm):
    body = {"text_input": PROMPT, "parameters": {**GREEDY, "exclude_input_in_output": True}}
    reply = httpx.post(f"http://{url}/v2/models/{llm[0]}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] == llm[1] and reply.json()["model_name"] == llm[0]
    with httpx.stream("POST", f"http://{url}/v2/models/{llm[0]}/generate_stream", json=body, timeout=120) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 2 and "".join(e["text_output"] for e in events) == llm[1]


@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        ("generate", {"text_input": PROMPT, "parameters": {"temprature": 0}}, 400, "parameters.temprature"),
        ("generate", {"prompt": PROMPT}, 400, "prompt"),
        ("generate", {"text_input": PROMPT, "stream": True}, 400, "stream"),
        ("generate_stream", {"text_input": PROMPT, "sampling_parameters": {"top_kk": 1}}, 400, "top_kk"),
        ("infer", {"inputs": [{"name": "text_input", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, 400,
         "text_input"),
        ("infer", {"inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]},
         400, "shape"),
    ],
)
def test_bad_requests_are_kserve_errors(url, llm, path, body, status, named, clean_log):
    reply = httpx.post(f"http://{url}/v2/models/{llm[0]}/{path}", json=body, timeout=120)
    assert reply.status_code == status, reply.text
    assert named in reply.json()["error"]


def test_unknown_model_is_404_and_the_client_says_so(client, url):
    reply = httpx.get(f"http://{url}/v2/models/no-such-model")
    assert reply.status_code == 404 and "no-such-model" in reply.json()["error"]
    with pytest.raises(InferenceServerException):
        client.get_model_metadata("no-such-model")
