"""top_n_sigma end to end: added in the proto, SamplingParams and the sampler only, it reaches the engine
from native JSON, native gRPC and the official ``openai`` client (as an extra body field), and a bad value
is refused naming it on each.

A tiny top_n_sigma at a flat temperature leaves only the most likely token, so the output is the greedy one.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPT = "The capital of France is"
FLAT = {"temperature": 5.0, "seed": 7}  # far from greedy unless something cuts the candidates down


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


def test_native_json_and_grpc_carry_it(live_server, base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        def text(**sampling) -> str:
            response = http.post("/v1/generate", json={"prompt": PROMPT, "sampling": {"max_tokens": 8, **sampling}})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        greedy = text(temperature=0)
        assert text(**FLAT, top_n_sigma=0.001) == greedy
        assert text(**FLAT) != greedy
        refused = http.post("/v1/generate", json={"prompt": PROMPT, "sampling": {"top_n_sigma": -1}})
    assert refused.status_code == 400
    violations = [d for d in refused.json()["details"] if d["@type"].endswith("BadRequest")]
    assert violations[0]["field_violations"][0]["field"] == "sampling.top_n_sigma"
    with live_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=8, top_n_sigma=0.001, **FLAT))
        assert stub.Generate(request).choices[0].text == greedy


def test_the_openai_client_sends_it_as_an_extra(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        cut = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, extra_body={"top_n_sigma": 0.001}, **FLAT
        )
        assert cut.choices[0].text == greedy.choices[0].text
        messages = [{"role": "user", "content": "Say hello."}]
        chat_greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        chat_cut = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, extra_body={"top_n_sigma": 0.001}, **FLAT
        )
        assert chat_cut.choices[0].message.content == chat_greedy.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=messages, extra_body={"top_n_sigma": 101})
    assert refused.value.param == "top_n_sigma"
