"""Stop strings across token boundaries, stop tokens, and UTF-8-safe incremental detokenization."""

from __future__ import annotations

from protoserve.engine.request import FinishReason
from protoserve.engine.sampling.detokenizer import IncrementalDetokenizer
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.sampling.stop_checker import (
    StopStringMatcher,
    check_token_stop,
    longest_stop_prefix_suffix,
)


def feed(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], str | None]:
    out = []
    for c in chunks:
        text, stop = matcher.push(c)
        out.append(text)
        if stop is not None:
            return out, stop
    out.append(matcher.flush())
    return out, None


def test_stop_string_across_tokens_is_cut_exactly():
    out, stop = feed(StopStringMatcher(["o w"]), ["Hel", "lo", " wor", "ld"])
    assert stop == "o w"
    assert "".join(out) == "Hell"


def test_possible_stop_prefix_is_held_back_until_ruled_out():
    m = StopStringMatcher(["END"])
    assert m.push("abcE") == ("abc", None)  # "E" might start "END"
    assert m.push("N") == ("", None)
    assert m.push("x") == ("ENx", None)  # ruled out: released
    assert m.push("yEN") == ("y", None)
    assert m.push("D and more") == ("", "END")


def test_earliest_stop_string_wins_and_text_after_is_dropped():
    out, stop = feed(StopStringMatcher(["cd", "b"]), ["a", "bcd", "e"])
    assert (("".join(out)), stop) == ("a", "b")
    out, stop = feed(StopStringMatcher(["zz"]), ["a", "b"])
    assert ("".join(out), stop) == ("ab", None)


def test_longest_stop_prefix_suffix():
    assert longest_stop_prefix_suffix("xxab", ["abc", "bq"]) == 2
    assert longest_stop_prefix_suffix("xxab", ["q"]) == 0
    assert longest_stop_prefix_suffix("a", ["aaaa"]) == 1


def test_token_stops_respect_min_tokens_and_ignore_eos():
    eos = frozenset({2})
    assert check_token_stop(2, 1, SamplingParams(), eos) == (FinishReason.STOP, None)
    assert check_token_stop(2, 1, SamplingParams(ignore_eos=True), eos) is None
    assert check_token_stop(2, 2, SamplingParams(min_tokens=2), eos) is None
    assert check_token_stop(2, 3, SamplingParams(min_tokens=2), eos) == (FinishReason.STOP, None)
    assert check_token_stop(7, 1, SamplingParams(stop_token_ids=[7]), eos) == (FinishReason.STOP, 7)
    assert check_token_stop(8, 1, SamplingParams(stop_token_ids=[7]), eos) is None


def test_detokenizer_never_splits_a_character():
    pieces = {0: b"caf", 1: b"\xc3", 2: b"\xa9 ", 3: b"\xf0\x9f", 4: b"\x98", 5: b"\x80!", 6: b"<eos>"}
    d = IncrementalDetokenizer(pieces.__getitem__, skip_token_ids=frozenset({6}))
    outs = [d.push(t) for t in (0, 1, 2, 3, 4, 5, 6)]
    assert outs == ["caf", "", "é ", "", "", "😀!", ""]
    assert d.flush() == ""
    d = IncrementalDetokenizer(pieces.__getitem__)
    assert d.push(3) == ""
    assert d.flush() == "\ufffd"


def test_detokenizer_replaces_invalid_bytes_without_stalling():
    d = IncrementalDetokenizer({0: b"\xff", 1: b"ok"}.__getitem__)
    assert d.push(0) + d.push(1) == "\ufffdok"
