"""The fused decoder step (engine/models/fused_step.py, kernels/cpu/decoder_step.cpp) against the module path.

Once load_model has packed every linear layer, ``Decoder.forward`` runs the
whole layer loop as one C++ call; it must write the same K/V and return the
same logits, bit for bit, as the module-by-module forward (``fused_step =
None``). Covered here:

* every tiny family (Llama, Mistral with its sliding window, Qwen2 with q/k/v
  biases and tied embeddings, Qwen3 with q/k norms) x float32 / int8 / int4 as
  load_model serves them (all twelve load: the tiny shapes fit int4/32), on one
  schedule that prefills several prompts at once and then decodes them beside
  the chunks of another prompt's prefill: logits and K/V pools ``torch.equal``;
* that the fused step really runs (the module path's layers are forbidden
  while it does) and that the caches it cannot take (ContiguousKVCache, a paged
  cache on the PyTorch attention) keep the module path, and that a bfloat16
  model runs the fused step on its bf16 weights;
* that ``quantize_linears`` drops the fused step bound to the replaced weights,
  and a deepcopy starts without one;
* that the step releases the GIL while it computes;
* that bad arguments raise a clear error instead of crashing the process.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from decoder_test_helpers import Driver, Step, contiguous_cache, paged_cache
from forward_batches import forward_batch, scheduled

from protoserve.engine.loader.load import load_model
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.decoder import Decoder, DecoderLayer
from protoserve.engine.models.fused_step import FusedStep
from protoserve.engine.models.kv_cache import KVCache, PagedKVCache, kv_row_elements
from protoserve.engine.models.linear import KernelPackable, quantize_linears
from protoserve.engine.models.rope import rope_cos_sin
from protoserve.kernels.cpu import extension
from protoserve.kernels.cpu.paged_attention import write_int8_rows

pytestmark = pytest.mark.skipif(not extension.cpu_supported(), reason="the CPU kernels need AVX-512 or AVX2")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
QUANTIZATIONS = ("none", "int8", "int4")

# The schedule: these prompts prefilled in one batch, then DECODE_STEPS steps in which each decodes one
# token while another prompt of CHUNKED_PROMPT tokens is prefilled in chunks of PREFILL_CHUNK beside
# them (at a different place in the batch each step, the last step decodes only). 40 and 37 are more
# than twice Mistral's window of 16.
PROMPTS = (9, 1, 40, 23)
DECODE_STEPS = 4
CHUNKED_PROMPT = 37
PREFILL_CHUNK = 16


def _sequences(seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [p + DECODE_STEPS for p in PROMPTS] + [CHUNKED_PROMPT]
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def prefill_then_decode_beside_chunked_prefill(seqs: Sequence[Sequence[int]]) -> Iterator[Step]:
    chunked = len(PROMPTS)
    assert len(seqs) == chunked + 1 and len(seqs[chunked]) == CHUNKED_PROMPT
    yield [(i, 0, p) for i, p in enumerate(PROMPTS)]
    done = 0
    for s in range(DECODE_STEPS):
        step: Step = [(i, p + s, p + s + 1) for i, p in enumerate(PROMPTS)]
        if done < CHUNKED_PROMPT:
            end = min(CHUNKED_PROMPT, done + PREFILL_CHUNK)
            step.insert(s % (chunked + 1), (chunked, done, end))
            done = end
        yield step
    assert done == CHUNKED_PROMPT


NUM_STEPS = 1 + DECODE_STEPS


class CountingStep:
    """Stands in for ``FusedStep._step`` (the C++ DecoderStep) and counts its forwards."""

    def __init__(self, step) -> None:
        self.step = step
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        return self.step.forward(*args)


def forbid_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the module path ran: DecoderLayer.forward was called")

    monkeypatch.setattr(DecoderLayer, "forward", fail)


def count_layer_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = DecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    return calls


def run(model: Decoder, cache: KVCache | None = None) -> tuple[list[torch.Tensor], KVCache]:
    """Every position's logits of the test schedule, on a fresh paged cache unless one is given."""
    cache = paged_cache(model, num_blocks=64) if cache is None else cache
    logits = Driver(model, cache).run(_sequences(), prefill_then_decode_beside_chunked_prefill)
    return logits, cache


def run_fused(model: Decoder, cache: KVCache | None = None) -> tuple[list[torch.Tensor], KVCache]:
    """``run`` with the module path forbidden and the fused step counted: it must serve every step."""
    assert model.fused_step is not None
    with pytest.MonkeyPatch.context() as mp:
        forbid_module_path(mp)
        counter = CountingStep(model.fused_step._step)
        mp.setattr(model.fused_step, "_step", counter)
        out = run(model, cache)
    assert counter.calls == NUM_STEPS
    return out


def run_module_path(model: Decoder, cache: KVCache | None = None) -> tuple[list[torch.Tensor], KVCache]:
    fused, model.fused_step = model.fused_step, None
    try:
        return run(model, cache)
    finally:
        model.fused_step = fused


def assert_same_run(
    a: tuple[list[torch.Tensor], KVCache], b: tuple[list[torch.Tensor], KVCache], what: str
) -> None:
    (logits_a, cache_a), (logits_b, cache_b) = a, b
    for i, (x, y) in enumerate(zip(logits_a, logits_b, strict=True)):
        assert torch.equal(x, y), (
            f"{what}: sequence {i} logits differ, max |diff| {(x - y).abs().max().item():.3e}"
        )
    for layer in range(len(cache_a.k)):
        for name, pa, pb in (
            ("K", cache_a.k[layer], cache_b.k[layer]),
            ("V", cache_a.v[layer], cache_b.v[layer]),
        ):
            assert torch.equal(pa, pb), (
                f"{what}: layer {layer} {name} pool differs, max |diff| {(pa - pb).abs().max().item():.3e}"
            )


# -- 1. bit-identical to the module path ---------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_step_bit_identical_to_module_path(tiny_checkpoint, family: str, quantization: str) -> None:
    model = load_model(tiny_checkpoint(family)[0], quantization=quantization, progress=False).model
    assert model.fused_step is not None, f"load_model left {family}/{quantization} without a fused step"
    fused = run_fused(model)
    module = run_module_path(model)
    assert_same_run(fused, module, f"{family}/{quantization}")
    # Not a comparison of zeros: real logits, and every written slot of the pools filled.
    logits, cache = fused
    assert max(t.abs().max().item() for t in logits) > 1.0
    written = sum(len(s) for s in _sequences())
    assert int((cache.k[0].abs().sum(dim=(-1, -2)) > 0).sum()) == written


def _as_stored(pool: torch.Tensor, dtype: torch.dtype, c: ModelConfig) -> torch.Tensor:
    """A float32 pool's contents as a pool of ``dtype`` stores them (bf16 rounding, or int8 rows)."""
    if dtype == torch.bfloat16:
        return pool.bfloat16()
    stored = torch.zeros(*pool.shape[:3], kv_row_elements(c.head_dim, dtype), dtype=dtype)
    write_int8_rows(stored, torch.arange(pool.shape[0] * pool.shape[1]), pool.view(-1, c.num_kv_heads, c.head_dim))
    return stored


# (K/V dtype, family, quantization, the largest and the mean logit difference from float32 K/V allowed)
LOW_PRECISION_POOLS = [
    (torch.bfloat16, "llama", "int4", 0.3, 0.03),
    (torch.bfloat16, "qwen3", "none", 0.3, 0.03),
    (torch.bfloat16, "mistral", "int8", 0.3, 0.03),
    (torch.int8, "llama", "int4", 0.8, 0.06),  # measured 0.47 (mean 0.038)
    (torch.int8, "qwen3", "none", 0.8, 0.06),  # measured 0.23 (mean 0.021)
]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("dtype", "family", "quantization", "max_err", "max_mean"), LOW_PRECISION_POOLS,
                         ids=[f"{str(d)[6:]}-{f}-{q}" for d, f, q, _, _ in LOW_PRECISION_POOLS])
def test_fused_step_with_low_precision_kv_pools_is_bit_identical(
    tiny_checkpoint, dtype: torch.dtype, family: str, quantization: str, max_err: float, max_mean: float
) -> None:
    """EngineConfig(kv_cache_dtype="bfloat16" / "int8"): the fused step rounds K/V as it stores them, the
    way the module path does (k.to(torch.bfloat16), or write_int8_rows' quantizer), and attends over the
    same pools."""
    model = load_model(tiny_checkpoint(family)[0], quantization=quantization, progress=False).model
    c = model.config

    def pools() -> PagedKVCache:
        return PagedKVCache(c.num_layers, 64, 4, c.num_kv_heads, c.head_dim, dtype)

    fused = run_fused(model, pools())
    assert_same_run(fused, run_module_path(model, pools()), f"{family}/{quantization} {dtype} K/V")
    assert fused[1].k[0].dtype == dtype
    float32_logits, float32_pools = run_fused(model)
    # The pools hold the float32 run's K/V as stored (same first-layer inputs: bit for bit).
    assert torch.equal(fused[1].k[0], _as_stored(float32_pools.k[0], dtype, c))
    err = torch.cat([(a - b).abs().flatten() for a, b in zip(fused[0], float32_logits, strict=True)])
    assert 0 < err.max() <= max_err and err.mean() < max_mean


@pytest.mark.parametrize(("family", "quantization"), [("mistral", "none"), ("qwen3", "int4")])
def test_fused_step_bit_identical_in_fast_mode_with_default_threads(
    tiny_checkpoint, family: str, quantization: str
) -> None:
    """The engine's other settings: deterministic off and the default intra-op thread count."""
    path = tiny_checkpoint(family)[0]
    model = load_model(path, quantization=quantization, progress=False, deterministic=False).model
    assert_same_run(run_fused(model), run_module_path(model), f"{family}/{quantization} fast")


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_step_team_of_threads_is_bit_identical(
    tiny_checkpoint, family: str, quantization: str, threads: int
) -> None:
    """The step runs as one team of OpenMP threads meeting at spin barriers; the split of rows,
    channel tiles and attention units between members must not change a bit, including with
    more members than cores (3 here: members yield while they wait)."""
    model = load_model(tiny_checkpoint(family)[0], quantization=quantization, progress=False).model
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        team = run_fused(model)
    finally:
        torch.set_num_threads(previous)
    torch.set_num_threads(1)
    try:
        alone = run_module_path(model)
    finally:
        torch.set_num_threads(previous)
    assert_same_run(team, alone, f"{family}/{quantization} team of {threads} vs module path on one thread")


# -- 2. which path runs ---------------------------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_caches_the_fused_step_cannot_take_use_the_module_path(tiny_checkpoint, monkeypatch) -> None:
    model = load_model(tiny_checkpoint("qwen3")[0], progress=False).model
    reference, paged = run_fused(model)
    assert FusedStep.accepts(paged)
    c = model.config
    caches = {
        "contiguous": (contiguous_cache(model, max_seqs=8, max_seq_len=64), 1e-4),
        "paged, PyTorch attention": (
            PagedKVCache(c.num_layers, 64, 4, c.num_kv_heads, c.head_dim, torch.float32, use_kernel=False),
            1e-4,
        ),
    }
    counter = CountingStep(model.fused_step._step)
    monkeypatch.setattr(model.fused_step, "_step", counter)
    layer_calls = count_layer_calls(monkeypatch)
    for name, (cache, atol) in caches.items():
        assert not FusedStep.accepts(cache), name
        layer_calls[0] = 0
        logits, _ = run(model, cache)
        assert counter.calls == 0, f"{name}: the fused step ran"
        assert layer_calls[0] == NUM_STEPS * c.num_layers, name
        for a, b in zip(logits, reference, strict=True):  # the same model either way
            torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_model_runs_the_fused_step(tiny_checkpoint, family: str) -> None:
    """A bfloat16 model's fused step keeps its bf16 weights and float32 activations between
    operations. Where the linear kernel multiplies in bf16 (AVX512-BF16) each linear's input is
    rounded to bf16, as a bf16 matmul's is; elsewhere the weights widen and the step is, bit for bit,
    that of a float32 model holding the same bf16-rounded weights. Either way it is closer to the
    float32 checkpoint than the bf16 module path, which rounds every activation."""
    from protoserve.kernels.cpu import packed_linear

    path = tiny_checkpoint(family)[0]
    bf16 = load_model(path, dtype="bfloat16", progress=False).model
    c = bf16.config

    def bf16_pools() -> PagedKVCache:
        return PagedKVCache(c.num_layers, 64, 4, c.num_kv_heads, c.head_dim, torch.bfloat16)

    fused, _ = run_fused(bf16, bf16_pools())
    module, _ = run_module_path(bf16, bf16_pools())

    twin = unpack(copy.deepcopy(bf16)).float()  # the weights rebuilt from the bf16 packs, widened
    twin.dtype = torch.float32
    twin.pack_for_kernels()
    same = [torch.equal(a, b) for a, b in zip(fused, run_fused(twin, bf16_pools())[0], strict=True)]
    assert all(same) != packed_linear.multiplies_in_bf16(), family

    reference, _ = run(load_model(path, progress=False).model)
    fused_err = torch.cat([(a - r).abs().flatten() for a, r in zip(fused, reference, strict=True)]).mean()
    module_err = torch.cat([(a - r).abs().flatten() for a, r in zip(module, reference, strict=True)]).mean()
    assert 0 < fused_err < module_err, (family, fused_err.item(), module_err.item())


# -- 3. quantize_linears and deepcopy ------------------------------------------------------------


def unpack(model: Decoder) -> Decoder:
    """The model with every layer back on its PyTorch path and no fused step."""
    for m in model.modules():
        if isinstance(m, KernelPackable):
            m.unpack_from_kernel()
    model.fused_step = None
    return model


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_linears_drops_the_fused_step(tiny_checkpoint, monkeypatch, family: str, mode: str) -> None:
    path = tiny_checkpoint(family)[0]
    model = load_model(path, progress=False).model
    assert model.fused_step is not None
    fp32_logits, _ = run(model)
    fresh = unpack(copy.deepcopy(model))  # quantized from an unpacked copy, never had a fused step

    quantize_linears(model, mode, head_int8=True)  # what load_model does
    assert model.fused_step is None
    quantize_linears(fresh, mode, head_int8=True)
    layer_calls = count_layer_calls(monkeypatch)
    quantized, _ = run(model)
    assert layer_calls[0] == NUM_STEPS * model.config.num_layers
    expected, _ = run(fresh)
    for i, (a, b, f) in enumerate(zip(quantized, expected, fp32_logits, strict=True)):
        assert torch.equal(a, b), f"sequence {i}: max |diff| {(a - b).abs().max().item():.3e}"
        assert not torch.equal(a, f)  # a stale fused step would have kept the float32 weights
    monkeypatch.undo()

    # Packed again, it gets a fused step over the quantized weights: exactly what load_model serves.
    model.pack_for_kernels()
    served = load_model(path, quantization=mode, progress=False).model
    assert_same_run(run_fused(model), run_fused(served), f"{family}/{mode} repacked vs loaded")


@pytest.mark.usefixtures("one_thread")
def test_deepcopy_has_no_fused_step_until_packed(tiny_checkpoint) -> None:
    model = load_model(tiny_checkpoint("qwen2")[0], progress=False).model
    twin = copy.deepcopy(model)
    assert twin.fused_step is None and model.fused_step is not None
    reference = run_fused(model)
    assert_same_run(run(twin), reference, "deepcopy (module path)")
    twin.pack_for_kernels()
    assert twin.fused_step is not None and twin.fused_step is not model.fused_step
    assert_same_run(run_fused(twin), reference, "deepcopy, packed again")


# -- 4. the GIL -----------------------------------------------------------------------------------


def _random_decoder(config: ModelConfig) -> Decoder:
    with torch.device("meta"):
        model = Decoder(config)
    g = torch.Generator().manual_seed(0)
    model.load_state_dict(
        {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in model.state_dict().items()}, assign=True
    )
    model.pack_for_kernels()
    return model


def _spin_until(done: threading.Event) -> tuple[int, float, float, float]:
    """Count loop turns until ``done``: (turns, first turn time, last turn time, longest gap between turns)."""
    turns, worst = 0, 0.0
    first = prev = time.perf_counter()
    while not done.is_set():
        now = time.perf_counter()
        worst = max(worst, now - prev)
        prev = now
        turns += 1
    return turns, first, prev, worst


def _main_thread_progress(work) -> tuple[float, float, float]:
    """Run ``work`` in a thread while this thread spins a pure-Python loop.

    Returns (seconds the work took, the loop's turns during it as a fraction of its turns alone in as long,
    this thread's longest stall during the work as a fraction of the work's time). A stall counts from
    the work's start: a call that held the GIL would keep this thread from taking its first turn.
    """
    started, done, span = threading.Event(), threading.Event(), []

    def worker() -> None:
        started.set()
        t0 = time.perf_counter()
        try:
            work()
        finally:
            span.extend((t0, time.perf_counter()))
            done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    turns, first, last, worst = _spin_until(done)
    thread.join()
    t0, t1 = span
    seconds = t1 - t0
    stall = max(worst, first - t0, t1 - last)
    idle_done = threading.Event()
    timer = threading.Timer(seconds, idle_done.set)  # the same loop, alone for as long
    timer.start()
    idle_turns = _spin_until(idle_done)[0]
    timer.join()
    return seconds, turns / max(idle_turns, 1), stall / seconds


@pytest.mark.usefixtures("one_thread")
def test_fused_step_releases_the_gil(monkeypatch) -> None:
    """While a long prefill runs in another thread (one intra-op thread), this thread keeps running Python.

    No absolute timings: the probe compares this thread against itself alone over the same time, and
    first checks that it does see a call that holds the GIL (builtin ``sum`` over a range never releases it).
    """
    model = _random_decoder(ModelConfig("llama", 256, 512, 1536, 4, 8, 2, 64))
    assert model.fused_step is not None
    tokens, bs = 384, 16
    blocks = tokens // bs
    batch = forward_batch([scheduled([i % 256 for i in range(tokens)], 0, list(range(blocks)))], bs)
    cache = PagedKVCache(4, blocks, bs, 2, 64)
    model(batch, cache)  # warm-up

    held_seconds, held_progress, held_stall = _main_thread_progress(lambda: sum(range(10_000_000)))
    if held_stall < 0.5:
        pytest.skip(f"this interpreter does not block on a GIL-holding call (stall {held_stall:.2f})")

    forbid_module_path(monkeypatch)  # the forward below is the fused step's
    seconds, progress, stall = _main_thread_progress(lambda: model(batch, cache))
    print(
        f"GIL-holding control: {held_seconds:.3f}s, progress {held_progress:.2f}, stall {held_stall:.2f}; "
        f"fused prefill of {tokens} tokens: {seconds:.3f}s, progress {progress:.2f}, stall {stall:.2f}"
    )
    assert stall < 0.25, f"this thread stalled for {stall:.0%} of the fused forward"
    assert progress > 0.05, f"this thread ran at {progress:.0%} of its idle rate during the fused forward"


# -- 5. bad input ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_bad_arguments_raise_clear_errors(tiny_checkpoint) -> None:
    model = load_model(tiny_checkpoint("mistral")[0], progress=False).model
    step = model.fused_step._step
    bs = 4
    batch = forward_batch([scheduled(list(range(5)), 0, [0, 1]), scheduled([0, 0, 0, 7], 3, [2])], bs)
    cache = paged_cache(model, num_blocks=8, block_size=bs)
    x = model.embed_tokens(batch.input_ids)
    cos, sin = rope_cos_sin(batch.positions, model.rope, torch.float32)
    good = dict(
        x=x,
        cos=cos,
        sin=sin,
        k_caches=cache.k,
        v_caches=cache.v,
        slot_mapping=batch.slot_mapping,
        block_tables=batch.block_tables,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        logits_indices=batch.logits_indices,
        sliding_window=model.config.sliding_window,
    )

    def call(**changes):
        def fresh(value):  # the step writes x and the pools in place
            if isinstance(value, list):
                return [t.clone() for t in value]
            return value.clone() if isinstance(value, torch.Tensor) else value

        args = {name: fresh(value) for name, value in good.items()}
        args.update(changes)
        return step.forward(**args)

    expected = model(batch, paged_cache(model, num_blocks=8, block_size=bs))
    assert torch.equal(call(), expected)  # the direct call is the forward's

    k, v = cache.k, cache.v
    bad = {
        "one K and one V pool per layer": [dict(k_caches=k[:-1]), dict(v_caches=v[:-1]), dict(k_caches=[])],
        r"slot_mapping must be int64 \[T\]": [
            dict(slot_mapping=batch.slot_mapping.int()),
            dict(slot_mapping=batch.slot_mapping[:-1]),
            dict(x=x[:-1].contiguous()),
        ],
        r"x must be contiguous float32 \[T, 64\]": [
            dict(x=x.double()),
            dict(x=x.t().contiguous().t()),
            dict(x=x[:, :32].contiguous()),
        ],
        r"cos and sin must be contiguous float32 \[T, head_dim\]": [
            dict(cos=cos[:-1], sin=sin[:-1]),
            dict(cos=cos.double(), sin=sin.double()),
        ],
        "must be contiguous int32 CPU tensors": [dict(block_tables=batch.block_tables.long())],
        "block id 1000 out of range": [dict(block_tables=batch.block_tables + 1000)],
        "exceeds its block table": [dict(seq_lens=batch.seq_lens + 100)],
        "query_start_loc must run from 0 to T": [dict(query_start_loc=batch.query_start_loc + 1)],
        r"sliding_window must be >= 0": [dict(sliding_window=-1)],
        r"every K/V pool must be contiguous, of one shape and one dtype \(float32, bfloat16 or int8\)": [
            dict(k_caches=[t.bfloat16() for t in k]),  # K bf16, V float32
            dict(k_caches=[t.half() for t in k], v_caches=[t.half() for t in v]),
            dict(v_caches=[torch.zeros(8, 4, 1, 32)] * len(v)),
        ],
        # A pool laid out for another model: wrong head size or wrong number of KV heads.
        r"the K/V pools hold 1 heads of 32, the model 2 of 16": [
            dict(k_caches=[torch.zeros(8, 4, 1, 32)] * len(k), v_caches=[torch.zeros(8, 4, 1, 32)] * len(v))
        ],
        r"the K/V pools hold 1 heads of 16, the model 2 of 16": [
            dict(k_caches=[torch.zeros(8, 4, 1, 16)] * len(k), v_caches=[torch.zeros(8, 4, 1, 16)] * len(v))
        ],
        "is outside the K/V pool": [
            dict(slot_mapping=batch.slot_mapping + 10**6),
            dict(slot_mapping=batch.slot_mapping - 100),
        ],
        "is outside the batch": [dict(logits_indices=torch.tensor([100]))],
    }
    for message, cases in bad.items():
        for changes in cases:
            with pytest.raises(RuntimeError, match=message):
                call(**changes)

    # Through the model too, and a failed step leaves the model serving.
    broken = copy.copy(batch)
    broken.slot_mapping = batch.slot_mapping.int()
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        model(broken, paged_cache(model, num_blocks=8, block_size=bs))
    assert torch.equal(model(batch, paged_cache(model, num_blocks=8, block_size=bs)), expected)


# -- phase timing (bench/step_profile.py --phases) ----------------------------------------------------


def test_step_phase_timing_books_the_timed_steps_only(tiny_checkpoint, monkeypatch) -> None:
    from protoserve.kernels.cpu import step_phases

    model = load_model(tiny_checkpoint("llama")[0], quantization="int4", progress=False).model
    step_phases.take()
    run_fused(model)
    assert step_phases.take()["steps"] == 0  # timing is off unless asked for
    calls: list[int] = []
    original = FusedStep.__call__

    def counted(self, batch, *args, **kwargs):
        calls.append(int(batch.slot_mapping.numel()))
        return original(self, batch, *args, **kwargs)

    monkeypatch.setattr(FusedStep, "__call__", counted)
    with step_phases.timed() as split:
        start = time.perf_counter()
        timed_logits = run_fused(model)[0]
        wall = time.perf_counter() - start
    assert (split["steps"], split["tokens"]) == (len(calls), sum(calls)) and calls
    assert all(split[name] > 0 for name in step_phases.PHASES), split
    assert sum(split[name] for name in step_phases.PHASES) <= wall
    assert step_phases.take()["steps"] == 0  # off again once the block ends
    for a, b in zip(timed_logits, run_fused(model)[0], strict=True):
        assert torch.equal(a, b)  # timing changes no result
