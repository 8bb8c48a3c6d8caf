"""Mixture-of-experts MLP blocks: routers, grouped experts, an optional shared expert.

A block maps ``[T, hidden]`` to ``[T, hidden]`` like the dense MLP, given the
batch's token ids as well (the token-routed family routes on them). Routing
is a small pure function returning a ``Routing``: integer expert ids ``[T, k]``
(int64) and float32 weights ``[T, k]``:

* ``softmax_top_k``: router logits, softmax in float32 over all experts, the k
  largest, renormalised to sum to one where asked (Mixtral always; Qwen2/3-MoE
  iff ``norm_topk_prob``), as transformers computes them;
* ``token_route``: ``expert = (token_id >> token_shift) & (num_experts - 1)``,
  one expert per token at weight 1: integer arithmetic on the id alone, no
  router weights and no dependence on the hidden states;
* ``group_top_k`` (DeepSeek): the experts split into ``num_groups`` groups, a token's
  top_k taken only within its ``topk_groups`` best groups. V2's
  ``group_limited_greedy`` ranks groups by their best softmax score; V3's
  ``noaux_tc`` scores by sigmoid, chooses on score + a learned per-expert bias
  (``e_score_correction_bias``), ranks groups by the sum of their two best and
  weights by the unbiased scores. Weights are renormalised where asked, then
  multiplied by ``routed_scaling_factor``.

Experts run grouped: the (token, slot) pairs are sorted by expert with integer
indices (a stable sort, so within an expert the pairs keep token order), each
expert's rows are gathered and go through one gate_up product, SiLU(gate) *
up and one down product, are scaled by their routing weight and written to the
pair's own row; a token's k rows are then summed in slot order. Each expert
projection is a ``Linear`` (quantized to ``Int8Linear`` / ``Int4Linear`` by
``quantize_linears`` and packed by ``pack_for_kernel`` like any dense layer), so
a row's product does not depend on the other rows gathered with it
(linear.py: fixed tiles or row-by-row kernels), and the slot-order sum depends
on the token alone: the block is batch invariant. With float32 activations and
every expert on the CPU kernel, the whole grouped pass is one C++ call
(kernels/cpu/moe_experts.cpp) computing the same operations in the same order,
so its result is bit-identical to the Python loop here.

The router and the shared expert's gate are ``FloatProjection``s, not
``Linear``s: quantization leaves them in the model's float dtype (an int4
router of 8 experts cannot even be packed, and a rounded router changes which
experts run, not just the output's last bits).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from protoserve.engine.models.device_ops import ops_for
from protoserve.engine.models.linear import KernelPackable, Linear, tiled_linear
from protoserve.kernels.cpu import moe_experts as kernel
from protoserve.kernels.cpu.packed_linear import PackedWeight

ROUTINGS = ("softmax_top_k", "token", "group_limited_greedy", "noaux_tc")
GROUP_ROUTINGS = ("group_limited_greedy", "noaux_tc")
ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class MoEConfig:
    """One MoE block's shape and routing rule.

    ``routing``: ``softmax_top_k`` (Mixtral, Qwen2/3-MoE) or ``token`` (the
    token-routed family, where ``top_k`` must be 1 and ``num_experts`` a power of two:
    ``expert = (token_id >> token_shift) & (num_experts - 1)``).
    ``shared_intermediate_size`` > 0 adds Qwen2-MoE's shared expert, always run, scaled by
    ``sigmoid(shared_expert_gate(x))`` when ``shared_expert_gate`` is set.
    """

    hidden_size: int
    intermediate_size: int  # of each routed expert
    num_experts: int
    top_k: int
    routing: str = "softmax_top_k"
    normalize_top_k: bool = True
    token_shift: int = 0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    hidden_act: str = "silu"
    num_groups: int = 1  # group routings: experts in this many groups ...
    topk_groups: int = 1  # ... of which a token's experts come from its best this many
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (DeepSeek)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive integer, got {value!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoEConfig.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.shared_intermediate_size < 0:
            raise ValueError(
                f"MoEConfig.shared_intermediate_size must be >= 0, got {self.shared_intermediate_size}"
            )
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError(
                "MoEConfig.shared_expert_gate needs a shared expert (shared_intermediate_size > 0)"
            )
        if self.routing == "token":
            if self.num_experts & (self.num_experts - 1):
                raise ValueError(
                    f"MoEConfig.num_experts must be a power of two for token routing, got {self.num_experts}"
                )
            if self.top_k != 1:
                raise ValueError(f"MoEConfig.top_k must be 1 for token routing, got {self.top_k}")
            if not 0 <= self.token_shift < 63:
                raise ValueError(f"MoEConfig.token_shift must be in 0..62, got {self.token_shift}")
        elif self.token_shift:
            raise ValueError("MoEConfig.token_shift applies to token routing only")
        self._check_groups()

    def _check_groups(self) -> None:
        groups, best = self.num_groups, self.topk_groups
        if self.routing not in GROUP_ROUTINGS:
            if groups != 1 or best != 1:
                raise ValueError(f"MoEConfig.num_groups/topk_groups apply to {' and '.join(GROUP_ROUTINGS)} only")
            return
        if groups < 1 or self.num_experts % groups:
            raise ValueError(f"MoEConfig.num_groups ({groups}) must divide num_experts ({self.num_experts})")
        if not 1 <= best <= groups:
            raise ValueError(f"MoEConfig.topk_groups must be in 1..{groups}, got {best}")
        per_group = self.num_experts // groups
        if self.top_k > best * per_group:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds the experts of topk_groups ({best}) groups "
                             f"of {per_group}")
        if self.routing == "noaux_tc" and per_group < 2:  # a group ranks by the sum of its two best
            raise ValueError(f"MoEConfig: noaux_tc routing needs at least 2 experts per group, got {per_group}")

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters of the block: router, experts, shared expert."""
        h = self.hidden_size
        expert = 3 * h * self.intermediate_size
        fixed = 3 * h * self.shared_intermediate_size + (h if self.shared_expert_gate else 0)
        if self.routing != "token":
            fixed += self.num_experts * h
        if self.routing == "noaux_tc":  # the per-expert score bias
            fixed += self.num_experts
        return fixed + self.num_experts * expert, fixed + self.top_k * expert


@dataclass(frozen=True)
class Routing:
    """Which experts each token goes to, and with what weight."""

    experts: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k] float32


def softmax_top_k(logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Router logits [T, E] -> the top_k experts of softmax(logits) (float32), renormalised iff ``normalize``.

    transformers' Mixtral router (always normalised) and Qwen2/3-MoE's (``norm_topk_prob``).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


# Columns each row is padded to before an elementwise kernel: a multiple of every SIMD loop's width.
_ROW_PAD = 64


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid`` of x [T, E], each row's result independent of T. PyTorch's vectorised loop computes a
    buffer's last (size mod vector width) elements on a scalar path with other rounding, so a row's
    bits would depend on where the batch puts it (measured); rows padded to 64 columns never form a tail."""
    rows, cols = x.shape
    padded = x.new_zeros(rows, -(-cols // _ROW_PAD) * _ROW_PAD)
    padded[:, :cols] = x
    return torch.sigmoid(padded)[:, :cols]


def group_top_k(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None) -> Routing:
    """DeepSeek's group-limited top-k of router logits [T, E] (see the module docstring), float32.

    ``bias`` is noaux_tc's ``e_score_correction_bias`` [E]: it picks experts, never weighs them.
    """
    t, e = logits.shape
    if cfg.routing == "noaux_tc":
        scores = row_sigmoid(logits.float())
        choice = scores + bias.float()
        group_scores = choice.view(t, cfg.num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
    else:
        scores = torch.softmax(logits.float(), dim=-1)
        choice = scores
        group_scores = choice.view(t, cfg.num_groups, -1).amax(dim=-1)
    groups = torch.topk(group_scores, cfg.topk_groups, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    kept = kept.unsqueeze(-1).expand(t, cfg.num_groups, e // cfg.num_groups).reshape(t, e)
    # Outside the kept groups: -inf for noaux_tc's biased choice (as DeepSeek-V3), 0 for V2's softmax.
    hidden = float("-inf") if cfg.routing == "noaux_tc" else 0.0
    experts = torch.topk(choice.masked_fill(~kept, hidden), cfg.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if cfg.normalize_top_k:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(experts, weights * cfg.routed_scaling_factor)


def token_route(token_ids: torch.Tensor, num_experts: int, shift: int = 0) -> Routing:
    """``expert = (token_id >> shift) & (num_experts - 1)``, weight 1: integer arithmetic on the ids alone.

    The shift picks which bits of the id choose the expert (0: the low bits, so consecutive ids
    spread over all experts; a larger shift keeps runs of 2**shift ids on one expert).
    """
    if token_ids.dim() != 1 or token_ids.dtype != torch.int64:
        raise ValueError(
            f"token_ids must be a 1-D int64 tensor, got {token_ids.dtype} {tuple(token_ids.shape)}"
        )
    if num_experts < 1 or num_experts & (num_experts - 1):
        raise ValueError(f"num_experts must be a power of two, got {num_experts}")
    if token_ids.numel() and int(token_ids.min()) < 0:
        raise ValueError("token_ids must be non-negative")
    experts = ((token_ids >> shift) & (num_experts - 1)).unsqueeze(1)
    return Routing(experts, torch.ones(experts.shape, dtype=torch.float32))


class FloatProjection(nn.Module):
    """``x @ W.T`` kept in the model's float dtype (a router, a shared-expert gate): not a ``Linear``,
    so quantization skips it; batch invariant in deterministic mode (fixed-tile GEMMs)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.deterministic = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return tiled_linear(x, self.weight, None)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, float"


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one product (the shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts run grouped (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up = nn.ModuleList(
            Linear(hidden_size, 2 * intermediate_size, dtype=dtype) for _ in range(num_experts)
        )
        self.down = nn.ModuleList(
            Linear(intermediate_size, hidden_size, dtype=dtype) for _ in range(num_experts)
        )
        self._bound: _Binding | None = None  # the packs the C++ pass was given
        self._stacks: tuple[torch.Tensor, torch.Tensor] | None = None  # the fused device kernel's weights

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        check_routing(routing, x.shape[0], self.num_experts, ids_checked_later=self._stacks is not None)
        if self._stacks is not None:  # stacked for the device's fused kernel: every expert at once
            return ops_for(x.device).fused_moe(x, *self._stacks, routing.experts, routing.weights).to(x.dtype)
        weights = self._kernel_weights(x)
        if weights is not None:
            return kernel.grouped_experts(x, routing.experts, routing.weights, weights)
        return self.grouped(x, routing)

    def grouped(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The module path: one gathered product per expert, in PyTorch over the layers' own forwards."""
        t, k = routing.experts.shape
        flat = routing.experts.reshape(-1)
        # Pair p = token * k + slot, grouped by expert; stable, so p ascends within an expert.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = routing.weights.reshape(-1)
        pairs = x.new_empty(t * k, self.hidden_size)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start : start + n]
            start += n
            y = self.expert(e, x.index_select(0, idx // k))
            pairs[idx] = (y * pair_weights[idx].unsqueeze(1)).to(pairs.dtype)
        return sum_slots(pairs.view(t, k, self.hidden_size))

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on ``rows`` [n, hidden] (the unscaled SwiGLU output)."""
        gate, up = self.gate_up[e](rows).split(self.intermediate_size, dim=-1)
        return self.down[e](F.silu(gate) * up)

    def stack_for_fused_kernel(self) -> bool:
        """Stack the float experts' weights as a device's fused MoE kernel takes them, [E, 2I, H] and
        [E, H, I], each expert's layers then holding views of them (one copy in memory); once the
        weights are final and on the device (Decoder.to_device). False, and nothing changes, for
        quantized experts, which keep their per-expert products."""
        layers = [*self.gate_up, *self.down]
        if not all(type(m) is Linear and m.packed is None and m.bias is None and
                   m.weight.dtype in (torch.float32, torch.bfloat16) for m in layers):
            return False
        stacks = []
        for group in (self.gate_up, self.down):
            stack = torch.stack([m.weight.detach() for m in group])
            for e, m in enumerate(group):
                m.weight = nn.Parameter(stack[e], requires_grad=False)
            stacks.append(stack)
        self._stacks = (stacks[0], stacks[1])
        return True

    def _kernel_weights(self, x: torch.Tensor) -> kernel.ExpertWeights | None:
        """The experts' packs bound for the C++ pass, or None where it cannot run (then the module path)."""
        if x.dtype != torch.float32 or not x.is_cpu or not kernel.available():
            return None
        layers = [*self.gate_up, *self.down]
        if not all(isinstance(m, KernelPackable) and m.packed is not None for m in layers):
            return None
        packs = tuple(m.packed for m in layers)
        if self._bound is None or not self._bound.binds(packs):  # layers swapped (quantize_linears): rebind
            self._bound = _Binding(
                packs,
                kernel.bind(
                    [(m.packed, getattr(m, "bias", None)) for m in self.gate_up],
                    [(m.packed, getattr(m, "bias", None)) for m in self.down],
                ),
            )
        return self._bound.weights


class _Binding:
    """The experts' packs as handed to the C++ pass, and the packs they came from."""

    def __init__(self, packs: tuple[PackedWeight, ...], weights: kernel.ExpertWeights) -> None:
        self.packs = packs
        self.weights = weights

    def binds(self, packs: tuple[PackedWeight, ...]) -> bool:
        return len(packs) == len(self.packs) and all(a is b for a, b in zip(packs, self.packs, strict=True))

    def __deepcopy__(self, memo: dict) -> None:
        # A copied model has new packs this binding does not see: the copy binds its own on first use.
        return None


def check_routing(routing: Routing, num_tokens: int, num_experts: int, *, ids_checked_later: bool = False) -> None:
    """Raise ValueError unless ``routing`` is [num_tokens, k] int64 ids in range with float32 weights.

    ``ids_checked_later``: the kernel that follows checks the ids' range itself (the fused device
    kernel's ``align_pairs``), so it is not read here: on a GPU each read is a device sync."""
    experts, weights = routing.experts, routing.weights
    if experts.dtype != torch.int64 or experts.dim() != 2 or experts.shape[0] != num_tokens:
        raise ValueError(
            f"routing.experts must be int64 [{num_tokens}, k], got {experts.dtype} {tuple(experts.shape)}"
        )
    if weights.dtype != torch.float32 or weights.shape != experts.shape:
        raise ValueError(
            f"routing.weights must be float32 {tuple(experts.shape)}, got {weights.dtype} {tuple(weights.shape)}"
        )
    # Reading the ids back syncs the device, which capturing a CUDA graph forbids; the ids captured are
    # placeholders, and those a graph replays come from the router's top-k, in range by construction.
    if ids_checked_later or not experts.numel() or (experts.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    low, high = torch.stack(torch.aminmax(experts)).tolist()  # one read-back for both ends
    if low < 0 or high >= num_experts:
        raise ValueError(f"routing.experts must lie in 0..{num_experts - 1}")


def sum_slots(pairs: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H], slot 0 + slot 1 + ... in that order: a fixed order per token, whatever T."""
    out = pairs[:, 0].clone()
    for s in range(1, pairs.shape[1]):
        out += pairs[:, s]
    return out


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names one expert's three projections (``experts.{e}.<name>.weight``)."""

    gate: str
    up: str
    down: str
    shared: str = "shared_expert"  # the always-on expert's module (DeepSeek: "shared_experts")


MIXTRAL_EXPERT_NAMES = ExpertNames("w1", "w3", "w2")
QWEN_EXPERT_NAMES = ExpertNames("gate_proj", "up_proj", "down_proj")
DEEPSEEK_EXPERT_NAMES = ExpertNames("gate_proj", "up_proj", "down_proj", shared="shared_experts")


def hf_weight_shapes(cfg: MoEConfig, prefix: str, names: ExpertNames) -> dict[str, tuple[int, ...]]:
    """The per-expert checkpoint tensors of a block of ``cfg`` under ``prefix`` (as saved on the Hub)."""
    h, i, si = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.routing != "token":
        shapes[f"{prefix}gate.weight"] = (cfg.num_experts, h)
    if cfg.routing == "noaux_tc":
        shapes[f"{prefix}gate.e_score_correction_bias"] = (cfg.num_experts,)
    for e in range(cfg.num_experts):
        shapes[f"{prefix}experts.{e}.{names.gate}.weight"] = (i, h)
        shapes[f"{prefix}experts.{e}.{names.up}.weight"] = (i, h)
        shapes[f"{prefix}experts.{e}.{names.down}.weight"] = (h, i)
    if si:
        for proj, shape in (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si))):
            shapes[f"{prefix}{names.shared}.{proj}.weight"] = shape
    if cfg.shared_expert_gate:
        shapes[f"{prefix}shared_expert_gate.weight"] = (1, h)
    return shapes


class MoEBlock(nn.Module):
    """The MoE feed-forward: route, run the experts grouped, add the (gated) shared expert."""

    def __init__(self, config: MoEConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.gate = FloatProjection(h, config.num_experts, dtype) if config.routing != "token" else None
        # noaux_tc's per-expert bias on the choice, float32 as DeepSeek keeps it.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.num_experts), requires_grad=False) if config.routing == "noaux_tc"
            else None
        )
        self.experts = GroupedExperts(config.num_experts, h, config.intermediate_size, dtype)
        self.shared_expert = (
            SwiGLU(h, config.shared_intermediate_size, dtype) if config.shared_intermediate_size else None
        )
        self.shared_expert_gate = FloatProjection(h, 1, dtype) if config.shared_expert_gate else None

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> Routing:
        cfg = self.config
        if cfg.routing == "token":
            if token_ids is None:
                raise ValueError("token_ids are required by token routing")
            if token_ids.shape != (x.shape[0],):
                raise ValueError(
                    f"token_ids must be [{x.shape[0]}] (one per row of x), got {tuple(token_ids.shape)}"
                )
            return token_route(token_ids, cfg.num_experts, cfg.token_shift)
        if cfg.routing in GROUP_ROUTINGS:
            return group_top_k(self.gate(x), cfg, self.e_score_correction_bias)
        return softmax_top_k(self.gate(x), cfg.top_k, cfg.normalize_top_k)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``token_ids`` [T] int64 (the batch's input ids), needed by token routing."""
        if x.dim() != 2 or x.shape[1] != self.config.hidden_size:
            raise ValueError(f"x must be [T, {self.config.hidden_size}], got {tuple(x.shape)}")
        out = self.experts(x, self.route(x, token_ids))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    # -- weights ------------------------------------------------------------

    def hf_weight_shapes(self, prefix: str, names: ExpertNames) -> dict[str, tuple[int, ...]]:
        """The per-expert checkpoint tensors this block loads under ``prefix`` (as saved on the Hub)."""
        return hf_weight_shapes(self.config, prefix, names)

    def load_hf_weights(
        self, weights: MutableMapping[str, torch.Tensor], prefix: str, names: ExpertNames
    ) -> None:
        """Take this block's tensors (consumed from ``weights``) under ``prefix``, e.g.
        ``model.layers.3.block_sparse_moe.`` (Mixtral) or ``model.layers.3.mlp.`` (Qwen).

        Experts come per expert (``experts.{e}.<names>.weight``, the Hub's form) or fused as
        transformers 5 holds them in memory (``experts.gate_up_proj`` [E, 2I, H], gate rows first,
        and ``experts.down_proj`` [E, H, I]).
        """

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"missing weight {name}")
            t = weights.pop(name)
            if tuple(t.shape) != shape:
                raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected {shape}")
            return t

        cfg = self.config
        h, i, e_count = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        if self.gate is not None:
            _assign(self.gate, take(f"{prefix}gate.weight", (e_count, h)))
        if self.e_score_correction_bias is not None:
            bias = take(f"{prefix}gate.e_score_correction_bias", (e_count,))
            self.e_score_correction_bias = nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        if f"{prefix}experts.gate_up_proj" in weights:
            gate_up = take(f"{prefix}experts.gate_up_proj", (e_count, 2 * i, h))
            down = take(f"{prefix}experts.down_proj", (e_count, h, i))
        else:
            ex = f"{prefix}experts."
            gate_up = torch.stack(
                [
                    torch.cat(
                        [
                            take(f"{ex}{e}.{names.gate}.weight", (i, h)),
                            take(f"{ex}{e}.{names.up}.weight", (i, h)),
                        ]
                    )
                    for e in range(e_count)
                ]
            )
            down = torch.stack([take(f"{ex}{e}.{names.down}.weight", (h, i)) for e in range(e_count)])
        self.set_experts(gate_up, down)
        if self.shared_expert is not None:
            si, sp = cfg.shared_intermediate_size, f"{prefix}{names.shared}."
            _assign(
                self.shared_expert.gate_up_proj,
                torch.cat([take(f"{sp}gate_proj.weight", (si, h)), take(f"{sp}up_proj.weight", (si, h))]),
            )
            _assign(self.shared_expert.down_proj, take(f"{sp}down_proj.weight", (h, si)))
        if self.shared_expert_gate is not None:
            _assign(self.shared_expert_gate, take(f"{prefix}shared_expert_gate.weight", (1, h)))

    def set_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """All experts' weights at once: gate_up [E, 2I, H] (gate rows, then up) and down [E, H, I].

        The stacked form of transformers 5 and of GGUF (``ffn_gate_exps`` and ``ffn_up_exps``
        concatenated along dim 1, ``ffn_down_exps``).
        """
        cfg = self.config
        e_count, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        if tuple(gate_up.shape) != (e_count, 2 * i, h):
            raise ValueError(f"gate_up must be [{e_count}, {2 * i}, {h}], got {tuple(gate_up.shape)}")
        if tuple(down.shape) != (e_count, h, i):
            raise ValueError(f"down must be [{e_count}, {h}, {i}], got {tuple(down.shape)}")
        for e in range(e_count):
            _assign(self.experts.gate_up[e], gate_up[e])
            _assign(self.experts.down[e], down[e])

    def pack_for_kernels(self) -> int:
        """Move this block's linear layers onto the CPU kernel where it runs, dropping their PyTorch
        copies; returns how many moved. For a block used on its own, once its weights are final: a
        Decoder packs its blocks itself (``Decoder.pack_for_kernels``)."""
        return sum(1 for m in self.modules() if isinstance(m, KernelPackable) and m.pack_for_kernel(release=True))


def _assign(layer: nn.Module, weight: torch.Tensor) -> None:
    """``layer.weight`` = ``weight`` in the layer's dtype (works on a meta-device model too)."""
    if tuple(layer.weight.shape) != tuple(weight.shape):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for a layer of {tuple(layer.weight.shape)}")
    layer.weight = nn.Parameter(weight.detach().to(layer.weight.dtype).contiguous(), requires_grad=False)


def per_token_forward(experts: GroupedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token through its own experts one at a time (the baseline grouping is measured against;
    the same products row by row, so the same result bit for bit)."""
    t, k = routing.experts.shape
    rows: list[torch.Tensor] = []
    for token in range(t):
        slots: Sequence[torch.Tensor] = [
            experts.expert(int(routing.experts[token, s]), x[token : token + 1])
            * routing.weights[token, s : s + 1]
            for s in range(k)
        ]
        total = slots[0].to(x.dtype).clone()
        for y in slots[1:]:
            total += y.to(x.dtype)
        rows.append(total)
    return torch.cat(rows) if rows else x.new_empty(0, experts.hidden_size)
