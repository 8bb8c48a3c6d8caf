"""DeepSeek-V2/V3 (multi-head latent attention + MoE with shared experts) on tiny random checkpoints.

Two checkpoints written with transformers' own classes: V2 with plain queries (no q_lora_rank),
softmax ``group_limited_greedy`` routing and two shared experts; V3 with low-rank queries, sigmoid
``noaux_tc`` routing with a non-zero ``e_score_correction_bias``, yarn rope with ``mscale_all_dim``
(so the softmax scale carries mscale squared) and ``routed_scaling_factor``. Both have a dense first
layer (``first_k_dense_replace``). Checked: every position's logits within 1e-4 of transformers over
a prefill and over random chunks of cached decode (on the C++ attention kernel and the PyTorch
fallback), 32 greedy tokens alone and in a mixed continuous batch, the paged pool holding one
``kv_lora_rank + qk_rope_head_dim`` vector per token (and GetModel saying so), the GGUF form, and
refusals of what is not served.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from decoder_test_helpers import Driver, all_at_once, greedy_generate, random_mix
from family_checkpoints import EOS, VOCAB, hf_greedy, make_checkpoint
from tiny_families import checkpoint_cache, mixed_batch
from torch import nn

from bench.tiny_checkpoints import hf_logits, random_model, random_prompts, save_checkpoint
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.load import load_model
from protoserve.engine.models.kv_cache import PagedKVCache

pytestmark = pytest.mark.usefixtures("one_thread")

VERSIONS = ("v2", "v3")
PROMPT_LENS = (5, 23, 41)
GREEDY = 32
RANK, ROPE, NOPE, V_DIM = 32, 8, 16, 16
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=EOS, bos_token_id=None, pad_token_id=None,
            kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V_DIM, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1)


def _hf_config(version: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    if version == "v2":
        return DeepseekV2Config(**TINY, q_lora_rank=None, topk_method="group_limited_greedy", n_shared_experts=2,
                                routed_scaling_factor=1.5)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV3Config(**TINY, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5,
                            rope_parameters=yarn)


def _make_checkpoint(version: str, directory: Path) -> nn.Module:
    model = random_model(_hf_config(version))
    with torch.no_grad():
        for module in model.modules():  # V3: a bias that changes which experts are chosen
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.copy_(0.1 * torch.randn_like(module.e_score_correction_bias))
    return save_checkpoint(model, directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, _make_checkpoint, prefix="deepseek-")


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory) -> tuple[Path, nn.Module]:
    """A family with KV heads to compare with (Qwen2: 3 layers, 2 KV heads of 16), with a tokenizer."""
    directory = tmp_path_factory.mktemp("qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return directory, make_checkpoint("qwen2-swa", directory)


def _gqa_bytes_per_token(config) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts(PROMPT_LENS, seed)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("use_kernel", [None, False], ids=["kernel", "pytorch"])
def test_logits_match_transformers_prefill_and_cached_decode(checkpoint, version: str, use_kernel) -> None:
    """Every position within 1e-4 of transformers, the prompts prefilled at once and in random chunks
    of cached decode (1, 2, 5, 16, 33 tokens over the latent pool); the two schedules bit-identical."""
    path, ref_model = checkpoint(version)
    loaded = load_model(path, progress=False)
    prompts = _prompts(1)

    def run(schedule):
        cache = PagedKVCache.for_model(loaded.config, 256, 4, use_kernel=use_kernel)
        return Driver(loaded.model, cache).run(prompts, schedule)

    once, mixed = run(all_at_once), run(random_mix(3))
    worst = 0.0
    for prompt, a, b in zip(prompts, once, mixed, strict=True):
        ref = hf_logits(ref_model, prompt)
        assert ref.abs().max() > 1.0
        worst = max(worst, (a - ref).abs().max().item())
        assert torch.equal(a, b)
    print(f"deepseek {version}: max |logit diff| vs transformers = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("version", VERSIONS)
def test_greedy_tokens_equal_transformers(checkpoint, version: str) -> None:
    path, ref_model = checkpoint(version)
    loaded = load_model(path, progress=False)
    prompts = _prompts(4)
    for prompt, tokens in zip(prompts, greedy_generate(loaded.model, prompts, GREEDY), strict=True):
        assert tokens == hf_greedy(ref_model, prompt, GREEDY)


@pytest.mark.parametrize("version", VERSIONS)
def test_mixed_continuous_batch(checkpoint, version: str) -> None:
    """Greedy requests among seeded sampling ones, chunked prefill beside decodes (LLMEngine): each
    greedy request's 32 tokens equal transformers'."""
    path, ref_model = checkpoint(version)
    prompts = _prompts(6)
    _, done = mixed_batch(path, prompts, GREEDY, sampled=3, sampled_len=30, sampled_tokens=16)
    for i, prompt in enumerate(prompts):
        assert done[f"greedy-{i}"] == hf_greedy(ref_model, prompt, GREEDY), f"greedy-{i}"


def test_the_pool_holds_the_compressed_latent(checkpoint, gqa_checkpoint) -> None:
    """The engine's pool keeps one (kv_lora_rank + qk_rope_head_dim) vector per token and layer, read as
    K and V alike; a GQA family keeps K and V per KV head. Bytes per token equal each formula."""
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(load_model(checkpoint("v3")[0], progress=False), EngineConfig(max_kv_blocks=8, block_size=4))
    pool = engine.runner.kv_cache
    assert pool.v is pool.k
    assert all(tuple(k.shape) == (pool.num_blocks, 4, 1, RANK + ROPE) for k in pool.k)
    assert pool.bytes_per_token == 2 * (RANK + ROPE) * 4  # 2 layers, float32
    assert engine.runner.block_bytes == 4 * pool.bytes_per_token

    path, hf = gqa_checkpoint
    gqa = LLMEngine(load_model(path, progress=False), EngineConfig(max_kv_blocks=8))
    assert gqa.runner.kv_cache.v is not gqa.runner.kv_cache.k
    assert gqa.runner.kv_cache.bytes_per_token == _gqa_bytes_per_token(hf.config)


def test_get_model_reports_kv_bytes_per_token(checkpoint, gqa_checkpoint, spawn_server) -> None:
    """GetModel over gRPC: DeepSeek's bytes per token are layers x (kv_lora_rank + qk_rope_head_dim) x
    dtype bytes; a GQA family's 2 x layers x KV heads x head_dim x dtype bytes."""
    from protoserve.v1 import inference_pb2, inference_pb2_grpc

    gqa_dir, gqa = gqa_checkpoint
    formulas = {checkpoint("v2")[0]: 2 * (RANK + ROPE) * 4, gqa_dir: _gqa_bytes_per_token(gqa.config)}
    for path, expected in formulas.items():
        server = spawn_server("--model", str(path), "--no-embedding-model", "--no-http")
        with server.sync_channel() as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            name = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=30).models[0].name
            info = stub.GetModel(inference_pb2.GetModelRequest(name=name), timeout=30).model
        server.stop()
        assert info.kv_cache_dtype == "float32"
        assert info.kv_bytes_per_token == expected, info.architecture


def test_summary_and_module_path(checkpoint, caplog) -> None:
    """GetModel's summary counts the routed experts a token skips; MLA and MoE run on the module path,
    the fused step's reason logged."""
    path, ref_model = checkpoint("v3")
    with caplog.at_level(logging.INFO, logger="protoserve.engine.models.decoder"):
        loaded = load_model(path, progress=False)
    summary = loaded.summary()
    total = sum(t.numel() for t in ref_model.state_dict().values())  # e_score_correction_bias is a buffer there
    assert summary.family == "deepseek" and summary.parameters == total
    assert summary.active_parameters == total - (4 - 2) * 3 * 64 * 32  # one MoE layer, 2 of 4 experts idle
    assert loaded.model.fused_step is None
    assert any("deepseek: the fused C++ step does not run multi-head latent attention" in r.getMessage()
               for r in caplog.records)


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **changes}))
    return dst


@pytest.mark.parametrize(("version", "changes", "message"), [
    ("v2", {"topk_method": "noaux_tc"}, "unsupported topk_method 'noaux_tc'"),
    ("v3", {"scoring_func": "softmax"}, "unsupported scoring_func 'softmax'"),
    ("v3", {"attention_bias": True}, "attention_bias"),
    ("v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("v2", {"hidden_act": "gelu"}, "hidden_act"),
    ("v3", {"n_group": 3}, "num_groups"),
    ("v3", {"num_experts_per_tok": 3}, "top_k"),
])
def test_unsupported_options_are_refused_by_name(checkpoint, tmp_path: Path, version, changes, message) -> None:
    bad = _copy_with_config(checkpoint(version)[0], tmp_path / "bad", **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(bad, progress=False)


def _with_mtp_layer(src: Path, dst: Path, **changes) -> Path:
    """The checkpoint plus a multi-token-prediction layer's tensors after its last layer, in a shard of
    their own, as DeepSeek-V3's release stores them (model.layers.61.* there)."""
    from safetensors.torch import save_file

    copy = _copy_with_config(src, dst, **changes)
    layer = f"model.layers.{TINY['num_hidden_layers']}"
    hidden = TINY["hidden_size"]
    mtp = {f"{layer}.enorm.weight": torch.ones(hidden), f"{layer}.hnorm.weight": torch.ones(hidden),
           f"{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
           f"{layer}.shared_head.norm.weight": torch.ones(hidden),
           f"{layer}.self_attn.kv_a_proj_with_mqa.weight": torch.randn(RANK + ROPE, hidden)}
    save_file(mtp, str(copy / "model-mtp.safetensors"))
    return copy


def test_a_v3_multi_token_prediction_layer_is_skipped(checkpoint, tmp_path: Path, caplog) -> None:
    path, ref_model = checkpoint("v3")
    with_mtp = _with_mtp_layer(path, tmp_path / "mtp", num_nextn_predict_layers=1)
    with caplog.at_level(logging.INFO, logger="protoserve.engine.loader.hf_checkpoint"):
        loaded = load_model(with_mtp, progress=False)
    assert "skipped the 5 tensors of its 1 multi-token-prediction layer(s)" in caplog.text
    prompt = _prompts(5)[0]
    assert greedy_generate(loaded.model, [prompt], GREEDY)[0] == hf_greedy(ref_model, prompt, GREEDY)
    # Only the layers num_nextn_predict_layers names: the same tensors are refused where it is 0.
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.2\."):
        load_model(_with_mtp_layer(path, tmp_path / "no-mtp", num_nextn_predict_layers=0), progress=False)


def test_lora_is_refused_on_latent_attention(checkpoint) -> None:
    from protoserve.engine.lora.adapter import AdapterError, check_adapter_targets

    config = load_model(checkpoint("v2")[0], progress=False).config
    with pytest.raises(AdapterError, match="multi-head latent attention"):
        check_adapter_targets(config, ("q_proj", "o_proj"))


def _write_deepseek2_gguf(path: Path, hf: nn.Module) -> Path:
    """The tiny V3 as llama.cpp's converter writes deepseek2: MLA as MQA over the latent, kv_b_proj split
    per head into attn_k_b (transposed) and attn_v_b, experts stacked, the score bias as exp_probs_b."""
    import tempfile

    import gguf
    from safetensors.torch import load_file

    c = hf.config
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(ROPE)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(c.rope_parameters["factor"])
    w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * c.rope_parameters["mscale_all_dim"])
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(RANK)
    w.add_key_length(RANK + ROPE)
    w.add_value_length(RANK)
    w.add_key_length_mla(NOPE + ROPE)
    w.add_value_length_mla(V_DIM)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
             "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
    with tempfile.TemporaryDirectory() as saved:
        hf.save_pretrained(saved)
        state = {k: v for f in Path(saved).glob("*.safetensors") for k, v in load_file(f).items()}
    w.add_tensor("token_embd.weight", state.pop("model.embed_tokens.weight").numpy())
    w.add_tensor("output_norm.weight", state.pop("model.norm.weight").numpy())
    w.add_tensor("output.weight", state.pop("lm_head.weight").numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        kv_b = state.pop(f"{p}self_attn.kv_b_proj.weight").view(c.num_attention_heads, NOPE + V_DIM, RANK)
        w.add_tensor(f"blk.{i}.attn_k_b.weight", kv_b[:, :NOPE].transpose(1, 2).contiguous().numpy())
        w.add_tensor(f"blk.{i}.attn_v_b.weight", kv_b[:, NOPE:].contiguous().numpy())
        if f"{p}mlp.gate.e_score_correction_bias" in state:
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", state.pop(f"{p}mlp.gate.e_score_correction_bias").numpy())
        for kind in ("gate", "up", "down"):
            names = [f"{p}mlp.experts.{e}.{kind}_proj.weight" for e in range(c.n_routed_experts)]
            if names[0] in state:
                w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", torch.stack([state.pop(n) for n in names]).numpy())
        for hf_part, gguf_part in parts.items():
            if f"{p}{hf_part}.weight" in state:
                w.add_tensor(f"blk.{i}.{gguf_part}.weight", state.pop(f"{p}{hf_part}.weight").numpy())
    assert not state, sorted(state)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_loads_the_same_model(checkpoint, tmp_path: Path) -> None:
    """The same weights from a deepseek2 GGUF and from safetensors: the same config and logits. GGUF keeps
    yarn's mscale_all_dim as a float32 0.1 * mscale_all_dim, so the softmax scale differs in its 8th
    digit and the logits by float rounding, far inside transformers' 1e-4."""
    path, hf = checkpoint("v3")
    from_gguf = load_model(_write_deepseek2_gguf(tmp_path / "tiny-deepseek2.gguf", hf), progress=False,
                           load_tokenizer=False)
    from_hf = load_model(path, progress=False)
    assert from_gguf.config.architecture == "deepseek"
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "head_dim", "num_experts",
                "experts_per_token", "moe_layers", "moe_routing", "moe_normalize_top_k", "moe_num_groups",
                "moe_topk_groups", "moe_routed_scaling_factor", "moe_shared_intermediate_size",
                "rope_interleaved"):
        assert getattr(from_gguf.config, key) == getattr(from_hf.config, key), key
    assert from_gguf.config.attention_scale == pytest.approx(from_hf.config.attention_scale, rel=1e-7)
    prompts = _prompts(9)
    a = Driver(from_gguf.model, PagedKVCache.for_model(from_gguf.config, 256, 4)).run(prompts, all_at_once)
    b = Driver(from_hf.model, PagedKVCache.for_model(from_hf.config, 256, 4)).run(prompts, all_at_once)
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() < 1e-5


def test_the_load_budget_estimates_the_latent_pool(checkpoint, gqa_checkpoint) -> None:
    """LoadModel's memory estimate (engine/loader/footprint.py) sizes the pool as the engine builds it."""
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.loader.footprint import estimate_footprint

    for path, kv_dtype in ((checkpoint("v3")[0], "auto"), (gqa_checkpoint[0], "auto"), (gqa_checkpoint[0], "int8")):
        config = EngineConfig(max_kv_blocks=8, block_size=4, kv_cache_dtype=kv_dtype)
        engine = LLMEngine(load_model(path, progress=False), config)
        estimate = estimate_footprint(path, "float32", "none", config)
        assert (estimate.kv_blocks, estimate.kv_pool_bytes) == (8, 8 * engine.runner.block_bytes), (path, kv_dtype)
