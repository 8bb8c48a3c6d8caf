"""The ``protoserve`` command: ``serve`` runs the gRPC server, ``generate`` runs one prompt locally,
``models`` lists the installed models."""

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
from typing import TYPE_CHECKING

from protoserve.engine.api import (
    ContextPolicy,
    EngineConfig,
    EngineError,
    ModelLoadError,
    RequestStats,
    SamplingParams,
    SpeculativeParams,
    TokenizedRequest,
    prefer_passive_omp_wait,
)
from protoserve.server import exit_codes
from protoserve.server.cli_flags import (
    DEFAULT_NGRAM_TOKENS,
    ENGINE_FLAGS,
    LOG_LEVELS,
    SAMPLING_DEFAULT_FLAGS,
    SPECULATIVE_MAX_BATCH,
)
from protoserve.server.cli_models import list_models
from protoserve.server.cli_parser import build_parser
from protoserve.server.errors import ServiceError, invalid_argument, to_service_error
from protoserve.server.models.chat_turn import CHAT_ROLES, ChatTurn
from protoserve.server.models.model_spec import ModelSpec, model_specs
from protoserve.server.models.sampling_mapping import default_problems
from protoserve.server.runtime.event_loop import EventLoopUnavailable, loop_factory

# The server and the model (torch) load only for a command that runs: a usage error or --help
# answers at once.
if TYPE_CHECKING:
    from protoserve.server.app import HttpGatewayStarter
    from protoserve.server.security.tls import TlsFiles

log = logging.getLogger("protoserve")



class CliError(Exception):
    """A user error: ``main`` prints ``protoserve: <message>`` as one line and exits with ``code``."""

    def __init__(self, message: str, code: int = exit_codes.USAGE) -> None:
        super().__init__(message)
        self.code = code


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
    quantization = getattr(args, "quantization", None)
    if getattr(args, "quant_group_size", None) is not None and quantization not in (None, "int4", "auto"):
        raise CliError(f"--quant-group-size sets int4 groups, and --quantization {quantization} makes none "
                       "(give it with --quantization int4 or auto)")
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


def _torchrun_worker(args: argparse.Namespace, engine_config: EngineConfig) -> int | None:
    """Under torchrun, a rank other than 0 serves rank 0's steps, not requests: its exit code; else None."""
    from protoserve.engine.runtime import run_worker_rank, torchrun_worker_rank

    if not torchrun_worker_rank():
        return None
    model = args.model[0] if args.model else None  # _model_specs lets tensor parallelism take one
    return run_worker_rank(model, dtype=args.dtype, quantization=args.quantization, config=engine_config)


# Flags that apply to one model's engine: with several --model they are refused, not applied to each.
ONE_MODEL_FLAGS = (("lora", "--lora"), ("speculative_model", "--speculative-model"))


def _model_specs(args: argparse.Namespace, engine_config: EngineConfig) -> tuple[ModelSpec, ...]:
    """serve's models from --model, --served-model-name and --max-kv-blocks."""
    try:
        specs = model_specs(args.model, args.served_model_name, args.model_kv_blocks)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if len(specs) > 1:
        given = [flag for dest, flag in ONE_MODEL_FLAGS if getattr(args, dest, None)]
        if engine_config.tensor_parallel_size > 1:
            given.append("--tensor-parallel-size")
        if given:
            raise CliError(f"{', '.join(given)} applies to one model: give a single --model")
    return specs


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The --tls-* files, None without them; the files themselves are read (and checked) by the server."""
    from protoserve.server.security.tls import TlsError, TlsFiles

    try:
        return TlsFiles.from_flags(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    except TlsError as exc:
        raise CliError(str(exc)) from exc


def _serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from protoserve.server.app import ServerConfig
    from protoserve.server.process import serve

    worker = _torchrun_worker(args, engine_config)  # before binding ports: rank 0 alone listens
    if worker is not None:
        return worker
    try:
        loop = loop_factory(args.event_loop)
    except EventLoopUnavailable as exc:
        raise CliError(str(exc)) from exc
    config = ServerConfig(
        models=_model_specs(args, engine_config),
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
        embedding_names=args.embedding_model_name,
        rag_partitions=args.rag_partitions,
        rag_index=args.rag_index,
        rag_max_documents=args.rag_max_documents,
        rag_max_bytes=args.rag_max_bytes,
        rag_key_max_documents=args.rag_key_max_documents,
        rag_key_max_bytes=args.rag_key_max_bytes,
        responses_max_bytes=args.responses_max_bytes,
        responses_key_max_bytes=args.responses_key_max_bytes,
        loras=tuple(args.lora),
        max_loras=args.max_loras,
        tls=_tls_files(args),
        memory_budget_bytes=args.memory_budget,
        model_idle_timeout_s=args.model_idle_timeout,
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
    from protoserve.engine.api import resolve_model
    from protoserve.engine.runtime import AsyncEngine
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
    try:
        path = (await asyncio.to_thread(resolve_model, args.model)).path
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
    prefer_passive_omp_wait()  # before anything imports torch: this process runs the engine
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "models":
        return list_models(args)
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
