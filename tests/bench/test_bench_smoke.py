"""The benchmark harness's pure parts: statistics, timelines, workloads, figures, report, step runner.

No model, no server, no speed targets: these check that the numbers the
harness prints are computed correctly, and that a failing measurement turns
into a visible skipped figure instead of ending the run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from bench import runner
from bench.compare import compare_figures
from bench.figures import Figure, Target, speedup
from bench.load_result import LoadResult
from bench.profile import PROFILES
from bench.report import format_table, json_lines
from bench.resources import EngineModel, Server, TransformersModel, Variant
from bench.run import SECTIONS, finish, selected_sections
from bench.stats import LatencySummary, median, percentile, significant
from bench.targets import targets_for
from bench.timeline import RequestTimeline
from bench.workload import (
    NonceSource,
    PromptFactory,
    RequestSpec,
    offline_workload,
    output_tokens,
    serving_workload,
)

# -- statistics ----------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    rng = random.Random(q)
    for n in (1, 2, 3, 10, 37):
        values = [rng.uniform(0, 5) for _ in range(n)]
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert median([5.0, 1.0, 3.0]) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_summary_and_significant() -> None:
    assert LatencySummary.of([]) is None
    s = LatencySummary.of([1.0, 2.0, 3.0, 4.0])
    assert s is not None and (s.count, s.p50, s.mean, s.max) == (4, 2.5, 2.5, 4.0)
    assert s.p99 == pytest.approx(3.97)
    assert significant(123.456) == 123.0
    assert significant(0.0012345) == 0.00123
    assert significant(0.0) == 0.0


# -- timelines and load results ------------------------------------------------


def test_timeline_ttft_itl_and_decode_rate() -> None:
    t = RequestTimeline(sent=10.0)
    t.add_chunk(10.5, 1)
    t.add_chunk(10.6, 1)
    t.add_chunk(10.8, 2)  # two tokens coalesced: two gaps of 0.1
    t.add_chunk(10.9, 0)  # no tokens: ignored
    t.finish(11.0)
    assert t.ok and t.output_tokens == 4
    assert t.ttft == pytest.approx(0.5)
    assert t.inter_token_latencies() == pytest.approx([0.1, 0.1, 0.1])
    assert t.decode_tokens_per_s() == pytest.approx(3 / 0.3)


def test_timeline_without_tokens() -> None:
    t = RequestTimeline(sent=0.0)
    t.fail(1.0, "boom")
    assert not t.ok and t.ttft is None and t.decode_tokens_per_s() is None
    assert t.inter_token_latencies() == []


def _timeline(
    sent: float, first: float, tokens: int, gap: float, error: str | None = None
) -> RequestTimeline:
    t = RequestTimeline(sent=sent)
    for i in range(tokens):
        t.add_chunk(first + i * gap, 1)
    if error:
        t.fail(first + tokens * gap, error)
    else:
        t.finish(first + (tokens - 1) * gap)
    return t


def test_load_result_aggregates_successes_only() -> None:
    ok = [_timeline(0.0, 0.2, 10, 0.1), _timeline(0.0, 0.4, 10, 0.1)]  # last token at 1.3
    failed = _timeline(0.5, 0.6, 3, 0.1, error="UNAVAILABLE")
    result = LoadResult.of([*ok, failed])
    assert (result.requests, result.errors, result.output_tokens) == (3, 1, 20)
    assert result.wall_s == pytest.approx(1.3)
    assert result.tokens_per_s == pytest.approx(20 / 1.3)
    assert result.ttft is not None and result.ttft.p50 == pytest.approx(0.3)
    assert result.itl is not None and result.itl.p50 == pytest.approx(0.1)
    details = result.details()
    assert details["errors"] == 1 and details["first_error"] == "UNAVAILABLE"
    assert details["ttft_p50_ms"] == pytest.approx(300.0)
    assert LoadResult.of([]).tokens_per_s == 0.0


def test_rounds_pool_tokens_over_their_own_wall_times() -> None:
    # Two runs of one path, 100 s apart (other paths ran between them): that gap is nobody's time.
    first = [_timeline(0.0, 0.2, 10, 0.1)]  # 0 .. 1.1 s
    second = [_timeline(100.0, 100.5, 10, 0.1), _timeline(100.0, 100.2, 4, 0.1)]  # 100 .. 101.4 s
    pooled = LoadResult.of_rounds([first, second])
    assert (pooled.requests, pooled.output_tokens) == (3, 24)
    assert pooled.wall_s == pytest.approx(1.1 + 1.4)
    assert pooled.tokens_per_s == pytest.approx(24 / 2.5)
    assert pooled.ttft is not None and pooled.ttft.p50 == pytest.approx(0.2)  # over every request
    assert LoadResult.of_rounds([first]) == LoadResult.of(first)


# -- workloads -----------------------------------------------------------------


def test_nonces_make_every_prompt_unique_across_factories() -> None:
    nonces = NonceSource()
    factories = [PromptFactory(nonces, seed=0), PromptFactory(nonces, seed=0), PromptFactory(nonces, seed=1)]
    prompts = [f.prompt(32) for f in factories for _ in range(300)]
    assert all(len(p) == 32 for p in prompts)
    starts = [p[: nonces.length] for p in prompts]
    assert len(set(starts)) == len(starts)  # unique first tokens: no prefix-cache block can match
    with pytest.raises(ValueError):
        factories[0].prompt(nonces.length)


def test_same_seed_same_workload_shape_but_fresh_nonces() -> None:
    nonces = NonceSource()
    a = offline_workload(PromptFactory(nonces, seed=7), 50, (100, 1024), (100, 512))
    b = offline_workload(PromptFactory(nonces, seed=7), 50, (100, 1024), (100, 512))
    assert [(s.prompt_len, s.max_tokens) for s in a] == [(s.prompt_len, s.max_tokens) for s in b]
    assert all(x.prompt_token_ids[4:] == y.prompt_token_ids[4:] for x, y in zip(a, b, strict=True))
    assert all(x.prompt_token_ids[:4] != y.prompt_token_ids[:4] for x, y in zip(a, b, strict=True))
    assert all(100 <= s.prompt_len <= 1024 and 100 <= s.max_tokens <= 512 for s in a)
    assert output_tokens(a) == sum(s.max_tokens for s in a)


def test_serving_workload_long_mix() -> None:
    specs = serving_workload(PromptFactory(NonceSource()), 8, 64, 16, long_every=4, long_prompt_len=1024)
    assert [s.prompt_len for s in specs] == [64, 64, 64, 1024, 64, 64, 64, 1024]
    assert {s.max_tokens for s in specs} == {16}


def test_profiles_are_consistent() -> None:
    for profile in PROFILES.values():
        assert profile.level_requests(64) >= 64 or profile.name == "smoke"
        assert all(c >= 1 for c in profile.concurrencies)
        assert profile.offline_prompt_len[0] > 4  # longer than the nonce


# -- figures, targets, comparisons, report -------------------------------------


def test_speedup_reads_the_same_way_for_latencies() -> None:
    assert speedup(200.0, 100.0, "higher") == 2.0
    assert speedup(0.25, 0.5, "lower") == 2.0  # half the latency is twice as good
    assert speedup(0.0, 1.0, "higher") is None


def test_targets_by_exact_name_and_pattern() -> None:
    found = targets_for(["decode.grpc", "compare.sse_vs_grpc.c16", "serving.grpc.c16.ttft_p50", "decode.sse"])
    assert found["decode.grpc"] == Target(170.0, "higher")
    assert found["compare.sse_vs_grpc.c16"].threshold == 0.90
    assert found["serving.grpc.c16.ttft_p50"] == Target(0.5, "lower")
    assert "decode.sse" not in found
    assert Target(0.5, "lower").met(0.4) and not Target(170.0, "higher").met(169.9)


def _fig(name: str, value: float | None, section: str = "decode", **kw) -> Figure:
    return Figure(name=name, value=value, unit="tok/s", section=section, **kw)


def test_finish_resolves_ratios_targets_and_comparisons() -> None:
    figures = finish(
        [
            _fig("decode.engine.fp32.det", 200.0, baseline="decode.transformers.batch1"),
            _fig("decode.engine.fp32.fast", 250.0, baseline="decode.transformers.batch1"),
            _fig("decode.transformers.batch1", 50.0),
            _fig("decode.grpc", 180.0, baseline="decode.transformers.batch1"),
            _fig("decode.sse", None, note="skipped: no gateway"),
            _fig(
                "serving.grpc.c16.ttft_p50",
                0.4,
                section="serving",
                better="lower",
                baseline="serving.transformers.batch16.ttft_p50",
            ),
            _fig("serving.transformers.batch16.ttft_p50", 0.8, section="serving", better="lower"),
        ]
    )
    by = {f.name: f for f in figures}
    assert by["decode.engine.fp32.det"].ratio_to_transformers == pytest.approx(4.0)
    assert by["decode.grpc"].met is True and by["decode.grpc"].target == Target(170.0, "higher")
    assert by["serving.grpc.c16.ttft_p50"].ratio_to_transformers == pytest.approx(2.0)
    assert by["serving.grpc.c16.ttft_p50"].met is True
    assert by["compare.grpc_vs_engine.decode"].value == pytest.approx(0.9)
    assert by["compare.grpc_vs_engine.decode"].met is False  # below 0.95
    assert by["compare.det_vs_fast.decode.fp32"].value == pytest.approx(0.8)
    assert by["compare.sse_vs_grpc.decode"].value is None
    assert "decode.sse was not measured" in by["compare.sse_vs_grpc.decode"].note


def test_compare_serving_levels() -> None:
    figures = [
        _fig("serving.engine.c4", 400.0, section="serving"),
        _fig("serving.grpc.c4", 380.0, section="serving"),
        _fig("serving.sse.c4", 361.0, section="serving"),
        _fig("serving.grpc.long_mix.c16", 300.0, section="serving"),
        _fig("serving.stream4.engine.c64", 500.0, section="serving"),
        _fig("serving.stream4.grpc.c64", 490.0, section="serving"),
        _fig("serving.stream4.sse.c64", 480.0, section="serving"),
    ]
    by = {f.name: f.value for f in compare_figures(figures)}
    assert by == {
        "compare.grpc_vs_engine.c4": pytest.approx(0.95),
        "compare.sse_vs_engine.c4": pytest.approx(0.9025),
        "compare.sse_vs_grpc.c4": pytest.approx(0.95),
        "compare.grpc_vs_engine.stream4.c64": pytest.approx(0.98),
        "compare.sse_vs_engine.stream4.c64": pytest.approx(0.96),
        "compare.sse_vs_grpc.stream4.c64": pytest.approx(480 / 490),
    }


def test_table_and_json_lines() -> None:
    figures = finish(
        [
            _fig("decode.grpc", 123.456, baseline="decode.transformers.batch1", details={"runs": 3}),
            _fig("decode.transformers.batch1", 41.0),
            _fig("serving.grpc.c64", None, section="serving", note="skipped: failed (RuntimeError: x)"),
        ]
    )
    table = format_table(figures)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["figure", "value", "unit"]
    assert "[decode]" in lines and "[serving]" in lines
    grpc_row = next(line for line in lines if line.startswith("decode.grpc"))
    assert "123" in grpc_row and "3.01x" in grpc_row and ">= 170" in grpc_row and "NOT MET" in grpc_row
    assert "runs=3" in grpc_row
    skipped_row = next(line for line in lines if line.startswith("serving.grpc.c64"))
    assert "skipped" in skipped_row and "RuntimeError: x" in skipped_row

    parsed = [json.loads(line) for line in json_lines(figures)]
    assert [p["figure"] for p in parsed] == [f.name for f in figures]
    first = parsed[0]
    assert list(first)[:4] == ["figure", "value", "unit", "ratio_to_transformers"]
    assert first["value"] == pytest.approx(123.456) and first["ratio_to_transformers"] == pytest.approx(3.011)
    assert first["met"] is False and first["runs"] == 3
    assert parsed[2]["value"] is None and parsed[2]["note"].startswith("skipped")


def test_selected_sections() -> None:
    assert selected_sections([]) == list(SECTIONS)
    assert list(SECTIONS)[:5] == ["offline", "prefill", "decode", "serving", "isolation"]
    assert selected_sections(["serving,decode"]) == ["decode", "serving"]
    with pytest.raises(SystemExit):
        selected_sections(["nope"])


# -- the step runner -----------------------------------------------------------


def test_steps_grouped_by_resource_kind() -> None:
    bf16 = Variant("bfloat16")
    steps = [
        runner.Step("decode", Server(), "grpc", lambda r: []),
        runner.Step("decode", EngineModel(), "fp32", lambda r: []),
        runner.Step("decode", TransformersModel(), "hf", lambda r: []),
        runner.Step("offline", EngineModel(bf16), "bf16", lambda r: []),
        runner.Step("offline", EngineModel(), "fp32 again", lambda r: []),
    ]
    order = [(key, [s.description for s in group]) for key, group in runner.order_steps(steps)]
    assert order == [
        (EngineModel(), ["fp32", "fp32 again"]),
        (EngineModel(bf16), ["bf16"]),
        (TransformersModel(), ["hf"]),
        (Server(), ["grpc"]),
    ]
    assert bf16.label == "bf16" and Variant("float32", "int4", "float32").label == "int4"
    assert Variant("float32", "int4", "bfloat16").label == "int4-kvbf16"
    # The label names the K/V the engine really stores: auto under int4 weights is bfloat16.
    assert Variant("float32", "int4").label == "int4-kvbf16" and Variant("bfloat16", "int4").label == "bf16-int4"


def test_failures_become_skipped_figures(monkeypatch, tmp_path: Path) -> None:
    released = []

    def acquire(key, results_dir, threads):
        if key == EngineModel(Variant("float32", "int4")):
            raise RuntimeError("no int4 kernel on this CPU")
        return f"resource:{key.describe()}"

    monkeypatch.setattr(runner, "acquire", acquire)
    monkeypatch.setattr(runner, "release", lambda key, resource: released.append(resource))

    def broken(resource):
        raise ValueError("forward exploded")

    steps = [
        runner.Step(
            "decode",
            EngineModel(),
            "works",
            lambda r: [_fig("decode.engine.fp32.det", 1.0)],
            (("decode.engine.fp32.det", "tok/s"),),
        ),
        runner.Step("decode", EngineModel(), "breaks", broken, (("decode.engine.fp32.fast", "tok/s"),)),
        runner.Step(
            "decode",
            EngineModel(Variant("float32", "int4")),
            "int4",
            lambda r: [],
            (("decode.engine.int4.det", "tok/s"),),
        ),
    ]
    figures = {f.name: f for f in runner.run_steps(steps, tmp_path, threads=2)}
    assert figures["decode.engine.fp32.det"].value == 1.0
    assert figures["decode.engine.fp32.fast"].value is None
    assert "forward exploded" in figures["decode.engine.fp32.fast"].note
    assert "no int4 kernel" in figures["decode.engine.int4.det"].note
    assert released == ["resource:engine model fp32"]  # the one resource that loaded was released


def test_server_figures_are_held_to_the_engine_figure_of_the_served_variant() -> None:
    figures = [
        _fig("decode.engine.fp32.det", 50.0),
        _fig("decode.engine.int4.det", 100.0),
        _fig("decode.grpc", 95.0),
    ]
    assert {f.name: f.value for f in compare_figures(figures, "int4")} == {
        "compare.grpc_vs_engine.decode": pytest.approx(0.95)
    }
    assert {f.name: f.value for f in compare_figures(figures)} == {
        "compare.grpc_vs_engine.decode": pytest.approx(1.9)
    }


def test_grpc_decode_is_held_to_the_engine_measured_in_turn_with_it() -> None:
    """When the decode step ran the engine in turn with the server, that pairing is the ratio."""
    figures = [
        _fig("decode.engine.int4.det", 120.0),
        _fig("decode.engine.paired", 100.0),
        _fig("decode.grpc", 96.0),
    ]
    by = {f.name: f for f in compare_figures(figures, "int4")}
    assert by["compare.grpc_vs_engine.decode"].value == pytest.approx(0.96)
    assert by["compare.grpc_vs_engine.decode"].details["over"] == "decode.engine.paired"


def test_grpc_prefill_is_held_to_the_engine_measured_in_turn_with_it() -> None:
    figures = [
        _fig("prefill.engine.int4.det.512", 2000.0),
        _fig("prefill.engine.paired.512", 1600.0),
        _fig("prefill.grpc.512", 1520.0),
        _fig("prefill.engine.int4.det.2048", 1000.0),
        _fig("prefill.grpc.2048", 900.0),  # no paired figure: held to the engine step's
    ]
    by = {f.name: f for f in compare_figures(figures, "int4")}
    assert by["compare.grpc_vs_engine.prefill.512"].value == pytest.approx(0.95)
    assert by["compare.grpc_vs_engine.prefill.512"].details["over"] == "prefill.engine.paired.512"
    assert by["compare.grpc_vs_engine.prefill.2048"].details["over"] == "prefill.engine.int4.det.2048"


def test_alternate_takes_engine_and_served_runs_in_turn() -> None:
    import asyncio

    from bench import paired

    order: list[str] = []

    class FakeTransport:
        async def stream(self, spec):
            order.append(f"served {spec.max_tokens}")
            return RequestTimeline(sent=0.0, prompt_tokens=spec.prompt_len)

        async def close(self) -> None:
            order.append("closed")

    def fake_run_requests(engine, specs):
        order.extend(f"engine {s.max_tokens}" for s in specs)
        return [RequestTimeline(sent=0.0, prompt_tokens=s.prompt_len) for s in specs]

    mp = pytest.MonkeyPatch()
    mp.setattr(paired.engine_direct, "warm_up", lambda engine, specs: order.append("engine warm"))
    mp.setattr(paired.engine_direct, "run_requests", fake_run_requests)
    try:
        specs = [RequestSpec((1, 2, 3), n) for n in (0, 1, 2)]
        served, direct = asyncio.run(paired.alternate(FakeTransport(), None, specs[0], specs[1:], specs[1:]))
    finally:
        mp.undo()
    assert order == ["served 0", "engine warm", "engine 1", "served 1", "engine 2", "served 2", "closed"]
    assert len(served) == len(direct) == 2


def test_serving_paths_take_each_level_in_turn() -> None:
    """engine c1, gRPC c1, SSE c1, engine c4, ...: the paths whose ratios are targets are measured
    seconds apart, not minutes; each path is warmed once first and closed at the end, and gets
    prompts of the same lengths but its own nonces (gRPC and SSE share one server's prefix cache)."""
    import asyncio
    import dataclasses
    import time

    from bench.context import BenchContext
    from bench.profile import SMOKE
    from bench.sections.serving import LoadPath, _levels

    calls: list[tuple[str, int]] = []
    prompts: dict[str, list[tuple[int, ...]]] = {}

    class FakeTransport:
        name = "fake"

        def __init__(self, label: str) -> None:
            self.label = label

        async def stream(self, spec):
            calls.append((self.label, spec.max_tokens))
            prompts.setdefault(self.label, []).append(tuple(spec.prompt_token_ids))
            timeline = RequestTimeline(sent=time.perf_counter(), prompt_tokens=spec.prompt_len)
            timeline.add_chunk(time.perf_counter(), spec.max_tokens)
            timeline.finish(time.perf_counter())
            return timeline

        async def close(self) -> None:
            calls.append((f"closed {self.label}", 0))

    profile = dataclasses.replace(SMOKE, serving_rounds=2)
    ctx = BenchContext(profile)
    paths = [LoadPath(FakeTransport(p), f"serving.{p}", ttft_figures=p == "grpc") for p in ("engine", "grpc", "sse")]
    figures = asyncio.run(_levels(ctx, paths, profile.concurrencies, long_mix=False))
    names = [f.name for f in figures]
    assert names == [
        "serving.engine.c1", "serving.grpc.c1", "serving.grpc.c1.ttft_p50", "serving.sse.c1",
        "serving.engine.c4", "serving.grpc.c4", "serving.grpc.c4.ttft_p50", "serving.sse.c4",
    ]  # fmt: skip
    # The warm-up requests ask for 4 tokens, the levels' requests for serving_max_tokens.
    order = [label for label, tokens in calls if tokens == profile.serving_max_tokens]
    per_level = [profile.level_requests(c) for c in profile.concurrencies]
    # Each level: engine, gRPC, SSE, then again for the second round, before the next level.
    expected = [p for n in per_level for _ in range(2) for p in ["engine"] * n + ["grpc"] * n + ["sse"] * n]
    assert order == expected
    # A figure pools both rounds of its path.
    by = {f.name: f for f in figures}
    assert by["serving.grpc.c4"].details["requests"] == 2 * profile.level_requests(4)
    assert len(by["serving.grpc.c4"].details["rounds_tok_s"].split("/")) == 2
    assert [label for label, _ in calls[-3:]] == ["closed engine", "closed grpc", "closed sse"]
    engine, grpc, sse = (prompts[p] for p in ("engine", "grpc", "sse"))
    assert [len(x) for x in engine] == [len(x) for x in grpc] == [len(x) for x in sse]
    assert not set(engine) & set(grpc) and not set(grpc) & set(sse)


def test_isolation_figures_hold_itl_p99_beside_huge_prompts_to_without() -> None:
    from bench.huge_prompt import text_of
    from bench.sections.isolation import HugeOutcome, huge_loads, isolation_figures

    huge, in_handler = huge_loads(20_000_000)
    alone = [[_timeline(0.0, 0.1, 20, 0.02), _timeline(0.0, 0.1, 20, 0.02)]]
    beside = [[_timeline(0.0, 0.1, 20, 0.02), _timeline(0.0, 0.1, 20, 0.03)]]
    slow = [[_timeline(0.0, 0.1, 20, 0.02), _timeline(0.0, 0.1, 20, 0.05)]]
    figures = isolation_figures(
        alone,
        [
            (huge, beside, [HugeOutcome("RESOURCE_EXHAUSTED", 0.25, overlapped=True)]),
            (in_handler, slow, [HugeOutcome("INVALID_ARGUMENT", 9.0, overlapped=False)]),
        ],
    )
    by = {f.name: f for f in finish(figures)}
    assert by["isolation.itl_p99.baseline"].value == pytest.approx(0.02)
    assert by["isolation.itl_p99.huge_prompt"].value == pytest.approx(0.03)
    ratio = by["isolation.itl_p99_ratio"]
    assert ratio.value == pytest.approx(1.5) and ratio.met is True and ratio.target == Target(2.0, "lower")
    assert ratio.details["prompt_status"] == "RESOURCE_EXHAUSTED" and ratio.details["overlapped_rounds"] == "1/1"
    assert ratio.details["prompt_bytes"] == 20_000_000 and ratio.note == ""
    late = by["isolation.itl_p99_ratio.in_handler"]
    assert late.value == pytest.approx(2.5) and late.met is False and late.target == Target(2.0, "lower")
    assert "after a stream ended" in late.note and late.details["overlapped_rounds"] == "0/1"
    assert len(text_of(20_000_000)) == 20_000_000 and text_of(20_000_000).isascii()


def test_fairness_figures_compare_each_tenant_with_itself_alone_and_the_weighted_split(tmp_path) -> None:
    from bench.sections.fairness import KEYS, LoopResult, fairness_figures, write_limits_file

    figures = fairness_figures(
        a_alone=LoopResult(tokens=30_000, seconds=48.0), a_beside=LoopResult(tokens=28_500, seconds=48.0),
        b_alone=[0.03] * 50 + [0.04], b_beside=[0.05] * 50 + [0.10], b_in_ramp=[0.3, 0.05],
        w2=LoopResult(tokens=2_100, seconds=24.0), w1=LoopResult(tokens=1_000, seconds=24.0),
    )
    by = {f.name: f for f in finish(figures)}
    assert by["fairness.a_throughput_ratio"].value == pytest.approx(0.95) and by["fairness.a_throughput_ratio"].met
    assert by["fairness.b_alone.ttft_p99"].value == pytest.approx(0.04)
    ratio = by["fairness.b_ttft_p99_ratio"]
    assert ratio.value == pytest.approx(2.5) and ratio.met is True and ratio.target == Target(3.0, "lower")
    assert by["fairness.b_beside_a.ttft_p99"].details["ttft_max_in_ramp"] == pytest.approx(0.3)
    share = by["fairness.weighted_share_error"]
    assert share.value == pytest.approx(0.05) and share.met and share.details["ratio"] == pytest.approx(2.1)
    limits = write_limits_file().read_text()
    assert f'[keys."{KEYS["w2"]}"]\nweight = 2' in limits and f'[keys."{KEYS["w1"]}"]\nweight = 1' in limits


def test_a_server_gets_its_own_data_dir_and_flags_without_touching_this_environment(monkeypatch, tmp_path) -> None:
    # ServerProcess.start(data_dir=...) is how the rag, affinity and peer sections give each server its
    # own RAG store: the child's environment carries it, this process's stays as it was.
    import os

    from bench import server_process

    class Started(Exception):
        pass

    seen: dict = {}

    def fake_popen(args, cwd, env, stdout, stderr, text):
        seen.update(args=args, env=env)
        raise Started

    monkeypatch.setattr(server_process.subprocess, "Popen", fake_popen)
    monkeypatch.delenv("PROTOSERVE_DATA_DIR", raising=False)
    with pytest.raises(Started):
        server_process.ServerProcess.start(tmp_path / "server.log", Variant(quantization="int4"), 2,
                                           data_dir=tmp_path / "store")
    assert seen["env"]["PROTOSERVE_DATA_DIR"] == str(tmp_path / "store")
    assert "PROTOSERVE_DATA_DIR" not in os.environ
    args = seen["args"]
    assert args[args.index("--speculative-ngram") + 1] == "0"  # beside the engine: one-token steps
    assert args[args.index("--activation-precision") + 1] == "exact"
    with pytest.raises(Started):
        server_process.ServerProcess.start(tmp_path / "server.log", Variant(activation_precision="fast"), 2,
                                           speculative=True)
    assert "--speculative-ngram" not in seen["args"] and "PROTOSERVE_DATA_DIR" not in seen["env"]
    assert seen["args"][seen["args"].index("--activation-precision") + 1] == "fast"


def test_every_section_module_is_registered_once() -> None:
    # One registry (bench/run.py's SECTIONS): the docs point at it instead of listing sections.
    from bench.run import SECTIONS

    sections = Path(__file__).resolve().parents[2] / "bench" / "sections"
    modules = {p.stem for p in sections.glob("*.py") if p.stem != "__init__"}
    registered = {fn.__module__.rsplit(".", 1)[1] for fn in SECTIONS.values()}
    assert registered == modules and len(set(SECTIONS.values())) == len(SECTIONS)
