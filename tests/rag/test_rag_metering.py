"""The pure parts of metering RAG and embeddings: token charges, per-key quota fields, usage, sizes.

No server: the limiter runs on a fake clock, and sizes are checked against the strings they predict.
"""

from __future__ import annotations

import grpc
import pytest

from protoserve.server import errors
from protoserve.server.observability.usage import UsageLedger
from protoserve.server.rag.records import ChunkHit, stored_size
from protoserve.server.rag.service import NO_SOURCES, context_size, context_text
from protoserve.server.security.auth import Authenticator
from protoserve.server.security.rate_limit import Limits, RateLimiter, load_key_limits


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_charged_tokens_leave_the_bucket_and_never_come_back():
    identity = Authenticator(["key"]).identity_for("key", "")
    clock = FakeClock()
    limiter = RateLimiter(Limits(tpm=600), clock=clock)
    limiter.charge_tokens(identity, 500)
    with pytest.raises(errors.ServiceError) as raised:
        limiter.charge_tokens(identity, 200)  # 100 left
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.retry_after_s == pytest.approx(10.0)  # 100 more at 10 a second
    with pytest.raises(errors.ServiceError) as raised:
        limiter.charge_tokens(identity, 601)
    assert raised.value.retry_after_s is None  # more than a minute's allowance: waiting cannot help
    clock.now += 10.0
    limiter.charge_tokens(identity, 200)
    RateLimiter(Limits(), clock=clock).charge_tokens(identity, 10**9)  # no tpm: nothing to charge


def test_the_limits_file_takes_rag_quotas_per_key(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text('[keys."k"]\nrpm = 5\nrag_max_documents = 7\nrag_max_bytes = 0\n\n[keys."j"]\ntpm = 9\n')
    limits = load_key_limits(path, Limits(rpm=1))
    assert limits["k"] == Limits(rpm=5, rag_max_documents=7, rag_max_bytes=0)
    assert limits["j"] == Limits(rpm=1, tpm=9)  # the server's --rag-key-max-* hold for it
    for body, message in (
        ('[keys."k"]\nrag_max_bytes = -1\n', "rag_max_bytes must be a whole number >= 0"),
        ('[keys."k"]\nrag_max_byte = 1\n', "unknown fields ['rag_max_byte']"),
    ):
        path.write_text(body)
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_key_limits(path)


def test_usage_can_add_tokens_to_a_request_counted_elsewhere():
    ledger = UsageLedger()
    ledger.record("me", 12, 0)  # an Embed call
    ledger.record("me", 5, 0, requests=0)  # a retrieve-and-generate's query; its call counts itself
    ledger.record("me", 30, 8)  # that call's generation
    usage = ledger.snapshot("me")["me"]
    assert (usage.requests, usage.input_tokens, usage.output_tokens) == (2, 47, 8)


def hit(document_id: str, text: str) -> ChunkHit:
    return ChunkHit(document_id, 0, 0, len(text), text, 0.5, {})


@pytest.mark.parametrize(
    "hits",
    [[], [hit("a", "short")], [hit("dökümän", "Zürich 日本語 😀"), hit("b", "x" * 300), hit("c", "")]],
)
def test_context_size_is_the_built_contexts_size(hits):
    assert context_size(hits) == len(context_text(hits).encode("utf-8"))
    assert context_text([]) == NO_SOURCES


def test_stored_size_counts_text_metadata_chunk_copies_and_vectors():
    text = "héllo wörld"  # 13 UTF-8 bytes
    size = stored_size(text, {"lang": "dé"}, ["héllo", "llo wörld"], dimensions=384)
    assert size == 13 + (4 + 3) + (6 + 10) + 2 * 384 * 4
