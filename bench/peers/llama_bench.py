"""llama.cpp's ``llama-bench``: its prompt (pp) and generation (tg) figures, run and parsed.

``pp512`` is 512 prompt tokens in one batch over an empty context, ``tg128``
128 tokens generated one at a time; each repeated ``-r`` times, averaged by
llama-bench itself. Flash attention off and on (``-fa 0,1``), since which is
faster depends on the CPU and the context.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.peers import llamacpp
from bench.peers.llamacpp import peer_env

PROMPT = 512
GENERATE = 128
FLASH_ATTN = (0, 1)
REPETITIONS = 5
TIMEOUT_S = 600.0


def find_for(model: Path) -> tuple[llamacpp.LlamaCppBinaries | None, str]:
    """llama.cpp's binaries to measure ``model`` with llama-bench, or None and why not (not built, or
    not a GGUF)."""
    lookup = llamacpp.find()
    if lookup.binaries is None:
        return None, lookup.reason
    if not str(model).endswith(".gguf"):
        return None, f"llama-bench needs a GGUF file; this run's model is {model}"
    return lookup.binaries, ""


@dataclass(frozen=True)
class LlamaBenchResult:
    """One test of a llama-bench run: ``pp512`` or ``tg128``, with flash attention off or on."""

    test: str
    flash_attn: int
    tokens_per_s: float
    stddev: float
    threads: int
    depth: int = 0  # tokens already in the context (``-d``) when the test starts

    @property
    def key(self) -> str:
        at = f"@d{self.depth}" if self.depth else ""
        return f"{self.test}{at}.fa{self.flash_attn}"


def bench_command(
    binary: Path,
    model: Path,
    threads: int,
    prompt: int = PROMPT,
    generate: int = GENERATE,
    flash_attn: Sequence[int] = FLASH_ATTN,
    repetitions: int = REPETITIONS,
) -> list[str]:
    if threads < 1 or prompt < 1 or generate < 1 or repetitions < 1:
        raise ValueError(f"threads, prompt, generate and repetitions must be >= 1, got "
                         f"{threads}, {prompt}, {generate}, {repetitions}")
    if not flash_attn or any(fa not in (0, 1) for fa in flash_attn):
        raise ValueError(f"flash_attn takes 0 and/or 1, got {list(flash_attn)}")
    return [
        str(binary), "-m", str(model), "-p", str(prompt), "-n", str(generate), "-t", str(threads),
        "-fa", ",".join(str(fa) for fa in flash_attn), "-r", str(repetitions), "-o", "json",
    ]  # fmt: skip


def depth_command(
    binary: Path,
    model: Path,
    threads: int,
    prompts: Sequence[int],
    generate: int,
    depths: Sequence[int],
    flash_attn: int,
    repetitions: int,
    cache_type: str | None = None,
) -> list[str]:
    """``-p`` each of ``prompts`` (0: none) and ``-n generate`` (0: none), each over every context depth
    of ``depths`` (``-d``: tokens put in the context before the timed part): the long-context tests.
    ``cache_type``: K and V stored as that type (``-ctk``/``-ctv``, e.g. ``q8_0``) instead of f16."""
    if not prompts or not depths or min(*prompts, *depths, generate) < 0 or threads < 1 or repetitions < 1:
        raise ValueError(f"bad long-context test: prompts {list(prompts)}, generate {generate}, depths {list(depths)}")
    if flash_attn not in (0, 1):
        raise ValueError(f"flash_attn takes 0 or 1, got {flash_attn}")
    return [
        str(binary), "-m", str(model), "-p", ",".join(map(str, prompts)), "-n", str(generate),
        "-d", ",".join(map(str, depths)),
        "-t", str(threads), "-fa", str(flash_attn), "-r", str(repetitions), "-o", "json",
        *(("-ctk", cache_type, "-ctv", cache_type) if cache_type else ()),
    ]  # fmt: skip


def _flash_attn(value: object) -> int:
    """llama-bench writes the setting as a bool, an int or a name depending on the version."""
    if isinstance(value, bool | int):
        return int(value)
    text = str(value).lower()
    if text in ("on", "enabled", "true", "1"):
        return 1
    if text in ("off", "disabled", "false", "0"):
        return 0
    raise ValueError(f"llama-bench flash_attn {value!r} is neither on nor off")


def parse_results(stdout: str) -> list[LlamaBenchResult]:
    """The tests of ``-o json`` output; raises ValueError naming what is missing."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench printed no JSON ({exc}): {stdout[:200]!r}") from exc
    if not isinstance(rows, list) or not rows:
        raise ValueError("llama-bench printed no test results")
    out = []
    for row in rows:
        missing = [k for k in ("n_prompt", "n_gen", "avg_ts", "stddev_ts", "flash_attn", "n_threads") if k not in row]
        if missing:
            raise ValueError(f"llama-bench result lacks {', '.join(missing)}")
        prompt, gen = int(row["n_prompt"]), int(row["n_gen"])
        test = f"pp{prompt}" if gen == 0 else f"tg{gen}" if prompt == 0 else f"pp{prompt}+tg{gen}"
        out.append(LlamaBenchResult(test, _flash_attn(row["flash_attn"]), float(row["avg_ts"]),
                                    float(row["stddev_ts"]), int(row["n_threads"]), int(row.get("n_depth", 0))))
    return out


def run(command: Sequence[str], timeout: float = TIMEOUT_S) -> list[LlamaBenchResult]:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, env=peer_env())
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return parse_results(done.stdout)
