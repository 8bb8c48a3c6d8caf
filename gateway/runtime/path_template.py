"""google.api.http path templates: parsing and matching request paths.

Grammar (from google/api/http.proto)::

    Template = "/" Segments [ Verb ] ;
    Segments = Segment { "/" Segment } ;
    Segment  = "*" | "**" | LITERAL | Variable ;
    Variable = "{" FieldPath [ "=" Segments ] "}" ;
    FieldPath = IDENT { "." IDENT } ;
    Verb     = ":" LITERAL ;

Matching runs on the raw (still percent-encoded) path so that an encoded
``%2F`` inside a single-segment variable cannot shift segment boundaries;
captured values are decoded afterwards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LITERAL = re.compile(r"[^/{}=*:]+")
# One path segment, and one or more segments (``**``), on the raw path.
_ONE = r"[^/]+"
_MANY = r"[^/]+(?:/[^/]+)*"


@dataclass(frozen=True, slots=True)
class Variable:
    """A ``{field.path=pattern}`` capture; ``pattern`` is the segments it spans."""

    field_path: str
    pattern: tuple[str, ...]


@dataclass(frozen=True)
class PathTemplate:
    """A parsed path template that matches raw request paths."""

    template: str
    # Each segment is a literal string, "*", "**" or a Variable.
    segments: tuple[str | Variable, ...]
    verb: str = ""
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = []
        for index, segment in enumerate(self.segments):
            if isinstance(segment, Variable):
                parts.append(f"(?P<v{index}>{_segments_regex(segment.pattern)})")
            else:
                parts.append(_segments_regex((segment,)))
        verb = re.escape(":" + self.verb) if self.verb else ""
        object.__setattr__(self, "_regex", re.compile("^/" + "/".join(parts) + verb + "$"))

    @classmethod
    def parse(cls, template: str) -> PathTemplate:
        """Parse ``template``; raises ValueError naming the problem."""
        if not template.startswith("/"):
            raise ValueError(f"path template {template!r} must start with '/'")
        parser = _Parser(template)
        segments = parser.segments(top_level=True)
        verb = ""
        if parser.peek(":"):
            parser.pos += 1
            verb = parser.literal()
        if parser.pos != len(template):
            raise ValueError(f"path template {template!r}: unexpected {template[parser.pos :]!r}")
        flat = [part for s in segments for part in (s.pattern if isinstance(s, Variable) else (s,))]
        if "**" in flat[:-1]:
            raise ValueError(f"path template {template!r}: '**' must be the last segment")
        names = [s.field_path for s in segments if isinstance(s, Variable)]
        if len(names) != len(set(names)):
            raise ValueError(f"path template {template!r} binds a field twice")
        return cls(template, tuple(segments), verb)

    @property
    def variables(self) -> tuple[Variable, ...]:
        """The captures, in path order."""
        return tuple(s for s in self.segments if isinstance(s, Variable))

    @property
    def literal_prefix(self) -> tuple[str, ...]:
        """Leading literal segments; the router uses them to guess which API an unknown path meant."""
        prefix = []
        for segment in self.segments:
            if isinstance(segment, Variable) or segment in ("*", "**"):
                break
            prefix.append(segment)
        return tuple(prefix)

    @property
    def specificity(self) -> tuple[int, int]:
        """Sort key: templates with more literal segments (then fewer wildcards) win a tie."""
        literals = sum(1 for s in self.segments if isinstance(s, str) and s not in ("*", "**"))
        return (literals + (1 if self.verb else 0), -len(self.variables))

    def openapi_path(self) -> str:
        """The template in OpenAPI form: every variable as ``{field.path}``."""
        parts = [f"{{{s.field_path}}}" if isinstance(s, Variable) else s for s in self.segments]
        return "/" + "/".join(parts) + (":" + self.verb if self.verb else "")

    def match(self, raw_path: str) -> dict[str, str] | None:
        """Field path → decoded value for a matching raw path, else None."""
        found = self._regex.match(raw_path)
        if found is None:
            return None
        values = {}
        for index, segment in enumerate(self.segments):
            if isinstance(segment, Variable):
                values[segment.field_path] = unquote(found.group(f"v{index}"))
        return values


def _segments_regex(pattern: tuple[str, ...]) -> str:
    parts = []
    for segment in pattern:
        parts.append(_ONE if segment == "*" else _MANY if segment == "**" else re.escape(segment))
    return "/".join(parts)


class _Parser:
    """Recursive-descent parser over the template string."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 1  # after the leading "/"

    def peek(self, char: str) -> bool:
        return self.text.startswith(char, self.pos)

    def fail(self, what: str) -> ValueError:
        return ValueError(f"path template {self.text!r}: {what} at offset {self.pos}")

    def literal(self) -> str:
        found = _LITERAL.match(self.text, self.pos)
        if not found:
            raise self.fail("expected a literal")
        self.pos = found.end()
        return found.group()

    def segments(self, top_level: bool) -> list[str | Variable]:
        result: list[str | Variable] = [self.segment(top_level)]
        while self.peek("/"):
            self.pos += 1
            result.append(self.segment(top_level))
        return result

    def segment(self, top_level: bool) -> str | Variable:
        if self.peek("**"):
            self.pos += 2
            return "**"
        if self.peek("*"):
            self.pos += 1
            return "*"
        if self.peek("{"):
            if not top_level:
                raise self.fail("variables cannot nest")
            return self.variable()
        return self.literal()

    def variable(self) -> Variable:
        self.pos += 1  # "{"
        names = [self.ident()]
        while self.peek("."):
            self.pos += 1
            names.append(self.ident())
        pattern: tuple[str, ...] = ("*",)
        if self.peek("="):
            self.pos += 1
            pattern = tuple(str(s) for s in self.segments(top_level=False))
        if not self.peek("}"):
            raise self.fail("expected '}'")
        self.pos += 1
        return Variable(".".join(names), pattern)

    def ident(self) -> str:
        found = _IDENT.match(self.text, self.pos)
        if not found:
            raise self.fail("expected a field name")
        self.pos = found.end()
        return found.group()
