"""The ``protoserve`` command's parser: one subcommand per command, each with its module's flags.

Importing it imports no torch and no server: a usage error or ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from typing import NoReturn

from protoserve.server import exit_codes
from protoserve.server.cli_flags import add_generate_flags
from protoserve.server.cli_models import add_models_flags
from protoserve.server.cli_serve_flags import add_serve_flags


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line; the usage is one ``--help`` away."""

    def error(self, message: str) -> NoReturn:
        self.exit(exit_codes.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, through the package metadata)."""
    try:
        return importlib.metadata.version("protoserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a package)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="protoserve", description="gRPC-first LLM inference server.")
    parser.add_argument(
        "--version", action="version", version=f"protoserve {_version()}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="serve, generate or models")

    add_serve_flags(sub.add_parser("serve", help="run the gRPC server (and the REST gateway when available)"))
    add_generate_flags(
        sub.add_parser("generate", help="generate from one prompt without a server, streaming to stdout")
    )
    add_models_flags(sub.add_parser("models", help="list the installed models (and a running server's)"))
    return parser
