"""The peer sections' pure parts: llama-server and llama-bench command lines, llama-bench's JSON, the chat
workload and stream accounting, /proc RSS, the figures and ratios, and the skip when no peer is built."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.context import BenchContext
from bench.figures import Figure, skipped
from bench.peers import llama_bench, llama_server, rss
from bench.peers.chat_transport import apply_usage, cached_tokens, content_of
from bench.peers.chat_workload import NONCE_WORDS, ChatPromptFactory, word_pool
from bench.peers.ratios import ratio_figure
from bench.peers.text_prefill import prefill_rate, text_prompt
from bench.profile import PROFILES
from bench.report import format_table
from bench.run import SECTIONS
from bench.sections import peer_engine, peer_serving
from bench.timeline import RequestTimeline

WORDS = [f"w{i:03d}x" for i in range(500)]


def test_registered() -> None:
    assert SECTIONS["peer_serving"] is peer_serving.steps
    assert SECTIONS["peer_engine"] is peer_engine.steps


def test_llama_server_command() -> None:
    cmd = llama_server.server_command(Path("/b/llama-server"), Path("/m.gguf"), 2, 8081)
    assert cmd == ["/b/llama-server", "-m", "/m.gguf", "-np", "64", "-c", "32768", "-t", "2", "-tb", "2",
                   "--host", "127.0.0.1", "--port", "8081"]
    with pytest.raises(ValueError, match="threads"):
        llama_server.server_command(Path("s"), Path("m"), 0, 1)
    with pytest.raises(ValueError, match="parallel"):
        llama_server.server_command(Path("s"), Path("m"), 2, 1, parallel=64, context=32)


def test_llama_bench_command() -> None:
    cmd = llama_bench.bench_command(Path("/b/llama-bench"), Path("/m.gguf"), 2, repetitions=3)
    assert cmd == ["/b/llama-bench", "-m", "/m.gguf", "-p", "512", "-n", "128", "-t", "2", "-fa", "0,1",
                   "-r", "3", "-o", "json"]
    with pytest.raises(ValueError, match="flash_attn"):
        llama_bench.bench_command(Path("b"), Path("m"), 2, flash_attn=(2,))
    with pytest.raises(ValueError, match="repetitions"):
        llama_bench.bench_command(Path("b"), Path("m"), 2, repetitions=0)


def _row(prompt: int, gen: int, fa, ts: float) -> dict:
    return {"n_prompt": prompt, "n_gen": gen, "flash_attn": fa, "avg_ts": ts, "stddev_ts": ts / 100,
            "n_threads": 2, "build_commit": "0c1e570"}


def test_llama_bench_json_parsed() -> None:
    rows = [_row(512, 0, 0, 460.5), _row(0, 128, 0, 157.0), _row(512, 0, True, 491.0), _row(0, 128, "on", 182.0)]
    results = llama_bench.parse_results(json.dumps(rows))
    assert [(r.key, r.tokens_per_s) for r in results] == [
        ("pp512.fa0", 460.5), ("tg128.fa0", 157.0), ("pp512.fa1", 491.0), ("tg128.fa1", 182.0)]
    with pytest.raises(ValueError, match="no JSON"):
        llama_bench.parse_results("main: error")
    with pytest.raises(ValueError, match="lacks avg_ts"):
        llama_bench.parse_results(json.dumps([{k: v for k, v in rows[0].items() if k != "avg_ts"}]))
    with pytest.raises(ValueError, match="neither on nor off"):
        llama_bench.parse_results(json.dumps([_row(512, 0, "auto", 1.0)]))


def test_word_pool_takes_whole_lowercase_words() -> None:
    vocab = ["\u0120the", "\u0120apple", "apple", "\u0120Apple", "\u0120ab", "\u0120caf\u00e9", "\u0120x1y", "\u0120pear"]
    assert word_pool(vocab) == ["apple", "pear", "the"]


def test_chat_prompts_share_bodies_by_seed_never_nonces() -> None:
    a, b = ChatPromptFactory(WORDS, seed=5), ChatPromptFactory(WORDS, seed=5)
    sa, sb = a.specs(20, 64), b.specs(20, 64)
    assert [s.user for s in sa] == [s.user for s in sb]  # every server gets the same bodies ...
    nonces = [s.system for s in sa + sb]
    assert len(set(nonces)) == len(nonces)  # ... behind nonces no other request has
    assert all(len(s.system.split()) == NONCE_WORDS for s in sa)
    assert len(sa[0].user.split()) == a.body_words
    body = sa[0].body("m")
    assert body["messages"][0] == {"role": "system", "content": sa[0].system}  # the nonce comes first
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 64 and body["temperature"] == 0.0
    with pytest.raises(ValueError, match="too small"):
        ChatPromptFactory(WORDS[:10])
    with pytest.raises(ValueError, match="no room"):
        ChatPromptFactory(WORDS, prompt_tokens=10)


def test_chat_stream_accounting() -> None:
    assert content_of({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""  # role chunk
    assert content_of({"choices": [{"delta": {"role": "assistant", "content": None}}]}) == ""
    assert content_of({"choices": [], "usage": {}}) == ""
    assert content_of({"choices": [{"delta": {"content": " hi"}}]}) == " hi"
    t = RequestTimeline(sent=0.0)
    t.add_chunk(1.0, 1)
    t.add_chunk(2.0, 1)
    usage = {"prompt_tokens": 101, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}
    apply_usage(t, usage)
    assert t.prompt_tokens == 101 and t.output_tokens == 5 and t.chunks[-1] == (2.0, 4) and t.ttft == 1.0
    assert cached_tokens(usage) == 3 and cached_tokens({"prompt_tokens": 1}) == 0


def test_text_prompt_and_its_rate() -> None:
    factory = ChatPromptFactory(WORDS, seed=1)
    a, b = text_prompt(factory, 512), text_prompt(factory, 512)
    assert len(a.split()) == 511 and a.split()[NONCE_WORDS:] != b.split()[NONCE_WORDS:]
    assert a.split()[:NONCE_WORDS] != b.split()[:NONCE_WORDS]  # a fresh nonce first
    with pytest.raises(ValueError, match="no room"):
        text_prompt(factory, NONCE_WORDS)
    t = RequestTimeline(sent=0.0, prompt_tokens=660)
    t.add_chunk(0.3, 1)
    t.finish(0.3)
    assert prefill_rate(t) == pytest.approx(2200.0)
    t.fail(0.4, "HTTP 500")
    assert prefill_rate(t) is None


def test_rss_reads_proc_trees(tmp_path: Path) -> None:
    def proc(pid: int, kb: int | None, kids: dict[str, list[int]]) -> None:
        (tmp_path / str(pid)).mkdir()
        status = "Name:\tx\n" + (f"VmRSS:\t {kb} kB\n" if kb is not None else "")
        (tmp_path / str(pid) / "status").write_text(status)
        for tid, children in kids.items():
            (tmp_path / str(pid) / "task" / tid).mkdir(parents=True)
            (tmp_path / str(pid) / "task" / tid / "children").write_text(" ".join(map(str, children)))

    proc(10, 1000, {"10": [11], "12": [13, 99]})  # 99 exited before it could be read
    proc(11, 200, {"11": []})
    proc(13, None, {"13": []})  # a zombie: no VmRSS
    assert rss.vmrss_bytes("VmRSS:\t 7 kB\n") == 7 * 1024
    assert rss.children(10, tmp_path) == [11, 13, 99]
    assert rss.tree_rss_bytes(10, tmp_path) == 1200 * 1024
    with pytest.raises(ProcessLookupError):
        rss.tree_rss_bytes(99, tmp_path)


def test_peak_rss_samples_while_the_block_runs() -> None:
    readings = iter([100, 300, 200, 150, 120, 110])

    async def main() -> int:
        async with rss.PeakRss(1, interval=0.001, read=lambda pid: next(readings, 50)) as peak:
            await asyncio.sleep(0.05)
        return peak.peak

    assert asyncio.run(main()) == 300


def _fig(name: str, value: float | None, unit: str = "tok/s") -> Figure:
    return Figure(name, value, unit, "s") if value is not None else skipped(name, unit, "s", "peer missing")


def test_ratio_figures_read_both_ways() -> None:
    r = ratio_figure("x.ratio", "s", _fig("ours", 600.0), _fig("theirs", 150.0))
    assert r.value == 4.0 and r.unit == "x" and r.details["of"] == "ours / theirs"
    ttft = ratio_figure("x.ttft", "s", _fig("o", 0.2, "s"), _fig("t", 2.0, "s"), better="lower")
    assert ttft.value == pytest.approx(0.1) and ttft.better == "lower"
    gone = ratio_figure("x.ratio", "s", _fig("ours", 600.0), _fig("theirs", None))
    assert gone.value is None and "theirs has no value" in gone.note


def _timelines(n: int, tokens: int, span: float, prompt: int = 100) -> list[RequestTimeline]:
    out = []
    for i in range(n):
        t = RequestTimeline(sent=0.0, prompt_tokens=prompt)
        t.add_chunk(0.1 * (i + 1), 1)
        t.add_chunk(span, tokens - 1)
        t.finish(span)
        out.append(t)
    return out


def test_level_figures_pool_rounds_and_hold_the_ratio_to_the_target() -> None:
    rounds = {"protoserve": [_timelines(4, 64, 1.0), _timelines(4, 64, 1.0)],
              "protoserve-fast": [_timelines(4, 64, 0.5), _timelines(4, 64, 0.5)],
              "llama-server": [_timelines(4, 64, 4.0), _timelines(4, 64, 4.0)]}
    rates = {"protoserve": [256.0, 256.0], "protoserve-fast": [512.0, 512.0], "llama-server": [64.0, 64.0]}
    figures = {f.name: f for f in peer_serving.level_figures(16, rounds, rates, {"llama-server": 3})}
    assert figures["peer_serving.protoserve.c16"].value == pytest.approx(256.0)
    assert figures["peer_serving.llama-server.c16"].value == pytest.approx(64.0)
    assert figures["peer_serving.protoserve.c16"].details["rounds_tok_s"] == "256/256"
    assert figures["peer_serving.protoserve.c16"].details["prompt_tokens"] == 100
    assert figures["peer_serving.llama-server.c16"].details["cached_prompt_tokens"] == 3
    ratio = figures["peer_serving.ratio.c16"]
    assert ratio.value == pytest.approx(4.0) and ratio.target is not None and not ratio.met  # 4x < 5x
    ttft = figures["peer_serving.ttft_ratio.c16"]
    assert ttft.value == pytest.approx(1.0) and ttft.better == "lower"
    fast = figures["peer_serving.ratio_fast.c16"]  # the fast mode beside the default, without a target
    assert fast.value == pytest.approx(8.0) and fast.target is None
    assert set(figures) == {n for n, _ in peer_serving.figure_names([16]) if "rss" not in n}


def test_level_with_every_request_failed_is_skipped_with_the_error() -> None:
    failed = RequestTimeline(sent=0.0)
    failed.fail(1.0, "HTTP 500: boom")
    rounds = {"protoserve": [_timelines(2, 8, 1.0)], "protoserve-fast": [_timelines(2, 8, 1.0)],
              "llama-server": [[failed]]}
    rates = {"protoserve": [16.0], "protoserve-fast": [16.0], "llama-server": [0.0]}
    figures = {f.name: f for f in peer_serving.level_figures(1, rounds, rates)}
    assert figures["peer_serving.llama-server.c1"].value is None
    assert "HTTP 500: boom" in figures["peer_serving.llama-server.c1"].note
    assert figures["peer_serving.ratio.c1"].value is None


def test_abba_order_and_rss_figures() -> None:
    assert [peer_serving.round_order(r) for r in range(3)] == [
        ("llama-server", "protoserve", "protoserve-fast"), ("protoserve-fast", "protoserve", "llama-server"),
        ("llama-server", "protoserve", "protoserve-fast")]
    figures = peer_serving.rss_figures({"protoserve": 512 * 2**20, "llama-server": 868 * 2**20},
                                       {"protoserve": 600 * 2**20}, 64)
    by_name = {f.name: f for f in figures}
    assert by_name["peer_serving.rss.protoserve.idle"].value == 512
    assert by_name["peer_serving.rss.protoserve.c64"].value == 600
    assert by_name["peer_serving.rss.llama-server.c64"].value is None


def test_engine_figures_take_llama_bench_medians_and_its_better_setting() -> None:
    results = llama_bench.parse_results(json.dumps(
        [_row(512, 0, 0, 460.0), _row(512, 0, 1, 491.0), _row(0, 128, 0, 157.0), _row(0, 128, 1, 182.0),
         _row(512, 0, 0, 440.0), _row(512, 0, 1, 501.0), _row(0, 128, 0, 150.0), _row(0, 128, 1, 180.0)]))
    peer = peer_engine.peer_figures(results)
    assert [f.value for f in peer] == [450.0, 496.0, 153.5, 181.0]
    ours = {"prefill512.engine": _fig("pe", 2480.0), "prefill512.grpc": _fig("pg", 2976.0),
            "prefill512.openai": _fig("po", 2232.0), "decode.engine": _fig("de", 181.0), "decode.grpc": _fig("dg", None)}
    ratios = {f.name: f for f in peer_engine.ratio_figures(peer, ours)}
    assert ratios["peer_engine.ratio.prefill512.engine"].value == pytest.approx(5.0)  # over fa1's 496
    assert ratios["peer_engine.ratio.prefill512.grpc"].value == pytest.approx(6.0)
    assert ratios["peer_engine.ratio.prefill512.grpc"].met
    assert ratios["peer_engine.ratio.prefill512.openai"].value == pytest.approx(4.5)
    assert ratios["peer_engine.ratio.decode.engine"].value == pytest.approx(1.0)
    assert ratios["peer_engine.ratio.decode.grpc"].value is None
    assert set(ratios) | {f.name for f in peer} <= {n for n, _ in peer_engine.figure_names()}
    assert "peer_engine.ratio.prefill512.grpc" in format_table([*peer, *ratios.values()])


@pytest.mark.parametrize("section", [peer_serving, peer_engine])
def test_without_a_peer_every_figure_is_skipped_with_the_reason(section, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PROTOSERVE_PEER_CACHE", str(tmp_path))
    [step] = section.steps(BenchContext(PROFILES["smoke"]))
    figures = step.run(object())  # no server is touched on the way out
    assert [(f.name, f.unit) for f in figures] == list(step.expects)
    assert all(f.value is None and "make bench-peers" in f.note for f in figures)
