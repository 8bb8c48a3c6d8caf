"""The contract's tooling: buf lint and breaking checks, and the generated-code staleness check."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "node_modules" / ".bin" / "buf"

pytestmark = pytest.mark.skipif(not BUF.exists(), reason="buf is installed by `make install` (npm ci)")


def _copy_contract(dst: Path) -> None:
    for name in ("proto", "third_party"):
        shutil.copytree(ROOT / name, dst / name)
    shutil.copy(ROOT / "buf.yaml", dst / "buf.yaml")


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_buf_lint_is_clean() -> None:
    result = _run(BUF, "lint", cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_catches_an_undocumented_message(tmp_path: Path) -> None:
    _copy_contract(tmp_path)
    proto = tmp_path / "proto/protoserve/v1/inference.proto"
    proto.write_text(proto.read_text() + "\nmessage Undocumented {\n  string x = 1;\n}\n")
    result = _run(BUF, "lint", cwd=tmp_path)
    assert result.returncode != 0
    assert "Undocumented" in result.stdout


def test_buf_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    before, after = tmp_path / "before", tmp_path / "after"
    _copy_contract(before)
    _copy_contract(after)
    proto = after / "proto/protoserve/v1/inference.proto"
    text = proto.read_text()
    renumbered = text.replace("  int32 min_tokens = 2;", "  int32 min_tokens = 42;")
    assert renumbered != text
    proto.write_text(renumbered)
    result = _run(BUF, "breaking", after, "--against", before, cwd=tmp_path)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "min_tokens" in result.stdout or '"2"' in result.stdout, result.stdout + result.stderr
    # An additive change is not breaking: the check is not simply failing on any difference.
    proto.write_text(text + "\n// A new message.\nmessage Added {\n  // A field.\n  string x = 1;\n}\n")
    result = _run(BUF, "breaking", after, "--against", before, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _breaks_release(root: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``buf breaking`` of the protos under ``root`` against the committed released contract, as make lint runs it."""
    image = tmp_path / f"{root.name}.binpb"
    built = _run(BUF, "build", "-o", image, cwd=root)
    assert built.returncode == 0, built.stdout + built.stderr
    return _run(BUF, "breaking", image, "--against", ROOT / "proto/baseline/protoserve.binpb",
                "--config", "buf.yaml", cwd=root)


def test_the_protos_keep_the_released_contract(tmp_path: Path) -> None:
    result = _breaks_release(ROOT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # Against the release, not the previous commit: a field the release has, deleted, is caught.
    changed = tmp_path / "changed"
    _copy_contract(changed)
    proto = changed / "proto/protoserve/v1/inference.proto"
    text = proto.read_text()
    assert text.count("  optional float min_p = 6;\n") == 1
    proto.write_text(text.replace("  optional float min_p = 6;\n", ""))
    result = _breaks_release(changed, tmp_path)
    assert result.returncode != 0 and '"min_p"' in result.stdout, result.stdout + result.stderr


def test_generated_code_is_current() -> None:
    result = _run("make", "--no-print-directory", "-s", "proto-check", cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_proto_check_fails_on_stale_generated_code(tmp_path: Path) -> None:
    stale = tmp_path / "gen"
    shutil.copytree(ROOT / "gen", stale)
    victim = stale / "python/protoserve/v1/inference_pb2.py"
    victim.write_text(victim.read_text() + "\n# hand edit\n")
    result = _run("make", "--no-print-directory", "-s", "proto-check", f"GEN={stale}", cwd=ROOT)
    assert result.returncode != 0
    assert "stale" in result.stderr
