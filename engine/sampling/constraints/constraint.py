"""Constraint: what a request's output must match, as plain data (no grammar engine here).

A request carries at most one, in ``SamplingParams.constraint``, so the ``n``
choices of a request share it (each with its own matcher). ``validate`` checks
its shape; whether the text compiles is decided by the grammar engine when the
engine prepares the request, and both report on the field ``constraint.<kind>``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ConstraintKind(StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # text: a JSON Schema, as JSON
    REGEX = "regex"  # text: a regular expression the whole output must match (Rust regex syntax)
    GRAMMAR = "grammar"  # text: a GBNF grammar (llama.cpp's format; Lark is accepted too), rule "root" first
    CHOICE = "choice"  # choices: the output is exactly one of these strings
    LARK = "lark"  # text: a grammar in llguidance's Lark dialect (rule "start" first; %json embeds a schema)


@dataclass(frozen=True)
class Constraint:
    """One output constraint: a kind plus its text (or, for ``choice``, its strings).

    Build with the classmethods (``Constraint.json_schema({...})``) or directly;
    frozen, so a request's choices and the compile cache can share it safely.
    """

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A plain string names the kind too ("regex"); an unknown one is left for validate() to report.
        if not isinstance(self.kind, ConstraintKind) and self.kind in {k.value for k in ConstraintKind}:
            object.__setattr__(self, "kind", ConstraintKind(self.kind))
        object.__setattr__(self, "choices", tuple(self.choices))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> Constraint:
        """A schema as JSON text or a dict (dumped keeping its key order: properties are generated in it)."""
        return cls(ConstraintKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def grammar(cls, gbnf: str) -> Constraint:
        return cls(ConstraintKind.GRAMMAR, gbnf)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        return cls(ConstraintKind.LARK, grammar)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> Constraint:
        return cls(ConstraintKind.CHOICE, choices=tuple(choices))

    @property
    def field(self) -> str:
        """The request field problems with this constraint are reported on."""
        return f"constraint.{self.kind}"

    @property
    def cache_key(self) -> str:
        """Hash of kind and text: equal constraints compile once."""
        body = json.dumps(list(self.choices)) if self.kind == ConstraintKind.CHOICE else self.text
        return hashlib.sha256(f"{self.kind}\0{body}".encode("utf-8", "surrogatepass")).hexdigest()

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for a malformed constraint; empty when its shape is right."""
        try:
            kind = ConstraintKind(self.kind)
        except ValueError:
            kinds = ", ".join(k.value for k in ConstraintKind)
            return [("constraint", f"unknown kind {self.kind!r}; one of {kinds}")]
        field = f"constraint.{kind.value}"
        if kind == ConstraintKind.CHOICE:
            if self.text:
                return [(field, "takes its strings in choices, not text")]
            if not self.choices:
                return [(field, "must list at least one string")]
            if any(not isinstance(c, str) or c == "" for c in self.choices):
                return [(field, "every choice must be a non-empty string")]
            return []
        if self.choices:
            return [(field, "only a choice constraint takes choices")]
        if kind == ConstraintKind.JSON_OBJECT:
            return [(field, "takes no text")] if self.text else []
        if not self.text:
            return [(field, "must not be empty")]
        if kind == ConstraintKind.JSON_SCHEMA:
            return _schema_problems(self.text, field)
        return []


def _schema_problems(text: str, field: str) -> list[tuple[str, str]]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        return [(field, f"is not valid JSON: {exc}")]
    if not isinstance(schema, dict | bool):
        return [(field, f"must be a JSON object (or true/false), not {type(schema).__name__}")]
    return []
