"""The whole stack on the PyTorch paths (``PROTOSERVE_CPU_KERNELS=0``), as a CPU without AVX2 runs it.

``protoserve serve`` with the C++ kernels switched off answers a native Generate over gRPC and an
OpenAI chat completion over the REST gateway, greedy, with exactly the tokens the engine's PyTorch
path computes for the same prompt ids outside any server. Few tokens: the point is that it serves.

The reference is the PyTorch path, not the kernels' text: the default int4 model multiplies in
bfloat16 there, and where the top two tokens nearly tie (SmolLM2's first answer token to "What is
the capital of France?" as a chat: "The" and "L" 0.1 nats apart) the two paths may choose apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
KERNEL_LIBRARY = "protoserve_cpu"  # kernels/cpu/extension.py's extension name
# The engine as `protoserve serve` builds it by default (quantization auto), greedy over given ids.
REFERENCE = """
import json, sys
from protoserve.engine.llm import LLM
llm = LLM(quantization="auto", progress=False)
done = llm.generate(prompt_token_ids=json.loads(sys.argv[1]), max_tokens=int(sys.argv[2]), temperature=0.0)
print(json.dumps([{"ids": c.choices[0].token_ids, "text": c.choices[0].text} for c in done]))
"""


def pytorch_path_reference(prompts: list[list[int]]) -> list[dict]:
    env = {**os.environ, "PROTOSERVE_CPU_KERNELS": "0"}
    done = subprocess.run(
        [sys.executable, "-c", REFERENCE, json.dumps(prompts), str(MAX_TOKENS)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def maps_kernels(pid: int) -> bool:
    """Whether the process has the compiled kernel extension mapped into memory."""
    return KERNEL_LIBRARY in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads which libraries a process mapped")
def test_the_pytorch_paths_serve_generate_and_chat(spawn_server) -> None:
    server = spawn_server(env={"PROTOSERVE_CPU_KERNELS": "0"})
    user = pb.ChatMessage(role="user", content=QUESTION)
    with server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        native = stub.Generate(
            pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)),
            timeout=120,
        )
        # The prompts' ids as the server renders them, for the reference to start from.
        prompt_ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=60).token_ids)
        chat_ids = list(stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatInput(messages=[user])), timeout=60).token_ids)
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    chat = reply.json()
    assert not maps_kernels(server.process.pid)  # it served without the kernels

    expected_native, expected_chat = pytorch_path_reference([prompt_ids, chat_ids])
    [choice] = native.choices
    assert list(choice.token_ids) == expected_native["ids"] and len(choice.token_ids) == MAX_TOKENS
    assert choice.text == expected_native["text"] and choice.text.strip()
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    assert chat["usage"]["completion_tokens"] == len(expected_chat["ids"])
    assert chat["choices"][0]["message"]["content"] == expected_chat["text"]
