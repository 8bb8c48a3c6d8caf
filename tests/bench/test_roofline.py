"""The int8 peak probe and the roofline figures built on it."""

from __future__ import annotations

import pytest

from bench import machine_peak
from bench.figures import Figure, Target
from bench.roofline import DOT_PRODUCTS_PER_MAC, LinearWork, RooflineInputs, roofline_figures
from bench.run import finish
from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.loader.gguf_checkpoint import GGUFCheckpoint
from protoserve.engine.models.config import ModelConfig
from protoserve.kernels.cpu.extension import cpu_flags

# SmolLM2-135M's linear work per token (checked against its GGUF below).
SMOLLM2 = LinearWork(body=106_168_320, head=576 * 49152)


def test_linear_work_counts_every_weight_of_the_projections_and_the_head() -> None:
    transformers = pytest.importorskip("transformers")
    config = ModelConfig(
        architecture="llama", vocab_size=300, hidden_size=48, intermediate_size=80,
        num_layers=3, num_heads=6, num_kv_heads=2, head_dim=12,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=300,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
        )  # fmt: skip
    )
    # One multiply-add per weight per token: the linear layers' weights, counted by transformers.
    body = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("proj.weight") and ".layers." in n)
    work = LinearWork.of(config)
    assert work.body == body
    assert work.head == hf.lm_head.weight.numel()


def test_smollm2_work_per_token() -> None:
    # The bench reads the served model's shape from the GGUF that make install ships.
    config = GGUFCheckpoint(default_model_path()).config
    work = LinearWork.of(config)
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert work.body == 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
    assert work == SMOLLM2
    # A 512-token prefill computes logits for its last token only.
    assert work.per_prompt_token(512) == pytest.approx(work.body + work.head / 512)
    # 64 prompt tokens and 63 fed-back output tokens through the layers, 64 logits rows, per 64 tokens.
    assert work.per_output_token(64, 64) == pytest.approx((127 * work.body + 64 * work.head) / 64)


def _inputs(**kw) -> RooflineInputs:
    base = dict(work=SMOLLM2, serving_prompt_len=64, serving_max_tokens=64,
                int8_dot_variant=True, amx=False)  # fmt: skip
    return RooflineInputs(**{**base, **kw})


def _figures(peak: float | None) -> list[Figure]:
    def fig(name: str, value: float | None, unit: str = "tok/s") -> Figure:
        return Figure(name=name, value=value, unit=unit, section=name.split(".")[0])

    return [
        fig(machine_peak.FIGURE, peak, "GMAC/s"),
        fig("prefill.grpc.512", 1100.0),
        fig("prefill.engine.int4.det.512", 1200.0),
        fig("decode.grpc", 180.0),
        fig("serving.grpc.c16", 450.0),
        fig("serving.grpc.c64", None),
        fig("serving.grpc.long_mix.c16", 160.0),
    ]


def test_roofline_shares_of_the_usable_peak_and_the_targets_needs() -> None:
    work = SMOLLM2
    out = {f.name: f for f in finish(_figures(peak=400.0), roofline=_inputs())}
    usable = 400.0 / DOT_PRODUCTS_PER_MAC
    assert sorted(n for n in out if n.startswith("roofline.")) == [
        "roofline.prefill.grpc.512", "roofline.serving.grpc.c16", "roofline.serving.grpc.c64",
    ]  # fmt: skip
    prefill = out["roofline.prefill.grpc.512"]
    assert prefill.value == pytest.approx(1100.0 * work.per_prompt_token(512) / 1e9 / usable)
    # The 2,200 tokens/s, in the same terms; its status says whether the figure reached it.
    need = 2200.0 * work.per_prompt_token(512) / 1e9 / usable
    assert prefill.target == Target(round(need, 3), "higher") and prefill.met is False
    c16 = out["roofline.serving.grpc.c16"]
    assert c16.value == pytest.approx(450.0 * work.per_output_token(64, 64) / 1e9 / usable)
    assert c16.details["target_gmacs"] == pytest.approx(700.0 * work.per_output_token(64, 64) / 1e9, abs=0.05)
    assert out["roofline.serving.grpc.c64"].value is None
    assert "serving.grpc.c64 was not measured" in out["roofline.serving.grpc.c64"].note


@pytest.mark.parametrize(
    ("peak", "inputs", "reason"),
    [
        (None, _inputs(), "machine.int8_dot_peak was not measured"),
        (400.0, _inputs(amx=True), "AMX tiles"),
        (400.0, _inputs(int8_dot_variant=False), "do not run on int8 dot products"),
    ],
)
def test_roofline_is_skipped_where_the_probe_does_not_bound_the_work(peak, inputs, reason) -> None:
    out = [f for f in roofline_figures(_figures(peak), inputs)]
    assert [f.name for f in out] == [
        "roofline.prefill.grpc.512", "roofline.serving.grpc.c16", "roofline.serving.grpc.c64",
    ]  # fmt: skip
    assert all(f.value is None and reason in f.note for f in out)


def test_no_roofline_without_prefill_or_serving_figures() -> None:
    assert roofline_figures([_figures(400.0)[0], _figures(400.0)[3]], _inputs()) == []


def test_the_probe_runs_the_kernels_instruction_set() -> None:
    if machine_peak.compiler() is None:
        pytest.skip("no C compiler")
    flags = cpu_flags().split()
    peak = machine_peak.measure(threads=2, instructions=2_000_000, repeats=1)
    expected = "avx512_vnni" if {"avx512f", "avx512_vnni"} <= set(flags) else "avx2"
    assert peak.isa == expected
    assert peak.threads == 2
    assert peak.gmacs > 0


def test_a_probe_that_cannot_be_built_is_a_skipped_figure(monkeypatch) -> None:
    monkeypatch.setattr(machine_peak, "compiler", lambda: None)
    figure = machine_peak.peak_figure(threads=2)
    assert figure.value is None and "no C compiler" in figure.note
    monkeypatch.setattr(machine_peak, "compiler", lambda: "false")  # a "compiler" that always fails
    figure = machine_peak.peak_figure(threads=2)
    assert figure.value is None and "could not build the probe" in figure.note


def test_roofline_inputs_of_the_served_model_or_none(monkeypatch, tmp_path) -> None:
    from bench import resources
    from bench.profile import DEFAULT
    from bench.run import roofline_inputs

    inputs = roofline_inputs(DEFAULT)
    assert inputs is not None and inputs.work == SMOLLM2 and inputs.int8_dot_variant
    assert (inputs.serving_prompt_len, inputs.serving_max_tokens) == (64, 64)
    # A model that cannot be read costs the roofline figures, not the run's report.
    monkeypatch.setattr(resources, "model_path", lambda: tmp_path / "missing.gguf")
    assert roofline_inputs(DEFAULT) is None
