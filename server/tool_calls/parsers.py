"""Finding tool calls in a model's output, as it streams or all at once, the same way both times.

A :class:`ToolCallParser` reads text in pieces (``feed``) and reports what it holds: plain content,
the start of a call (its name known), and pieces of a call's arguments, which are the JSON text the
model wrote for them, unchanged. A whole output is the same reading done in one piece
(:func:`parse_output`), so a streamed call always reassembles to the unary one.

The formats (:data:`FORMATS`) differ only in how calls are marked:

- ``hermes`` (Hermes, Qwen2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
  object per tag, tags repeated for parallel calls, text before them is content;
- ``smollm2`` (SmolLM2, the APIGen format it was trained on): one ``<tool_call>`` tag holding a JSON
  array of such objects, ``[]`` meaning no call;
- ``llama3_json`` (Llama 3.1+): the output itself is ``{"name": ..., "parameters": {...}}``, calls
  separated by ``;``, optionally after ``<|python_tag|>``; output that starts otherwise is content,
  and so is text after the calls.

Inside a call region the parser walks the JSON character by character (strings, escapes, nesting),
so it never needs the region to be complete to stream it. A region that holds no call at all (say
``<tool_call>hello</tool_call>``) is given back as content, tags included. Whitespace after a call
is content only where more content follows it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from protoserve.server.tool_calls.call import ToolCall, new_call_id

NAME_KEY = "name"


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family marks its calls in text."""

    name: str
    open_tag: str = ""  # empty: calls are bare JSON at the output's start (llama3_json)
    close_tag: str = ""
    arguments_keys: tuple[str, ...] = ("arguments", "parameters")
    arguments_key: str = "arguments"  # the key the model is told to write
    list_in_tag: bool = False  # one tag holds a JSON array of calls
    bare_prefix: str = ""  # a marker that may precede bare JSON calls


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
SMOLLM2 = ToolCallFormat("smollm2", "<tool_call>", "</tool_call>", list_in_tag=True)
LLAMA3_JSON = ToolCallFormat("llama3_json", arguments_key="parameters", bare_prefix="<|python_tag|>")
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, SMOLLM2, LLAMA3_JSON)}


@dataclass
class Content:
    """Text outside any call."""

    text: str


@dataclass
class CallStart:
    """A call whose name is now known; its arguments follow as :class:`CallArguments`."""

    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    """More of a call's argument text."""

    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class _Call:
    """A call object being read: what the walker has found of it so far."""

    name: str | None = None
    arguments: list[str] = field(default_factory=list)  # read before the name was known
    index: int = -1  # set when started
    saw_arguments: bool = False


class _CallObjectWalker:
    """Walks the JSON of a call region one character at a time, finding call objects' names and
    the raw text of their arguments.

    Call objects are the objects at ``call_depth`` (1 when the region is objects, 2 when it is an
    array of them). Inside one, each key is read whole; the value of ``name`` is decoded once its
    string closes; the value of an arguments key is passed on as it is read.
    """

    def __init__(
        self,
        fmt: ToolCallFormat,
        on_name: Callable[[_Call], None],
        on_arguments: Callable[[_Call, str], None],
        on_close: Callable[[_Call], None],
    ) -> None:
        self._fmt = fmt
        self._on_name = on_name
        self._on_arguments = on_arguments
        self._on_close = on_close
        self.depth = 0
        self.in_string = False
        self._escape = False
        self.call_depth = 0  # decided by the region's first container
        self._call: _Call | None = None
        self._key: list[str] | None = None  # chars of the key being read
        self._last_key = ""
        self._expect = "key"  # in a call object: "key", "colon", "value" or "comma"
        self._value_kind = ""  # "name", "arguments" or "other" while a value is read
        self._value_depth = 0
        self._value_chars: list[str] = []
        self._scalar = False
        self.broken = False  # the text stopped being JSON

    @property
    def at_top(self) -> bool:
        """Between top-level values: where a close tag or a separator may come."""
        return self.depth == 0 and not self.in_string

    def feed(self, ch: str) -> None:
        if self.broken:
            return
        in_call_value = self._call is not None and self._expect == "value"
        if in_call_value and self._value_kind:
            self._value_char(ch)
            return
        if self.in_string:
            self._string_char(ch)
            return
        if ch == '"':
            self.in_string = True
            if self._call is not None and self.depth == self.call_depth and self._expect == "key":
                self._key = []
            return
        if ch in "{[":
            if self.depth == 0 and self.call_depth == 0:
                self.call_depth = 1 if ch == "{" else 2
            self.depth += 1
            if ch == "{" and self.depth == self.call_depth:
                self._call = _Call()
                self._expect = "key"
            return
        if ch in "}]":
            if self.depth == 0:
                self.broken = True
                return
            if ch == "}" and self._call is not None and self.depth == self.call_depth:
                call, self._call = self._call, None
                self._on_close(call)
            self.depth -= 1
            return
        if self._call is not None and self.depth == self.call_depth:
            if ch == ":" and self._expect == "colon":
                self._expect = "value"
                self._value_kind = ""
                self._begin_value_wait()
            elif ch == "," and self._expect == "comma":
                self._expect = "key"
            elif not ch.isspace():
                self.broken = True

    # -- inside a call object -------------------------------------------------------------

    def _begin_value_wait(self) -> None:
        key = self._last_key
        if key == NAME_KEY:
            self._value_kind = "pending-name"
        elif key in self._fmt.arguments_keys:
            self._value_kind = "pending-arguments"
        else:
            self._value_kind = "pending-other"

    def _string_char(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self.in_string = False
            if self._key is not None:
                try:
                    self._last_key = json.loads('"' + "".join(self._key) + '"')
                except ValueError:
                    self._last_key = ""
                self._key = None
                self._expect = "colon"
                return
        if self._key is not None:
            self._key.append(ch)

    def _value_char(self, ch: str) -> None:
        kind = self._value_kind
        if kind.startswith("pending-"):
            if ch.isspace():
                return
            kind = self._value_kind = kind.removeprefix("pending-")
            self._value_depth = self.depth
            self._scalar = ch not in '{["'
            self._value_chars = []
        if self._scalar and not self.in_string and ch in ",}":
            self._end_value()
            self.feed(ch)  # the comma or brace belongs to the call object
            return
        self._track(ch)
        if kind == "arguments" and not self._scalar:
            self._on_arguments(self._call, ch)
        else:
            self._value_chars.append(ch)
        if not self._scalar and self.depth == self._value_depth and not self.in_string:
            self._end_value()

    def _track(self, ch: str) -> None:
        """Strings and nesting inside a value, so its end is found."""
        if self.in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _end_value(self) -> None:
        call, kind, text = self._call, self._value_kind, "".join(self._value_chars).strip()
        self._value_kind = ""
        self._expect = "comma"
        if call is None:
            return
        if kind == "name":
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            if isinstance(name, str) and name and call.name is None:
                call.name = name
                self._on_name(call)
        elif kind == "arguments":
            call.saw_arguments = True
            if self._scalar and text:
                self._on_arguments(call, text)


class ToolCallParser:
    """Reads one choice's output in pieces and reports content, call starts and argument text.

    ``max_calls`` (1 when the request forbids parallel calls) drops every call after that many.
    """

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self._max_calls = max_calls
        self._events: list[Event] = []
        self._pending = ""  # text not yet decided: a possible start of a tag, or held whitespace
        self._inside = False
        self._region: list[str] = []  # the current region's raw text, given back if it holds no call
        self._region_calls = 0
        self._walker: _CallObjectWalker | None = None
        self._started = 0  # calls started over the whole output
        self._decided_bare = False  # llama3_json: whether the output's start was looked at
        self._held_space = ""  # whitespace after a region, content only if more content follows

    # -- public -------------------------------------------------------------------------

    @property
    def calls_started(self) -> int:
        return self._started

    def feed(self, text: str) -> list[Event]:
        """Events for this piece of output (possibly none: a tag may be half-written)."""
        self._pending += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """Events for what was held back, at the end of the output."""
        self._advance(final=True)
        if self._inside:
            self._close_region(final=True)
        if self._pending:
            self._content(self._pending)
            self._pending = ""
        return self._take()

    # -- outside regions ------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        while self._pending:
            if self._inside:
                if not self._advance_inside(final):
                    return
                continue
            if not self.fmt.open_tag:
                if not self._advance_bare(final):
                    return
                continue
            tag = self.fmt.open_tag
            at = self._pending.find(tag)
            if at >= 0:
                self._content(self._pending[:at])
                self._pending = self._pending[at + len(tag) :]
                self._open_region()
                continue
            keep = 0 if final else _partial_suffix(self._pending, tag)
            self._content(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return

    def _advance_bare(self, final: bool) -> bool:
        """llama3_json: the output is calls if it starts with ``{`` (after an optional marker)."""
        if self._decided_bare:
            self._content(self._pending)
            self._pending = ""
            return False
        stripped = self._pending.lstrip()
        prefix = self.fmt.bare_prefix
        if not stripped or (prefix.startswith(stripped) and not final):
            if final:
                self._content(self._pending)
                self._pending = ""
            return False
        self._decided_bare = True
        if prefix and stripped.startswith(prefix):
            stripped = stripped[len(prefix) :]
        elif not stripped.startswith("{"):
            return True  # content, from here to the end
        self._pending = stripped
        self._open_region()
        return True

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._started:
            # Whitespace between or after calls is content only if more content follows it. Every
            # piece's trailing whitespace is held, so the decision is the same however the text
            # was cut into pieces (a stream's content equals the unary one).
            body = text.rstrip()
            if not body:
                self._held_space += text
                return
            text, self._held_space = self._held_space + body, text[len(body) :]
        self._events.append(Content(text))

    # -- inside a region --------------------------------------------------------------------

    def _open_region(self) -> None:
        self._inside = True
        self._region = []
        self._region_calls = 0
        self._walker = _CallObjectWalker(self.fmt, self._named, self._arguments, self._closed)

    def _advance_inside(self, final: bool) -> bool:
        walker = self._walker
        close = self.fmt.close_tag
        i = 0
        text = self._pending
        while i < len(text):
            if close and walker.at_top and text[i] == close[0]:
                rest = text[i:]
                if rest.startswith(close):
                    self._region.append(text[:i])
                    self._pending = text[i + len(close) :]
                    self._close_region(final=False)
                    return True
                if close.startswith(rest) and not final:
                    self._region.append(text[:i])
                    self._pending = rest
                    return False
            if not close and walker.at_top:
                if text[i] == ";":
                    i += 1
                    continue
                if walker.call_depth and not text[i].isspace() and text[i] != "{":
                    # Bare calls have no close tag: they end where text that starts no call begins,
                    # and that text is content, not lost inside the region.
                    self._region.append(text[:i])
                    self._pending = text[i:]
                    self._close_region(final=False)
                    return True
            walker.feed(text[i])
            i += 1
        self._region.append(text)
        self._pending = ""
        return False

    def _close_region(self, final: bool) -> None:
        self._inside = False
        region = "".join(self._region)
        if not self._region_calls and not _is_empty_list(region):
            # Nothing in it was a call: it is content after all, tags and all.
            tail = self.fmt.close_tag if not final and self.fmt.close_tag else ""
            self._content(self.fmt.open_tag + region + tail)
        self._region = []
        self._walker = None

    def _named(self, call: _Call) -> None:
        self._region_calls += 1
        if self._max_calls is not None and self._started >= self._max_calls:
            return  # past the request's limit: read, and dropped
        call.index = self._started
        self._started += 1
        self._events.append(CallStart(call.index, new_call_id(), call.name or ""))
        if call.arguments:
            self._events.append(CallArguments(call.index, "".join(call.arguments)))
            call.arguments = []

    def _arguments(self, call: _Call, text: str) -> None:
        if call.index >= 0:
            self._events.append(CallArguments(call.index, text))
        elif call.name is None:
            call.arguments.append(text)  # arguments written before the name: held until it comes

    def _closed(self, call: _Call) -> None:
        if call.index >= 0 and not call.saw_arguments:
            self._events.append(CallArguments(call.index, "{}"))

    def _take(self) -> list[Event]:
        events, self._events = _merged(self._events), []
        return events


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent content, and adjacent argument text of one call, as one event each."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Content) and isinstance(last, Content):
            last.text += event.text
        elif (
            isinstance(event, CallArguments) and isinstance(last, CallArguments) and last.index == event.index
        ):
            last.text += event.text
        else:
            out.append(event)
    return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a start of ``tag`` (held until it is decided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _is_empty_list(region: str) -> bool:
    try:
        return json.loads(region) == []
    except ValueError:
        return False


@dataclass
class ParsedOutput:
    """A whole output: its content (None when it is only calls) and its calls in order."""

    content: str | None
    tool_calls: list[ToolCall]


def collect(
    events: list[Event], calls: dict[int, list[str]], names: dict[int, tuple[str, str]], content: list[str]
) -> None:
    """Fold events into the pieces of a :class:`ParsedOutput` (used whole and by streams that keep one)."""
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            names[event.index] = (event.id, event.name)
            calls[event.index] = []
        else:
            calls[event.index].append(event.text)


def parsed(
    calls: dict[int, list[str]], names: dict[int, tuple[str, str]], content: list[str]
) -> ParsedOutput:
    text = "".join(content)
    tool_calls = [ToolCall(names[i][0], names[i][1], "".join(calls[i])) for i in sorted(calls)]
    if tool_calls and not text.strip():
        return ParsedOutput(None, tool_calls)
    return ParsedOutput(text, tool_calls)


def parse_output(text: str, fmt: ToolCallFormat, max_calls: int | None = None) -> ParsedOutput:
    """The content and calls of a whole output."""
    parser = ToolCallParser(fmt, max_calls)
    calls: dict[int, list[str]] = {}
    names: dict[int, tuple[str, str]] = {}
    content: list[str] = []
    collect(parser.feed(text) + parser.finish(), calls, names, content)
    return parsed(calls, names, content)


class StreamedOutput:
    """One choice's events as a stream sends them, adding up to what :func:`parse_output` gives the
    whole output: whitespace-only content is held back while no other content has gone out, and
    dropped at the end when the choice called tools (the whole output's content is None then)."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None) -> None:
        self.parser = ToolCallParser(fmt, max_calls)
        self._held = ""
        self._text_sent = False

    def feed(self, text: str, finished: bool) -> list[Event]:
        """The events of the next piece of output (``finished``: it is the last)."""
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        out: list[Event] = []
        for event in events:
            if isinstance(event, Content) and not self._text_sent:
                self._held += event.text
                if not self._held.strip():
                    continue
                event, self._held, self._text_sent = Content(self._held), "", True
            out.append(event)
        if finished and self._held and not self.parser.calls_started:
            out.append(Content(self._held))
        return out
