"""Mixtral, Qwen3-MoE and the token-routed family, end to end on tiny random checkpoints.

Mixtral and Qwen3-MoE against transformers (every position's logits within 1e-4, 32
greedy tokens equal alone and inside a mixed continuous batch); Qwen3-MoE with a dense
layer among the sparse ones (``mlp_only_layers``). The token-routed family has no
transformers implementation: its reference is transformers' Llama with each MLP replaced
by a plain PyTorch module written here from the family's definition
(``expert = (token_id >> shift) & (num_experts - 1)``). GetModel's summary counts active
parameters, and MoE layers run on the module path with the fused step's reason logged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from decoder_test_helpers import Driver, all_at_once, greedy_generate, paged_cache, random_mix
from family_checkpoints import TINY, VOCAB, hf_greedy, write_byte_tokenizer
from tiny_families import checkpoint_cache, mixed_batch, worst_diff
from torch import nn

from bench.tiny_checkpoints import random_prompts
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.load import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("mixtral", "qwen3_moe", "token_moe")
PROMPT_LENS = (5, 23, 41)
GREEDY = 32
EXPERTS = 4
SHIFT = 1


def _hf_config(family: str):
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    tiny = {**TINY, "num_hidden_layers": 3}
    if family == "mixtral":
        return MixtralConfig(**tiny, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=None)
    if family == "qwen3_moe":  # layer 1 keeps a dense MLP; top-2 of 4 renormalised
        return Qwen3MoeConfig(**tiny, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=2,
                              moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])
    if family == "token_moe":  # the attention's reference: Llama with the same shapes
        return LlamaConfig(**tiny)
    raise ValueError(family)


class TokenRoutedMLP(nn.Module):
    """The token-routed family's MLP from its definition: each token through expert
    ``(id >> shift) & (E - 1)``'s SwiGLU, weight 1. ``ids`` is set before each forward."""

    def __init__(self, hidden: int, intermediate: int, experts: int, shift: int) -> None:
        super().__init__()
        self.shift, self.ids = shift, None
        self.experts = nn.ModuleList(
            nn.ModuleDict({p: nn.Linear(*(hidden, intermediate) if p != "down_proj" else (intermediate, hidden),
                                         bias=False) for p in ("gate_proj", "up_proj", "down_proj")})
            for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for b in range(x.shape[0]):
            for t in range(x.shape[1]):
                e = self.experts[(int(self.ids[b, t]) >> self.shift) & (len(self.experts) - 1)]
                h = x[b, t]
                out[b, t] = e["down_proj"](nn.functional.silu(e["gate_proj"](h)) * e["up_proj"](h))
        return out


class TokenRoutedReference(nn.Module):
    """transformers' Llama with TokenRoutedMLPs, fed the ids they route on."""

    def __init__(self, llama: nn.Module, mlps: list[TokenRoutedMLP]) -> None:
        super().__init__()
        self.llama, self.mlps = llama, mlps

    def forward(self, input_ids: torch.Tensor):
        for m in self.mlps:
            m.ids = input_ids
        return self.llama(input_ids)


def _randomize(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))


def _make_checkpoint(family: str, directory: Path) -> nn.Module:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family), dtype=torch.float32).eval()
    if family != "token_moe":
        _randomize(model)
        model.save_pretrained(directory, safe_serialization=True)
        write_byte_tokenizer(directory)
        return model
    cfg = model.config
    mlps = [TokenRoutedMLP(cfg.hidden_size, cfg.intermediate_size, EXPERTS, SHIFT) for _ in model.model.layers]
    for layer, mlp in zip(model.model.layers, mlps, strict=True):
        layer.mlp = mlp
    _randomize(model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("lm_head") or
               not cfg.tie_word_embeddings}
    save_file(tensors, directory / "model.safetensors")
    raw = cfg.to_dict()
    raw.update(model_type="token_moe", architectures=["TokenMoeForCausalLM"], num_experts=EXPERTS,
               expert_token_shift=SHIFT)
    (directory / "config.json").write_text(json.dumps(raw))
    write_byte_tokenizer(directory)
    return TokenRoutedReference(model, mlps).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, _make_checkpoint)


def _prompts(seed: int = 1) -> list[list[int]]:
    return random_prompts(PROMPT_LENS, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_reference(checkpoint, family: str) -> None:
    path, ref_model = checkpoint(family)
    loaded = load_model(path, progress=False)
    assert loaded.config.num_experts == EXPERTS
    prompts = _prompts()
    worst = worst_diff(ref_model, prompts, Driver(loaded.model, paged_cache(loaded.model)).run(prompts, all_at_once))
    print(f"{family}: max |logit diff| vs reference = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_schedules(checkpoint, family: str) -> None:
    """32 greedy tokens equal the reference's with all prompts batched in every step, and a random
    mix of prefill chunks gives the same logits bit for bit (the grouped experts are batch invariant)."""
    path, ref_model = checkpoint(family)
    loaded = load_model(path, progress=False)
    prompts = _prompts(4)
    for prompt, tokens in zip(prompts, greedy_generate(loaded.model, prompts, GREEDY), strict=True):
        assert tokens == hf_greedy(ref_model, prompt, GREEDY)
    one = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, all_at_once)
    mixed = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, random_mix(3))
    for a, b in zip(one, mixed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_continuous_batch(checkpoint, family: str) -> None:
    """Greedy requests among seeded sampling requests, chunked prefill beside decodes (LLMEngine):
    each greedy request's tokens equal the reference's."""
    path, ref_model = checkpoint(family)
    prompts = _prompts(6)
    _, done = mixed_batch(path, prompts, GREEDY, sampled=4, sampled_len=30, sampled_tokens=16)
    for i, prompt in enumerate(prompts):
        tokens = done[f"greedy-{i}"]
        assert all(t < VOCAB for t in tokens)
        assert tokens == hf_greedy(ref_model, prompt, GREEDY), f"{family} greedy-{i}"


def test_summary_counts_active_parameters(checkpoint) -> None:
    for family in FAMILIES:
        path, ref_model = checkpoint(family)
        summary = load_model(path, progress=False).summary()
        total = sum(p.numel() for p in ref_model.parameters())
        assert summary.family == family and summary.parameters == total
        c = _hf_config(family)
        h = c.hidden_size
        if family == "qwen3_moe":  # 2 sparse layers, 2 of 4 experts of 48 idle per token
            idle = 2 * (EXPERTS - 2) * 3 * h * 48
        elif family == "mixtral":
            idle = 3 * (EXPERTS - 2) * 3 * h * c.intermediate_size
        else:
            idle = 3 * (EXPERTS - 1) * 3 * h * c.intermediate_size
        assert summary.active_parameters == total - idle


def test_moe_layers_take_the_module_path_with_a_reason(checkpoint, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="protoserve.engine.models.decoder"):
        loaded = load_model(checkpoint("mixtral")[0], progress=False)
    assert loaded.model.fused_step is None
    assert any("mixtral: the fused C++ step does not run mixture-of-experts layers" in r.getMessage()
               for r in caplog.records)


def test_token_moe_config_is_checked(tmp_path: Path, checkpoint) -> None:
    path, _ = checkpoint("token_moe")
    raw = json.loads((path / "config.json").read_text())
    for key, value, message in (("num_experts", 6, "power of two"), ("expert_token_shift", 70, "0..62")):
        bad = tmp_path / key
        bad.mkdir()
        for f in path.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ModelLoadError, match=message):
            load_model(bad, progress=False)


def test_lora_refuses_mlp_targets_on_moe_models(checkpoint) -> None:
    from protoserve.engine.lora.adapter import AdapterError, check_adapter_targets

    config = load_model(checkpoint("mixtral")[0], progress=False).config
    check_adapter_targets(config, ("q_proj", "v_proj"))
    with pytest.raises(AdapterError, match="mixture-of-experts"):
        check_adapter_targets(config, ("q_proj", "gate_proj"))


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (LlamaModel.permute) for Llama-layout files."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# family -> (GGUF architecture, experts' prefix and names (gate, up, down), router part, q/k permuted)
GGUF_FORMS = {
    "qwen3_moe": ("qwen3moe", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), "mlp.gate", False),
    "mixtral": ("llama", "block_sparse_moe.experts", ("w1", "w3", "w2"), "block_sparse_moe.gate", True),
}


def _write_moe_gguf(path: Path, hf: nn.Module, family: str) -> Path:
    """The tiny model as llama.cpp's converter writes it: experts stacked per layer
    (``ffn_{gate,up,down}_exps`` [experts, rows, cols]), the router as ``ffn_gate_inp``."""
    import tempfile

    import gguf
    from safetensors.torch import load_file

    arch, experts, (gate, up, down), router, permute = GGUF_FORMS[family]
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(48 if family == "qwen3_moe" else c.intermediate_size)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", router: "ffn_gate_inp"}
    with tempfile.TemporaryDirectory() as saved:
        hf.save_pretrained(saved)
        state = {k: v for f in Path(saved).glob("*.safetensors") for k, v in load_file(f).items()}
    writer.add_tensor("token_embd.weight", state.pop("model.embed_tokens.weight").numpy())
    writer.add_tensor("output_norm.weight", state.pop("model.norm.weight").numpy())
    writer.add_tensor("output.weight", state.pop("lm_head.weight").numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind, gguf_part in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps"), (down, "ffn_down_exps")):
            names = [f"{p}{experts}.{e}.{kind}.weight" for e in range(EXPERTS)]
            if names[0] in state:
                writer.add_tensor(f"blk.{i}.{gguf_part}.weight", torch.stack([state.pop(n) for n in names]).numpy())
        for hf_part, gguf_part in parts.items():
            name = f"{p}{hf_part}.weight"
            if name in state:
                w = state.pop(name)
                if permute and hf_part in ("self_attn.q_proj", "self_attn.k_proj"):
                    w = _permute(w, c.num_attention_heads if hf_part.endswith("q_proj") else c.num_key_value_heads)
                writer.add_tensor(f"blk.{i}.{gguf_part}.weight", w.numpy())
    assert not state, sorted(state)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("family", sorted(GGUF_FORMS))
def test_moe_gguf_loads_the_same_model(checkpoint, tmp_path: Path, family: str) -> None:
    """The same weights from GGUF (stacked experts; Qwen3-MoE with a dense layer without a router,
    Mixtral filed as "llama" with q/k permuted) and from safetensors: the same config and
    bit-identical logits."""
    path, hf = checkpoint(family)
    gguf_path = _write_moe_gguf(tmp_path / f"tiny-{family}.gguf", hf, family)
    from_gguf = load_model(gguf_path, progress=False, load_tokenizer=False)
    from_hf = load_model(path, progress=False)
    assert from_gguf.config.architecture == family
    for key in ("num_experts", "experts_per_token", "moe_intermediate_size", "moe_layers", "moe_normalize_top_k",
                "qk_norm", "num_layers"):
        assert getattr(from_gguf.config, key) == getattr(from_hf.config, key), key
    prompts = _prompts(9)
    a = Driver(from_gguf.model, paged_cache(from_gguf.model)).run(prompts, all_at_once)
    b = Driver(from_hf.model, paged_cache(from_hf.model)).run(prompts, all_at_once)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


# int4 against dequantized weights is tests/models/test_moe_block.py's (these random weights are
# too rough for int4 at the model level: its rounding flips most routes).
@pytest.mark.parametrize("quantization", ["int8"])
def test_quantized_experts(checkpoint, quantization: str) -> None:
    """--quantization packs the experts like dense layers (the router stays float), and the model's
    logits stay near the float model's."""
    from protoserve.engine.models.linear import Int4Linear, Int8Linear

    path, _ = checkpoint("mixtral")
    quant = load_model(path, progress=False, quantization=quantization)
    experts = [m for n, m in quant.model.named_modules() if ".experts." in n and isinstance(m, Int8Linear | Int4Linear)]
    assert len(experts) == 3 * EXPERTS * 2  # three MoE layers, gate_up and down per expert
    assert not any(isinstance(m, Int8Linear | Int4Linear) for n, m in quant.model.named_modules()
                   if n.endswith("mlp.gate"))  # the router
    base = load_model(path, progress=False)
    prompts = _prompts(11)
    q = Driver(quant.model, paged_cache(quant.model)).run(prompts, all_at_once)
    f = Driver(base.model, paged_cache(base.model)).run(prompts, all_at_once)
    # Per position: a router decision that flips under quantization moves the rest of that sequence
    # (MoE's discontinuity), so the median position is the measure of the experts' rounding.
    per_position = torch.cat([(a - b).abs().mean(-1) / b.abs().mean(-1) for a, b in zip(q, f, strict=True)])
    median = per_position.median().item()
    print(f"{quantization}: median relative logit error per position {median:.3f}, max {per_position.max():.3f}")
    assert median < 0.1
