"""GrammarCompiler: a Constraint turned into an llguidance matcher template, once per text and tokenizer.

llguidance builds a grammar's parser and lexer in the ``LLMatcher`` constructor
(with the GIL released); every sequence then starts from a ``deep_copy`` of that
pristine matcher, which costs microseconds. Compiled grammars, and the messages
of constraints that failed to compile, are kept in a bounded LRU keyed by a hash
of the constraint's kind and text. One compiler belongs to one engine, so one
tokenizer: the key needs no tokenizer part.

``compile`` may run on any thread (the engine's ``prepare`` runs on the caller's);
the cache is guarded by a lock, and the compile itself runs outside it.

A grammar that compiles may still admit no output at all (an empty language, a rule
that only refers to itself) or hit one of llguidance's limits on the text it forces
from the start (``root ::= "a" root``): a copy of the new matcher walks that forced
start, and either is refused here like a grammar that does not compile. Limits hit
later, on a path the model chose, are the engine's to report. The copies of one
template share its lexer, which a limit hit leaves broken: the engine ``forget``s a
template a sequence failed under, so the next request compiles afresh.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from protoserve.engine.sampling.constraints.constraint import Constraint, ConstraintKind
from protoserve.engine.tokenizer.tokenizer import Tokenizer

DEFAULT_CACHE_SIZE = 256
# JSON is generated compactly with the spacing models were trained on ("a": 1, "b": 2): flexible
# whitespace would let a small model pad the output with newlines until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
# Tokens of a grammar's forced start walked at compile time: every output begins with them, so a
# limit they hit would fail every request (a forced start past this is rare and cheap to follow).
PROBE_FORCED_TOKENS = 8


def parser_limits() -> LLParserLimits:
    """llguidance's default limits, with errors that name the problem but not the parser's state
    (which quotes the grammar and would reach clients and logs)."""
    return LLParserLimits(verbose_errors=False)


def matcher_error(matcher: LLMatcher) -> str:
    """A failed matcher's message: its first line (the rest is a marker of the state left out)."""
    lines = matcher.get_error().strip().splitlines()
    return lines[0] if lines else "the grammar engine failed without a message"


class ConstraintCompileError(Exception):
    """The grammar engine refused a constraint: ``field`` is ``constraint.<kind>``, the message its own."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: the matcher every sequence under it starts from."""

    key: str
    grammar: str  # llguidance's grammar definition (JSON) the template was built from
    template: LLMatcher
    compile_s: float

    def new_matcher(self) -> LLMatcher:
        """A fresh matcher at the grammar's start, for one sequence."""
        return self.template.deep_copy()


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0  # each one a compile
    failures: int = 0  # misses whose constraint did not compile


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching the results (successes and failures)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        # The mask must cover every logits column; ids past the tokenizer's vocabulary are never allowed.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar | ConstraintCompileError] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: LLTokenizer | None = None
        self.stats = CompileStats()

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (a quarter second for 49k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self._eos)
            return self._ll_tokenizer

    def cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint.cache_key in self._cache

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of ``constraint``; raises ConstraintCompileError with the engine's message."""
        key = constraint.cache_key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
        if found is None:
            found = self._compile(key, constraint)
            with self._lock:
                self.stats.misses += 1
                self.stats.failures += isinstance(found, ConstraintCompileError)
                # Two threads may have compiled the same text at once: keep the first, so callers share it.
                found = self._cache.setdefault(key, found)
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(found, ConstraintCompileError):
            raise found
        return found

    def _compile(self, key: str, constraint: Constraint) -> CompiledGrammar | ConstraintCompileError:
        started = time.perf_counter()
        try:
            grammar = grammar_definition(constraint)
        except ValueError as exc:
            return ConstraintCompileError(constraint.field, _clean(str(exc)))
        template = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            return ConstraintCompileError(constraint.field, _clean(template.get_error()))
        problem = self._forced_start_problem(template)
        if problem:
            return ConstraintCompileError(constraint.field, problem)
        return CompiledGrammar(key, grammar, template, time.perf_counter() - started)

    def _forced_start_problem(self, template: LLMatcher) -> str:
        """Why no output can follow the grammar, found on a copy walking the tokens every output starts
        with; empty when none is found."""
        probe = template.deep_copy()
        for taken in range(PROBE_FORCED_TOKENS + 1):
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(probe.compute_bitmask(), dtype=np.uint8),
                                                   bitorder="little")[: self.vocab_size])
            if probe.is_error():
                break
            if probe.is_stopped() or len(allowed) != 1 or taken == PROBE_FORCED_TOKENS:
                return ""
            if not probe.consume_token(int(allowed[0])):
                break
        reason = matcher_error(probe)
        if reason.startswith("NoExtension"):  # llguidance's word for "no byte may come next"
            return "no output can satisfy it: it matches no text"
        return f"the text every output must start with is beyond the grammar engine's limits ({reason})"

    def forget(self, constraint: Constraint) -> None:
        """Drop the constraint's compiled grammar (a sequence under it failed): the next use recompiles."""
        with self._lock:
            self._cache.pop(constraint.cache_key, None)


def grammar_definition(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint; ValueError for text its converters cannot read."""
    kind = constraint.kind
    if kind == ConstraintKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if kind == ConstraintKind.JSON_SCHEMA:
        return LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_OPTIONS)
    if kind == ConstraintKind.REGEX:
        return LLMatcher.grammar_from_regex(constraint.text)
    if kind == ConstraintKind.GRAMMAR:
        return llguidance.grammar_from("gbnf", constraint.text)
    if kind == ConstraintKind.LARK:
        return llguidance.grammar_from("lark", constraint.text)
    if kind == ConstraintKind.CHOICE:
        return llguidance.grammar_from("choice", json.dumps(list(constraint.choices)))
    raise ValueError(f"unknown constraint kind {kind!r}")


def _clean(message: str) -> str:
    """The engine's message without the trailing blank lines its source excerpts end with."""
    return message.strip() or "the grammar engine refused it without a message"
