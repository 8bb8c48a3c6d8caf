"""Every example in README.md and docs/ that calls a server runs here, against the live server, and gives
the kind of answer its page describes.

A fenced ``bash`` or ``python`` block that calls the default addresses (http://127.0.0.1:8000, or
'127.0.0.1:50051' given to a client) is an example; it runs as written, with only the addresses moved to the test server's ports and ``.venv/bin/python``
to this interpreter. Each needs a check below, found by a phrase of its text: a new example without one
fails, so none goes stale unrun.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ADDRESSES = ("http://127.0.0.1:8000", "'127.0.0.1:50051'")  # as a call names them, not as prose does
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if any(address in match.group(2) for address in ADDRESSES):
                line = text.count("\n", 0, match.start()) + 1
                found.append(Example(page.relative_to(REPO).as_posix(), line, match.group(1), match.group(2)))
    return found


def _leading_json(output: str) -> tuple[dict, str]:
    value, end = json.JSONDecoder().raw_decode(output.lstrip())
    return value, output.lstrip()[end:]


def check_first_call(output: str) -> None:
    """README's first call: a chat completion over curl, then a completion from the Python client."""
    reply, rest = _leading_json(output)
    assert "Paris" in reply["choices"][0]["message"]["content"], reply
    assert "Paris" in rest, rest


def check_openai_stream(output: str) -> None:
    """The openai client's streamed chat: the reply's text, printed as it arrives."""
    assert output.strip(), "the stream printed nothing"


def check_agent_run(output: str) -> None:
    """The agent example: the forced calculator call computes 17 * 23, and the run answers."""
    events = [json.loads(line[len("data: "):]) for line in output.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    results = [e["tool_result"] for e in events if "tool_result" in e]
    assert results and not results[0].get("is_error"), json.dumps(events)
    assert "391" in results[0]["content"], results
    assert any("answer" in e for e in events), events


def check_responses_call(output: str) -> None:
    """The Responses API example: a second turn on previous_response_id answers with text."""
    assert output.strip(), "the second response printed no text"


def check_messages_call(output: str) -> None:
    """The Anthropic Messages example: the reply's text, why it stopped and its output tokens."""
    words = output.split()
    assert len(words) >= 3 and words[-2] in ("end_turn", "max_tokens") and int(words[-1]) > 0, output


def check_triton_infer(output: str) -> None:
    """The Open Inference example: tritonclient's greedy text_output, the prompt first (as vLLM's backend)."""
    assert output.startswith("The capital of France is") and "Paris" in output, output


CHECKS: dict[str, Callable[[str], None]] = {
    "What is the capital of France?": check_first_call,
    "client.chat.completions.create(": check_openai_stream,
    "/v1/agent/runs": check_agent_run,
    "client.responses.create(": check_responses_call,
    "client.messages.create(": check_messages_call,
    "triton.InferenceServerClient(": check_triton_infer,
}


def check_for(example: Example) -> Callable[[str], None]:
    matching = [check for phrase, check in CHECKS.items() if phrase in example.code]
    assert len(matching) == 1, f"{example.id}: an example needs exactly one check in {__file__}"
    return matching[0]


def test_the_pages_have_examples_and_each_has_a_check() -> None:
    found = examples()
    assert {e.page for e in found} >= {"README.md", "docs/usage.md", "docs/api.md"}, found
    for example in found:
        check_for(example)


@pytest.mark.parametrize("example", examples(), ids=lambda e: e.id)
def test_the_example_runs_and_answers_as_documented(example: Example, live_server) -> None:
    check = check_for(example)
    grpc_port = live_server.grpc_target.rsplit(":", 1)[1]
    code = (example.code.replace("127.0.0.1:8000", f"127.0.0.1:{live_server.http_port}")
            .replace("127.0.0.1:50051", f"127.0.0.1:{grpc_port}")
            .replace(".venv/bin/python", sys.executable))
    command = ["bash", "-euo", "pipefail", "-c", code] if example.language == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, f"{example.id} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    check(done.stdout)
