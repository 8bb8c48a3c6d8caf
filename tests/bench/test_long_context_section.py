"""bench/sections/long_context.py's pure parts: llama-bench's depth command and results, the figures and
their ratios, and every figure skipped with the reason when no peer is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.context import BenchContext
from bench.peers import llama_bench
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import long_context as lc


def test_registered() -> None:
    assert SECTIONS["long_context"] is lc.steps


def test_depth_command() -> None:
    cmd = llama_bench.depth_command(Path("/b/llama-bench"), Path("/m.gguf"), 2, (0,), 64, (0, 4096), 1, 2)
    assert cmd == ["/b/llama-bench", "-m", "/m.gguf", "-p", "0", "-n", "64", "-d", "0,4096", "-t", "2",
                   "-fa", "1", "-r", "2", "-o", "json"]
    kv8 = llama_bench.depth_command(Path("/b/llama-bench"), Path("/m.gguf"), 2, (0,), 64, (0,), 1, 2, "q8_0")
    assert kv8[-4:] == ["-ctk", "q8_0", "-ctv", "q8_0"]
    with pytest.raises(ValueError, match="flash_attn"):
        llama_bench.depth_command(Path("b"), Path("m"), 2, (512,), 0, (0,), 2, 1)
    with pytest.raises(ValueError, match="bad long-context test"):
        llama_bench.depth_command(Path("b"), Path("m"), 2, (512,), 0, (-1,), 1, 1)


def _row(prompt: int, gen: int, depth: int, ts: float) -> dict:
    return {"n_prompt": prompt, "n_gen": gen, "n_depth": depth, "flash_attn": 1, "avg_ts": ts,
            "stddev_ts": 1.0, "n_threads": 2}


def test_depth_results_become_figures_and_ratios() -> None:
    results = llama_bench.parse_results(json.dumps(
        [_row(4096, 0, 0, 200.0), _row(0, 64, 0, 100.0), _row(0, 64, 4096, 50.0)]))
    assert [r.key for r in results] == ["pp4096.fa1", "tg64.fa1", "tg64@d4096.fa1"]
    rates = lc.Rates()
    lc.add_peer_results(results, rates)
    rates.add(lc._name("protoserve", "prefill", 4096), 900.0)
    rates.add(lc._name("protoserve", "decode", 4096), 120.0)
    rates.add(lc._name("protoserve", "decode", "short"), 240.0)
    rates.add(lc._name("protoserve", "decode", 2048), None, "timed out")
    figures = {name: rates.figure(name) for name, unit in lc.figure_names() if unit == lc.UNIT}
    assert figures["long_context.llama-bench.decode.4096"].value == 50.0
    assert figures["long_context.llama-bench.decode.short"].value == 100.0
    assert figures["long_context.protoserve.decode.2048"].value is None
    assert "timed out" in figures["long_context.protoserve.decode.2048"].note
    assert "load_avg_1m" in figures["long_context.protoserve.decode.4096"].details
    ratios = {f.name: f for f in lc.ratio_figures(figures)}
    assert ratios["long_context.ratio.prefill.4096"].value == pytest.approx(4.5)
    assert ratios["long_context.ratio.prefill.4096"].met
    assert ratios["long_context.ratio.decode.4096"].value == pytest.approx(2.4)
    assert not ratios["long_context.ratio.decode.4096"].met
    assert ratios["long_context.self.decode.4096"].value == pytest.approx(0.5)
    assert ratios["long_context.ratio.decode.2048"].value is None
    # The 8-bit K/V pass: its own figures from the same kind of results, its own ratios.
    lc.add_peer_results(results, rates, lc.KV8)
    rates.add(lc._name("protoserve-kv8", "decode", 4096), 150.0)
    rates.add(lc._name("protoserve-kv8", "decode", "short"), 240.0)
    figures = {name: rates.figure(name) for name, unit in lc.figure_names() if unit == lc.UNIT}
    kv8 = {f.name: f for f in lc.ratio_figures(figures, lc.KV8)}
    assert kv8["long_context.ratio-kv8.decode.4096"].value == pytest.approx(3.0)
    assert kv8["long_context.ratio-kv8.decode.4096"].met
    assert kv8["long_context.self-kv8.decode.4096"].value == pytest.approx(0.625)
    assert kv8["long_context.ratio-kv8.prefill.4096"].value is None  # not measured here
    assert set(ratios) | set(kv8) | set(figures) == {n for n, _ in lc.figure_names()}


def test_without_a_peer_every_figure_is_skipped_with_the_reason(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PROTOSERVE_PEER_CACHE", str(tmp_path))
    [step] = lc.steps(BenchContext(PROFILES["smoke"]))
    figures = step.run(object())  # no model is touched on the way out
    assert [(f.name, f.unit) for f in figures] == list(step.expects)
    assert all(f.value is None and "make bench-peers" in f.note for f in figures)


def test_figure_of_nothing_measured_is_skipped() -> None:
    figure = lc.Rates().figure("long_context.protoserve.prefill.512")
    assert figure.value is None and "nothing measured" in figure.note
