"""A PEFT LoRA adapter read from disk, checked against the base model, in the decoder's fused layout.

PEFT saves ``adapter_config.json`` and ``adapter_model.safetensors`` whose tensors are
named ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``:
``A`` is ``[r, in_features]``, ``B`` is ``[out_features, r]`` and the layer computes
``base(x) + scale * (x @ A.T) @ B.T`` with ``scale = lora_alpha / r`` (``/ sqrt(r)``
under rsLoRA).

The decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, so each
fused layer gets one ``A`` (the targets' ``A`` stacked, ``[targets * r, in]``) and one
block-diagonal ``B`` (``[fused out, targets * r]``, the scale folded in): one pair of
small GEMMs per fused layer, whichever of its projections the adapter targets.

Only what this computes exactly is accepted; anything else (DoRA, trained biases,
``modules_to_save``, per-module ranks, targets outside the seven projections, missing or
extra tensors, shapes that do not match the base) is an AdapterError naming it. So is a path
the server cannot read (an OSError), a config over MAX_CONFIG_BYTES or nested deeper than
MAX_CONFIG_DEPTH: whatever is on disk, loading fails with an AdapterError and nothing else.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import reprlib
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from protoserve.engine.models.config import ModelConfig

MAX_RANK = 64
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The decoder's fused layer each projection lives in.
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
# PEFT writes a config of a few KB, three or four levels deep; these bounds keep a hostile one
# from costing memory or Python's recursion limit (json's decoder recurses per level).
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_DEPTH = 16
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter this engine will not load; the message names the file, field or tensor at fault.

    Files are named relative to the adapter's directory: whoever loads it knows the directory, and
    a path of thousands of characters must not crowd the problem out of a bounded error message.

    ``field`` is the load request's field it is about: the adapter's ``path`` (its files), or ``name``.
    """

    def __init__(self, message: str, field: str = "path") -> None:
        super().__init__(message)
        self.field = field


# What an OSError on an adapter's path means, in words an admin can act on.
_OS_ERRORS = {
    errno.ENOENT: "does not exist",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.ENAMETOOLONG: "the path or one of its names is too long for the file system",
    errno.EACCES: "permission denied (the server's user cannot read it)",
    errno.EPERM: "permission denied (the server's user cannot read it)",
    errno.ELOOP: "too many levels of symbolic links",
}


def os_error_text(path: Path, exc: OSError) -> str:
    """``exc`` as an AdapterError message: what went wrong, and with which file when not the directory."""
    what = _OS_ERRORS.get(exc.errno, exc.strerror or type(exc).__name__)
    file = Path(exc.filename) if exc.filename is not None else path
    return what if file == path or not file.is_relative_to(path) else f"{file.relative_to(path)}: {what}"


def shown(value: object) -> str:
    """A config value as a message quotes it: bounded, however large the value."""
    return reprlib.repr(value)


@dataclass(frozen=True)
class FusedDelta:
    """The low-rank update of one fused layer: ``delta = (x @ a.T) @ b.T``, scale folded into ``b``."""

    a: torch.Tensor  # [targets * r, in_features]
    b: torch.Tensor  # [out_features, targets * r], block-diagonal over the targets' output slices
    out_slices: tuple[tuple[int, int], ...]  # target j's [begin, end) of the output; its r columns of b


@dataclass(frozen=True)
class LoraAdapter:
    """One loaded adapter: per (layer index, fused layer name) its FusedDelta."""

    name: str
    path: Path
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    digest: bytes  # sha256 of the config and weights files: what keys its prefix-cache blocks
    deltas: dict[tuple[int, str], FusedDelta]

    @property
    def nbytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size() for d in self.deltas.values())


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each Hugging Face projection."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size), "v_proj": (kv, c.hidden_size),
            "o_proj": (c.hidden_size, q), "gate_proj": (c.intermediate_size, c.hidden_size),
            "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size)}


def output_offsets(config: ModelConfig) -> dict[str, int]:
    """Where each projection's rows start in its fused layer's output."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": 0, "k_proj": q, "v_proj": q + kv, "o_proj": 0,
            "gate_proj": 0, "up_proj": c.intermediate_size, "down_proj": 0}


def read_adapter_config(path: Path) -> dict:
    """The adapter's config as a dict; AdapterError when too large, too deep or not a JSON object
    (OSErrors pass to load_adapter, which words them)."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"no {CONFIG_FILE} (a PEFT LoRA adapter directory has one)")
    with file.open("rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes (PEFT writes a few KB)")
    too_deep = AdapterError(f"{CONFIG_FILE}: nests deeper than {MAX_CONFIG_DEPTH} levels of arrays and objects")
    try:
        cfg = json.loads(data)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        raise AdapterError(f"{CONFIG_FILE}: not valid JSON ({exc})") from None
    if json_depth(cfg) > MAX_CONFIG_DEPTH:
        raise too_deep
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE}: must hold a JSON object")
    return cfg


def json_depth(value: object) -> int:
    """How deep arrays and objects nest in decoded JSON, walked without recursion (so a value json
    decoded near the recursion limit is measured, not re-raised on), stopping past MAX_CONFIG_DEPTH."""
    deepest, todo = 0, [(value, 1)]
    while todo and deepest <= MAX_CONFIG_DEPTH:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_adapter_config(cfg: dict) -> tuple[int, float, bool, tuple[str, ...]]:
    """(rank, alpha, use_rslora, targets) of a PEFT LoRA config this engine computes exactly."""
    where = CONFIG_FILE
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {shown(cfg.get('peft_type'))} is not supported (only LORA)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RANK:
        raise AdapterError(f"{where}: r must be an integer in [1, {MAX_RANK}], got {shown(r)}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a finite number, got {shown(alpha)}")
    if cfg.get("use_dora"):
        raise AdapterError(f"{where}: use_dora (DoRA) is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {shown(cfg.get('bias'))} is not supported (only 'none': no trained biases)")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save {shown(cfg['modules_to_save'])} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{where}: {key} is not supported (one rank and alpha for every module)")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"{where}: fan_in_fan_out is not supported (Conv1D-style weights)")
    if cfg.get("layers_to_transform") is not None:
        raise AdapterError(f"{where}: layers_to_transform is not supported (the adapter must cover every layer)")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(PROJECTIONS)
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{where}: target_modules must be a non-empty list of module names, got {shown(targets)}")
    unknown = sorted(set(targets) - set(PROJECTIONS))
    if unknown:
        raise AdapterError(f"{where}: target_modules {shown(unknown)} are not supported (only {list(PROJECTIONS)})")
    return r, float(alpha), bool(cfg.get("use_rslora", False)), tuple(p for p in PROJECTIONS if p in targets)


def check_adapter_targets(config: ModelConfig, targets: tuple[str, ...]) -> None:
    """AdapterError for targets the base model does not have as plain layers: the MLP projections of a
    mixture-of-experts model live per expert, where a PEFT LoRA of the dense names does not apply, and an
    ungated GELU MLP (StarCoder2) has no gate or up projection."""
    if config.kv_lora_rank:  # no q/k/v projections: MLA's are low-rank and absorbed (latent_attention.py)
        raise AdapterError(f"{CONFIG_FILE}: LoRA adapters are not supported on {config.architecture}'s "
                           f"multi-head latent attention models")
    mlp = sorted(t for t in targets if PARENT[t] == "mlp")
    if config.num_experts and mlp:
        raise AdapterError(f"{CONFIG_FILE}: target_modules {mlp} are MLP projections, and this base model's "
                           f"MLPs are mixture-of-experts blocks; LoRA on experts is not supported (target the "
                           f"attention projections)")
    gated = sorted(t for t in mlp if t in ("gate_proj", "up_proj"))
    if config.mlp == "gelu" and gated:
        raise AdapterError(f"{CONFIG_FILE}: target_modules {gated} are gated-MLP projections, and this base "
                           f"model's MLP has no gate (c_fc, c_proj); only down_proj (its c_proj) takes a LoRA")


def read_adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"{WEIGHTS_FILE}: missing (PEFT saves the weights as {WEIGHTS_FILE})")
    try:
        return load_file(file)
    except (SafetensorError, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE}: not a readable safetensors file ({exc})") from None


def tensor_name(layer: int, proj: str, which: str) -> str:
    return f"{_PREFIX}model.layers.{layer}.{PARENT[proj]}.{proj}.lora_{which}.weight"


def load_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter for a base model of ``config``; its deltas in ``dtype``.

    Every failure, a file the server cannot read included, is an AdapterError."""
    path = Path(path)
    try:
        return _read_adapter(name, path, config, dtype)
    except OSError as exc:
        raise AdapterError(os_error_text(path, exc)) from None


def _read_adapter(name: str, path: Path, config: ModelConfig, dtype: torch.dtype) -> LoraAdapter:
    # stat, not is_dir: a missing path, a symlink loop or a denied one each gets its own words.
    if not stat.S_ISDIR(path.stat().st_mode):
        raise AdapterError(f"not a directory (a PEFT adapter is a directory with {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE})")
    cfg = read_adapter_config(path)
    r, alpha, rslora, targets = check_adapter_config(cfg)
    check_adapter_targets(config, targets)
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    tensors = read_adapter_tensors(path)
    shapes = projection_shapes(config)
    offsets = output_offsets(config)
    expected = {tensor_name(i, p, w) for i in range(config.num_layers) for p in targets for w in "AB"}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise AdapterError(f"{WEIGHTS_FILE}: missing {len(missing)} tensor(s) the config's target_modules need, "
                           f"e.g. {missing[0]!r}")
    extra = sorted(tensors.keys() - expected)
    if extra:
        raise AdapterError(f"{WEIGHTS_FILE}: tensor {extra[0]!r} is not a LoRA A/B of a target module of this "
                           f"base model ({len(extra)} such)")
    deltas: dict[tuple[int, str], FusedDelta] = {}
    for i in range(config.num_layers):
        by_fused: dict[str, list[str]] = {}
        for p in targets:
            out_f, in_f = shapes[p]
            a, b = tensors[tensor_name(i, p, "A")], tensors[tensor_name(i, p, "B")]
            if tuple(a.shape) != (r, in_f):
                raise AdapterError(f"{WEIGHTS_FILE}: {tensor_name(i, p, 'A')} has shape {list(a.shape)}, the base "
                                   f"model needs [{r}, {in_f}] (r={r}, {p} in_features={in_f})")
            if tuple(b.shape) != (out_f, r):
                raise AdapterError(f"{WEIGHTS_FILE}: {tensor_name(i, p, 'B')} has shape {list(b.shape)}, the base "
                                   f"model needs [{out_f}, {r}] ({p} out_features={out_f}, r={r})")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"{WEIGHTS_FILE}: layer {i} {p} has non-finite weights")
            by_fused.setdefault(FUSED[p], []).append(p)
        for fused, projs in by_fused.items():
            fused_out = sum(shapes[p][0] for p in PROJECTIONS if FUSED[p] == fused)
            a_cat = torch.cat([tensors[tensor_name(i, p, "A")].float() for p in projs])
            b_full = torch.zeros(fused_out, r * len(projs))
            out_slices = tuple((offsets[p], offsets[p] + shapes[p][0]) for p in projs)
            for j, (p, (begin, end)) in enumerate(zip(projs, out_slices, strict=True)):
                b_full[begin:end, j * r : (j + 1) * r] = tensors[tensor_name(i, p, "B")].float() * scale
            deltas[(i, fused)] = FusedDelta(a_cat.to(dtype).contiguous(), b_full.to(dtype).contiguous(), out_slices)
    return LoraAdapter(name=name, path=path, rank=r, alpha=alpha, scale=scale, target_modules=targets,
                       digest=adapter_digest(path), deltas=deltas)


def adapter_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        h.update((path / file).read_bytes())
    return h.digest()
