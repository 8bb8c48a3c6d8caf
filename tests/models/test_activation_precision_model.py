"""--activation-precision fast on the served model: SmolLM2 int4 (the default model, quantization
"auto") against float32 along the float model's greedy continuation, the fused step against the
module path, the engine applying its setting, and the setting's refusals."""

from __future__ import annotations

import pytest
import torch
from decoder_test_helpers import Driver, all_at_once, paged_cache

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.loader.load import load_model
from protoserve.engine.models.linear import KernelPackable
from protoserve.kernels.cpu import packed_linear
from protoserve.server.cli import _engine_config, build_parser


@pytest.fixture(scope="module")
def served():
    return load_model(None, quantization="auto", progress=False)


def _logits(model, seq: list[int], positions: slice) -> torch.Tensor:
    return Driver(model, paged_cache(model, num_blocks=16, block_size=16)).run([seq], all_at_once)[0][positions]


@pytest.mark.usefixtures("one_thread")
def test_fast_int4_smollm2_against_float32(smollm2, smollm2_chat, served) -> None:
    if not packed_linear.int8_dot_available():
        pytest.skip("no integer-dot kernels here: the precision has nothing to change")
    prompt, continuation = smollm2_chat
    seq = prompt + continuation
    positions = slice(len(prompt) - 1, len(seq) - 1)  # the 32 positions that chose the continuation
    ref = _logits(smollm2.model, seq, positions)
    model = served.model
    assert model.fused_step is not None
    figures = {}
    try:
        for precision in ("exact", "fast"):
            model.set_activation_precision(precision)
            out = _logits(model, seq, positions)
            agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
            figures[precision] = (out, agree, (out - ref).abs().mean().item())
            print(f"SmolLM2 int4 {precision}: greedy agreement {agree:.3f}, mean |logit error| {figures[precision][2]:.3f}")
        fused = model.fused_step
        model.fused_step = None  # the module path: every layer honours the setting too, bit for bit
        try:
            assert torch.equal(_logits(model, seq, positions), figures["fast"][0])
        finally:
            model.fused_step = fused
    finally:
        model.set_activation_precision("exact")
    assert not torch.equal(figures["exact"][0], figures["fast"][0])
    _, agree, err = figures["fast"]
    assert agree >= 0.6 and err <= 1.0  # loose (measured 0.81 / 0.42): the figures are printed and benched
    assert figures["exact"][2] <= err  # the fine codes are what buys the accuracy back


def test_engine_applies_the_setting(served) -> None:
    engine = LLMEngine(served, EngineConfig(activation_precision="fast", max_kv_blocks=8))
    try:
        model = engine.runner.model
        layers = [m for m in model.modules() if isinstance(m, KernelPackable)]
        assert layers and all(not m.fine_activations for m in layers)
        assert model.fused_step is None or model.fused_step.fine_activations is False
    finally:
        served.model.set_activation_precision("exact")
    with pytest.raises(ValueError, match="activation_precision"):
        served.model.set_activation_precision("approximate")


def test_config_and_cli_refuse_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="activation_precision must be one of exact, fast"):
        EngineConfig(activation_precision="int8").validate()
    parse = build_parser().parse_args
    assert _engine_config(parse(["serve"])).activation_precision == "exact"
    assert _engine_config(parse(["serve", "--activation-precision", "fast"])).activation_precision == "fast"
    with pytest.raises(SystemExit):
        parse(["serve", "--activation-precision", "quick"])
    assert "--activation-precision" in capsys.readouterr().err
