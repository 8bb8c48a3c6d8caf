"""The ``protoserve`` command's flags: every one documented, --version, chat roles and --raw refused
as the API refuses them. Behaviour is checked on the real console script, as a subprocess."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from protoserve.server import exit_codes
from protoserve.server.cli import build_parser

pytestmark = pytest.mark.live  # each test runs the CLI in a process of its own

REPO = Path(__file__).resolve().parents[2]
PROTOSERVE = Path(sys.executable).with_name("protoserve")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PROTOSERVE), *args], cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )


def parsers(parser: argparse.ArgumentParser, path: str = "protoserve"):
    """(command path, parser) for the command and each of its subcommands."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_flag_of_every_command_has_help() -> None:
    undocumented = [
        f"{path}: {'/'.join(action.option_strings) or action.dest}"
        for path, parser in parsers(build_parser())
        for action in parser._actions
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS
    ]
    assert [path for path, _ in parsers(build_parser())] == [
        "protoserve",
        "protoserve serve",
        "protoserve generate",
        "protoserve models",
    ]
    assert not undocumented, undocumented


def test_version_is_the_package_metadata() -> None:
    done = run_cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"protoserve {importlib.metadata.version('protoserve')}\n"


@pytest.mark.parametrize("message", ["bogus:hi", ":hi", "User:hi"])
def test_an_unknown_chat_role_is_one_line_and_exit_2(message: str) -> None:
    done = run_cli("generate", "--message", message, "--no-progress")
    assert done.returncode == exit_codes.USAGE, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("protoserve: ") and "Traceback" not in done.stderr
    assert message in line and "system, user, assistant, tool" in line
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--raw", "--message", "user:hi"], "--raw"),
        (["--raw", "--chat", "--prompt", "hi"], "--chat: not allowed with argument --raw"),
    ],
)
def test_raw_with_chat_input_is_refused(args: list[str], needle: str) -> None:
    done = run_cli("generate", *args, "--no-progress")
    assert done.returncode == exit_codes.USAGE, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("protoserve") and needle in line


def test_max_tokens_and_its_old_name_are_one_flag() -> None:
    parse = build_parser().parse_args
    assert parse(["generate", "--max-tokens", "5"]).max_tokens == 5
    assert parse(["generate", "--max-new-tokens", "7"]).max_tokens == 7
    done = run_cli("generate", "--max-tokens", "-2", "--prompt", "x", "--no-progress")
    assert done.returncode == exit_codes.USAGE and "--max-tokens" in done.stderr, done.stderr
