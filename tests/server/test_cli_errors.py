"""Every user error of the ``protoserve`` command is one line on stderr and an exit code, never a traceback.

The real console script runs as a subprocess. Exit codes (server/exit_codes.py):
1 a model that does not load, 2 a bad flag or a file a flag names, 3 a port
that cannot be listened on. ``serve`` runs with ``--log-level warning`` where
it gets as far as starting, so its INFO records do not count as lines.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from protoserve.server import exit_codes

pytestmark = pytest.mark.live  # each test runs the CLI in a process of its own

REPO = Path(__file__).resolve().parents[2]
PROTOSERVE = Path(sys.executable).with_name("protoserve")
TIMEOUT_S = 180


def run_cli(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PROTOSERVE), *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def run_python(probe: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -c probe args`` in a fresh interpreter: what an import costs shows in its sys.modules."""
    return subprocess.run([sys.executable, "-c", probe, *args], cwd=REPO, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_one_line_error(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("protoserve"), done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("serve", "--port", "0", "--no-progress", "--log-level", "warning", *args)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Paths that are not loadable checkpoints, each named by what is wrong with it."""
    from protoserve.engine.loader.default_model import default_model_path

    root = tmp_path_factory.mktemp("bad-models")
    (root / "empty-dir").mkdir()
    (root / "garbage.gguf").write_bytes(b"\x00\x13\x37 not a model")
    (root / "header-only.gguf").write_bytes(b"GGUF\x03\x00")
    truncated = root / "truncated.gguf"
    with default_model_path().open("rb") as src, truncated.open("wb") as dst:
        shutil.copyfileobj(src, dst, 4 * 1024 * 1024)
        dst.truncate(4 * 1024 * 1024)  # the header parses; the tensors run past the end
    return {
        "nonexistent": root / "nonexistent.gguf",
        "directory": root / "empty-dir",
        "garbage": root / "garbage.gguf",
        "header-only": root / "header-only.gguf",
        "truncated": truncated,
    }


@pytest.mark.parametrize("kind", ["nonexistent", "directory", "garbage", "header-only", "truncated"])
def test_generate_with_a_bad_model_is_one_line_and_exit_1(bad_models: dict[str, Path], kind: str) -> None:
    path = bad_models[kind]
    done = run_cli("generate", "--model", str(path), "--prompt", "hi", "--no-progress")
    assert_one_line_error(done, exit_codes.MODEL_LOAD, "could not load the model:", str(path))
    assert done.stdout == ""


@pytest.mark.parametrize("kind", ["nonexistent", "directory", "garbage"])
def test_serve_with_a_bad_model_is_one_line_and_exit_1(bad_models: dict[str, Path], kind: str) -> None:
    path = bad_models[kind]
    done = serve("--no-http", "--model", str(path))
    assert_one_line_error(done, exit_codes.MODEL_LOAD, "could not load the model:", str(path))


def test_a_flag_the_model_cannot_take_is_a_load_error_naming_the_flag() -> None:
    # Valid on its own; only the loaded model's context window (8192) refuses it.
    done = run_cli("generate", "--max-model-len", "100000", "--prompt", "hi", "--no-progress")
    assert_one_line_error(done, exit_codes.MODEL_LOAD, "--max-model-len 100000 exceeds")


def test_serve_on_a_taken_grpc_port_is_one_line_and_exit_3(taken_port: int) -> None:
    done = run_cli("serve", "--port", str(taken_port), "--no-http", "--no-progress", "--log-level", "warning")
    assert_one_line_error(done, exit_codes.PORT_UNAVAILABLE, f"127.0.0.1:{taken_port} (gRPC)", "in use")
    assert "listening" not in done.stdout


def test_serve_on_a_taken_http_port_is_one_line_and_exit_3(taken_port: int) -> None:
    done = serve("--http-port", str(taken_port))
    assert_one_line_error(done, exit_codes.PORT_UNAVAILABLE, f"127.0.0.1:{taken_port} (HTTP)", "in use")
    assert "listening" not in done.stdout


def test_serve_on_a_taken_metrics_port_is_one_line_and_exit_3(taken_port: int) -> None:
    done = serve("--no-http", "--metrics-port", str(taken_port))
    assert_one_line_error(done, exit_codes.PORT_UNAVAILABLE, f"127.0.0.1:{taken_port} (metrics)")


def test_the_same_port_for_grpc_and_http_is_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = run_cli("serve", "--port", str(port), "--http-port", str(port), "--no-progress", "--log-level", "warning")
    assert_one_line_error(done, exit_codes.PORT_UNAVAILABLE, f"127.0.0.1:{port} (HTTP)")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (["serve", "--max-model-len", "-1"], "--max-model-len must be at least 2"),
        (["serve", "--max-queue", "0"], "--max-queue must be at least 1"),
        (["generate", "--max-kv-blocks", "0", "--prompt", "x"], "--max-kv-blocks must be at least 1"),
        (["serve", "--max-num-seqs", "many"], "--max-num-seqs"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--http-port", "-1"], "--http-port"),
        (["serve", "--dtype", "float16"], "--dtype"),
        (["serve", "--log-level", "chatty"], "--log-level"),
        (["serve", "--no-such-flag"], "--no-such-flag"),
        (["generate", "--top-p", "3", "--prompt", "x", "--no-progress"], "--top-p"),
        (["generate", "--message", "no-role", "--no-progress"], "ROLE:CONTENT"),
        ([], "required"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    assert_one_line_error(run_cli(*args), exit_codes.USAGE, needle)


@pytest.mark.parametrize(
    ("args", "code"),
    [(["--help"], 0), (["serve", "--help"], 0), (["serve", "--no-such-flag"], 2), (["serve", "--max-num-seqs", "0"], 2)],
)
def test_help_and_usage_errors_answer_without_loading_the_engine(args: list[str], code: int) -> None:
    # torch alone takes ~1.5 s to import: a typo must not wait for it.
    probe = (
        "import sys\nfrom protoserve.server import cli\n"
        "try:\n    code = cli.main(sys.argv[1:])\nexcept SystemExit as stop:\n    code = stop.code\n"
        "print('exit', code, 'torch' in sys.modules)"
    )
    done = run_python(probe, *args)
    assert done.stdout.splitlines()[-1] == f"exit {code} False", done.stdout[-2000:] + done.stderr[-2000:]


def test_serving_does_not_import_torch_compile() -> None:
    # torch._dynamo (torch.compile's tracer) takes 1-2 s to import, which every `serve` and
    # `generate` would pay at start; nothing on the serving path compiles anything. Imports and
    # both default models' loads, as `serve` does them.
    probe = (
        "import sys\nimport protoserve.server.app, protoserve.engine.async_engine, protoserve.gateway.app\n"
        "from protoserve.engine.embedding.model import EmbeddingModel\nfrom protoserve.engine.llm import LLM\n"
        "from protoserve.engine.loader.default_model import default_model_path\n"
        "EmbeddingModel.load()\nLLM(default_model_path())\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    done = run_python(probe)
    assert done.stdout.splitlines()[-1:] == ["[]"], done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_an_unreadable_api_keys_file_is_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "keys" if kind == "missing" else tmp_path
    done = serve("--no-http", "--api-keys-file", str(path))
    assert_one_line_error(done, exit_codes.USAGE, f"cannot read {path}")
    assert "listening" not in done.stdout


def test_the_cli_offers_exactly_the_dtypes_the_loader_takes() -> None:
    from protoserve.engine.loader.load import DTYPES as LOADER_DTYPES
    from protoserve.server.cli_flags import DTYPES

    assert set(DTYPES) == set(LOADER_DTYPES)
