"""`protoserve generate`: one-shot generation without a server, text on stdout, stats on stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

REPO = Path(__file__).resolve().parents[2]

PROMPT = "The three primary colours are"


def test_generate_streams_text_and_stats(live_server):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "generate",
            "--prompt",
            PROMPT,
            "--temperature",
            "0",
            "--max-new-tokens",
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


def test_generate_rejects_bad_parameters():
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "generate", "--prompt", "x", "--top-p", "3", "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2 and "--top-p" in result.stderr
