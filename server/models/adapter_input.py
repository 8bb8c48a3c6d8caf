"""What LoadAdapter and ``--lora NAME=PATH`` accept as a LoRA adapter's name and path: the one place
their rules live (the caps themselves are in server/limits.py).

A name is what OpenAI requests send as ``model`` and what every caller's /v1/models lists, so it
keeps to the characters of model ids (Hugging Face's ``org/name``, OpenAI's ``ft:base:org::id``):
letters, digits and ``. _ : - /``, each ``/``-separated part starting with a letter or digit. So no
part is empty, ``.`` or ``..``, and the name is one segment of ``DELETE /v1/adapters/{name}`` once
percent-encoded (as the openai client and curl's ``--data-urlencode`` encode ``/``).
"""

from __future__ import annotations

import re

from protoserve.server import errors
from protoserve.server.limits import MAX_ADAPTER_NAME_CHARS, MAX_ADAPTER_PATH_CHARS

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*(?:/[A-Za-z0-9][A-Za-z0-9._:-]*)*")
NAME_RULE = (f"1 to {MAX_ADAPTER_NAME_CHARS} characters of A-Z a-z 0-9 . _ : - and /, "
             "each /-separated part starting with a letter or digit")


def adapter_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter, or None."""
    if not name:
        return "is required"
    if len(name) > MAX_ADAPTER_NAME_CHARS:
        return f"is {len(name)} characters; an adapter name is {NAME_RULE}"
    if _NAME.fullmatch(name) is None:
        return f"{errors.echo(name)} is not a valid adapter name: {NAME_RULE}"
    return None


def adapter_path_problem(path: str) -> str | None:
    """Why ``path`` cannot name an adapter directory before it is looked at, or None."""
    if not path:
        return "is required"
    if len(path) > MAX_ADAPTER_PATH_CHARS:
        return f"is {len(path)} characters; a path is at most {MAX_ADAPTER_PATH_CHARS}"
    if "\x00" in path:
        return "contains a NUL character, which no file name can"
    return None


def adapter_load_problems(name: str, path: str) -> list[tuple[str, str]]:
    """(field, problem) pairs of a LoadAdapter's or a ``--lora``'s name and path."""
    found = (("name", adapter_name_problem(name)), ("path", adapter_path_problem(path)))
    return [(field, problem) for field, problem in found if problem is not None]
