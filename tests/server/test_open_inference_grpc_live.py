"""The Open Inference Protocol (KServe v2 / Triton) over gRPC, driven by the official tritonclient.grpc."""

from __future__ import annotations

import json
import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from openai import OpenAI
from tritonclient.utils import InferenceServerException

from protoserve.v1 import embeddings_pb2, embeddings_pb2_grpc, inference_pb2_grpc
from protoserve.v1 import inference_pb2 as pb

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def client(live_server):
    with triton.InferenceServerClient(live_server.grpc_target) as c:
        yield c


@pytest.fixture(scope="module")
def names(live_server):
    """(the LLM's name, the embedding model's name), as the native API reports them."""
    with live_server.sync_channel() as channel:
        llm = inference_pb2_grpc.InferenceServiceStub(channel).ListModels(pb.ListModelsRequest()).models[0].name
        embedder = embeddings_pb2_grpc.EmbeddingServiceStub(channel).Embed(
            embeddings_pb2.EmbedRequest(texts=["x"])
        ).model
    return llm, embedder


def native_greedy(live_server, prompt: str = PROMPT, max_tokens: int = 8) -> str:
    with live_server.sync_channel() as channel:
        response = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens))
        )
    return response.choices[0].text


def text_inputs(prompt: str = PROMPT, sampling: dict | None = None, **flags: bool) -> list[triton.InferInput]:
    inputs = [triton.InferInput("text_input", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    if sampling is not None:
        tensor = triton.InferInput("sampling_parameters", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
        inputs.append(tensor)
    for name, value in flags.items():
        tensor = triton.InferInput(name, [1], "BOOL")
        tensor.set_data_from_numpy(np.array([value], dtype=bool))
        inputs.append(tensor)
    return inputs


def refusal(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def test_health_and_server_metadata(client, names):
    llm, embedder = names
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(llm) and client.is_model_ready(embedder)
    assert not client.is_model_ready("no-such-model")
    assert not client.is_model_ready(llm, model_version="2")
    metadata = client.get_server_metadata()
    assert metadata.name == "protoserve"
    assert {"binary_tensor_data", "generate"} <= set(metadata.extensions)


def test_model_metadata_describes_the_tensors(client, names):
    llm, embedder = names
    metadata = client.get_model_metadata(llm, as_json=True)
    assert metadata["name"] == llm and metadata["versions"] == ["1"]
    inputs = {t["name"]: t["datatype"] for t in metadata["inputs"]}
    assert inputs == {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES",
                      "exclude_input_in_output": "BOOL"}
    assert [(t["name"], t["datatype"]) for t in metadata["outputs"]] == [("text_output", "BYTES")]
    vectors = client.get_model_metadata(embedder, as_json=True)
    assert [(t["name"], t["datatype"], t["shape"]) for t in vectors["outputs"]] == [
        ("embedding", "FP32", ["-1", "384"])
    ]
    error = refusal(lambda: client.get_model_metadata("no-such-model"))
    assert error.status() == "StatusCode.NOT_FOUND" and "no-such-model" in error.message()


def test_infer_equals_native_greedy(client, names, live_server):
    expected = native_greedy(live_server)
    result = client.infer(names[0], text_inputs(sampling=GREEDY, exclude_input_in_output=True), request_id="r-1")
    assert result.get_response().id == "r-1"
    [text] = result.as_numpy("text_output")
    assert text.decode() == expected
    # As the vLLM backend: without exclude_input_in_output the prompt comes first.
    [whole] = client.infer(names[0], text_inputs(sampling=GREEDY)).as_numpy("text_output")
    assert whole.decode() == PROMPT + expected


def test_sampling_keys_as_request_parameters(client, names, live_server):
    expected = native_greedy(live_server, max_tokens=4)
    result = client.infer(names[0], text_inputs(exclude_input_in_output=True),
                          parameters={"temperature": 0.0, "max_tokens": 4})
    assert result.as_numpy("text_output")[0].decode() == expected


def test_stream_deltas_equal_native_greedy(client, names, live_server):
    expected = native_greedy(live_server)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(names[0], text_inputs(sampling=GREEDY, stream=True), request_id="s-1",
                                  enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            assert response.id == "s-1"
            if response.parameters["triton_final_response"].bool_param:
                assert not response.outputs  # the empty final response asked for
                break
            pieces.append(result.as_numpy("text_output")[0].decode())
    finally:
        client.stop_stream()
    assert len(pieces) >= 2, "text must arrive as deltas"
    assert "".join(pieces) == expected


def test_stream_reports_a_bad_request_and_goes_on(client, names, live_server, clean_log):
    expected = native_greedy(live_server, max_tokens=3)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(names[0], text_inputs(sampling={"temprature": 0}, stream=True))
        result, error = responses.get(timeout=120)
        assert result is None and "sampling_parameters.temprature" in error.message()
        client.async_stream_infer(names[0], text_inputs(sampling={"temperature": 0, "max_tokens": 3},
                                                         exclude_input_in_output=True))
        result, error = responses.get(timeout=120)
        assert error is None
        assert result.as_numpy("text_output")[0].decode() == expected
        assert result.get_response().parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream()


def test_embeddings_equal_openai_embeddings(client, names, live_server):
    texts = ["a cat sat on the mat", "protocol buffers"]
    tensor = triton.InferInput("text_input", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    vectors = client.infer(names[1], [tensor]).as_numpy("embedding")
    assert vectors.dtype == np.float32 and vectors.shape == (2, 384)
    openai = OpenAI(base_url=f"http://127.0.0.1:{live_server.http_port}/v1", api_key="unused")
    reference = openai.embeddings.create(model=names[1], input=texts)
    np.testing.assert_allclose(vectors, np.array([d.embedding for d in reference.data]), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("inputs", "named", "says"),
    [
        (lambda: [_bytes("prompt", [b"x"])], "prompt", "is not an input"),
        (lambda: [_fp32("text_input", [1])], "text_input", "datatype must be BYTES"),
        (lambda: [_bytes("text_input", [b"a", b"b"])], "text_input", "shape must be [1]"),
        (lambda: text_inputs(sampling={"max_tokens": 4, "top_kk": 2}), "sampling_parameters.top_kk", "unknown"),
        (lambda: text_inputs(sampling={"max_tokens": "many"}), "sampling_parameters.max_tokens", "invalid value"),
        (lambda: text_inputs(sampling={"logprobs": 2}), "sampling_parameters.logprobs", "logprobs output"),
        (lambda: text_inputs(sampling={"temperature": -1}), "sampling_parameters.temperature", ""),
        (lambda: text_inputs(stream=True), "stream", "ModelStreamInfer"),
        (lambda: [_bytes("stream", [b"x"])], "stream", "datatype must be BOOL"),
    ],
)
def test_bad_tensors_are_invalid_argument_naming_them(client, names, inputs, named, says, clean_log):
    built = inputs()
    if built[0].name() != "text_input":
        built.append(_bytes("text_input", [PROMPT.encode()]))
    error = refusal(lambda: client.infer(names[0], built))
    assert error.status() == "StatusCode.INVALID_ARGUMENT", error
    assert named in error.message() and says in error.message(), error.message()


def test_other_triton_rpcs_are_unimplemented_with_a_reason(client, names):
    error = refusal(lambda: client.get_model_config(names[0]))
    assert error.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelConfig is not served" in error.message() and "ModelMetadata" in error.message()


def test_auth_as_the_native_rpcs(live_server_auth):
    with triton.InferenceServerClient(live_server_auth.grpc_target) as anonymous:
        assert anonymous.is_server_live()  # probes need no key
        error = refusal(lambda: anonymous.infer("any", text_inputs(sampling=GREEDY)))
        assert error.status() == "StatusCode.UNAUTHENTICATED"
    key = {"authorization": f"Bearer {live_server_auth.api_keys[0]}"}
    with triton.InferenceServerClient(live_server_auth.grpc_target) as keyed:
        model = keyed.get_server_metadata(headers=key).name and keyed.is_server_ready()
        assert model
        with grpc.insecure_channel(live_server_auth.grpc_target) as channel:
            llm = inference_pb2_grpc.InferenceServiceStub(channel).ListModels(
                pb.ListModelsRequest(), metadata=live_server_auth.metadata()
            ).models[0].name
        result = keyed.infer(llm, text_inputs(sampling=GREEDY), headers=key)
        assert result.as_numpy("text_output")[0].decode().startswith(PROMPT)


def _bytes(name: str, values: list[bytes]) -> triton.InferInput:
    tensor = triton.InferInput(name, [len(values)], "BYTES")
    tensor.set_data_from_numpy(np.array(values, dtype=object))
    return tensor


def _fp32(name: str, shape: list[int]) -> triton.InferInput:
    tensor = triton.InferInput(name, shape, "FP32")
    tensor.set_data_from_numpy(np.zeros(shape, dtype=np.float32))
    return tensor
