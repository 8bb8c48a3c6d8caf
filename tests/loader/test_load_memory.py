"""A load leaves resident only what the model keeps, not the float32 copy it was built from."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from protoserve.engine.loader.heap import release_freed_memory

REPO = Path(__file__).resolve().parents[2]


def test_release_freed_memory_finds_glibc_malloc_trim():
    if not sys.platform.startswith("linux"):
        pytest.skip("malloc_trim is glibc's")
    assert release_freed_memory() is True


# A fresh interpreter, so no other test's allocations sit in the heap: resident memory before
# and after load_model, and what the model's tensors and kernel packs really take.
_PROBE = textwrap.dedent(
    """
    import json, torch
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    import protoserve.engine.loader.load  # imports (torch, the kernels module) count as the base
    base = rss()
    loaded = protoserve.engine.loader.load.load_model(None, quantization="int4", progress=False)
    grown = rss() - base
    held = loaded.model.weight_bytes()  # state dict and kernel packs
    print(json.dumps({"grown": grown, "held": held}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_int4_load_leaves_no_float32_heap_resident():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    grown, held = figures["grown"], figures["held"]
    mib = 2**20
    # SmolLM2 int4 holds ~290 MiB (float32 embedding, int8 head, int4 layers and their packs);
    # the float32 model it was quantized from is ~540 MiB. Before the heap was trimmed the load
    # grew the process by ~1,000 MiB; now by the model plus the tokenizer and allocator slack.
    assert held < 400 * mib, f"the int4 model itself holds {held / mib:.0f} MiB"
    assert grown < held + 250 * mib, (
        f"loading grew the process by {grown / mib:.0f} MiB for a model of {held / mib:.0f} MiB: "
        "freed float32 weights are still resident"
    )
