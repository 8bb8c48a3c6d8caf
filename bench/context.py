"""BenchContext: what every section's steps share (the profile and the run's nonce source)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.profile import Profile
from bench.resources import Variant
from bench.workload import NonceSource, PromptFactory


@dataclass
class BenchContext:
    """The run's profile and workload generators."""

    profile: Profile
    seed: int = 0
    nonces: NonceSource = field(default_factory=NonceSource)

    def factory(self, stream: int) -> PromptFactory:
        """A prompt factory for one workload: the same ``stream`` gives the same lengths and bodies
        (so every path gets the same workload), while nonces stay unique across the whole run."""
        return PromptFactory(self.nonces, seed=self.seed * 1_000_003 + stream)


def mode_label(deterministic: bool) -> str:
    """'det' for the batch-invariant kernels (the server's default), 'fast' for the library's own."""
    return "det" if deterministic else "fast"


def engine_label(variant: Variant, deterministic: bool) -> str:
    return f"{variant.label}.{mode_label(deterministic)}"
