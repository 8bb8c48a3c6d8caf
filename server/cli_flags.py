"""The ``protoserve`` command line's shared flags and value checks, and ``generate``'s flags (``serve``'s are in
cli_serve_flags.py, the parser in cli_parser.py; server/cli.py runs them).

Importing this module imports no torch and no server: a usage error or ``--help`` answers at once. Its value
checks (``port_number``, ``byte_count``, ...: argparse ``type`` functions) are public, for serve's flags too.
"""

from __future__ import annotations

import argparse
import os

from protoserve.engine.api import (
    ACTIVATION_PRECISIONS,
    AUTO,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_MODES,
    ContextPolicy,
)
from protoserve.server.limits import MAX_MODEL_NAME_CHARS
from protoserve.server.models.adapter_input import adapter_name_problem
from protoserve.server.models.chat_turn import CHAT_ROLES
from protoserve.server.models.model_spec import parse_names

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
    ("async_scheduling", "async_scheduling"),
    ("stream_interval", "stream_interval"),
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


def port_number(text: str) -> int:
    """A TCP port flag: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0..65535")
    return port


def byte_count(text: str) -> int:
    """A size flag in bytes: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a positive number of bytes")
    return int(text)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a positive integer")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: 0 or a positive integer")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a positive number of seconds")
    return seconds


def lora_spec(value: str) -> tuple[str, str]:
    """``--lora NAME=PATH`` as (name, path); the name keeps LoadAdapter's rules."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    problem = adapter_name_problem(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"NAME {problem}")
    return name, path


def served_names(text: str) -> tuple[str, ...]:
    try:
        return parse_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def one_model_name(text: str) -> tuple[str, ...]:
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
            type=served_names,
            default=[],
            help="the name clients use for a model, then other names it answers to; the i-th names the "
            "i-th --model [from the checkpoint, and an installed model's short name as an alias]",
        )
        parser.add_argument(
            "--model-name",
            dest="served_model_name",
            metavar="NAME",
            action="append",
            type=one_model_name,
            help="--served-model-name with one name and no aliases",
        )
        parser.add_argument(
            "--max-kv-blocks",
            dest="model_kv_blocks",
            metavar="N",
            action="append",
            type=positive_int,
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
        "decode step reads, at bf16 rounding of K and V; int8 (CPU only) holds about twice bfloat16's, as int8 "
        "codes with a float32 scale per token and KV head (llama.cpp's q8_0 K/V) [auto: the model's dtype, "
        "bfloat16 when the weights are served int8/int4]",
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
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule each step while the one before runs on the device, its sampled tokens joined a step "
        "later (the same tokens); steps that need them on the host first run plain [on for --device cuda, "
        "off for cpu]",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="shard the model over N ranks on torch.distributed (gloo on cpu, nccl on cuda) [1]",
    )
    parser.add_argument(
        "--stream-interval",
        type=positive_int,
        metavar="N",
        help="after a request's first token, stream its tokens N at a time (and the rest when it ends): fewer "
        "messages per stream for the serving loop at high concurrency, coarser streaming; the same tokens [1]",
    )
    parser.add_argument("--max-num-seqs", type=int, help="sequences per engine step")
    parser.add_argument("--max-batch-tokens", type=int,
                        help="new tokens per engine step (chunked prefill) [256 on cpu, 8192 on cuda]")
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
