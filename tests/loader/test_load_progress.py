"""The loading progress bar is drawn on a terminal and left out of logs (files and pipes).

tqdm redraws with carriage returns; in a server's log file those frames made one long line.
Each case loads the first tensors of the default GGUF in a fresh process with progress on.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOAD_A_FEW_TENSORS = (
    "import itertools\n"
    "from protoserve.engine.loader.default_model import default_model_path\n"
    "from protoserve.engine.loader.gguf_checkpoint import GGUFCheckpoint\n"
    "weights = GGUFCheckpoint(default_model_path()).iter_weights(progress=True)\n"
    "assert len(list(itertools.islice(weights, 8))) == 8\n"
    "weights.close()\n"
    "print('loaded', flush=True)\n"
)


def run_loader(stderr) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", LOAD_A_FEW_TENSORS], cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, timeout=120
    )


def test_no_bar_in_a_log_file(tmp_path: Path) -> None:
    log = tmp_path / "protoserve.server.log"
    with log.open("wb") as f:
        done = run_loader(f)
    assert done.returncode == 0 and done.stdout == b"loaded\n"
    written = log.read_bytes()
    assert b"\r" not in written and b"Loading" not in written, written[:500]


def test_no_bar_in_a_pipe() -> None:
    done = run_loader(subprocess.PIPE)
    assert done.returncode == 0
    assert b"\r" not in done.stderr and b"Loading" not in done.stderr, done.stderr[:500]


def test_the_bar_on_a_terminal() -> None:
    """The control: the same load with stderr on a pseudo-terminal draws the bar."""
    parent, child = pty.openpty()
    # 24 rows of 100 columns: a new pty has 0 columns, where tqdm draws an empty bar.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        done = run_loader(child)
        os.close(child)
        child = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(parent, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        if child != -1:
            os.close(child)
        os.close(parent)
    assert done.returncode == 0
    assert b"Loading SmolLM2" in drawn and b"\r" in drawn, drawn[:500]
