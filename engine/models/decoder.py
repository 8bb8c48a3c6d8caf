"""One decoder-only transformer for every dense family of engine/models/families.

The families differ only in switches of ModelConfig, which each family's module sets:

* Llama: RoPE with optional ``rope_scaling`` (``linear`` or ``llama3``).
* Mistral: every layer attends within a sliding window.
* Qwen2: q/k/v projections have biases; Qwen2/3 may slide on some layers only.
* Qwen3: RMSNorm over each head of q and k before RoPE.
* Gemma 3: local (sliding, own rope base) and global layers, four norms per layer
  ("sandwich"), GeGLU, scaled embeddings, ``query_pre_attn_scalar``, logit soft-capping.
* Gemma 2: Gemma's blocks without q/k norms, plus attention-logit soft-capping.
* StarCoder2: LayerNorms with biases, a GELU MLP without gate, biases everywhere.
* Command-R: one LayerNorm feeding attention and the MLP in parallel, interleaved rope,
  logits scaled by ``logit_scale``.
* Phi-3/4: Llama blocks (its fused checkpoint tensors split on load), LongRoPE, partial rotary.
* DeepSeek-V2/V3: multi-head latent attention (latent_attention.py: a compressed KV latent
  cached in place of K/V) and group-routed MoE layers with shared experts after the first dense ones.

Each layer takes its own sliding window (``ModelConfig.layer_windows``) and rope table
(sliding layers of a family with ``rope_local_theta`` take the local one): the step prepares
one attention plan per distinct window.

The model works on a flattened ForwardBatch (no padding, no batch dimension):
activations are ``[T, hidden]``, the KV cache is written and read through the
KVCache interface, and the LM head runs only on ``batch.logits_indices`` rows.
Parameter names follow Hugging Face without the ``model.`` prefix, except that
q/k/v and gate/up are fused into one GEMM each (``qkv_proj``, ``gate_up_proj``);
``load_hf_weights`` does the renaming.

``deterministic`` (on by default) makes every row of the output bit-identical
whatever the batch around it and however its prompt was chunked (see
linear.py and attention.py for how); off, the model takes the faster,
shape-dependent kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from protoserve.engine.config import ACTIVATION_PRECISIONS
from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.engine.lora.batch import LayerLora, lora_batch
from protoserve.engine.models import families
from protoserve.engine.models.config import SLIDING, ModelConfig
from protoserve.engine.models.device_ops import DeviceOps, ops_for
from protoserve.engine.models.families.moe_family import block_config
from protoserve.engine.models.families.weights import expected_hf_shapes as expected_hf_shapes
from protoserve.engine.models.families.weights import layer_norm_names, mlp_projections
from protoserve.engine.models.fused_step import FusedStep
from protoserve.engine.models.kv_cache import AttentionMetadata, KVCache
from protoserve.engine.models.latent_attention import LatentAttention, latent_attention_state
from protoserve.engine.models.linear import KernelPackable, Linear
from protoserve.engine.models.moe import GroupedExperts, MoEBlock
from protoserve.engine.models.rope import (
    RopeSpec,
    apply_rope,
    apply_rope_interleaved,
    rope_cos_sin,
    rope_spec,
)

if TYPE_CHECKING:
    from protoserve.engine.lora.stack import AdapterStack

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Layers


def _norm_kernels(x: torch.Tensor) -> DeviceOps | None:
    """The device's fused norm/RoPE kernels when they take x (kernels/cpu/norm_rope.cpp: float32 on a CPU
    that builds it; kernels/triton/norm_rope.py on CUDA), else None: the PyTorch path."""
    ops = ops_for(x.device)
    return ops if ops.norm_kernel(x) else None


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, computed in float32 over the last dim."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _norm_kernels(x)
        if ops is not None:  # always this path where it runs, contiguous or not: one implementation, one result
            return ops.rms_norm(x.contiguous(), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerNorm(nn.Module):
    """``w * (x - mean) / sqrt(var + eps) (+ b)`` in float32 over the last dim (StarCoder2 with a bias,
    Command-R without); the weights are assigned at load."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps).to(x.dtype)


def make_norm(config: ModelConfig, dtype: torch.dtype) -> RMSNorm | LayerNorm:
    """One of the model's hidden-size norms, of the config's kind."""
    if config.norm == "layer":
        return LayerNorm(config.hidden_size, config.rms_norm_eps, dtype, config.norm_bias)
    return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Attention(nn.Module):
    """GQA self-attention: fused q/k/v projection, optional per-head q/k norm, RoPE, cached attention."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.rope_interleaved = config.rope_interleaved
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add("qkv_proj", x, qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        ops = _norm_kernels(q)
        if self.rope_interleaved:  # the device kernels rotate halves only
            q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        elif ops is not None:  # in place on views of the qkv output: no copies
            ops.rope_(q, cos, sin)
            ops.rope_(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = kv_cache.attend(self.layer_idx, q, k, v, meta, self.scale).reshape(t, q_size)
        if lora is not None:
            return lora.add("o_proj", out, self.o_proj(out))
        return self.o_proj(out)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# ModelConfig.mlp -> the gate's activation.
MLP_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"swiglu": F.silu, "geglu": _gelu_tanh}


class MLP(nn.Module):
    """Gated feed-forward ``down(act(gate(x)) * up(x))``, gate and up in one GEMM: SwiGLU (silu) or
    GeGLU (gelu, tanh approximation)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.act = MLP_ACTIVATIONS[config.mlp]
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias,
                                   dtype=dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        if lora is None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(self.act(gate) * up)
        gate, up = lora.add("gate_up_proj", x, self.gate_up_proj(x)).split(self.intermediate_size, dim=-1)
        h = self.act(gate) * up
        return lora.add("down_proj", h, self.down_proj(h))


class GeluMLP(nn.Module):
    """Feed-forward without a gate, ``c_proj(gelu_tanh(c_fc(x)))`` (StarCoder2), biases as the config says.

    LoRA reaches ``c_proj`` as ``down_proj`` (the same shape); a delta on gate/up has no layer here."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, dtype=dtype)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        h = _gelu_tanh(self.c_fc(x))
        if lora is None:
            return self.c_proj(h)
        if any((lora.index, "gate_up_proj") in g.adapter.deltas for g in lora.batch.groups):
            raise ValueError("a LoRA adapter targets gate_proj/up_proj, which this model's MLP "
                             "(c_fc, c_proj) does not have")
        return lora.add("down_proj", h, self.c_proj(h))


class DecoderLayer(nn.Module):
    """Residual block, attention then MLP, normed "pre" (Llama: ``post_attention_layernorm`` is the
    MLP's input norm), "sandwich" (Gemma: each sublayer's input and output normed) or "parallel"
    (Command-R: one norm, attention and MLP both read it and both add to the residual)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.placement = config.norm_placement
        for name in layer_norm_names(config):
            setattr(self, name, make_norm(config, dtype))
        if config.kv_lora_rank:
            self.self_attn = LatentAttention(config, layer_idx, dtype,
                                             lambda dim: RMSNorm(dim, config.rms_norm_eps, dtype))
        else:
            self.self_attn = Attention(config, layer_idx, dtype)
        self.moe = config.is_moe_layer(layer_idx)
        if self.moe:
            self.mlp = MoEBlock(block_config(config), dtype)
        else:
            self.mlp = GeluMLP(config, dtype) if config.mlp == "gelu" else MLP(config, dtype)

    def feed_forward(self, h: torch.Tensor, lora: LayerLora | None, token_ids: torch.Tensor | None) -> torch.Tensor:
        # An MoE block routes on the batch's token ids; adapters never target it (engine/lora/adapter.py).
        return self.mlp(h, token_ids) if self.moe else self.mlp(h, lora)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: LayerLora | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        attn = self.self_attn(h, cos, sin, kv_cache, meta, lora)
        if self.placement == "parallel":
            return x + attn + self.feed_forward(h, lora, token_ids)
        if self.placement == "sandwich":
            x = x + self.post_attention_layernorm(attn)
            ff = self.feed_forward(self.pre_feedforward_layernorm(x), lora, token_ids)
            return x + self.post_feedforward_layernorm(ff)
        ops = _norm_kernels(x) if isinstance(self.post_attention_layernorm, RMSNorm) else None
        if ops is not None:  # x += attn and the second norm in one pass; x is this forward's own buffer
            h = ops.add_rms_norm_(attn, x, self.post_attention_layernorm.weight,
                                  self.post_attention_layernorm.eps)
            return x.add_(self.feed_forward(h, lora, token_ids))
        x = x + attn
        return x + self.feed_forward(self.post_attention_layernorm(x), lora, token_ids)


class Decoder(nn.Module):
    """The whole model: embeddings, layers, final norm, LM head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        # _weight skips the random init (slow, and pointless before the checkpoint is assigned).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
        self.norm = make_norm(config, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The context the engine serves (None until it says, see serve_context): dynamic NTK's base
        # and longrope's factor set depend on it.
        self.max_model_len: int | None = None
        self.rope = self._rope()
        # Sliding layers of a family with a local rope base (Gemma 3) rotate by this one, unscaled.
        self.local_rope = self._local_rope()
        self.deterministic = True
        self.activation_precision = "exact"  # see set_activation_precision
        self.fused_step: FusedStep | None = None  # set by pack_for_kernels where it can run
        self.adapters: AdapterStack | None = None  # LoRA adapters the batch's lora_slots name (engine/lora)

    def set_deterministic(self, enabled: bool) -> None:
        """Batch-invariant kernels (slower) or shape-dependent fast ones, for every layer."""
        self.deterministic = enabled
        for module in self.modules():
            if module is not self and hasattr(module, "deterministic"):
                module.deterministic = enabled

    def set_activation_precision(self, precision: str) -> None:
        """How int8/int4 layers on the integer-dot kernels quantize activations: "exact" (int8 codes
        plus codes of their rounding error) or "fast" (the codes alone: half the integer products, a
        coarser result). Float32/bfloat16 weights ignore it; the fused step and every layer follow it."""
        if precision not in ACTIVATION_PRECISIONS:
            raise ValueError(f"activation_precision must be one of {', '.join(ACTIVATION_PRECISIONS)}, "
                             f"got {precision!r}")
        self.activation_precision = precision
        for module in self.modules():
            if isinstance(module, KernelPackable):
                module.fine_activations = precision == "exact"
        if self.fused_step is not None:
            self.fused_step.fine_activations = precision == "exact"

    def serve_context(self, max_model_len: int) -> None:
        """Fix the rope tables for the context the engine serves (its resolved max_model_len), which is
        known only once the KV pool is sized, after the model is built. Call before the first step: keys
        cached under the old tables would no longer match. The frequencies stay on their device."""
        device = self.rope.inv_freq.device
        self.max_model_len = max_model_len
        self.rope = self._rope()
        self.local_rope = self._local_rope()
        self._ropes_on(device)

    def _rope(self) -> RopeSpec:
        c = self.config
        return rope_spec(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, self.max_model_len)

    def _local_rope(self) -> RopeSpec | None:
        c = self.config
        if c.rope_local_theta is None:
            return None
        return rope_spec(c.head_dim, c.rope_local_theta, None, c.max_position_embeddings, self.max_model_len)

    def _layer_ropes(self) -> list[int]:
        """Per layer, 0 for the global rope table or 1 for the local one."""
        c = self.config
        if self.local_rope is None or c.layer_types is None:
            return [0] * c.num_layers
        return [1 if t == SLIDING else 0 for t in c.layer_types]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:  # sqrt(hidden) rounded to the activation dtype first, as Gemma does
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def _final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's float32 output scaled (Command-R) and soft-capped (Gemma) as the config says."""
        if self.config.logit_scale is not None:
            logits = logits * self.config.logit_scale
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def fused_step_unsupported(self) -> str | None:
        """Why the fused C++ step cannot run this model's blocks (None: it can)."""
        return families.get(self.config.architecture).fused_step_unsupported(self.config)

    def pack_for_kernels(self) -> int:
        """Move every linear layer onto the CPU kernel where it can run; returns how many moved.

        Call once the weights are final (loaded and quantized): the packed copy does not follow later edits.
        A layer that moved keeps its weights only in the pack (``unpack_from_kernel`` brings them
        back), except a head tied to the embedding, whose table the lookup still reads.
        When every layer moved, the forward also becomes one C++ call (``FusedStep``).
        """
        embedding = self.embed_tokens.weight
        moved = sum(
            1
            for m in self.modules()
            if isinstance(m, KernelPackable) and m.pack_for_kernel(release=getattr(m, "weight", None) is not embedding)
        )
        reason = self.fused_step_unsupported()
        if reason is not None:
            logger.info("%s: the fused C++ step does not run %s; serving on the module path",
                        self.config.architecture, reason)
            self.fused_step = None
        else:
            self.fused_step = FusedStep.build(self)
        self.set_activation_precision(self.activation_precision)  # layers quantized since take it too
        return moved

    def to_device(self, device: torch.device) -> None:
        """Move the model onto a GPU once its weights are final (loaded and quantized), instead of
        ``pack_for_kernels``: quantized layers repack into the layouts the device's kernels read, float
        layers move as they are (the device's GEMM library multiplies them); the fused C++ step stays off."""
        for m in self.modules():
            if isinstance(m, KernelPackable):
                m.pack_for_device(device)
        self.to(device)
        self.fused_step = None
        if ops_for(device).fused_moe is not None:  # its MoE layers' float experts, stacked for the kernel
            for m in self.modules():
                if isinstance(m, GroupedExperts):
                    m.stack_for_fused_kernel()
        self._ropes_on(device)

    def _ropes_on(self, device: torch.device) -> None:
        """The rope tables' frequencies on ``device``: no host copy inside a step (nor a CUDA graph)."""
        self.rope = dataclasses.replace(self.rope, inv_freq=self.rope.inv_freq.to(device))
        if self.local_rope is not None:
            self.local_rope = dataclasses.replace(self.local_rope, inv_freq=self.local_rope.inv_freq.to(device))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Next-token logits [len(batch.logits_indices), vocab] float32; writes the batch's K/V."""
        x = self._embed(batch.input_ids)
        lora = lora_batch(batch.lora_slots, self.adapters, self.deterministic)
        if self.fused_step is not None and self.fused_step.accepts(kv_cache):
            # The fused step computes in float32 whatever the weights' dtype (see FusedStep).
            cos, sin = rope_cos_sin(batch.positions, self.rope, torch.float32)
            local = None if self.local_rope is None else rope_cos_sin(batch.positions, self.local_rope, torch.float32)
            windows = self.config.layer_windows()
            logits = self.fused_step(batch, kv_cache, x.float(), cos, sin,
                                     windows if len(set(windows)) > 1 else windows[0], lora,
                                     local, self._layer_ropes() if local is not None else None)
            return self._final_logits(logits)
        specs = [self.rope] if self.local_rope is None else [self.rope, self.local_rope]
        ropes = [rope_cos_sin(batch.positions, spec, self.dtype) for spec in specs]
        windows = self.config.layer_windows()
        metas = {
            window: kv_cache.prepare(
                batch, num_heads=self.config.num_heads, sliding_window=window, deterministic=self.deterministic,
                logit_softcap=self.config.attn_logit_softcapping,
            )
            for window in dict.fromkeys(windows)
        }
        for i, (layer, rope) in enumerate(zip(self.layers, self._layer_ropes(), strict=True)):
            cos, sin = ropes[rope]
            x = layer(x, cos, sin, kv_cache, metas[windows[i]], None if lora is None else lora.layer(i),
                      batch.input_ids)
        x = self.norm(x[batch.logits_indices])
        return self._final_logits(self.lm_head(x).float())

    # -- weights ------------------------------------------------------------

    def load_hf_weights(self, weights: MutableMapping[str, torch.Tensor]) -> None:
        """Take Hugging Face-named tensors (consumed from ``weights``) as this model's parameters.

        Shapes must already be checked (see ``expected_hf_shapes``); q/k/v and
        gate/up are concatenated and everything is cast to the model dtype.
        Works on a model built on the meta device (parameters are assigned).
        """
        cfg = self.config
        state: dict[str, torch.Tensor] = {}

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(self.dtype)

        state["embed_tokens.weight"] = take("model.embed_tokens.weight")
        if not cfg.tie_word_embeddings:
            state["lm_head.weight"] = take("lm_head.weight")
        norm_parts = ("weight", "bias") if cfg.norm_bias else ("weight",)
        for part in norm_parts:
            state[f"norm.{part}"] = take(f"model.norm.{part}")
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            for norm in layer_norm_names(cfg):
                for part in norm_parts:
                    state[f"{ours}{norm}.{part}"] = take(f"{hf}{norm}.{part}")
            attn_hf = f"{hf}self_attn."
            if cfg.kv_lora_rank:
                state.update(latent_attention_state(cfg, weights, attn_hf, f"{ours}self_attn.", self.dtype))
            else:
                state.update(self._attention_state(weights, attn_hf, f"{ours}self_attn."))
            if cfg.is_moe_layer(i):
                block = self.layers[i].mlp
                moe_names = families.get(cfg.architecture).moe_names
                block.load_hf_weights(weights, f"{hf}{moe_names.prefix}", moe_names.experts)
                state.update({f"{ours}mlp.{k}": v for k, v in block.state_dict().items()})
                continue
            state.update(self._mlp_state(weights, f"{hf}mlp.", f"{ours}mlp."))
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        self.load_state_dict(state, strict=True, assign=True)
        if cfg.tie_word_embeddings:  # assign wraps each entry in its own Parameter: share one again
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = self._rope()
        self.local_rope = self._local_rope()

    def _attention_state(
        self, weights: MutableMapping[str, torch.Tensor], hf: str, ours: str
    ) -> dict[str, torch.Tensor]:
        """A GQA attention's parameters from its Hugging Face tensors: q/k/v fused into qkv_proj."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            return weights.pop(f"{hf}{name}").to(self.dtype)

        state = {f"{ours}qkv_proj.weight": torch.cat([take(f"{p}_proj.weight") for p in "qkv"]),
                 f"{ours}o_proj.weight": take("o_proj.weight")}
        if cfg.attention_bias:
            state[f"{ours}qkv_proj.bias"] = torch.cat([take(f"{p}_proj.bias") for p in "qkv"])
        if cfg.o_proj_bias:
            state[f"{ours}o_proj.bias"] = take("o_proj.bias")
        if cfg.qk_norm:
            state[f"{ours}q_norm.weight"] = take("q_norm.weight")
            state[f"{ours}k_norm.weight"] = take("k_norm.weight")
        return state

    def _mlp_state(
        self, weights: MutableMapping[str, torch.Tensor], hf: str, ours: str
    ) -> dict[str, torch.Tensor]:
        """A dense MLP's parameters from its Hugging Face tensors: gate and up fused (a gated MLP),
        c_fc and c_proj as they are (a GELU MLP)."""
        parts = ("weight", "bias") if self.config.mlp_bias else ("weight",)
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            if self.config.mlp == "gelu":
                for name in mlp_projections(self.config):
                    state[f"{ours}{name}.{part}"] = weights.pop(f"{hf}{name}.{part}").to(self.dtype)
                continue
            gate, up = weights.pop(f"{hf}gate_proj.{part}"), weights.pop(f"{hf}up_proj.{part}")
            state[f"{ours}gate_up_proj.{part}"] = torch.cat([gate, up]).to(self.dtype)
            state[f"{ours}down_proj.{part}"] = weights.pop(f"{hf}down_proj.{part}").to(self.dtype)
        return state

    def weight_bytes(self) -> int:
        """Bytes the weights hold: the state dict (quantized codes and scales included, the rope
        table not; a tied embedding once) plus the CPU kernels' packs."""
        unique = {t.data_ptr(): t for t in self.state_dict().values()}
        packs = sum(m.packed.nbytes for m in self.modules() if isinstance(m, KernelPackable) and m.packed is not None)
        return sum(t.numel() * t.element_size() for t in unique.values()) + packs
