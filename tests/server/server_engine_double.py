"""A tiny in-memory stand-in for AsyncEngine, for server edge cases the real model cannot produce on demand.

It follows the AsyncEngine contract (errors at the first ``__anext__``, closing
the generator aborts (its final output going to ``on_abandoned``), ``abort()`` finishes the request with CANCELLED within one
step, KV blocks held per running request) with a byte-level tokenizer and a
"model" that echoes the prompt's bytes back. Tests of the real behaviour use the
real engine; this one exists for faults such as an unexpected exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from protoserve.engine.errors import (
    ContextLengthError,
    EngineStoppedError,
    InvalidRequestError,
    QueueFullError,
)
from protoserve.engine.lora.stack import AdapterStack
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.request import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    RequestStats,
    TokenizedRequest,
)
from protoserve.engine.sampling.sampling_params import ContextPolicy
from protoserve.engine.stats import EngineStats
from protoserve.engine.tokenizer.special_text import SpecialText

EOS = 256


class ByteTokenizer:
    """Token id = byte value; 256 is EOS."""

    vocab_size = 257
    has_chat_template = True
    chat_template = None  # its template is apply_chat_template below; no tool-call format to read

    max_token_span_bytes = 1
    special_text = SpecialText(None, ())  # no special tokens: nothing to protect

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    encode_unlocked = encode

    def fewest_tokens(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class EngineDouble:
    """Generates the prompt's bytes back, one token per ``step_s``, holding one KV block per running request."""

    def __init__(
        self, *, step_s: float = 0.01, max_running: int = 2, max_queue: int = 2, max_model_len: int = 64
    ):
        self.model_name = "double"
        self.tokenizer = ByteTokenizer()
        self.model_config = ModelConfig(
            architecture="llama",
            vocab_size=257,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
        )
        self.max_model_len = max_model_len
        self.adapters: AdapterStack | None = None  # serves no LoRA adapters
        self.step_s = step_s
        self.max_running = max_running
        self.max_queue = max_queue
        self.fail_with: BaseException | None = None  # raised by the next generate()
        self.fail_after_first: BaseException | None = None  # raised by the next generate() after one output
        self.kv_blocks_total = 8
        self._running: set[str] = set()
        self._waiting: list[str] = []
        self._aborted: set[str] = set()
        self._stopped = False
        self.submitted: list[TokenizedRequest] = []

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        self._stopped = True

    def stats(self) -> EngineStats:
        used = len(self._running)
        return EngineStats(
            running=used,
            waiting=len(self._waiting),
            kv_blocks_total=self.kv_blocks_total,
            kv_blocks_free=self.kv_blocks_total - used,
            kv_usage=used / self.kv_blocks_total,
        )

    def abort(self, request_id: str) -> bool:
        if request_id in self._running or request_id in self._waiting:
            self._aborted.add(request_id)
            return True
        return False

    async def generate(
        self, request: TokenizedRequest, *, on_abandoned: Callable[[RequestOutput], None] | None = None
    ) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        if self._stopped:
            raise EngineStoppedError("stopped")
        if self.fail_with is not None:
            exc, self.fail_with = self.fail_with, None
            raise exc
        bad = request.sampling.validate(self.tokenizer.vocab_size)
        if bad:
            raise InvalidRequestError(bad)
        budget = len(request.prompt_token_ids) + (request.sampling.max_tokens or 0)
        if request.context_policy is ContextPolicy.REJECT and budget > self.max_model_len:
            raise ContextLengthError(budget, self.max_model_len, f"{budget} tokens do not fit")
        if len(self._running) >= self.max_running and len(self._waiting) >= self.max_queue:
            raise QueueFullError(len(self._waiting), retry_after_s=0.5)
        self.submitted.append(request)
        self._waiting.append(rid)
        n = request.sampling.n
        produced, ended = 0, False
        try:
            while len(self._running) >= self.max_running and rid not in self._aborted:
                await asyncio.sleep(self.step_s)
            self._waiting.remove(rid)
            self._running.add(rid)
            limit = request.sampling.max_tokens or self.max_model_len - len(request.prompt_token_ids)
            while True:
                await asyncio.sleep(self.step_s)
                if rid in self._aborted:
                    deltas = [
                        CompletionDelta(i, "", [], finish_reason=FinishReason.CANCELLED) for i in range(n)
                    ]
                    ended = True
                    yield self._final(request, deltas, produced)
                    return
                token = request.prompt_token_ids[produced % len(request.prompt_token_ids)]
                produced += 1
                done = produced >= limit
                deltas = [
                    CompletionDelta(
                        i,
                        self.tokenizer.decode([token]),
                        [token],
                        finish_reason=FinishReason.LENGTH if done else None,
                    )
                    for i in range(n)
                ]
                if done:
                    ended = True
                    yield self._final(request, deltas, produced)
                    return
                yield RequestOutput(rid, deltas, num_prompt_tokens=len(request.prompt_token_ids))
                if self.fail_after_first is not None:
                    exc, self.fail_after_first = self.fail_after_first, None
                    raise exc
        finally:
            if not ended and on_abandoned is not None:  # the caller left: the abort's final output
                cancelled = [CompletionDelta(i, "", [], finish_reason=FinishReason.CANCELLED) for i in range(n)]
                on_abandoned(self._final(request, cancelled, produced))
            self._running.discard(rid)
            if rid in self._waiting:
                self._waiting.remove(rid)
            self._aborted.discard(rid)

    def _final(
        self, request: TokenizedRequest, deltas: list[CompletionDelta], produced: int
    ) -> RequestOutput:
        stats = RequestStats(
            prompt_tokens=len(request.prompt_token_ids), generated_tokens=produced * request.sampling.n
        )
        return RequestOutput(
            request.request_id,
            deltas,
            finished=True,
            num_prompt_tokens=len(request.prompt_token_ids),
            stats=dataclasses.replace(stats),
        )
