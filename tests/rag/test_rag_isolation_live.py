"""RAG and embeddings between tenants, on a real server (auth on) over gRPC, the gateway and the openai client.

Issue #42's findings, each as its caller would meet it: embedding, index and search calls count
against the caller's rpm and tpm (an index call's every chunk token, overlap included, before
anything is embedded); RAG quotas hold per API key over all its user ids, with sizes that count
chunk texts and vectors; chunking caps refuse before embedding; a `{context}` placeholder repeated
10,000 times is refused by its size with the server's memory unmoved; and a 4 MiB index call whose
caller leaves after a second stops within two seconds and stores nothing.

One server for the module; every test uses its own API key, so buckets and quotas stay apart.
"""

from __future__ import annotations

import functools
import os
import random
import time

import grpc
import httpx
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protoserve.v1 import embeddings_pb2 as epb
from protoserve.v1 import embeddings_pb2_grpc, metrics_pb2, metrics_pb2_grpc, rag_pb2_grpc
from protoserve.v1 import rag_pb2 as rpb

KEYS = ("iso-rpm", "iso-tpm-embed", "iso-tpm-index", "iso-http", "iso-quota", "iso-quota-big", "iso-bytes",
        "iso-caps", "iso-context", "iso-abandon-grpc", "iso-abandon-http")  # fmt: skip
TPM_EMBED, TPM_INDEX, KEY_DOCUMENTS, BIG_KEY_DOCUMENTS, KEY_BYTES = 600, 700, 3, 6, 40_000


@pytest.fixture(scope="module")
def server(spawn_server, tmp_path_factory):
    directory = tmp_path_factory.mktemp("rag-isolation")
    (directory / "keys").write_text("\n".join(KEYS) + "\n")
    (directory / "limits.toml").write_text(
        '[keys."iso-rpm"]\nrpm = 3\n\n'
        f'[keys."iso-tpm-embed"]\ntpm = {TPM_EMBED}\n\n'
        f'[keys."iso-tpm-index"]\ntpm = {TPM_INDEX}\n\n'
        '[keys."iso-http"]\nrpm = 2\n\n'
        f'[keys."iso-quota-big"]\nrag_max_documents = {BIG_KEY_DOCUMENTS}\n\n'
        f'[keys."iso-bytes"]\nrag_max_bytes = {KEY_BYTES}\n'
    )
    server = spawn_server(
        "--api-keys-file", str(directory / "keys"),
        "--rate-limits-file", str(directory / "limits.toml"),
        "--rag-key-max-documents", str(KEY_DOCUMENTS),
        env={"PROTOSERVE_DATA_DIR": str(directory / "data")},
    )  # fmt: skip
    assert server.http_port is not None
    yield server
    server.stop()


def md(key: str, user: str | None = None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) + ((("x-user-id", user),) if user else ())


def details(error: grpc.RpcError) -> dict[str, object]:
    found: dict[str, object] = {}
    for any_detail in rpc_status.from_call(error).details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.BadRequest):
            if any_detail.Is(kind.DESCRIPTOR):
                message = kind()
                any_detail.Unpack(message)
                found[kind.__name__] = message
    return found


def refused(call, *args, **kwargs) -> tuple[grpc.StatusCode, str, float | None, list[str]]:
    """(code, ErrorInfo reason, RetryInfo seconds or None, BadRequest fields) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as raised:
        call(*args, **kwargs)
    found = details(raised.value)
    retry = found.get("RetryInfo")
    fields = [v.field for v in found["BadRequest"].field_violations] if "BadRequest" in found else []
    return (
        raised.value.code(),
        found["ErrorInfo"].reason,
        retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9 if retry is not None else None,
        fields,
    )


def stubs(server) -> tuple[grpc.Channel, rag_pb2_grpc.RagServiceStub, embeddings_pb2_grpc.EmbeddingServiceStub]:
    channel = server.sync_channel()
    return channel, rag_pb2_grpc.RagServiceStub(channel), embeddings_pb2_grpc.EmbeddingServiceStub(channel)


def index_request(*documents: tuple[str, str], chunk_tokens: int | None = None, overlap: int | None = None):
    chunking = rpb.ChunkingOptions()
    if chunk_tokens is not None:
        chunking.chunk_tokens = chunk_tokens
    if overlap is not None:
        chunking.overlap_tokens = overlap
    return rpb.IndexDocumentsRequest(
        documents=[rpb.Document(document_id=d, text=t) for d, t in documents], chunking=chunking
    )


def listed(stub, key: str, user: str | None = None) -> list[str]:
    return [d.document_id for d in stub.ListDocuments(rpb.ListDocumentsRequest(page_size=100), metadata=md(key, user)).documents]


def usage(server, key: str) -> metrics_pb2.IdentityUsage:
    with server.sync_channel() as channel:
        reply = metrics_pb2_grpc.MetricsServiceStub(channel).GetMetrics(
            metrics_pb2.GetMetricsRequest(), metadata=md(key), timeout=30
        )
    [row] = reply.snapshot.usage_by_identity.values()
    return row


# ---- rate limits ---------------------------------------------------------------------------------


def test_embed_index_and_search_each_take_a_request(server):
    channel, rag, embed = stubs(server)
    key = md("iso-rpm")
    try:
        embed.Embed(epb.EmbedRequest(texts=["one"]), metadata=key, timeout=60)
        rag.IndexDocuments(index_request(("d", "Otters hold hands.")), metadata=key, timeout=60)
        rag.SearchDocuments(rpb.SearchDocumentsRequest(query="otters"), metadata=key, timeout=60)
        for call, request in (
            (embed.Embed, epb.EmbedRequest(texts=["four"])),
            (rag.SearchDocuments, rpb.SearchDocumentsRequest(query="otters")),
            (rag.IndexDocuments, index_request(("e", "Another document."))),
        ):
            code, reason, retry, _ = refused(call, request, metadata=key, timeout=60)
            assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMIT_EXCEEDED")
            assert 0 < retry <= 60
        assert listed(rag, "iso-rpm") == ["d"]
    finally:
        channel.close()


def test_embedding_tokens_count_against_tpm(server):
    channel, _, embed = stubs(server)
    key = md("iso-tpm-embed")
    try:
        first = embed.Embed(epb.EmbedRequest(texts=["hello " * 99, "hello " * 97]), metadata=key, timeout=60)
        assert first.usage.prompt_tokens == 200  # each text's tokens, [CLS] and [SEP] included
        # More than a minute's allowance in one call: refused, and no wait would help.
        code, reason, retry, _ = refused(
            embed.Embed, epb.EmbedRequest(texts=["hello " * 200] * 4), metadata=key, timeout=60
        )
        assert (code, reason, retry) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMIT_EXCEEDED", None)
        # Within the allowance but past what is left of it: retry once the bucket has refilled.
        code, reason, retry, _ = refused(
            embed.Embed, epb.EmbedRequest(texts=["hello " * 200, "hello " * 200]), metadata=key, timeout=60
        )
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMIT_EXCEEDED") and retry > 0
    finally:
        channel.close()
    # The usage ledger has the embedded tokens of the call that ran, none of the refused ones.
    row = usage(server, "iso-tpm-embed")
    assert (row.requests, row.input_tokens) == (1, 200)


def test_index_charges_every_chunk_token_overlap_included(server):
    channel, rag, _ = stubs(server)
    key = md("iso-tpm-index")
    text = "hello " * 150  # 150 tokens of text
    try:
        done = rag.IndexDocuments(
            index_request(("first", text), chunk_tokens=16, overlap=8), metadata=key, timeout=60
        )
        charged = done.documents[0].tokens
        # 14-token windows stepping 6: every token is embedded (and charged) more than twice.
        assert done.documents[0].chunks >= 24 and charged > 2 * 150
        assert charged <= TPM_INDEX < 2 * charged
        code, reason, retry, _ = refused(
            rag.IndexDocuments, index_request(("second", text), chunk_tokens=16, overlap=8), metadata=key, timeout=60
        )
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMIT_EXCEEDED") and retry > 0
        assert listed(rag, "iso-tpm-index") == ["first"]  # nothing of the refused call was stored
        hits = rag.SearchDocuments(rpb.SearchDocumentsRequest(query="hello"), metadata=key, timeout=60)
    finally:
        channel.close()
    row = usage(server, "iso-tpm-index")
    assert (row.requests, row.input_tokens) == (2, charged + hits.usage.prompt_tokens)


def test_the_gateway_answers_429_with_retry_after(server):
    base = f"http://127.0.0.1:{server.http_port}/v1"
    headers = {"authorization": "Bearer iso-http"}
    with openai.OpenAI(base_url=base, api_key="iso-http", max_retries=0, timeout=60) as client:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="one")
        assert httpx.post(f"{base}/rag/search", json={"query": "q"}, headers=headers, timeout=60).status_code == 200
        with pytest.raises(openai.RateLimitError) as raised:
            client.embeddings.create(model="all-MiniLM-L6-v2", input="three")
        assert int(raised.value.response.headers["retry-after"]) >= 1
        assert raised.value.body["type"] == "rate_limit_error"
    response = httpx.post(f"{base}/rag/search", json={"query": "q"}, headers=headers, timeout=60)
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1


# ---- quotas ---------------------------------------------------------------------------------


def test_rag_quotas_hold_per_api_key_across_user_ids(server):
    channel, rag, _ = stubs(server)
    try:
        rag.IndexDocuments(index_request(("a", "first"), ("b", "second")), metadata=md("iso-quota", "u1"), timeout=60)
        rag.IndexDocuments(index_request(("c", "third")), metadata=md("iso-quota", "u2"), timeout=60)
        for user in ("u2", "a-brand-new-user"):  # a new x-user-id buys no new quota
            code, reason, retry, _ = refused(
                rag.IndexDocuments, index_request(("d", "fourth")), metadata=md("iso-quota", user), timeout=60
            )
            assert (code, reason, retry) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", None)
        assert listed(rag, "iso-quota", "u2") == ["c"] and listed(rag, "iso-quota", "a-brand-new-user") == []
        # Freeing one of u1's documents makes room for anyone under the key.
        rag.DeleteDocuments(rpb.DeleteDocumentsRequest(document_ids=["a"]), metadata=md("iso-quota", "u1"))
        rag.IndexDocuments(index_request(("d", "fourth")), metadata=md("iso-quota", "a-brand-new-user"), timeout=60)
        # A key's own quota from the rate-limits file.
        for user, count in (("u1", 4), ("u2", 2)):
            docs = [(f"{user}-{i}", f"text {i}") for i in range(count)]
            rag.IndexDocuments(index_request(*docs), metadata=md("iso-quota-big", user), timeout=60)
        code, reason, _, _ = refused(
            rag.IndexDocuments, index_request(("x", "one too many")), metadata=md("iso-quota-big", "u3"), timeout=60
        )
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
    finally:
        channel.close()
    response = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v1/rag/index",
        json={"documents": [{"document_id": "e", "text": "fifth"}]},
        headers={"authorization": "Bearer iso-quota", "x-user-id": "u9"},
        timeout=60,
    )
    assert response.status_code == 429 and "API key" in response.json()["message"]


def test_the_byte_quota_counts_chunk_texts_and_vectors(server):
    channel, rag, _ = stubs(server)
    key = md("iso-bytes", "writer")
    text = " ".join(f"word{i % 50} is here" for i in range(150))  # ~2.5 KB, a few hundred tokens
    try:
        # Default chunking: ~2 chunks, the text twice and two vectors: far below the key's 40,000 bytes.
        rag.IndexDocuments(index_request(("plain", text)), metadata=key, timeout=60)
        # The same text in 16-token chunks overlapping by 8: its text bytes alone would fit many times
        # over, but its ~100 vectors of 1,536 bytes do not.
        code, reason, _, _ = refused(
            rag.IndexDocuments, index_request(("small-chunks", text), chunk_tokens=16, overlap=8),
            metadata=key, timeout=60,
        )  # fmt: skip
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
        [info] = rag.ListDocuments(rpb.ListDocumentsRequest(), metadata=key).documents
        assert (info.document_id, info.bytes) == ("plain", len(text))  # a document's bytes: its text's
    finally:
        channel.close()


# ---- caps ---------------------------------------------------------------------------------


def test_chunking_caps_refuse_before_embedding(server):
    channel, rag, embed = stubs(server)
    key = md("iso-caps")
    try:
        code, _, _, fields = refused(
            rag.IndexDocuments, index_request(("d", "some text"), chunk_tokens=16, overlap=9), metadata=key, timeout=60
        )
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["chunking.overlap_tokens"])
        # 60,000 tokens in 14-token windows stepping 6: ~10,000 chunks, past the cap of 8,192. Refused
        # while planning, long before 10,000 forwards could run (the timeout would catch those).
        code, _, _, fields = refused(
            rag.IndexDocuments, index_request(("many", "hello " * 60_000), chunk_tokens=16, overlap=8),
            metadata=key, timeout=60,
        )  # fmt: skip
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["documents[0].text"])
        with pytest.raises(grpc.RpcError) as raised:
            embed.Embed(epb.EmbedRequest(texts=["ok", "x" * 70_000]), metadata=key, timeout=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "texts[1]" in raised.value.details() and "65536 bytes" in raised.value.details()
        assert listed(rag, "iso-caps") == []
    finally:
        channel.close()


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status", encoding="ascii"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_context_placeholders_are_sized_before_the_prompt_is_built(server):
    base = f"http://127.0.0.1:{server.http_port}/v1/rag"
    headers = {"authorization": "Bearer iso-context"}
    words = " ".join(f"fact{i} about otters and rivers" for i in range(200))  # ~4 chunks of ~1 KB
    assert httpx.post(f"{base}/index", json={"documents": [{"document_id": "otters", "text": words}]},
                      headers=headers, timeout=120).status_code == 200  # fmt: skip
    generate = {"query": "What about otters?", "top_k": 4, "sampling": {"max_tokens": 1}}
    assert httpx.post(f"{base}/generate", json=generate, headers=headers, timeout=120).status_code == 200
    before = rss_bytes(server.process.pid)
    body = {**generate, "system_prompt": "{context}" * 10_000}  # 90 KB; ~40 MB once expanded
    response = httpx.post(f"{base}/generate", json=body, headers=headers, timeout=120)
    after = rss_bytes(server.process.pid)
    assert response.status_code == 400, response.text
    [bad_request] = [d for d in response.json()["details"] if d["@type"].endswith("BadRequest")]
    assert [v["field"] for v in bad_request["field_violations"]] == ["system_prompt"]
    assert after - before < 50 * 1024 * 1024, (before, after)


# ---- abandoned index calls ------------------------------------------------------------------


@functools.cache
def four_mib_document() -> str:
    """~3.9 MiB (under the gateway's 4 MiB body) of short dictionary words: ~1M tokens, ~5,000 chunks."""
    from tokenizers import Tokenizer

    from protoserve.engine.embedding.default_model import default_embedding_model_dir

    vocab = Tokenizer.from_file(str(default_embedding_model_dir() / "tokenizer.json")).get_vocab()
    words = sorted(w for w in vocab if w.isascii() and w.isalpha() and 2 <= len(w) <= 3)
    rng = random.Random(42)
    text = " ".join(rng.choice(words) for _ in range(1_100_000))
    return text[: int(3.9 * 1024 * 1024)]


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat", encoding="ascii").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.parametrize("how", ["grpc-deadline", "http-disconnect"])
def test_an_abandoned_4_mib_index_call_stops_and_stores_nothing(server, how):
    key = f"iso-abandon-{how.split('-')[0]}"
    text = four_mib_document()
    if how == "grpc-deadline":
        channel, rag, _ = stubs(server)
        with pytest.raises(grpc.RpcError) as raised:
            rag.IndexDocuments(index_request(("big", text)), metadata=md(key), timeout=1.0)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        channel.close()
    else:
        timeout = httpx.Timeout(30.0, read=1.0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{server.http_port}/v1/rag/index", timeout=timeout,
                       json={"documents": [{"document_id": "big", "text": text}]},
                       headers={"authorization": f"Bearer {key}"})  # fmt: skip
    left = time.monotonic()
    time.sleep(2.0)
    start = cpu_seconds(server.process.pid)
    time.sleep(2.0)
    # From two seconds after the caller left, the server is idle: no chunking or embedding goes on.
    busy = cpu_seconds(server.process.pid) - start
    assert busy < 0.4, f"{busy:.2f} CPU-s between {time.monotonic() - left - 2:.1f} and {time.monotonic() - left:.1f} s"
    channel, rag, _ = stubs(server)
    try:
        assert listed(rag, key) == []
    finally:
        channel.close()
