"""The loader imports the model families, never the reverse at run time: no import cycle between
engine/loader and engine/models (the families name the loader's field readers for type checking only)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
LOADER = "protoserve.engine.loader"


def run_time_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each absolute import that runs, nested ones included; ``if TYPE_CHECKING:`` skipped."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            found.append((node.lineno, node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def loader_imports(source: str) -> list[tuple[int, str]]:
    return [(line, m) for line, m in run_time_imports(source) if m == LOADER or m.startswith(f"{LOADER}.")]


def test_the_check_sees_run_time_imports_and_skips_type_checking_ones() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from protoserve.engine.loader.hf_fields import HFFields\n"
        "from protoserve.engine.loader.load import load_model\n"
        "def f():\n    import protoserve.engine.loader.gguf\n"
    )
    assert loader_imports(source) == [(4, "protoserve.engine.loader.load"), (6, "protoserve.engine.loader.gguf")]


def test_the_models_import_the_loader_for_type_checking_only() -> None:
    files = sorted((ENGINE / "models").rglob("*.py"))
    assert len(files) > 20 and any(LOADER in path.read_text() for path in files)  # the families do name it
    offenders = [f"{path.relative_to(ENGINE.parent)}:{line} imports {module}"
                 for path in files for line, module in loader_imports(path.read_text())]
    assert not offenders, "engine/models must not import the loader at run time:\n" + "\n".join(offenders)


def test_the_loader_imports_the_families() -> None:
    imported = {m for path in (ENGINE / "loader").rglob("*.py") for _, m in run_time_imports(path.read_text())}
    assert any(m.startswith("protoserve.engine.models.families") for m in imported)
