"""Mirostat end to end: ``mirostat_mode``/``mirostat_tau``/``mirostat_eta`` reach the engine's sampler from
native JSON, native gRPC and the official ``openai`` client (as extra body fields), and bad combinations
are refused naming the field on each.

Mirostat 2.0 with a target surprise of 0 bits keeps only the most likely token at every step (mu starts at
2·tau = 0 and nothing less surprising than the top token exists), so at a flat temperature its output is
the greedy one; with a high target it samples widely. The sampler's own arithmetic is checked step by step
against llama.cpp's in tests/engine/test_mirostat.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPT = "The capital of France is"
FLAT = {"temperature": 5.0, "seed": 7}


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
        assert text(**FLAT, mirostat_mode=2, mirostat_tau=0.0) == greedy
        assert text(**FLAT, mirostat_mode=2, mirostat_tau=10.0, mirostat_eta=0.5) != greedy
        # Same seed, same settings: the same text (mu is per choice, restarted per request).
        assert text(**FLAT, mirostat_mode=1) == text(**FLAT, mirostat_mode=1)
    with live_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(
            prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=8, mirostat_mode=2, mirostat_tau=0.0, **FLAT)
        )
        assert stub.Generate(request).choices[0].text == greedy


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"mirostat_mode": 3}, "sampling.mirostat_mode"),
        ({"mirostat_mode": 2, "top_p": 0.9}, "sampling.top_p"),
        ({"mirostat_mode": 2, "temperature": 0}, "sampling.temperature"),
        ({"mirostat_tau": 3.0}, "sampling.mirostat_tau"),
        ({"mirostat_mode": 1, "mirostat_eta": 2.0}, "sampling.mirostat_eta"),
    ],
)
def test_native_refusals_name_the_field(base_url, sampling, field):
    response = httpx.post(f"{base_url}/v1/generate", json={"prompt": PROMPT, "sampling": sampling}, timeout=60)
    assert response.status_code == 400, response.text
    violations = [d for d in response.json()["details"] if d["@type"].endswith("BadRequest")]
    assert field in [v["field"] for v in violations[0]["field_violations"]], violations


def test_the_openai_client_sends_it_as_an_extra(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        forced = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=5.0, seed=7,
            extra_body={"mirostat_mode": 2, "mirostat_tau": 0.0},
        )
        assert forced.choices[0].text == greedy.choices[0].text
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=5.0, seed=7,
            extra_body={"mirostat_mode": 2, "mirostat_tau": 0.0},
        )
        chat_greedy = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content == chat_greedy.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, top_p=0.5,
                extra_body={"mirostat_mode": 2},
            )
        assert exc.value.param == "top_p"
