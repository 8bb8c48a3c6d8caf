"""TP=2 on this machine's CPU (two processes, gloo) against TP=1, through LLMEngine end to end.

Three concurrent greedy requests of 32 tokens run on each engine; every step's logits must agree
and every token must be the same. Float tolerance: |TP2 - TP1| <= 1e-5 + 1e-5 * |TP1| (the ranks
sum the row-parallel partial products in another order; measured max 6e-6 on logits up to 11).
int8 layers quantize their input rows on the fly, and a row-parallel layer's input is the rank's
own columns, so its codes differ from TP=1's in the last steps (the weight codes are the same:
test_sharding.py): there 1e-2, with the KV cache in float32 (measured 2.3e-3).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from kv_pools import rank_kv_pools

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.models.rope import rope_spec
from protoserve.engine.parallel import ranks
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # each test starts a rank process (4-9 s)

PROMPT_LENS = (5, 11, 17)
GREEDY_TOKENS = 32
FLOAT_TOL = 1e-5


def _generate(engine: LLMEngine, greedy: int = GREEDY_TOKENS) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Each step's logits and each request's tokens, the requests all in the queue at once."""
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(seqs, num_new_tokens):
        logits = execute(seqs, num_new_tokens)
        steps.append(logits.clone())
        return logits

    engine.runner.execute = recording
    rng = random.Random(0)
    tokens: dict[str, list[int]] = {}
    for i, n in enumerate(PROMPT_LENS):
        prompt = [rng.randrange(engine.vocab_size) for _ in range(n)]
        sampling = SamplingParams(max_tokens=greedy, temperature=0.0, ignore_eos=True)
        engine.add_request(TokenizedRequest(f"r{i}", prompt, sampling))
        tokens[f"r{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                tokens[out.request_id] += delta.token_ids
    return steps, tokens


def _engine(path, tp: int, **options) -> LLMEngine:
    quantization = options.pop("quantization", "none")
    config = EngineConfig(tensor_parallel_size=tp, max_kv_blocks=64, **options)
    return LLMEngine.from_pretrained(str(path), quantization=quantization, config=config, progress=False)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def _compare(path, tol: float, tp: int = 2, greedy: int = GREEDY_TOKENS, **options) -> LLMEngine:
    """TP=1 and TP=tp give the same logits (within tol) and tokens; returns the open TP=tp engine."""
    ref_steps, ref_tokens = _generate(_engine(path, 1, **options), greedy)
    engine = _engine(path, tp, **options)
    steps, tokens = _generate(engine, greedy)
    assert tokens == ref_tokens and all(len(t) == greedy for t in tokens.values())
    assert len(steps) == len(ref_steps)
    for got, want in zip(steps, ref_steps, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    return engine


def test_llama_tp2_equals_tp1_then_shuts_down(checkpoint):
    engine = _compare(checkpoint("llama"), FLOAT_TOL)
    workers = engine.runner.group.workers
    assert len(workers) == 1 and workers[0].is_alive()
    with pytest.raises(ValueError, match="LoRA adapters are not served with tensor_parallel_size > 1"):
        engine.enable_lora(2)
    engine.runner.close()
    assert workers[0].exitcode == 0 and _gone(workers[0].pid)  # left on the shutdown message
    assert ranks.current() is None and not torch.distributed.is_initialized()


def test_qwen3_tp2_equals_tp1(checkpoint):
    _compare(checkpoint("qwen3"), FLOAT_TOL).runner.close()


def test_qwen2_int8_tp2_equals_tp1(checkpoint):
    _compare(checkpoint("qwen2"), 1e-2, quantization="int8", kv_cache_dtype="float32").runner.close()


@pytest.mark.parametrize("family", ["gemma2", "starcoder2", "command_r", "phi3", "phi4-mini"])
def test_dense_families_tp2_equal_tp1(checkpoint, family):
    # StarCoder2's ungated GELU MLP splits c_fc by rows and c_proj by columns, its biases once;
    # Phi's fused checkpoint tensors are split on load, so its ranks shard the decoder's as any family's.
    _compare(checkpoint(family), FLOAT_TOL).runner.close()


def test_every_rank_fixes_its_rope_for_the_served_context(checkpoint):
    """Phi-3 served within its original context (48) rotates by longrope's short factors: on every rank,
    or the heads of a rank on the long ones would leave TP=2's logits off TP=1's."""
    engine = _compare(checkpoint("phi3"), FLOAT_TOL, greedy=48 - max(PROMPT_LENS), max_model_len=48)
    c = engine.runner.model.config
    short = rope_spec(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, max_model_len=48)
    assert torch.equal(engine.runner.model.rope.inv_freq, short.inv_freq)
    engine.runner.close()


@pytest.mark.parametrize(("family", "tp"), [("gemma3-kv1", 2), ("gemma3-kv1", 4), ("gemma3-kv2", 4)])
def test_replicated_kv_heads_equal_tp1(checkpoint, family, tp):
    """Fewer KV heads than ranks: each rank keeps a copy of the KV head its query heads read."""
    engine = _compare(checkpoint(family), FLOAT_TOL, tp)
    assert engine.runner.kv_cache.num_kv_heads == 1 and len(engine.runner.group.workers) == tp - 1
    engine.runner.close()


def test_replicated_kv_heads_hold_the_same_bits_on_their_ranks(checkpoint, tmp_path):
    """2 KV heads over 4 ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1, bit for bit."""
    pools = rank_kv_pools(str(checkpoint("gemma3-kv2")), 4, "none", tmp_path)
    for pool in ("k", "v"):
        for layer in range(len(pools[0][pool])):
            per_rank = [p[pool][layer] for p in pools]
            assert all(t.shape[2] == 1 and t.count_nonzero() > 0 for t in per_rank)
            assert torch.equal(per_rank[0], per_rank[1]) and torch.equal(per_rank[2], per_rank[3])
            assert not torch.equal(per_rank[0], per_rank[2])  # two heads, not one copied four times


@pytest.mark.parametrize(("family", "tp", "quantization", "error"), [
    # Read off the config before any rank starts.
    ("odd_heads", 2, "none", r"^tensor_parallel_size 2 does not divide the model's num_heads \(3\); "
                             r"tensor_parallel_size this model takes: 1$"),
    # Found only while slicing the quantized layers, once the workers run: they are stopped.
    ("llama", 4, "int4", r"o_proj: int4 groups of 32 input columns do not split at a rank's columns"),
])
def test_refusal_stops_the_spawned_workers(checkpoint, family, tp, quantization, error):
    with pytest.raises(ValueError, match=error):
        _engine(checkpoint(family), tp, quantization=quantization)
    assert ranks.current() is None and not torch.distributed.is_initialized()
    assert not [p for p in __import__("multiprocessing").active_children() if p.name.startswith("protoserve-tp")]


# Rank 0 of a TP=2 engine in a process of its own: "pid" prints its worker's pid and waits,
# "generate" prints greedy tokens and exits (the workers are told to stop by its atexit handler).
RANK0 = """
import json, sys, torch
from protoserve.engine.config import EngineConfig
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams
if __name__ == "__main__":
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(sys.argv[1], progress=False,
                                       config=EngineConfig(tensor_parallel_size=2, max_kv_blocks=64))
    if sys.argv[2] == "pid":
        print(engine.runner.group.workers[0].pid, flush=True)
        sys.stdin.read()
    engine.add_request(TokenizedRequest("a", list(range(7, 20)), SamplingParams(max_tokens=16, temperature=0.0)))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for d in out.deltas for t in d.token_ids]
    print(json.dumps(tokens), flush=True)
"""


@pytest.fixture
def rank0_script(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    return script


def test_worker_exits_when_rank0_is_killed(checkpoint, rank0_script):
    rank0 = subprocess.Popen([sys.executable, str(rank0_script), str(checkpoint("qwen2")), "pid"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(rank0.stdout.readline())
        assert not _gone(worker)
        os.kill(rank0.pid, signal.SIGKILL)  # no atexit, no shutdown message
        rank0.wait()
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker)
    finally:
        rank0.kill()


def test_torchrun_ranks(checkpoint, rank0_script):
    """Under torchrun every rank runs the script: rank 0 returns from from_pretrained and serves,
    rank 1 serves its steps inside it and exits 0 when rank 0's process ends."""
    path = checkpoint("qwen2")
    engine = _engine(path, 1)
    engine.add_request(TokenizedRequest("a", list(range(7, 20)), SamplingParams(max_tokens=16, temperature=0.0)))
    want = []
    while engine.has_unfinished():
        want += [t for out in engine.step() for d in out.deltas for t in d.token_ids]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(rank0_script),
                          str(path), "generate"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == want and len(want) == 16


def test_int8_kv_cache_tp2_equals_tp1(checkpoint):
    """--kv-cache-dtype int8 under tensor parallelism: each rank quantizes its own heads' rows (a row's
    scale is per KV head, so sharding heads splits no row): the same tokens as one rank. The logits move
    a little more than float32 K/V's: the sharded projections' last-bit differences flip a code now and
    then, one step of its row's scale (measured up to 6e-5)."""
    engine = _compare(checkpoint("qwen3"), 1e-3, kv_cache_dtype="int8")
    assert engine.runner.kv_cache.k[0].dtype == torch.int8
    engine.runner.close()
