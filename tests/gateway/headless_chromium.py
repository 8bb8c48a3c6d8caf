"""Headless Chromium driven over the DevTools protocol, for tests that need a real browser.

Debian's ``chromium`` (``make install`` installs it where apt-get runs as root). It is started
offline-safe (no sync, component updates, background networking or QUIC: this machine has no
internet, and Chromium would keep trying to reach Google) with a fresh profile, and with
``--remote-debugging-port=0``: the port it picks is read from the profile's
``DevToolsActivePort``. ``run_page(url)`` loads a page and waits, in real time, until the
page's script sets ``window.results``, which it returns: the page does its own cross-origin
requests exactly as any web page could. For driving a page as a user would: ``navigate``,
``evaluate`` (a JavaScript expression's JSON value), ``wait_for`` (until an expression is
truthy), ``type_text`` (real key input into the focused element) and ``screenshot``.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1280,1024",  # room for a page's screenshot to show what went wrong
)
START_TIMEOUT_S = 60.0


def chromium_path() -> str | None:
    """The Chromium binary, or None when it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class HeadlessChromium:
    """One Chromium process with one page; ``close()`` ends it and removes its profile."""

    def __init__(self, binary: str) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="protoserve-chromium-"))
        self._profile = self._root / "profile"  # a new, empty profile: Chromium creates it
        self._log = (self._root / "chromium.log").open("w+")
        self.process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        port = self._devtools_port()
        pages = [
            t
            for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            if t["type"] == "page"
        ]
        self._connection = contextlib.ExitStack()
        self._page = self._connection.enter_context(
            connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        )
        self._ids = itertools.count(1)

    def _devtools_port(self) -> int:
        active = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not active.exists() or not active.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                raise RuntimeError(
                    f"chromium did not start (exit {self.process.poll()}):\n{self._log.read()[-3000:]}"
                )
            time.sleep(0.1)
        return int(active.read_text().split()[0])

    def _call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        self._page.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._page.recv(timeout=30))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def run_page(self, url: str, timeout: float = 60.0) -> dict[str, Any]:
        """Load ``url`` and return the ``window.results`` its script sets (JSON), waiting up to ``timeout``."""
        self._call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self._call("Runtime.evaluate", expression="JSON.stringify(window.results ?? null)")
            text = value["result"].get("value")
            if text not in (None, "null"):
                return json.loads(text)
            time.sleep(0.2)
        raise TimeoutError(f"{url} set no window.results in {timeout} s")

    def navigate(self, url: str) -> None:
        """Start loading ``url`` in the page (wait_for what should appear on it)."""
        self._call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises awaited)."""
        reply = self._call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll ``expression`` until it is truthy and return its value; TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"not true after {timeout} s: {expression}")

    def type_text(self, text: str) -> None:
        """Type ``text`` into the focused element, as keyboard input (frameworks see input events)."""
        self._call("Input.insertText", text=text)

    def screenshot(self, path: Path) -> Path:
        """Save the whole page as it is now (not only the window's part of it) as a PNG at ``path``."""
        size = self._call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self._call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        self._connection.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        shutil.rmtree(self._root, ignore_errors=True)
