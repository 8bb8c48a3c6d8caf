"""When a choice stops: stop tokens, stop strings, length.

Stop strings are matched on decoded text, so they are found across token
boundaries. The output is cut just before the stop string (OpenAI's behaviour:
neither the stop string nor anything after it is returned), and text that could
still turn out to be the start of a stop string is held back until it is ruled out.
"""

from __future__ import annotations

from protoserve.engine.request import FinishReason
from protoserve.engine.sampling.sampling_params import SamplingParams


def check_token_stop(
    token_id: int, num_generated: int, sampling: SamplingParams, eos_token_ids: frozenset[int]
) -> tuple[FinishReason, int | None] | None:
    """Stop caused by the token just sampled (``num_generated`` includes it), or None.

    EOS ends with stop_reason None (OpenAI reports plain "stop"); a stop token id
    ends with that id. Neither may end a choice before ``min_tokens`` tokens.
    """
    if num_generated <= sampling.min_tokens:
        return None
    if not sampling.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP, None
    if token_id in sampling.stop_token_ids:
        return FinishReason.STOP, token_id
    return None


def longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


class StopStringMatcher:
    """Holds back text until no stop string can begin in it; reports the stop string that matched."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self.pending = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Feed new text; returns (text safe to emit, the stop string if one completed)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, None
        # Every possible match starts inside `pending`: earlier text was only released
        # once no stop string could start in it.
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.pending.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            out = self.pending[: best[0]]
            self.pending = ""
            return out, best[1]
        hold = longest_stop_prefix_suffix(self.pending, self.stops)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        """The choice ended for another reason: release what was held back."""
        out, self.pending = self.pending, ""
        return out
