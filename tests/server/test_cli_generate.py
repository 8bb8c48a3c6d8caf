"""`protoserve generate`: one-shot generation without a server, text on stdout, stats on stderr.

On a model with a chat template (the default SmolLM2-Instruct has one) ``--prompt`` is a user
message, as a chat client would send it; ``--raw`` completes the text as it is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

pytestmark = pytest.mark.live  # each test runs the CLI in a process of its own

REPO = Path(__file__).resolve().parents[2]

PROMPT = "The three primary colours are"


def test_generate_raw_streams_text_and_stats(live_server):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "protoserve.server.cli",
            "generate",
            "--raw",
            "--prompt",
            PROMPT,
            "--temperature",
            "0",
            "--max-new-tokens",  # the old name of --max-tokens still works
            "8",
            "--no-progress",
            "--show-stats",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    # Same greedy text as the server gives for the same prompt.
    with live_server.sync_channel() as channel:
        response = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=8, temperature=0))
        )
    assert result.stdout == response.choices[0].text + "\n"
    assert "--- stats ---" in result.stderr and "generated tokens" in result.stderr
    assert "time to first token" in result.stderr


def test_a_prompt_is_a_user_message_on_a_model_with_a_chat_template(live_server):
    question = "What is the capital of France?"
    result = subprocess.run(
        [sys.executable, "-m", "protoserve.server.cli", "generate", "--prompt", question, "--temperature", "0",
         "--max-tokens", "8", "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    with live_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        sampling = pb.SamplingParams(max_tokens=8, temperature=0)
        chat = stub.Generate(
            pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=question)]),
                               sampling=sampling)
        )
        raw = stub.Generate(pb.GenerateRequest(prompt=question, sampling=sampling))
    assert result.stdout == chat.choices[0].text + "\n"
    assert chat.choices[0].text != raw.choices[0].text  # so the two paths are told apart


def test_generate_rejects_bad_parameters():
    result = subprocess.run(
        [sys.executable, "-m", "protoserve.server.cli", "generate", "--prompt", "x", "--top-p", "3", "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2 and "--top-p" in result.stderr
