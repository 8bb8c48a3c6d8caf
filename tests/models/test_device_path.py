"""The GPU path (``device="cuda"``): the whole model on the Triton kernels, against transformers.

Here, with no GPU, the Triton table of engine/models/device_ops.py serves CPU tensors under
TRITON_INTERPRET=1 (``triton-interpreted``): the same kernels, block tables, packs and engine
code the CUDA device runs, checked end to end. On a machine with a CUDA device (``make test-gpu``)
the same tests also run with ``device="cuda"`` for real.

Checked: every position's logits of float32 models within 1e-4 of transformers (llama3 rope scaling,
Mistral's window, Qwen2 biases and tied head, Qwen3 q/k norms), through two chunks of one prompt
(prefill, then a chunk over the cached part); greedy tokens of three concurrent requests through
LLMEngine equal transformers'; int8 and int4 layers equal the product with their own dequantized
codes; FP8 (E4M3) layers equal their codes' product and keep the logits close; Gemma 2's soft-capped
scores and DeepSeek's latent attention (one shared pool read as K and V) on the attention kernels,
logits and greedy tokens against transformers and the CPU path; refusals of what the device cannot serve.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from forward_batches import forward_batch, scheduled

from protoserve.engine.config import EngineConfig
from protoserve.engine.execution.device import DeviceUnavailableError, resolve_device
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.loader.load import load_model
from protoserve.engine.models import device_ops
from protoserve.engine.models.kv_cache import PagedKVCache
from protoserve.engine.models.linear import KernelPackable
from protoserve.kernels import triton as triton_kernels
from protoserve.kernels.cpu.packed_linear import unpack

pytestmark = pytest.mark.slow  # the Triton kernels under the CPU interpreter (tens of seconds): make test, not make test-fast

TARGETS = ["triton-interpreted", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))]
BLOCK = 4


@pytest.fixture(params=TARGETS)
def device(request, monkeypatch) -> str:
    """The engine's device name for the target; the interpreted target routes CPU tensors to Triton."""
    if request.param == "cuda":
        return "cuda"
    if not (triton_kernels.available() and triton_kernels.interpreting()):
        pytest.skip("the Triton interpreter is not set up (TRITON_INTERPRET=1 before triton is imported)")
    monkeypatch.setattr(device_ops, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    return "cpu"


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def step_logits(model, cache: PagedKVCache, ids: list[int], computed: int, table: list[int]) -> torch.Tensor:
    seq = scheduled(ids, computed, table)
    batch = forward_batch([seq], BLOCK, every_position=True).to(cache.k[0].device)
    return model(batch, cache).float().cpu()


def device_cache(loaded, device: torch.device, num_blocks: int = 32) -> PagedKVCache:
    # The model's own KV layout: K/V per KV head, or MLA's one shared latent pool.
    return PagedKVCache.for_model(loaded.config, num_blocks, BLOCK, torch.float32, device=device)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_float_logits_equal_transformers(device, family, tiny_checkpoint):
    directory, hf_model = tiny_checkpoint(family)
    loaded = load_model(directory, progress=False, load_tokenizer=False, device=device)
    assert loaded.model.fused_step is None  # the Triton kernels, not the C++ step
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (37,)).tolist()  # longer than Mistral's window of 16
    cache = device_cache(loaded, loaded.device)
    table = list(range(10))
    first = step_logits(loaded.model, cache, ids[:21], 0, table)  # prefill
    rest = step_logits(loaded.model, cache, ids, 21, table)  # a chunk over the cached 21
    ours = torch.cat([first, rest])
    expected = hf_logits(hf_model, ids)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_of_concurrent_requests_equal_transformers(device, family, tiny_checkpoint):
    from family_checkpoints import hf_greedy

    directory, hf_model = tiny_checkpoint(family)
    loaded = load_model(directory, progress=False, load_tokenizer=False, device=device)
    engine = LLMEngine(loaded, EngineConfig(device=device, max_kv_blocks=48, block_size=BLOCK,
                                            max_num_batched_tokens=24))
    prompts = [[5, 17, 99, 3], list(range(40, 71)), [200, 1, 2, 3, 4, 5, 6, 7, 8]]
    completions = LLM(engine=engine).generate(prompt_token_ids=prompts, max_tokens=12, temperature=0.0,
                                              ignore_eos=True)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.choices[0].token_ids == hf_greedy(hf_model, prompt, 12)


def test_seeded_sampling_on_the_device_equals_the_host_sampler(device, tiny_checkpoint):
    """The rows the batched sampler serves (engine/sampling/batched.py; on cuda the logits never leave the
    GPU) draw the host sampler's tokens: same filters, same uniforms from each request's generator."""
    directory, _ = tiny_checkpoint("llama")
    loaded = load_model(directory, progress=False, load_tokenizer=False, device=device)
    engine = LLMEngine(loaded, EngineConfig(device=device, max_kv_blocks=48, block_size=BLOCK))
    llm = LLM(engine=engine)
    prompts = [[5, 17, 99, 3], list(range(40, 60))]
    kinds = [dict(temperature=0.9, top_k=20, seed=11), dict(temperature=1.2, top_p=0.8, min_p=0.05, seed=12,
                                                           repetition_penalty=1.2, frequency_penalty=0.3)]
    outputs = {}
    for batch_rows in (True, False):
        engine.sampler.batch_rows = batch_rows or device == "cuda"  # cuda: the device path whatever the flag
        outputs[batch_rows] = [llm.generate(prompt_token_ids=prompts, max_tokens=10, ignore_eos=True, **kind)
                               for kind in kinds]
    assert [[c.choices[0].token_ids for c in run] for run in outputs[True]] == \
        [[c.choices[0].token_ids for c in run] for run in outputs[False]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_decode_graphs_give_the_eager_steps_tokens(tiny_checkpoint):
    from family_checkpoints import hf_greedy

    directory, hf_model = tiny_checkpoint("qwen3")
    prompts = [[5, 17, 99, 3], list(range(40, 71)), [200, 1, 2, 3, 4, 5, 6, 7, 8]]  # 3 rows: bucket 4, padded
    tokens = {}
    for graphs in (True, False):
        loaded = load_model(directory, progress=False, load_tokenizer=False, device="cuda")
        engine = LLMEngine(loaded, EngineConfig(device="cuda", cuda_graphs=graphs, max_kv_blocks=48,
                                                block_size=BLOCK, max_num_batched_tokens=24))
        completions = LLM(engine=engine).generate(prompt_token_ids=prompts, max_tokens=12, temperature=0.0,
                                                  ignore_eos=True)
        tokens[graphs] = [c.choices[0].token_ids for c in completions]
        assert (engine.runner.graphs is not None) == graphs
        if graphs:
            assert {1, 2, 4} & set(engine.runner.graphs.graphs)  # decode steps did replay
    assert tokens[True] == tokens[False] == [hf_greedy(hf_model, p, 12) for p in prompts]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_experts_on_the_fused_kernel_equal_transformers(device, family, tmp_path, monkeypatch):
    import warnings

    from test_moe_families import _make_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = _make_checkpoint(family, tmp_path)
    ops = device_ops.ops_for(torch.device(device))
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return ops.fused_moe(*args)

    monkeypatch.setattr(device_ops, "_triton_ops", lambda: dataclasses.replace(ops, fused_moe=counted))
    loaded = load_model(tmp_path, progress=False, load_tokenizer=False, device=device)
    ids = list(range(30, 57))
    ours = step_logits(loaded.model, device_cache(loaded, loaded.device), ids, 0, list(range(10)))
    experts = [m.mlp.experts for m in loaded.model.layers if m.moe]
    assert experts and all(e._stacks is not None for e in experts)
    assert calls == [len(ids)] * len(experts)  # the fused kernel ran every MoE layer
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    """(directory, transformers model) of a tiny Gemma 2 (tests/models/dense_family_checkpoints.py: a window
    of 8, attention scores capped at 5, which bends them) or DeepSeek-V2 (test_deepseek_family.py: MLA with
    plain queries, group-routed experts beside two shared ones), built once per module."""
    from dense_family_checkpoints import make_checkpoint
    from test_deepseek_family import _make_checkpoint as make_deepseek
    from tiny_families import checkpoint_cache

    def make(family: str, directory):
        return make_deepseek("v2", directory) if family == "deepseek-v2" else make_checkpoint(family, directory)

    return checkpoint_cache(tmp_path_factory, make)


def counting_attention(monkeypatch) -> list:
    """Every call of the Triton paged attention, as (rows, soft cap): proof the kernels served each layer."""
    ops = device_ops.ops_for(torch.device("cuda"))
    calls = []

    def counted(q, k_pool, v_pool, batch, scale, window, softcap):
        calls.append((q.shape[0], softcap))
        return ops.paged_attention(q, k_pool, v_pool, batch, scale, window, softcap)

    monkeypatch.setattr(device_ops, "_triton_ops", lambda: dataclasses.replace(ops, paged_attention=counted))
    return calls


@pytest.mark.parametrize("family", ["gemma2", "deepseek-v2"])
def test_soft_capped_and_latent_attention_equal_transformers(device, family, family_checkpoint, monkeypatch):
    """Gemma 2 (scores capped in the kernels) and DeepSeek-V2 (MLA: the kernels attend over one shared
    latent pool): every position's logits within 1e-4 of transformers over a prefill and a chunk over
    the cached part, every layer on the Triton attention."""
    directory, hf_model = family_checkpoint(family)
    calls = counting_attention(monkeypatch)
    loaded = load_model(directory, progress=False, load_tokenizer=False, device=device)
    ids = list(range(3, 40))  # past Gemma 2's window of 8
    cache = device_cache(loaded, loaded.device)
    assert (cache.v is cache.k) == (family == "deepseek-v2")
    table = list(range(10))
    ours = torch.cat([step_logits(loaded.model, cache, ids[:21], 0, table),
                      step_logits(loaded.model, cache, ids, 21, table)])
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() < 1e-4
    cap = loaded.config.attn_logit_softcapping
    assert cap == (5.0 if family == "gemma2" else None)
    assert calls == [(21, cap)] * loaded.config.num_layers + [(16, cap)] * loaded.config.num_layers


@pytest.mark.parametrize("family", ["gemma2", "deepseek-v2"])
def test_soft_capped_and_latent_greedy_tokens_equal_the_cpu_path(device, family, family_checkpoint):
    """Three concurrent requests through LLMEngine, chunked prefill beside decodes: the device path's greedy
    tokens equal the CPU path's (the tiled soft-capped attention, the C++ or PyTorch MLA) and transformers'."""
    from family_checkpoints import hf_greedy

    directory, hf_model = family_checkpoint(family)
    prompts = [[5, 17, 99, 3], list(range(40, 71)), [200, 1, 2, 3, 4, 5, 6, 7, 8]]
    tokens = {}
    for target in (device, "host"):
        on_device = target == device
        with pytest.MonkeyPatch.context() as patch:
            if not on_device:  # the interpreted target routes CPU tensors to Triton: not for the host run
                patch.setattr(device_ops, "TRITON_DEVICE_TYPES", frozenset({"cuda"}))
            name = device if on_device else "cpu"
            loaded = load_model(directory, progress=False, load_tokenizer=False, device=name)
            engine = LLMEngine(loaded, EngineConfig(device=name, max_kv_blocks=48, block_size=BLOCK,
                                                    max_num_batched_tokens=24))
            assert (engine.runner.kv_cache.ops.name == "triton") == on_device
            completions = LLM(engine=engine).generate(prompt_token_ids=prompts, max_tokens=12, temperature=0.0,
                                                      ignore_eos=True)
        tokens[target] = [c.choices[0].token_ids for c in completions]
    assert tokens[device] == tokens["host"] == [hf_greedy(hf_model, p, 12) for p in prompts]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_layers_multiply_their_own_codes(device, mode, tiny_checkpoint):
    directory, _ = tiny_checkpoint("qwen2")  # q/k/v biases: the kernel adds them
    loaded = load_model(directory, quantization=mode, group_size=32, progress=False, load_tokenizer=False,
                        device=device)
    layers = [m for m in loaded.model.modules() if isinstance(m, KernelPackable) and m.packed is not None]
    assert all(m.packed.data.device == loaded.device for m in layers)
    # The plain packs (no CPU integer-dot layout); the LM head is int8 under int4 too.
    assert sorted({m.packed.format for m in layers}) == sorted({mode, "int8"})
    torch.manual_seed(2)
    for layer in layers:
        x = torch.randn(5, layer.in_features, device=loaded.device)
        w = unpack(layer.packed.to(torch.device("cpu"))).double()
        expected = x.cpu().bfloat16().double() @ w.T  # the device multiplies bf16 activations
        if layer.bias is not None:
            expected += layer.bias.cpu().double()
        got = layer(x).double().cpu()
        assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_fp8_layers_multiply_their_codes_and_stay_close_to_float(device, tiny_checkpoint):
    from protoserve.engine.models.linear import Fp8Linear, Linear, dequantize_int8, quantize_int8
    from protoserve.kernels.triton.fp8_matmul import (
        Fp8Weight,
        dequantize_fp8,
        quantize_fp8,
        reference_fp8_matmul,
    )

    directory, hf_model = tiny_checkpoint("qwen2")
    loaded = load_model(directory, quantization="fp8", progress=False, load_tokenizer=False, device=device)
    layers = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * loaded.config.num_layers and layers[0].codes.dtype == torch.float8_e4m3fn
    torch.manual_seed(3)
    for layer in layers:
        x = torch.randn(3, layer.in_features, device=loaded.device)
        bias = None if layer.bias is None else layer.bias.cpu()
        # The device multiplies bf16 activations (exact products with the E4M3 codes).
        expected = reference_fp8_matmul(x.cpu().bfloat16(), Fp8Weight(layer.codes.cpu(), layer.scales.cpu()), bias)
        assert (layer(x).cpu() - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())
    # The whole model equals the float model whose weights are the dequantized codes (the head int8)
    # and whose FP8 layers' and head's inputs are rounded to bf16.
    reference = load_model(directory, progress=False, load_tokenizer=False, device=device)
    with torch.no_grad():
        for name, m in reference.model.named_modules():
            if isinstance(m, Linear) and name != "lm_head":
                m.weight.copy_(dequantize_fp8(quantize_fp8(m.weight)).float())
                # as the device does, the FP8 layers multiply bf16-rounded activations
                m.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
        head = reference.model.lm_head.weight
        q, scales = quantize_int8(head)
        reference.model.lm_head.weight = torch.nn.Parameter(dequantize_int8(q, scales), requires_grad=False)
        reference.model.lm_head.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    ids = list(range(60, 90))
    ours = step_logits(loaded.model, device_cache(loaded, loaded.device), ids, 0, list(range(10)))
    expected = step_logits(reference.model, device_cache(reference, reference.device), ids, 0, list(range(10)))
    # An activation a float32 ulp from a bf16 tie can round the other way in one of the two, and the
    # change spreads to later positions through their K/V: most logits agree to float32 rounding,
    # none by more than a tenth of what the codes' own rounding moves.
    diff = (ours - expected).abs()
    assert diff.median().item() < 1e-5 and diff.max().item() < 0.05
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() > 0.5  # and the codes did round


def test_device_names_and_refusals(tiny_checkpoint):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig(device="tpu").validate()
    with pytest.raises(ValueError, match="speculative_model .* device cpu only"):
        EngineConfig(device="cuda", speculative_model="default").validate()
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="torch.cuda.is_available\\(\\) is False"):
            resolve_device("cuda")
        directory, _ = tiny_checkpoint("llama")
        with pytest.raises(DeviceUnavailableError):  # before any weight is read
            load_model(directory, progress=False, load_tokenizer=False, device="cuda")
    with pytest.raises(ValueError, match="quantization fp8 has no kernel on device cpu"):
        load_model(tiny_checkpoint("llama")[0], quantization="fp8", progress=False, load_tokenizer=False)
    loaded = load_model(tiny_checkpoint("llama")[0], progress=False, load_tokenizer=False)
    with pytest.raises(ValueError, match="loaded on cpu"):
        LLMEngine(loaded, EngineConfig(device="cuda", max_kv_blocks=16))


@pytest.mark.parametrize("graphs", [True, False])
def test_async_scheduling_gives_the_plain_steps_tokens(device, graphs, tiny_checkpoint):
    """Overlapped steps (engine/execution/async_step.py: the next step's input ids taken on the device, the
    host a step behind) against plain ones: greedy and seeded rows ending at different steps, a stop token,
    a cancel and an arrival mid-run; on cuda with decode graphs and without (the interpreter has none)."""
    from protoserve.engine.request import TokenizedRequest
    from protoserve.engine.sampling.sampling_params import SamplingParams

    if graphs and device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    directory, _ = tiny_checkpoint("llama")
    kinds = {"greedy": dict(max_tokens=12, temperature=0.0), "seeded": dict(max_tokens=9, temperature=0.9, seed=5),
             "short": dict(max_tokens=3, temperature=0.0), "stop": dict(max_tokens=12, temperature=0.0,
                                                                        stop_token_ids=[17, 99, 200]),
             "cancel": dict(max_tokens=12, temperature=0.0), "late": dict(max_tokens=6, temperature=0.7, seed=9)}
    tokens = {}
    for overlap in (True, False):
        loaded = load_model(directory, progress=False, load_tokenizer=False, device=device)
        engine = LLMEngine(loaded, EngineConfig(device=device, max_kv_blocks=64, block_size=BLOCK,
                                                cuda_graphs=graphs, async_scheduling=overlap))
        engine.sampler.batch_rows = True
        got: dict[str, list[int]] = {}

        def add(name: str) -> None:
            engine.add_request(TokenizedRequest(request_id=name, prompt_token_ids=[5, 17, 99, 3, len(name) * 11],  # noqa: B023
                                                sampling=SamplingParams(ignore_eos=True, **kinds[name])))

        for name in ("greedy", "seeded", "short", "stop", "cancel"):
            add(name)
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(t for d in out.deltas for t in d.token_ids)
            if "late" not in got and len(got.get("greedy", [])) >= 2:
                add("late")
                got["late"] = []
            if len(got.get("cancel", [])) >= 4:
                engine.abort("cancel")
        tokens[overlap] = got
        assert (engine.overlap is not None and engine.overlap.num_overlapped > 3) == overlap
    assert tokens[True] == tokens[False]
    assert len(tokens[False]["late"]) == 6 and 4 <= len(tokens[False]["cancel"]) < 12
