"""EngineConfig: the knobs of the batching engine (memory, batch shape, queueing)."""

from __future__ import annotations

from dataclasses import dataclass

from protoserve.engine.speculative.params import SpeculativeParams

# The dtypes a model's activations (and float weights) run in; engine/loader/load.py maps each to torch's.
DTYPES = ("float32", "bfloat16")
# How the linear layers' weights are stored (engine/models/linear.py); fp8 only on a device's kernels.
QUANTIZATION_MODES = ("none", "int8", "int4", "fp8")
# int4 groups of input columns the kernels take (engine/models/linear.py). 32 divides every hidden size
# in use, and the default SmolLM2 GGUF is itself Q4_1 in groups of 32, which int4/32 reproduces almost
# exactly (measured: mean |logit error| 0.20 vs 1.79 at 64).
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP_SIZE = 32
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
# How int8/int4 layers on the integer-dot kernels quantize their activations: "exact", int8 codes plus
# int8 codes of their rounding error; "fast", the codes alone (llama.cpp's Q8 activations), half the
# integer products at a coarser result (kernels/cpu/int8_dot_linear.cpp, figures in docs/notes/performance-log.md).
ACTIVATION_PRECISIONS = ("exact", "fast")
# Where the model runs: "cpu" (the C++ kernels) or "cuda" (the Triton kernels of kernels/triton and
# torch CUDA tensors); engine/execution/device.py is the one place that turns the name into a device.
DEVICES = ("cpu", "cuda")
# Each device's default chunked-prefill budget (EngineConfig.max_num_batched_tokens). On the CPU kernels
# prefill runs as fast in 256-token chunks as in 512, and smaller steps bring a burst's median first token
# forward. On a GPU a step with prefill in it runs eagerly (no CUDA graph), bound by the host launching its
# kernels whatever its size, so fewer, larger steps win: vLLM and SGLang default to 8192 there too
# (docs/notes/performance-log.md has both measurements).
DEFAULT_BATCHED_TOKENS = {"cpu": 256, "cuda": 8192}


@dataclass
class EngineConfig:
    """How much KV memory to hold and how big one engine step may get.

    The KV pool is either ``max_kv_blocks`` blocks, or as many blocks as fit in
    ``kv_cache_bytes``. ``max_model_len=None`` takes the model's context window,
    capped by what the pool can hold, so one sequence always fits alone (which is
    what lets preemption guarantee progress).
    """

    block_size: int = 16  # tokens per KV block
    max_kv_blocks: int | None = None  # exact pool size; overrides kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024 * 1024  # pool budget when max_kv_blocks is None
    # "bfloat16" halves the pool's bytes (twice the tokens per budget, half the memory a batched
    # decode step streams) at bf16 rounding of K and V; "int8" halves them again (codes and a scale per
    # token and KV head, as llama.cpp's q8_0 K/V; the CPU kernel only); "auto" is the activation dtype,
    # or bfloat16 for a model served with quantized weights (kv_cache.resolve_kv_dtype).
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64  # sequences in one forward (each choice of n>1 counts)
    # New tokens per step (decode tokens included): the chunked-prefill budget. None: the device's
    # default (DEFAULT_BATCHED_TOKENS); token_budget() resolves it.
    max_num_batched_tokens: int | None = None
    max_queue: int = 1024  # waiting requests beyond this are shed with QueueFullError
    max_model_len: int | None = None  # prompt + generated tokens of one sequence
    enable_prefix_caching: bool = True
    # Where prefix-cache blocks persist (engine/kv_offload): written when evicted from the pool and at
    # shutdown, read back on a prefix miss, so a conversation resumes after a restart without recomputing
    # its prefix; None keeps blocks in memory only. The directory holds at most kv_offload_max_bytes (LRU).
    kv_offload_dir: str | None = None
    kv_offload_max_bytes: int = 8 * 1024**3
    deterministic: bool = True  # batch-invariant model kernels: same tokens alone or batched
    # "exact" or "fast" activation codes for int8/int4 layers (ACTIVATION_PRECISIONS); float32 and
    # bfloat16 weights multiply float activations either way. Both are batch invariant.
    activation_precision: str = "exact"
    device: str = "cpu"  # DEVICES
    # The int4 group size for quantizing a float checkpoint on load (tiny-duo-infer's --quant-group-size);
    # a GPTQ/AWQ checkpoint under quantization "auto" keeps its own (engine/loader/load.py).
    quant_group_size: int = DEFAULT_INT4_GROUP_SIZE
    # On device cuda, decode steps replay CUDA graphs captured per batch-size bucket
    # (engine/execution/cuda_graphs.py); False runs every step eagerly (vLLM's enforce_eager).
    cuda_graphs: bool = True
    # Ranks the model is sharded over (engine/parallel): heads and MLP columns split, one all-reduce
    # after each attention and MLP; 1 is unsharded.
    tensor_parallel_size: int = 1
    # A waiting or running sequence gains one priority level per this many steps
    # it has existed, so a steady stream of high-priority work cannot starve it. 0 disables.
    priority_aging_steps: int = 512
    # Fair scheduling across tenants (engine/scheduling/fair_share.py): a tenant's running work is
    # preempted to admit another's only while it has been served more than this many weighted tokens
    # (prompt tokens cost 1, generated tokens 2) beyond the other; it also bounds the credit an idle
    # tenant brings back. Larger: fewer preemptions between backlogged tenants, a looser fairness bound.
    fairness_margin_tokens: int = 1024
    # Hard caps on what one identity holds at once, alone or not: running sequences (each choice of
    # n > 1 counts; 0: no cap) and a share of the KV pool (1.0: no cap).
    max_running_per_identity: int = 0
    max_kv_share_per_identity: float = 1.0
    # Speculative decoding for requests that leave SamplingParams.speculative unset and have no
    # constraint (a constrained request may not opt in); None: off unless a request asks.
    speculative: SpeculativeParams | None = None
    # A draft model for speculative method "draft": a checkpoint path, or "default" for the default
    # model, loaded with speculative_model_quantization; it must share the target's vocabulary.
    speculative_model: str | None = None
    speculative_model_quantization: str = "int4"
    # No drafting in steps that start with more running sequences than this (vLLM's
    # disable_by_batch_size): batched decode already uses the compute a verification would.
    speculative_disable_by_batch_size: int | None = None
    # Tokens a request's grammar forces (JSON keys, punctuation, the rest of an enum value) are drafted
    # and verified in the forward that computes the token before them, rather than one forward each
    # (engine/sampling/constraints/fast_forward.py); output is the same either way. False: one by one.
    grammar_fast_forward: bool = True
    # Async scheduling (vLLM's --async-scheduling, SGLang's overlap scheduler): schedule step N+1 while
    # step N runs on the device, its sampled ids feeding N+1's forward there and reaching the host a step
    # later (engine/execution/async_step.py); the tokens are the same. None: on for device cuda, off on
    # cpu, where the host runs the forward itself and there is nothing to overlap.
    async_scheduling: bool | None = None
    # Tokens a stream's caller gets at a time (vLLM's and SGLang's --stream-interval): after its first
    # token, a request's output is handed over once it has this many new tokens, or when it ends. Each
    # hand-over costs the serving loop a message (gRPC, SSE) per stream, so a larger interval leaves more
    # of the cores to the engine at high concurrency, at coarser streaming. The tokens are the same.
    stream_interval: int = 1

    def overlaps_steps(self) -> bool:
        """Whether steps overlap (``async_scheduling`` with its default resolved)."""
        if self.async_scheduling is None:
            return self.device == "cuda" and self.tensor_parallel_size == 1
        return self.async_scheduling

    def token_budget(self) -> int:
        """New tokens per step (``max_num_batched_tokens`` with its device default resolved)."""
        if self.max_num_batched_tokens is None:
            return DEFAULT_BATCHED_TOKENS.get(self.device, DEFAULT_BATCHED_TOKENS["cpu"])
        return self.max_num_batched_tokens

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent setting."""
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.max_kv_blocks is not None and self.max_kv_blocks < 1:
            raise ValueError("max_kv_blocks must be at least 1")
        if self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.activation_precision not in ACTIVATION_PRECISIONS:
            raise ValueError(f"activation_precision must be one of {', '.join(ACTIVATION_PRECISIONS)}, "
                             f"got {self.activation_precision!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.kv_cache_dtype == "int8" and self.device != "cpu":
            raise ValueError("kv_cache_dtype int8 is served by the CPU attention kernel only; "
                             f"on device {self.device} use auto, bfloat16 or float32")
        if self.quant_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quant_group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                             f"got {self.quant_group_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.kv_offload_max_bytes < 1:
            raise ValueError("kv_offload_max_bytes must be positive")
        if self.kv_offload_dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir persists the prefix cache, which enable_prefix_caching turns off")
        if self.kv_offload_dir is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_offload_dir is not served with tensor_parallel_size > 1 "
                             f"(it is {self.tensor_parallel_size}): each rank holds only its heads' K/V")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2 (one prompt token and one generated)")
        if self.priority_aging_steps < 0:
            raise ValueError("priority_aging_steps must be non-negative")
        if self.fairness_margin_tokens < 0:
            raise ValueError("fairness_margin_tokens must be non-negative")
        if self.max_running_per_identity < 0:
            raise ValueError("max_running_per_identity must be non-negative (0: no cap)")
        if not 0.0 < self.max_kv_share_per_identity <= 1.0:
            raise ValueError("max_kv_share_per_identity must be in (0, 1] (1: no cap)")
        for field, problem in self.speculative.validate() if self.speculative is not None else []:
            raise ValueError(f"{field} {problem}")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise ValueError("speculative_disable_by_batch_size must be at least 1")
        if self.speculative_model is not None and self.device != "cpu":
            raise ValueError(f"speculative_model (a draft model) runs on device cpu only, not {self.device!r}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling is not served with tensor_parallel_size > 1 "
                             f"(it is {self.tensor_parallel_size}): each step is broadcast to the ranks from the host")
        if self.speculative is not None and self.speculative.method == "draft" and self.speculative_model is None:
            raise ValueError("speculative.method \"draft\" needs speculative_model")


def resolve_num_blocks(config: EngineConfig, block_bytes: int) -> int:
    """Pool size in blocks: the explicit count, else as many as the byte budget holds."""
    if config.max_kv_blocks is not None:
        return config.max_kv_blocks
    return max(1, config.kv_cache_bytes // block_bytes)


def identity_block_cap(config: EngineConfig, num_blocks: int) -> int:
    """KV blocks one identity may hold: ``max_kv_share_per_identity`` of the pool (at least one block)."""
    return max(1, int(num_blocks * config.max_kv_share_per_identity))


def resolve_max_model_len(config: EngineConfig, model_max: int, num_blocks: int) -> int:
    """The context limit the engine enforces; raises when the pool (or one identity's share of it)
    cannot hold one such sequence."""
    cap_blocks = identity_block_cap(config, num_blocks)
    pool_tokens = cap_blocks * config.block_size
    if config.max_model_len is None:
        return min(model_max, pool_tokens)
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context window {model_max}")
    if config.max_model_len > pool_tokens:
        held = f"the pool has {num_blocks}" if cap_blocks == num_blocks else (
            f"one identity may hold {cap_blocks} (max_kv_share_per_identity {config.max_kv_share_per_identity:g} "
            f"of {num_blocks})")
        raise ValueError(
            f"max_model_len {config.max_model_len} needs {-(-config.max_model_len // config.block_size)} "
            f"KV blocks but {held}: one sequence must always fit alone"
        )
    return config.max_model_len
