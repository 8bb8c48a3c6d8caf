"""RoPE scaling (engine/models/rope.py, rope_config.py) against transformers and vLLM's formulas.

inv_freq and attention factors are compared with transformers' ROPE_INIT_FUNCTIONS
on tiny LlamaConfigs, cos/sin with LlamaRotaryEmbedding's forward; dynamic NTK
against vLLM's static-base formula restated here; every validation error must
name its key.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from protoserve.engine.models.rope import (
    ROPE_TYPES,
    RopeConfigError,
    apply_rope,
    rope_cos_sin,
    rope_spec,
)
from protoserve.engine.models.rope_config import (
    RopeSettings,
    rope_scaling_from_gguf,
    rope_settings_by_layer_type_from_hf,
    rope_settings_from_hf,
)

REL = 1e-7


def _factors(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [round(1.0 + 3.0 * rng.random(), 4) for _ in range(n)]


def _hf_config(
    head_dim: int, theta: float, scaling: dict | None, max_pos: int, partial: float = 1.0
) -> LlamaConfig:
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )


def _hf_inv_freq(config: LlamaConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


def _assert_rel(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.float(), rtol=REL, atol=0.0)


YARN = [
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=256,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # Qwen3-style long context.
    dict(
        head_dim=128,
        theta=1e6,
        max_pos=131072,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    # gpt-oss style: untruncated ramp, explicit betas.
    dict(
        head_dim=64,
        theta=150000.0,
        max_pos=131072,
        scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    ),
    dict(
        head_dim=32,
        theta=10000.0,
        max_pos=512,
        scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    ),
    # DeepSeek-style mscale pair, and factor derived from the context lengths.
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=1024,
        scaling={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    ),
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=640,
        scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
    ),
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=256,
        scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.3,
        },
    ),
    # mscale alone does not count (transformers needs both).
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=256,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7},
    ),
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=256,
        partial=0.5,
        scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
]
LLAMA3 = [
    dict(
        head_dim=64,
        theta=500000.0,
        max_pos=131072,
        scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    dict(
        head_dim=128,
        theta=500000.0,
        max_pos=131072,
        scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
]
LINEAR = [
    dict(head_dim=64, theta=10000.0, max_pos=4096, scaling={"rope_type": "linear", "factor": 2.0}),
    dict(head_dim=32, theta=1e6, max_pos=4096, scaling={"rope_type": "linear", "factor": 8}),
]
DEFAULT = [
    dict(head_dim=64, theta=10000.0, max_pos=2048, scaling=None),
    dict(head_dim=128, theta=1e6, max_pos=2048, scaling=None),
]


def _case_id(case: dict) -> str:
    s = case["scaling"] or {"rope_type": "default"}
    extra = ",".join(
        f"{k}={v}" for k, v in s.items() if k not in ("rope_type", "long_factor", "short_factor")
    )
    return f"{s['rope_type']}-d{case['head_dim']}-{extra}-p{case.get('partial', 1.0)}"


@pytest.mark.parametrize("case", YARN + LLAMA3 + LINEAR + DEFAULT, ids=_case_id)
def test_static_types_match_transformers(case: dict) -> None:
    config = _hf_config(
        case["head_dim"], case["theta"], case["scaling"], case["max_pos"], case.get("partial", 1.0)
    )
    ref_inv, ref_attention = _hf_inv_freq(config)
    scaling = dict(case["scaling"] or {})
    if case.get("partial", 1.0) != 1.0:
        scaling["partial_rotary_factor"] = case["partial"]
    spec = rope_spec(case["head_dim"], case["theta"], scaling or None, case["max_pos"])
    _assert_rel(spec.inv_freq, ref_inv)
    assert spec.attention_factor == pytest.approx(ref_attention, rel=REL)
    assert spec.rotary_dim == int(case["head_dim"] * case.get("partial", 1.0))


def test_yarn_attention_factor_is_not_one() -> None:
    """The yarn cases above exercise the factor (a test that passes with 1.0 everywhere proves nothing)."""
    spec = rope_spec(64, 10000.0, YARN[0]["scaling"], 256)
    assert spec.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    mscale_pair = rope_spec(64, 10000.0, YARN[4]["scaling"], 1024)
    assert mscale_pair.attention_factor == pytest.approx((0.1 * math.log(16) + 1) / (0.08 * math.log(16) + 1))


LONGROPE = [
    # Phi-3 style: no factor, max_position_embeddings is the extended context.
    dict(
        head_dim=32,
        theta=10000.0,
        max_pos=1024,
        scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 64,
            "short_factor": _factors(16, 1),
            "long_factor": _factors(16, 2),
        },
    ),
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=4096,
        scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 256,
            "factor": 8.0,
            "short_factor": _factors(32, 3),
            "long_factor": _factors(32, 4),
        },
    ),
    dict(
        head_dim=64,
        theta=250000.0,
        max_pos=4096,
        scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 256,
            "attention_factor": 1.25,
            "short_factor": _factors(32, 5),
            "long_factor": _factors(32, 6),
        },
    ),
    dict(
        head_dim=64,
        theta=10000.0,
        max_pos=4096,
        partial=0.5,
        scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 256,
            "short_factor": _factors(16, 7),
            "long_factor": _factors(16, 8),
        },
    ),
]


@pytest.mark.parametrize("case", LONGROPE, ids=_case_id)
def test_longrope_matches_transformers_for_the_chosen_factor_set(case: dict) -> None:
    config = _hf_config(
        case["head_dim"], case["theta"], case["scaling"], case["max_pos"], case.get("partial", 1.0)
    )
    scaling = dict(case["scaling"])
    if case.get("partial", 1.0) != 1.0:
        scaling["partial_rotary_factor"] = case["partial"]
    original = scaling["original_max_position_embeddings"]

    # Served context beyond the pretraining one (the config's own): long factors.
    long_inv, long_attention = _hf_inv_freq(config, seq_len=original + 1)
    spec = rope_spec(case["head_dim"], case["theta"], scaling, case["max_pos"])
    _assert_rel(spec.inv_freq, long_inv)
    assert spec.attention_factor == pytest.approx(long_attention, rel=REL)

    # An engine serving at most the pretraining context: short factors, same attention factor.
    short_inv, short_attention = _hf_inv_freq(config, seq_len=None)
    spec = rope_spec(case["head_dim"], case["theta"], scaling, case["max_pos"], max_model_len=original)
    _assert_rel(spec.inv_freq, short_inv)
    assert spec.attention_factor == pytest.approx(short_attention, rel=REL)
    assert not torch.equal(long_inv, short_inv)


def _vllm_dynamic_inv_freq(theta: float, d: int, factor: float, served: float, trained: int) -> torch.Tensor:
    """vLLM's DynamicNTKScalingRotaryEmbedding: a static base for the served context (no
    scaling at or below the trained length), then the usual inverse frequencies."""
    if served <= trained:
        base = theta
    else:
        base = theta * ((factor * served / trained) - (factor - 1)) ** (d / (d - 2))
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d))


DYNAMIC = [
    dict(head_dim=64, theta=10000.0, max_pos=256, factor=2.0),
    dict(head_dim=128, theta=1e6, max_pos=4096, factor=4.5),
    dict(head_dim=32, theta=500.0, max_pos=64, factor=1.0),
]


@pytest.mark.parametrize("case", DYNAMIC, ids=lambda c: f"d{c['head_dim']}-f{c['factor']}")
@pytest.mark.parametrize("served", [None, "trained", "3x", "half"])
def test_dynamic_is_vllm_static_base_and_transformers_at_that_length(case: dict, served: str | None) -> None:
    d, theta, trained, factor = case["head_dim"], case["theta"], case["max_pos"], case["factor"]
    max_model_len = {None: None, "trained": trained, "3x": 3 * trained + 5, "half": trained // 2}[served]
    spec = rope_spec(
        d, theta, {"rope_type": "dynamic", "factor": factor}, trained, max_model_len=max_model_len
    )
    # Without max_model_len the served context is the full scaled one, trained * factor.
    length = trained * factor if max_model_len is None else max_model_len
    _assert_rel(spec.inv_freq, _vllm_dynamic_inv_freq(theta, d, factor, length, trained))
    assert spec.attention_factor == 1.0

    # transformers' per-batch base, at a batch whose longest sequence is exactly that long.
    config = _hf_config(d, theta, {"rope_type": "dynamic", "factor": factor}, trained)
    ref, _ = _hf_inv_freq(config, seq_len=int(length))
    if float(length).is_integer():
        _assert_rel(spec.inv_freq, ref)


def test_dynamic_differs_from_transformers_on_short_batches_when_serving_long() -> None:
    """The documented difference: transformers resets to the unscaled base for a batch that fits
    the original context; the engine keeps the base of its served context for every batch."""
    config = _hf_config(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 256)
    short_batch, _ = _hf_inv_freq(config, seq_len=100)
    serving_long = rope_spec(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 256, max_model_len=1024)
    serving_short = rope_spec(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 256, max_model_len=256)
    assert not torch.allclose(serving_long.inv_freq, short_batch)
    _assert_rel(serving_short.inv_freq, short_batch)


def _hf_cos_sin(config: LlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    module = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(x, positions[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize(
    ("case", "positions", "max_model_len"),
    [
        (YARN[0], [0, 1, 7, 63, 64, 200, 255], None),
        (YARN[4], [0, 5, 513, 1023], None),
        (YARN[8], [0, 3, 99, 255], None),  # partial rotary
        (LONGROPE[0], [0, 65, 300, 1023], None),  # longest > original: both use long factors
        (LONGROPE[1], [0, 1, 17, 255], 256),  # engine serving the original context: short
        (LONGROPE[2], [3, 4000], None),
    ],
    ids=["yarn", "yarn-mscale", "yarn-partial", "longrope-long", "longrope-short", "longrope-attn"],
)
def test_cos_sin_match_llama_rotary_embedding(
    case: dict, positions: list[int], max_model_len: int | None
) -> None:
    partial = case.get("partial", 1.0)
    config = _hf_config(case["head_dim"], case["theta"], case["scaling"], case["max_pos"], partial)
    pos = torch.tensor(positions, dtype=torch.int64)
    ref_cos, ref_sin = _hf_cos_sin(config, pos)
    scaling = dict(case["scaling"])
    if partial != 1.0:
        scaling["partial_rotary_factor"] = partial
    spec = rope_spec(case["head_dim"], case["theta"], scaling, case["max_pos"], max_model_len=max_model_len)
    cos, sin = rope_cos_sin(pos, spec, torch.float32)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-6, atol=1e-7)
    if spec.attention_factor != 1.0:
        assert cos[0].abs().max().item() == pytest.approx(spec.attention_factor, rel=1e-6)


def test_cos_sin_match_dynamic_rotary_embedding_at_its_length() -> None:
    config = _hf_config(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 256)
    pos = torch.tensor([0, 17, 300, 999], dtype=torch.int64)  # longest sequence: 1000 tokens
    ref_cos, ref_sin = _hf_cos_sin(config, pos)
    spec = rope_spec(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 256, max_model_len=1000)
    cos, sin = rope_cos_sin(pos, spec, torch.float32)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "scaling", [YARN[0]["scaling"], LONGROPE[0]["scaling"], {"rope_type": "dynamic", "factor": 4.0}]
)
def test_a_position_rotates_the_same_whatever_the_batch(scaling: dict) -> None:
    """Batch invariance: a position's cos/sin do not depend on the positions beside it."""
    max_pos = 1024 if scaling["rope_type"] == "longrope" else 256
    spec = rope_spec(32, 10000.0, scaling, max_pos)
    alone = torch.tensor([5, 6, 7])
    crowd = torch.tensor([5, 6, 7, 1000, 0, 3000])
    for a, b in zip(
        rope_cos_sin(alone, spec, torch.float32), rope_cos_sin(crowd, spec, torch.float32), strict=True
    ):
        assert torch.equal(a, b[:3])


def test_apply_rope_matches_transformers_and_passes_partial_dims_through() -> None:
    torch.manual_seed(0)
    spec = rope_spec(64, 10000.0, YARN[0]["scaling"], 256)
    pos = torch.arange(9)
    cos, sin = rope_cos_sin(pos, spec, torch.float32)
    q = torch.randn(9, 4, 64)
    ours = apply_rope(q, cos, sin)
    # transformers wants [batch, heads, seq, dim] and [batch, seq, dim].
    ref, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(ours, ref[0].transpose(0, 1), rtol=0, atol=0)

    partial = rope_spec(64, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.5}, 256)
    cos, sin = rope_cos_sin(pos, partial, torch.float32)
    assert cos.shape == (9, 32)
    out = apply_rope(q, cos, sin)
    assert torch.equal(out[..., 32:], q[..., 32:])
    assert torch.equal(out[..., :32], apply_rope(q[..., :32].contiguous(), cos, sin))
    assert not torch.equal(out[1:, :, :32], q[1:, :, :32])


def test_specs_built_under_meta_device_are_real_cpu_tensors() -> None:
    """The decoder is built under torch.device('meta'); its rope tables must still hold values."""
    cases = [(YARN[0], None), (LONGROPE[0], None), (LLAMA3[0], None), (DEFAULT[0], None)]
    for case, _ in cases:
        real = rope_spec(case["head_dim"], case["theta"], case["scaling"], case["max_pos"])
        with torch.device("meta"):
            meta = rope_spec(case["head_dim"], case["theta"], case["scaling"], case["max_pos"])
        assert meta.inv_freq.device.type == "cpu"
        assert torch.equal(meta.inv_freq, real.inv_freq)


# ---------------------------------------------------------------------------
# linear / llama3 bit for bit as transformers computes them


@pytest.mark.parametrize("case", LLAMA3 + LINEAR, ids=_case_id)
def test_linear_llama3_bit_identical_to_transformers(case: dict) -> None:
    config = _hf_config(case["head_dim"], case["theta"], case["scaling"], case["max_pos"])
    ref, _ = _hf_inv_freq(config)
    assert torch.equal(
        rope_spec(case["head_dim"], case["theta"], case["scaling"], case["max_pos"]).inv_freq, ref
    )


# ---------------------------------------------------------------------------
# Validation: every error names its key


_LONG = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 64,
    "short_factor": [1.0] * 16,
    "long_factor": [2.0] * 16,
}
BAD = [
    ({"rope_type": "linear"}, "'factor'"),
    ({"rope_type": "dynamic"}, "'factor'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "'factor'"),
    ({"rope_type": "linear", "factor": 0.5}, "'factor'"),
    ({"rope_type": "yarn", "factor": 0.9, "original_max_position_embeddings": 64}, "'factor'"),
    ({"rope_type": "dynamic", "factor": True}, "'factor'"),
    ({"rope_type": "linear", "factor": "2"}, "'factor'"),
    ({"rope_type": "yarn", "factor": 4.0}, "'original_max_position_embeddings'"),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
        "'original_max_position_embeddings'",
    ),
    ({"rope_type": "ntk", "factor": 2.0}, "'rope_type'"),
    ({"type": "su", "factor": 2.0}, "'rope_type'"),
    ({**_LONG, "short_factor": [1.0] * 15}, "'short_factor'"),
    ({**_LONG, "long_factor": [1.0] * 17}, "'long_factor'"),
    ({**_LONG, "long_factor": [1.0] * 15 + ["x"]}, "'long_factor'"),
    ({k: v for k, v in _LONG.items() if k != "short_factor"}, "'short_factor'"),
    ({**_LONG, "short_mscale": 1.1}, "'short_mscale'"),
    ({**_LONG, "attention_factor": -1.0}, "'attention_factor'"),
    ({**_LONG, "factor": 0.5}, "'factor'"),
    (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 4.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
        },
        "'high_freq_factor'",
    ),
    (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "'low_freq_factor'",
    ),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": "no"},
        "'truncate'",
    ),
    (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": "32"},
        "'beta_fast'",
    ),
    (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "extrapolation_factor": 1.0,
        },
        "'extrapolation_factor'",
    ),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 1.5}, "'partial_rotary_factor'"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.01}, "'partial_rotary_factor'"),
    ({"rope_type": "linear", "type": "dynamic", "factor": 2.0}, "'type'"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, "'rope_theta'"),
]


@pytest.mark.parametrize(("scaling", "key"), BAD, ids=[f"{i}-{k}" for i, (_, k) in enumerate(BAD)])
def test_validation_errors_name_their_key(scaling: dict, key: str) -> None:
    with pytest.raises(RopeConfigError) as info:
        rope_spec(32, 10000.0, scaling, 256)
    assert key in str(info.value)


def test_unknown_type_lists_the_supported_ones() -> None:
    with pytest.raises(RopeConfigError) as info:
        rope_spec(32, 10000.0, {"rope_type": "ntk", "factor": 2.0}, 256)
    for rope_type in ROPE_TYPES:
        assert rope_type in str(info.value)


def test_bad_max_model_len_names_it() -> None:
    with pytest.raises(RopeConfigError, match="'max_model_len'"):
        rope_spec(32, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 256, max_model_len=0)


# ---------------------------------------------------------------------------
# config.json -> RopeSettings


HF_RAWS = [
    # transformers < 5: rope_theta beside rope_scaling, legacy `type`.
    {
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    },
    # transformers >= 5: theta inside rope_parameters.
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
    # yarn without its original context: max_position_embeddings fills it.
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    # Phi-3: the original context at the top level, partial rotary beside.
    {
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    },
    {"rope_scaling": {"rope_type": "dynamic", "factor": 3.0}, "rope_theta": 20000},
]


@pytest.mark.parametrize("raw", HF_RAWS, ids=range(len(HF_RAWS)))
def test_hf_settings_match_transformers_standardisation(raw: dict) -> None:
    settings = rope_settings_from_hf(raw, head_dim=32, max_position_embeddings=256)
    # Phi-3's config class is the one that reads a top-level original context; transformers
    # edits the dicts it is given, hence the copy.
    config_class = Phi3Config if "original_max_position_embeddings" in raw else LlamaConfig
    hf = config_class(
        hidden_size=128, num_attention_heads=4, head_dim=32, max_position_embeddings=256, **copy.deepcopy(raw)
    )
    expected = {k: v for k, v in hf.rope_parameters.items() if k not in ("rope_theta", "type")}
    assert settings.theta == float(hf.rope_parameters["rope_theta"])
    assert settings.scaling == expected
    rope_spec(32, settings.theta, settings.scaling, 256)  # and they build


def test_hf_plain_rope_is_none_and_theta_defaults() -> None:
    assert rope_settings_from_hf({}, 64, 2048) == RopeSettings(10000.0, None)
    assert rope_settings_from_hf({"rope_theta": 1e6, "rope_scaling": None}, 64, 2048) == RopeSettings(
        1e6, None
    )
    assert rope_settings_from_hf(
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}, 64, 2048
    ) == RopeSettings(5.0, None)
    partial = rope_settings_from_hf({"partial_rotary_factor": 0.5}, 64, 2048)
    assert partial.scaling == {"rope_type": "default", "partial_rotary_factor": 0.5}


def test_hf_errors_name_their_key() -> None:
    with pytest.raises(RopeConfigError, match="'rope_type'"):
        rope_settings_from_hf({"rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}}, 64, 2048)
    with pytest.raises(RopeConfigError, match="'long_factor'"):
        rope_settings_from_hf(
            {
                "rope_scaling": {
                    "type": "longrope",
                    "short_factor": [1.0] * 32,
                    "long_factor": [1.0] * 31,
                    "original_max_position_embeddings": 64,
                }
            },
            64,
            2048,
        )
    with pytest.raises(RopeConfigError, match="rope_parameters.*rope_scaling"):
        rope_settings_from_hf(
            {
                "rope_parameters": {"rope_type": "linear", "factor": 2.0},
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            },
            64,
            2048,
        )
    with pytest.raises(RopeConfigError, match="original_max_position_embeddings"):
        rope_settings_from_hf(
            {
                "original_max_position_embeddings": 64,
                "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
            },
            64,
            2048,
        )
    with pytest.raises(RopeConfigError, match="per layer type"):
        rope_settings_from_hf({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, 64, 2048)


def test_hf_per_layer_type_settings() -> None:
    raw = {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    }
    settings = rope_settings_by_layer_type_from_hf(raw, 64, 2048)
    assert settings == {
        "sliding_attention": RopeSettings(10000.0, None),
        "full_attention": RopeSettings(1e6, {"rope_type": "linear", "factor": 8.0}),
    }
    flat = rope_settings_by_layer_type_from_hf(
        {"layer_types": ["full_attention"] * 3, "rope_theta": 7.0}, 64, 2048
    )
    assert flat == {"full_attention": RopeSettings(7.0, None)}


# ---------------------------------------------------------------------------
# GGUF metadata -> the same dict


def test_gguf_yarn_maps_onto_the_hf_dict() -> None:
    meta = {
        "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 64,
        "qwen3.rope.scaling.yarn_beta_fast": 32.0,
        "qwen3.rope.scaling.yarn_beta_slow": 1.0,
        "qwen3.rope.scaling.finetuned": True,
        "qwen3.context_length": 256,
        "general.architecture": "qwen3",
    }
    scaling = rope_scaling_from_gguf(meta, "qwen3", head_dim=64, rope_theta=10000.0, context_length=256)
    assert scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    from_gguf = rope_spec(64, 10000.0, scaling, 256)
    from_hf = rope_spec(64, 10000.0, YARN[0]["scaling"], 256)
    assert torch.equal(from_gguf.inv_freq, from_hf.inv_freq)
    assert from_gguf.attention_factor == from_hf.attention_factor


def test_gguf_yarn_attn_factor_and_default_original() -> None:
    meta = {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 2.0,
        "llama.rope.scaling.yarn_attn_factor": 1.5,
    }
    scaling = rope_scaling_from_gguf(meta, "llama", 64, 10000.0, 512)
    assert scaling == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 512,
        "attention_factor": 1.5,
    }
    assert rope_spec(64, 10000.0, scaling, 512).attention_factor == 1.5


def test_gguf_linear_none_and_longrope() -> None:
    assert rope_scaling_from_gguf({}, "llama", 64, 10000.0, 2048) is None
    assert rope_scaling_from_gguf({"llama.rope.scaling.type": "none"}, "llama", 64, 10000.0, 2048) is None
    linear = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert rope_scaling_from_gguf(linear, "llama", 64, 10000.0, 2048) == {
        "rope_type": "linear",
        "factor": 4.0,
    }

    long_f, short_f = _factors(16, 11), _factors(16, 12)
    meta = {"phi3.rope.scaling.attn_factor": 1.19, "phi3.rope.scaling.original_context_length": 64}
    scaling = rope_scaling_from_gguf(
        meta, "phi3", 32, 10000.0, 1024, long_factors=long_f, short_factors=short_f
    )
    assert scaling == {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "long_factor": long_f,
        "short_factor": short_f,
        "attention_factor": 1.19,
    }
    spec = rope_spec(32, 10000.0, scaling, 1024)
    assert spec.attention_factor == 1.19
    assert torch.equal(
        spec.inv_freq, 1.0 / (torch.tensor(long_f) * 10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    )


def test_gguf_partial_rotary_from_the_dimension_count() -> None:
    """Phi-4-mini's ``rope.dimension_count`` below the head dim: partial rotary, as its config.json says."""
    scaling = rope_scaling_from_gguf({}, "phi3", 16, 10000.0, 512, rotary_dim=12)
    assert scaling == {"rope_type": "default", "partial_rotary_factor": 0.75}
    assert rope_spec(16, 10000.0, scaling, 512).rotary_dim == 12
    assert rope_scaling_from_gguf({}, "phi3", 16, 10000.0, 512, rotary_dim=16) is None
    for bad in (7, 18, 0):
        with pytest.raises(RopeConfigError, match="phi3.rope.dimension_count"):
            rope_scaling_from_gguf({}, "phi3", 16, 10000.0, 512, rotary_dim=bad)


def test_gguf_yarn_log_multiplier_where_the_softmax_takes_it() -> None:
    """deepseek2's converter writes 0.1 * mscale_all_dim; llama.cpp scales the softmax by it and leaves
    the rope's magnitude at 1, which mscale = mscale_all_dim gives (transformers' attention factor)."""
    meta = {
        "deepseek2.rope.scaling.type": "yarn",
        "deepseek2.rope.scaling.factor": 4.0,
        "deepseek2.rope.scaling.original_context_length": 128,
        "deepseek2.rope.scaling.yarn_log_multiplier": 0.0707,
    }
    scaling = rope_scaling_from_gguf(meta, "deepseek2", 64, 10000.0, 512, softmax_mscale=True)
    assert scaling["mscale"] == scaling["mscale_all_dim"] == pytest.approx(0.707)
    assert rope_spec(64, 10000.0, scaling, 512).attention_factor == 1.0
    with pytest.raises(RopeConfigError, match="yarn_log_multiplier"):
        rope_scaling_from_gguf(meta, "deepseek2", 64, 10000.0, 512)


GGUF_BAD = [
    ({"llama.rope.scaling.type": "linear"}, "llama.rope.scaling.factor", {}),
    ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.factor", {}),
    ({"llama.rope.scaling.type": "ntk"}, "llama.rope.scaling.type", {}),
    (
        {
            "llama.rope.scaling.type": "linear",
            "llama.rope.scaling.factor": 2.0,
            "llama.rope.scaling.wobble": 1,
        },
        "llama.rope.scaling.wobble",
        {},
    ),
    (
        {
            "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.yarn_log_multiplier": 0.1,
        },
        "llama.rope.scaling.yarn_log_multiplier",
        {},
    ),
    (
        {
            "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.yarn_ext_factor": 0.5,
        },
        "llama.rope.scaling.yarn_ext_factor",
        {},
    ),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.5}, "'factor'", {}),
    (
        {
            "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 2.0,
            "llama.rope.scaling.alpha": 2.0,
        },
        "llama.rope.scaling.alpha",
        {},
    ),
    ({}, "rope_factors_short", {"long_factors": [1.0] * 16}),
    (
        {},
        "llama.rope.scaling.original_context_length",
        {"long_factors": [1.0] * 16, "short_factors": [1.0] * 16},
    ),
    (
        {"llama.rope.scaling.original_context_length": 64},
        "'long_factor'",
        {"long_factors": [1.0] * 15, "short_factors": [1.0] * 16},
    ),
]


@pytest.mark.parametrize(("meta", "key", "tensors"), GGUF_BAD, ids=[f"{i}" for i in range(len(GGUF_BAD))])
def test_gguf_errors_name_their_key(meta: dict, key: str, tensors: dict) -> None:
    with pytest.raises(RopeConfigError) as info:
        rope_scaling_from_gguf(meta, "llama", 32, 10000.0, 2048, **tensors)
    assert key in str(info.value)


# ---------------------------------------------------------------------------
# Served end to end: a tiny Llama with yarn or longrope scaling against transformers


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0},
    # A prompt longer than original_max_position_embeddings: transformers then takes the long
    # factors, as the engine does for a context (512) past it.
    {"rope_type": "longrope", "original_max_position_embeddings": 64, "rope_theta": 10000.0,
     "short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": [1.0 + 0.4 * i for i in range(8)]},
], ids=lambda s: s["rope_type"])
def test_scaled_llama_logits_match_transformers(tmp_path, scaling: dict) -> None:
    import warnings as _warnings

    from decoder_test_helpers import Driver, all_at_once, paged_cache
    from family_checkpoints import write_byte_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from protoserve.engine.loader.load import load_model

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                         rope_parameters=scaling)
    torch.manual_seed(0)
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")
        hf = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
        hf.save_pretrained(tmp_path)
    write_byte_tokenizer(tmp_path)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.config.rope_scaling["rope_type"] == scaling["rope_type"]
    assert loaded.model.rope.attention_factor != 1.0  # both types scale cos/sin
    prompt = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = Driver(loaded.model, paged_cache(loaded.model)).run([prompt], all_at_once)[0]
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max() < 1e-4


def test_the_engine_serves_dynamic_ntk_for_its_resolved_context(tiny_checkpoint, tmp_path) -> None:
    """LLMEngine fixes dynamic NTK's base for the max_model_len it resolves (here the config's
    context, as no larger one is served): the unscaled base transformers takes for every sequence
    that short, so the served logits equal transformers'. The base for max_position_embeddings *
    factor, which the model had before the engine said its context, does not."""
    import json
    import shutil

    from decoder_test_helpers import Driver, all_at_once, paged_cache
    from transformers import AutoModelForCausalLM

    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.loader.load import load_model

    path = tmp_path / "dynamic"
    shutil.copytree(tiny_checkpoint("llama")[0], path)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 50000.0}
    raw.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(raw))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = load_model(path, progress=False)
    before = loaded.model.rope
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=256, block_size=4))
    assert engine.max_model_len == raw["max_position_embeddings"]
    model = engine.runner.model
    prompt = torch.randint(0, raw["vocab_size"], (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = Driver(model, paged_cache(model)).run([prompt], all_at_once)[0]
    assert (ours - ref).abs().max() < 1e-4
    model.rope = before
    unserved = Driver(model, paged_cache(model)).run([prompt], all_at_once)[0]
    assert (unserved - ref).abs().max() > 1e-2
