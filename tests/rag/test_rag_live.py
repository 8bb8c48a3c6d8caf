"""RAG end to end on a real server: the real all-MiniLM-L6-v2 and SmolLM2, auth on, over gRPC and both gateways.

Isolation is checked the way callers can break it: two users under one team key and two keys, with the
same document ids, on a server whose identities spread over partitions and on one with a single
partition; no search, list, get, delete or retrieve-and-generate of one touches the other's documents.
Durability: the server is killed with SIGKILL while a client indexes one document per call; after a
restart every acknowledged document is there and searchable. Quality: 50 made-up facts, 50 questions,
recall@5 at least 0.9.
"""

from __future__ import annotations

import base64
import signal
import struct
import tempfile
import threading
import time

import grpc
import httpx
import numpy as np
import openai
import pytest

from protoserve.v1 import embeddings_pb2 as epb
from protoserve.v1 import embeddings_pb2_grpc, rag_pb2_grpc
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import rag_pb2 as rpb

KEYS = ("rag-team-key", "rag-other-key")
COUNTRIES = [
    ("Zorvania", "Kelmar"),
    ("Quillonia", "Bratis"),
    ("Vendaro", "Ostrel"),
    ("Maribeth Isles", "Port Aldo"),
    ("Trelund", "Visk"),
    ("Ashgrove", "Nerrin"),
    ("Palumbria", "Cestor"),
    ("Drevia", "Yalt"),
    ("Ulmatra", "Fenwick"),
    ("Corrisande", "Lutzow"),
]
INVENTIONS = [
    ("Edda Ravensworth", "the clockwork loom"),
    ("Tobias Quell", "the glass bicycle"),
    ("Mirela Dunn", "the solar kettle"),
    ("Henrik Vasko", "the folding bridge"),
    ("Ines Calloway", "the wind piano"),
    ("Otto Brambel", "the paper submarine"),
    ("Sana Okafor", "the singing lamp"),
    ("Lev Marchetti", "the rain clock"),
    ("Ada Thornbury", "the mirror telescope"),
    ("Pavel Lindqvist", "the copper violin"),
]
ANIMALS = [
    ("glimmerfox", "silver"),
    ("marsh dragon", "olive green"),
    ("sky whale", "pale blue"),
    ("ember moth", "orange"),
    ("frost hare", "white"),
    ("dune beetle", "golden"),
    ("shadow owl", "black"),
    ("coral serpent", "pink"),
    ("thunder goat", "grey"),
    ("lantern squid", "violet"),
]
RIVERS = [
    ("Orlin", 412),
    ("Sappho", 87),
    ("Keshet", 1290),
    ("Vardis", 233),
    ("Moller", 655),
    ("Tirana Reach", 51),
    ("Halvard", 978),
    ("Pemberly", 140),
    ("Sunder", 3020),
    ("Ostwick", 767),
]
FOUNDINGS = [
    ("Brightwater Academy", 1742),
    ("the Guild of Lamplighters", 1611),
    ("Cobalt Harbor", 1899),
    ("the Order of the Quiet Bell", 1503),
    ("Larkspur Observatory", 1821),
    ("the Ferrymen's Union", 1777),
    ("Greystone Library", 1654),
    ("the Meridian Rail Company", 1912),
    ("Old Fennel Market", 1588),
    ("the Tidewatch Society", 1933),
]


def facts() -> list[tuple[str, str, str]]:
    """(document id, fact, question) triples: 50 made-up facts no model knows."""
    out = []
    for i, (country, capital) in enumerate(COUNTRIES):
        out.append(
            (
                f"country-{i}",
                f"The capital city of {country} is {capital}.",
                f"What is the capital of {country}?",
            )
        )
    for i, (person, thing) in enumerate(INVENTIONS):
        out.append(
            (f"inventor-{i}", f"{person} invented {thing} in her workshop.", f"What did {person} invent?")
        )
    for i, (animal, colour) in enumerate(ANIMALS):
        out.append(
            (f"animal-{i}", f"The {animal} has {colour} fur or scales.", f"What colour is the {animal}?")
        )
    for i, (river, km) in enumerate(RIVERS):
        out.append(
            (f"river-{i}", f"The river {river} is {km} kilometres long.", f"How long is the river {river}?")
        )
    for i, (place, year) in enumerate(FOUNDINGS):
        out.append(
            (f"founding-{i}", f"{place} was founded in the year {year}.", f"When was {place} founded?")
        )
    return out


def metadata(key: str, user: str = "") -> tuple[tuple[str, str], ...]:
    md = (("authorization", f"Bearer {key}"),)
    return md + ((("x-user-id", user),) if user else ())


@pytest.fixture(scope="module")
def rag_server(spawn_server):
    data = tempfile.mkdtemp(prefix="protoserve-rag-")
    return spawn_server(env={"PROTOSERVE_API_KEYS": ",".join(KEYS), "PROTOSERVE_DATA_DIR": data})


@pytest.fixture(scope="module")
def single_partition_server(spawn_server):
    data = tempfile.mkdtemp(prefix="protoserve-rag1-")
    return spawn_server(
        "--rag-partitions", "1", env={"PROTOSERVE_API_KEYS": ",".join(KEYS), "PROTOSERVE_DATA_DIR": data}
    )


def stubs(server):
    channel = grpc.insecure_channel(server.grpc_target)
    return channel, rag_pb2_grpc.RagServiceStub(channel)


def index(stub, md, *documents: tuple[str, str]) -> rpb.IndexDocumentsResponse:
    return stub.IndexDocuments(
        rpb.IndexDocumentsRequest(documents=[rpb.Document(document_id=d, text=t) for d, t in documents]),
        metadata=md,
        timeout=60,
    )


@pytest.mark.parametrize("server_fixture", ["rag_server", "single_partition_server"])
def test_identities_never_see_each_others_documents(request, server_fixture):
    server = request.getfixturevalue(server_fixture)
    channel, stub = stubs(server)
    callers = {
        "alice": metadata(KEYS[0], "alice"),
        "bob": metadata(KEYS[0], "bob"),  # same team key, another user
        "carol": metadata(KEYS[1]),  # another key
    }
    try:
        for name, md in callers.items():
            # The same document id for everyone, each with its own secret.
            index(stub, md, ("shared-id", f"The secret password of {name} is {name}-swordfish."))
            index(stub, md, (f"{name}-only", f"{name} keeps a diary about gardening."))
        for name, md in callers.items():
            others = [o for o in callers if o != name]
            hits = stub.SearchDocuments(
                rpb.SearchDocumentsRequest(query="secret password", top_k=100), metadata=md
            ).chunks
            assert hits and all(name in h.text for h in hits), (name, [h.text for h in hits])
            listed = stub.ListDocuments(rpb.ListDocumentsRequest(page_size=100), metadata=md).documents
            assert {d.document_id for d in listed} == {"shared-id", f"{name}-only"}
            got = stub.GetDocument(rpb.GetDocumentRequest(document_id="shared-id"), metadata=md)
            assert got.text == f"The secret password of {name} is {name}-swordfish."
            for other in others:
                with pytest.raises(grpc.RpcError) as exc:
                    stub.GetDocument(rpb.GetDocumentRequest(document_id=f"{other}-only"), metadata=md)
                assert exc.value.code() == grpc.StatusCode.NOT_FOUND
                gone = stub.DeleteDocuments(
                    rpb.DeleteDocumentsRequest(document_ids=[f"{other}-only"]), metadata=md
                )
                assert list(gone.not_found) == [f"{other}-only"] and not gone.deleted
            answer = stub.RetrieveAndGenerate(
                rpb.RetrieveAndGenerateRequest(
                    query="What is the secret password?",
                    top_k=20,
                    sampling=pb.SamplingParams(temperature=0, max_tokens=8),
                ),
                metadata=md,
                timeout=120,
            )
            assert answer.citations and all(name in c.chunk.text for c in answer.citations)
        # Nobody's delete reached another: every caller still has both documents.
        for md in callers.values():
            assert len(stub.ListDocuments(rpb.ListDocumentsRequest(), metadata=md).documents) == 2
    finally:
        channel.close()


def test_recall_at_5_on_made_up_facts(rag_server):
    channel, stub = stubs(rag_server)
    md = metadata(KEYS[1], "quality")
    try:
        triples = facts()
        index(stub, md, *[(doc, fact) for doc, fact, _ in triples])
        found = 0
        for doc, _, question in triples:
            hits = stub.SearchDocuments(
                rpb.SearchDocumentsRequest(query=question, top_k=5), metadata=md
            ).chunks
            found += doc in [h.document_id for h in hits]
        assert found / len(triples) >= 0.9, found
        answer = stub.RetrieveAndGenerate(
            rpb.RetrieveAndGenerateRequest(
                query="What is the capital city of Zorvania?",
                top_k=3,
                sampling=pb.SamplingParams(temperature=0, max_tokens=24),
            ),
            metadata=md,
            timeout=120,
        )
        assert answer.citations[0].number == 1 and answer.citations[0].chunk.document_id == "country-0"
        assert "Kelmar" in answer.answer, answer.answer
        assert answer.usage.completion_tokens > 0 and answer.finish_reason in (
            pb.FINISH_REASON_STOP,
            pb.FINISH_REASON_LENGTH,
        )
    finally:
        channel.close()


def test_retrieve_and_generate_streams_citations_then_text(rag_server):
    channel, stub = stubs(rag_server)
    md = metadata(KEYS[1], "stream")
    try:
        index(stub, md, ("otter", "Otters hold hands while they sleep so they do not drift apart."))
        events = list(
            stub.RetrieveAndGenerateStream(
                rpb.RetrieveAndGenerateStreamRequest(
                    request=rpb.RetrieveAndGenerateRequest(
                        query="Why do otters hold hands?",
                        sampling=pb.SamplingParams(temperature=0, max_tokens=16),
                    )
                ),
                metadata=md,
                timeout=120,
            )
        )
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[0] == "citations" and kinds[-1] == "final" and set(kinds[1:-1]) == {"text"}
        assert events[0].citations.citations[0].chunk.document_id == "otter"
        assert (
            events[-1].final.usage.completion_tokens == 16
            or events[-1].final.finish_reason == pb.FINISH_REASON_STOP
        )
    finally:
        channel.close()


def test_kill_9_while_indexing_loses_no_acknowledged_document(spawn_server):
    data = tempfile.mkdtemp(prefix="protoserve-rag-kill-")
    env = {"PROTOSERVE_API_KEYS": KEYS[0], "PROTOSERVE_DATA_DIR": data}
    server = spawn_server(env=env)
    md = metadata(KEYS[0], "writer")
    acknowledged: list[str] = []
    stop = threading.Event()

    def write() -> None:
        channel, stub = stubs(server)
        try:
            for i in range(10_000):
                if stop.is_set():
                    return
                doc = f"doc-{i}"
                index(stub, md, (doc, f"Record number {i} says the tide was {i % 7} metres high."))
                acknowledged.append(doc)
        except grpc.RpcError:
            return  # the server died mid-call: that one was never acknowledged
        finally:
            channel.close()

    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 60
    while len(acknowledged) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    writer.join(30)
    stop.set()
    assert len(acknowledged) >= 20
    restarted = spawn_server(env=env)
    channel, stub = stubs(restarted)
    try:
        listed = []
        token = ""
        while True:
            page = stub.ListDocuments(rpb.ListDocumentsRequest(page_size=1000, page_token=token), metadata=md)
            listed += [d.document_id for d in page.documents]
            token = page.next_page_token
            if not token:
                break
        assert set(acknowledged) <= set(listed)
        # Anything stored beyond the acknowledged ones is whole (the call died after its commit).
        for doc in set(listed) - set(acknowledged):
            assert stub.GetDocument(rpb.GetDocumentRequest(document_id=doc), metadata=md).document.chunks == 1
        last = acknowledged[-1]
        number = int(last.split("-")[1])
        hits = stub.SearchDocuments(
            rpb.SearchDocumentsRequest(
                query=f"Record number {number} says the tide was {number % 7} metres high.", top_k=3
            ),
            metadata=md,
        ).chunks
        assert last in [h.document_id for h in hits]
    finally:
        channel.close()


def test_openai_embeddings_match_native_embed(rag_server):
    base = f"http://127.0.0.1:{rag_server.http_port}/v1"
    with openai.OpenAI(base_url=base, api_key=KEYS[0], max_retries=0, timeout=60) as client:
        model = "all-MiniLM-L6-v2"
        floats = client.embeddings.create(
            model=model, input=["hello world", "goodbye"], encoding_format="float"
        )
        assert [d.index for d in floats.data] == [0, 1] and len(floats.data[0].embedding) == 384
        assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
        # The client's default is base64, which it decodes itself.
        default = client.embeddings.create(model=model, input="hello world")
        assert np.allclose(default.data[0].embedding, floats.data[0].embedding, atol=1e-6)
        with pytest.raises(openai.BadRequestError) as exc:
            client.embeddings.create(model=model, input="hi", dimensions=64)
        assert exc.value.param == "dimensions"
        with pytest.raises(openai.BadRequestError) as exc:
            client.embeddings.create(model=model, input=["fine", ""])
        assert exc.value.param == "input[1]"
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="text-embedding-3-small", input="hi")
    raw = httpx.post(
        f"{base}/embeddings",
        json={"model": model, "input": "hello world", "encoding_format": "base64"},
        headers={"authorization": f"Bearer {KEYS[0]}"},
    ).json()
    decoded = struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))
    with grpc.insecure_channel(rag_server.grpc_target) as channel:
        native = embeddings_pb2_grpc.EmbeddingServiceStub(channel).Embed(
            epb.EmbedRequest(texts=["hello world"]), metadata=metadata(KEYS[0])
        )
    assert np.allclose(decoded, native.embeddings[0].values, atol=1e-6)
    assert abs(float(np.linalg.norm(decoded)) - 1.0) < 1e-5


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/v1/rag/index", {"documents": [{"document_id": "x", "text": ""}]}, 400, "documents[0].text"),
        ("/v1/rag/index", {"documents": [{"document_id": "", "text": "t"}]}, 400, "documents[0].document_id"),
        (
            "/v1/rag/index",
            {"documents": [{"document_id": "big", "text": "a " * (2 * 1024 * 1024 + 1)}]},
            400,
            None,
        ),
        ("/v1/rag/search", {"query": "q", "top_k": 0}, 400, "top_k"),
        ("/v1/rag/search", {"query": "q", "top_k": 10000}, 400, "top_k"),
        ("/v1/rag/search", {"query": ""}, 400, "query"),
        ("/v1/rag/generate", {"query": "q", "top_k": 50}, 400, "top_k"),
        ("/v1/rag/documents:delete", {"document_ids": []}, 400, "document_ids"),
    ],
)
def test_bad_rag_requests_are_status_errors_naming_the_field(rag_server, path, body, status, field):
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    response = httpx.post(
        f"http://127.0.0.1:{rag_server.http_port}{path}", json=body, headers=headers, timeout=60
    )
    assert response.status_code in (status, 413), response.text
    if response.status_code == 400:
        status_body = response.json()
        assert status_body["code"] == 3
        if field is not None:
            violations = [d for d in status_body["details"] if d["@type"].endswith("BadRequest")][0]
            assert field in [v["field"] for v in violations["field_violations"]]


def test_unknown_document_is_404(rag_server):
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    response = httpx.get(f"http://127.0.0.1:{rag_server.http_port}/v1/rag/documents/nope", headers=headers)
    assert response.status_code == 404 and response.json()["code"] == 5


def test_without_an_embedding_model_rag_is_failed_precondition(spawn_server):
    server = spawn_server("--no-embedding-model", env={"PROTOSERVE_DATA_DIR": tempfile.mkdtemp()})
    channel, stub = stubs(server)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            stub.SearchDocuments(rpb.SearchDocumentsRequest(query="q"))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        channel.close()
    response = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v1/embeddings", json={"model": "m", "input": "hi"}
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_quotas_are_resource_exhausted_and_write_nothing(spawn_server):
    server = spawn_server("--rag-max-documents", "2", env={"PROTOSERVE_API_KEYS": ",".join(KEYS)})
    channel, stub = stubs(server)
    md = metadata(KEYS[0], "quota")
    try:
        index(stub, md, ("a", "first"), ("b", "second"))
        with pytest.raises(grpc.RpcError) as exc:
            index(stub, md, ("c", "third"))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "documents" in exc.value.details()
        index(stub, md, ("a", "first, replaced"))  # a replacement adds no document
        listed = stub.ListDocuments(rpb.ListDocumentsRequest(), metadata=md).documents
        assert sorted(d.document_id for d in listed) == ["a", "b"]
        # Another user of the same key shares the key's quota (--rag-key-max-documents defaults to
        # --rag-max-documents); another key has its own.
        with pytest.raises(grpc.RpcError) as exc:
            index(stub, metadata(KEYS[0], "someone-else"), ("c", "third"))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "API key" in exc.value.details()
        index(stub, metadata(KEYS[1], "someone-else"), ("c", "third"))
    finally:
        channel.close()
    response = httpx.post(
        f"http://127.0.0.1:{server.http_port}/v1/rag/index",
        json={"documents": [{"document_id": "c", "text": "third"}]},
        headers={"authorization": f"Bearer {KEYS[0]}", "x-user-id": "quota"},
    )
    assert response.status_code == 429 and response.json()["details"]
