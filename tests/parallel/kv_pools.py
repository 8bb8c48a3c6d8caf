"""Every rank's KV pool after a tensor-parallel run, gathered by running the ranks under torchrun.

Under torchrun each rank runs ``SCRIPT`` and builds its engine through LLMEngine.from_pretrained,
the real path: rank 0 returns and generates, the other ranks serve its steps inside
from_pretrained. The script wraps the workers' step loop so that each saves its pool once rank 0
has shut the ranks down (block ids are rank 0's on every rank, so pools compare block by block);
rank 0 saves its own after generating.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = """
import sys, torch
from protoserve.engine.config import EngineConfig
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.parallel.runner import TensorParallelRunner
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams

def save(runner, out):
    torch.save({"k": runner.kv_cache.k, "v": runner.kv_cache.v}, f"{out}/rank{runner.rank}.pt")

if __name__ == "__main__":
    torch.set_num_threads(1)
    path, size, quantization, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    serve_steps = TensorParallelRunner.serve_steps

    def serve_then_save(runner):
        serve_steps(runner)
        save(runner, out)

    TensorParallelRunner.serve_steps = serve_then_save
    engine = LLMEngine.from_pretrained(path, quantization=quantization, progress=False,
                                       config=EngineConfig(tensor_parallel_size=size, max_kv_blocks=32))
    for i, n in enumerate((5, 11, 17)):
        prompt = [(7 * i + 13 * j) % 200 + 3 for j in range(n)]
        engine.add_request(TokenizedRequest(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    save(engine.runner, out)
"""


def rank_kv_pools(model: str, size: int, quantization: str, workdir: Path) -> list[dict[str, list[torch.Tensor]]]:
    """Each rank's K and V pools (per layer) after three greedy requests on ``size`` ranks."""
    script = workdir / "kv_pools_rank.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(size), str(script),
                          model, str(size), quantization, str(workdir)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [torch.load(workdir / f"rank{rank}.pt") for rank in range(size)]
