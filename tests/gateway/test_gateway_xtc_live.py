"""XTC end to end: ``xtc_probability``/``xtc_threshold`` reach the sampler from native JSON, native gRPC and
the official ``openai`` client (as extra body fields), and settings it cannot honour are refused by name.

With top-k 2, probability 1 and threshold 0 both candidates qualify at every step and XTC keeps the less
likely one: each chosen token is the second of the two most likely, which the logprobs (reported before
the filters) show position by position. The arithmetic is checked against llama.cpp's in
tests/engine/test_xtc.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPT = "The capital of France is"
# top_p 1.0: the model's card default (0.9) would leave only the likeliest of the two.
SECOND_CHOICE = {"temperature": 1.0, "top_k": 2, "top_p": 1.0, "xtc_probability": 1.0, "xtc_threshold": 0.0}


@pytest.fixture(scope="module")
def base_url(live_server) -> str:
    assert live_server.http_port, "the server started no REST gateway"
    return f"http://127.0.0.1:{live_server.http_port}"


def test_each_token_is_the_second_likeliest(live_server, base_url):
    body = {"prompt": PROMPT, "sampling": {"max_tokens": 8, "logprobs": True, "top_logprobs": 2, **SECOND_CHOICE}}
    response = httpx.post(f"{base_url}/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    positions = choice["logprobs"]
    assert len(positions) == 8
    for position in positions:
        assert position["chosen"]["token_id"] == position["top"][1]["token_id"], position
    with live_server.sync_channel() as channel:
        reply = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=8, **SECOND_CHOICE)), timeout=60
        )
    assert reply.choices[0].text == choice["text"]


def test_the_openai_client_sends_it_as_an_extra(base_url):
    native = httpx.post(f"{base_url}/v1/generate", timeout=60,
                        json={"prompt": PROMPT, "sampling": {"max_tokens": 8, **SECOND_CHOICE}}).json()
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        extra = {k: SECOND_CHOICE[k] for k in ("top_k", "xtc_probability", "xtc_threshold")}
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                               top_p=1.0, extra_body=extra)
        assert completion.choices[0].text == native["choices"][0]["text"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={"xtc_probability": 0.5, "xtc_threshold": 0.7})
        assert refused.value.body["param"] == "xtc_threshold"


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"xtc_probability": 2.0}, "sampling.xtc_probability"),
        ({"xtc_probability": 0.5, "xtc_threshold": 0.6}, "sampling.xtc_threshold"),
        ({"xtc_threshold": 0.2}, "sampling.xtc_threshold"),
        ({"xtc_probability": 0.5, "temperature": 0}, "sampling.temperature"),
        ({"xtc_probability": 0.5, "mirostat_mode": 2}, "sampling.xtc_probability"),
    ],
)
def test_native_refusals_name_the_field(base_url, sampling, field):
    response = httpx.post(f"{base_url}/v1/generate", json={"prompt": PROMPT, "sampling": sampling}, timeout=60)
    assert response.status_code == 400, response.text
    violations = [d for d in response.json()["details"] if d["@type"].endswith("BadRequest")]
    assert field in [v["field"] for v in violations[0]["field_violations"]], violations
