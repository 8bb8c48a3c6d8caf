"""What callers hand the engine and what it streams back (plain data only)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from protoserve.engine.sampling.sampling_params import ContextPolicy, SamplingParams

if TYPE_CHECKING:
    from protoserve.engine.errors import EngineError
    from protoserve.engine.tracing import RequestTrace


@dataclass(frozen=True)
class Tenant:
    """Whom a request is served for, in the engine's fair scheduling (engine/scheduling/fair_share.py).

    ``identity`` is the caller; ``group`` the API key its identities share (the identity itself
    when there is no key), so one key with many user ids competes as one tenant, served in
    proportion to its ``weight``. The server derives all three from the authenticated caller.
    """

    identity: str = ""
    group: str = ""
    weight: int = 1


@dataclass
class TokenizedRequest:
    """One prompt to generate from, already tokenized: what any caller hands the engine.

    ``cache_salt`` keys the prefix cache: the server derives it from the
    authenticated identity so two identities never share cached KV blocks.
    ``trace``, when set, makes the engine record a span for the request under
    the caller's span (the step thread cannot see the caller's context).
    ``sampling_checked`` says the caller has run ``sampling.validate`` against
    this model's vocabulary and refused the request on any problem (the server
    does, to name the request's own fields), so the engine does not run it again.
    ``tenant`` is whom the request is served for: while tenants compete, the
    scheduler serves the least-served first (priorities order one identity's requests).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context_policy: ContextPolicy = ContextPolicy.ALLOW_CONTEXT_STOP
    priority: int = 0  # higher runs first among the tenant's requests; FCFS within a level
    cache_salt: bytes = b""
    tenant: Tenant = field(default_factory=Tenant)
    arrival_time: float = field(default_factory=time.monotonic)
    trace: RequestTrace | None = None
    sampling_checked: bool = False
    # The LoRA adapter (by name, see engine/lora) the request runs under; None: the base model.
    adapter: str | None = None
    # The caller's name for ``sampling.constraint``, which an error found while generating names
    # (a grammar-engine limit hit mid-output); empty: the engine's own ``constraint.<kind>``.
    constraint_field: str = ""


class FinishReason(StrEnum):
    """Why a choice ended."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    CANCELLED = "cancelled"  # abort(), client gone, deadline


@dataclass
class TokenLogprob:
    """Log probability of one token under the distribution sampled from."""

    token_id: int
    logprob: float


@dataclass
class PositionLogprobs:
    """The chosen token's logprob and the most likely alternatives, best first."""

    chosen: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass
class CompletionDelta:
    """New output of one choice since the previous RequestOutput.

    ``text`` never ends inside a UTF-8 character: bytes of an incomplete
    character are held back until the character is complete.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class Choice:
    """Everything one choice has produced so far: its deltas folded together."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class RequestStats:
    """Where a request's time went and what it held (seconds, tokens, blocks)."""

    queue_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    e2e_time_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0
    kv_blocks: int = 0  # most blocks held at once
    kv_bytes: int = 0
    preemptions: int = 0
    truncated_prompt_tokens: int = 0
    # Speculative decoding (all choices): verification steps with drafts, tokens drafted, drafts accepted.
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Seconds the request waited for its model to load (an idle-evicted model reloading), before arrival.
    model_load_s: float = 0.0
    # Seconds between consecutive steps that gave this request tokens (all choices together).
    inter_token_latencies_s: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0


@dataclass
class RequestOutput:
    """One update of a request: deltas of the choices that advanced this step."""

    request_id: str
    deltas: list[CompletionDelta]
    finished: bool = False
    num_prompt_tokens: int = 0
    stats: RequestStats | None = None  # set on the finishing output
    # Set on the finishing output of a request that failed while generating: it is the request's end
    # (the deltas are its output up to the failure and report no finish reason).
    error: EngineError | None = None
