"""Prefix-cache blocks persisted under kv_offload_dir (engine/kv_offload): a prompt whose prefix was
evicted, or computed by an engine since closed, loads it from disk and generates what an engine that
kept it in memory generates; damaged files, another fingerprint and another salt load nothing."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from protoserve.engine.llm import LLM
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.block_manager import chain_hashes

BLOCK = 16
PROMPT = [(7 * i + 3) % 250 for i in range(200)]  # 12 full blocks usable as prefix
OTHER = [(11 * i + 5) % 250 for i in range(200)]


def run(engine, prompt: list[int], rid: str, salt: bytes = b"alice") -> tuple[list[int], int]:
    """Greedy tokens of ``prompt`` and its cached prompt tokens."""
    request = TokenizedRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                               cache_salt=salt)
    [c] = LLM(engine=engine).run([request])
    return c.choices[0].token_ids, c.stats.cached_prompt_tokens


def block_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/partition-*/*.kv"))


@pytest.fixture
def turns(make_engine):
    """The reference: turn 1, then turn 2 (turn 1's prompt, its reply and more) on one engine kept in memory."""
    engine = make_engine()
    first, _ = run(engine, PROMPT, "ref-1")
    second_prompt = PROMPT + first + [9, 8, 7]
    second, cached = run(engine, second_prompt, "ref-2")
    # The in-memory hit this feature must reproduce: every full block turn 1 computed (all but its last token).
    assert cached == (len(PROMPT) + len(first) - 1) // BLOCK * BLOCK
    return first, second_prompt, second


def test_a_restart_loads_the_prefix_and_generates_the_same_tokens(make_engine, turns, tmp_path):
    first, second_prompt, second = turns
    engine = make_engine(kv_offload_dir=str(tmp_path))
    assert run(engine, PROMPT, "1")[0] == first
    engine.close()  # shutdown persists what is still cached
    assert len(block_files(tmp_path)) == (len(PROMPT) + len(first) - 1) // BLOCK

    restarted = make_engine(kv_offload_dir=str(tmp_path))
    tokens, cached = run(restarted, second_prompt, "2")
    assert tokens == second
    assert cached == (len(PROMPT) + len(first) - 1) // BLOCK * BLOCK
    assert restarted.kv_offload.counters.blocks_loaded == cached // BLOCK
    assert restarted.stats().prefix_cache_hits == cached


def test_another_salt_loads_nothing(make_engine, turns, tmp_path):
    first, second_prompt, second = turns
    engine = make_engine(kv_offload_dir=str(tmp_path))
    run(engine, PROMPT, "1")
    engine.close()
    restarted = make_engine(kv_offload_dir=str(tmp_path))
    tokens, cached = run(restarted, second_prompt, "2", salt=b"mallory")
    assert (tokens, cached) == (second, 0)
    assert restarted.kv_offload.counters.blocks_loaded == 0
    # Each salt has a directory of its own.
    restarted.close()
    assert len({p.parent for p in block_files(tmp_path)}) == 2


def test_blocks_evicted_from_the_pool_come_back_from_disk(make_engine, turns, tmp_path):
    first, _, _ = turns
    engine = make_engine(kv_offload_dir=str(tmp_path), max_kv_blocks=14)  # one prompt and its reply
    assert run(engine, PROMPT, "1") == (first, 0)
    run(engine, OTHER, "2")  # takes the pool: PROMPT's blocks are evicted, so written
    assert engine.block_manager.match_prefix(chain_hashes(b"alice", PROMPT, BLOCK, [])) == []
    tokens, cached = run(engine, PROMPT, "3")
    assert tokens == first
    assert cached == (len(PROMPT) - 1) // BLOCK * BLOCK
    assert engine.kv_offload.counters.blocks_loaded == cached // BLOCK


def test_a_damaged_block_warns_and_is_recomputed(make_engine, turns, tmp_path, caplog):
    first, second_prompt, second = turns
    engine = make_engine(kv_offload_dir=str(tmp_path))
    run(engine, PROMPT, "1")
    engine.close()
    files = block_files(tmp_path)
    for path in files:  # one byte of every payload flipped
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    restarted = make_engine(kv_offload_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="protoserve.engine.kv_offload"):
        tokens, cached = run(restarted, second_prompt, "2")
    assert (tokens, cached) == (second, 0)
    assert "checksum mismatch" in caplog.text
    assert restarted.kv_offload.counters.blocks_loaded == 0
    assert sum(not p.exists() for p in files) == 1  # the first of the chain, deleted; the read stopped there


def test_another_fingerprint_loads_nothing_and_warns(make_engine, tmp_path, caplog):
    engine = make_engine(kv_offload_dir=str(tmp_path))
    run(engine, PROMPT, "1")
    engine.close()
    with caplog.at_level(logging.WARNING, logger="protoserve.engine.kv_offload"):
        other = make_engine(kv_offload_dir=str(tmp_path), kv_cache_dtype="bfloat16")
    assert "another model configuration" in caplog.text
    reference = make_engine(kv_cache_dtype="bfloat16")
    assert run(other, PROMPT + [1, 2, 3], "2") == (run(reference, PROMPT + [1, 2, 3], "r")[0], 0)
    assert other.kv_offload.counters.blocks_loaded == 0


def test_the_size_cap_deletes_the_least_recently_used(make_engine, tmp_path):
    engine = make_engine(kv_offload_dir=str(tmp_path))
    payload = engine.kv_offload.store.payload_bytes
    cap = 5 * (payload + 200)
    engine.close()
    engine = make_engine(kv_offload_dir=str(tmp_path), kv_offload_max_bytes=cap)
    run(engine, PROMPT, "1")
    engine.close()
    files = block_files(tmp_path)
    assert len(files) == 5 and sum(p.stat().st_size for p in files) <= cap


def test_a_request_waiting_for_its_blocks_can_be_cancelled(make_engine, tmp_path):
    engine = make_engine(kv_offload_dir=str(tmp_path))
    run(engine, PROMPT, "1")
    engine.close()
    restarted = make_engine(kv_offload_dir=str(tmp_path))
    restarted.add_request(TokenizedRequest("p", PROMPT + [1, 2], SamplingParams(temperature=0.0, max_tokens=4),
                                           cache_salt=b"alice"))
    assert restarted.kv_offload.num_parked == 1 and restarted.stats().waiting == 1
    assert restarted.abort("p")
    [out] = restarted.step()
    assert out.request_id == "p" and out.finished
    assert not restarted.has_unfinished() and restarted.kv_offload.num_parked == 0
    assert restarted.block_manager.num_free_blocks == restarted.block_manager.num_blocks


def test_a_preempted_request_reloads_its_evicted_prefix_from_disk(make_engine, tmp_path):
    """B is preempted (recompute) when the pool runs out; A then grows into the free queue, evicting B's
    tail blocks, which are written to disk. When B is admitted again it reads them back, as a new
    request would, instead of recomputing them; both outputs equal an engine's with room for both."""
    a = TokenizedRequest("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                         cache_salt=b"alice")
    b = TokenizedRequest("b", OTHER, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         cache_salt=b"alice")
    roomy = make_engine()
    expected = {c.request_id: c.choices[0].token_ids for c in LLM(engine=roomy).run([a, b])}
    assert roomy.stats().preemptions_total == 0

    engine = make_engine(kv_offload_dir=str(tmp_path), max_kv_blocks=27)  # both prompts and one block more
    done = {c.request_id: c for c in LLM(engine=engine).run([a, b])}
    assert {rid: c.choices[0].token_ids for rid, c in done.items()} == expected
    assert done["b"].stats.preemptions == 1 and done["a"].stats.preemptions == 0
    # A's 3 blocks past the pool took B's 3 tail blocks; B's 13 usable blocks were all hits again.
    assert engine.kv_offload.counters.blocks_loaded == 3
    assert engine.stats().prefix_cache_hits == (len(OTHER) + 8) // BLOCK * BLOCK


def test_a_preempted_request_parked_for_its_blocks_can_be_cancelled(make_engine, tmp_path):
    """Cancelling a preempted request while its prefix is read back ends it and leaves its tenant's
    accounts as if it finished; the others run to their ends. The worker is held so the read is
    still under way when the cancel comes."""
    engine = make_engine(kv_offload_dir=str(tmp_path), max_kv_blocks=27)
    for rid, prompt, n in (("a", PROMPT, 64), ("b", OTHER, 12), ("c", [1, 2, 3], 200)):
        engine.add_request(TokenizedRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                        ignore_eos=True), cache_salt=b"alice"))
    gate = threading.Event()
    held = False
    outputs = []
    while not engine.kv_offload.num_parked:
        if not held and engine.stats().preemptions_total:
            engine.kv_offload._worker.submit(gate.wait)  # reads queue behind this until the gate opens
            held = True
        outputs += engine.step()
    assert engine.kv_offload.parked_request_ids() == {"b"} and engine.scheduler.running  # c still runs
    assert engine.abort("b")
    gate.set()
    while engine.has_unfinished():
        outputs += engine.step()
    finished = {o.request_id: o for o in outputs if o.finished}
    assert set(finished) == {"a", "b", "c"}
    assert [d.finish_reason for d in finished["b"].deltas] == [FinishReason.CANCELLED]
    fair = engine.scheduler.fair
    assert all(a.live == 0 for accounts in (fair.groups.accounts, fair.identities.accounts)
               for a in accounts.values())
    assert engine.block_manager.num_free_blocks == 27


def test_int8_pools_round_trip_through_disk(make_engine, tmp_path):
    """kv_cache_dtype int8: the rows (codes and their scales) persist and load back byte for byte, so a
    restarted engine continues as the one that computed them."""
    engine = make_engine(kv_offload_dir=str(tmp_path), kv_cache_dtype="int8")
    first, _ = run(engine, PROMPT, "1")
    second_prompt = PROMPT + first + [9, 8, 7]
    reference = make_engine(kv_cache_dtype="int8")
    run(reference, PROMPT, "r1")
    second, cached_in_memory = run(reference, second_prompt, "r2")
    engine.close()
    restarted = make_engine(kv_offload_dir=str(tmp_path), kv_cache_dtype="int8")
    tokens, cached = run(restarted, second_prompt, "2")
    assert restarted.runner.kv_cache.k[0].dtype == torch.int8
    assert (tokens, cached) == (second, cached_in_memory) and cached > 0
    assert restarted.kv_offload.counters.blocks_loaded == cached // BLOCK
