"""A load client in a process of its own (bench/short_requests.py, bench/huge_prompt.py): started, then
ready when it says so, so the measuring process's busy event loop delays nothing of its requests."""

from __future__ import annotations

import asyncio
import sys

from bench.server_process import REPO


async def start_client_process(module: str, *args: str, what: str) -> asyncio.subprocess.Process:
    """``python -m module args...`` with pipes, once it has printed ``ready``; RuntimeError naming ``what``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args,
        cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    line = await process.stdout.readline()
    if line.strip() != b"ready":
        process.kill()
        await process.wait()
        raise RuntimeError(f"{what} did not start (said {line[:200]!r})")
    return process
