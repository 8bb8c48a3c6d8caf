"""Real web pages against ``protoserve serve``: what a foreign origin cannot do, and an allowed one can.

Headless Chromium (headless_chromium.py) loads pages from two small HTTP servers on other
ports, each another origin than the gateway's: one not allowed at all, one given with
``--cors-origin`` (guarded_server). The foreign page tries what any page on the web could
without asking the user: a ``text/plain`` POST that would index a RAG document (a CORS "simple"
request, sent without preflight), a ``no-cors`` POST of an untyped body, one that would delete a
document, and a WebSocket that would read a completion. Afterwards the test looks through the
API: nothing was indexed or deleted. The allowed page indexes a document, lists documents and
reads a completion over the WebSocket. Skips only where Chromium is not installed.
"""

from __future__ import annotations

import http.server
import json
import threading

import httpx

KEPT_DOCUMENT = "kept-by-the-test"
ALLOWED_DOCUMENT = "from-the-allowed-page"
FOREIGN_DOCUMENTS = ("via-text-plain", "via-no-cors")

FOREIGN_SCRIPT = """
async function attempt(request) {
  try { return await request(); } catch (error) { return "error " + error.name; }
}
const planted = (id) => JSON.stringify({documents: [{document_id: id, text: "planted by " + location.origin}]});
(async () => {
  const out = {};
  out.text_plain = await attempt(async () => {
    const r = await fetch(API + "/v1/rag/index",
                          {method: "POST", headers: {"content-type": "text/plain"}, body: planted("via-text-plain")});
    return "read " + r.status;
  });
  out.no_cors = await attempt(async () => {
    const r = await fetch(API + "/v1/rag/index", {method: "POST", mode: "no-cors", body: new Blob([planted("via-no-cors")])});
    return "opaque " + r.type;
  });
  out.delete_no_cors = await attempt(async () => {
    const body = new Blob([JSON.stringify({document_ids: [KEPT]})]);
    const r = await fetch(API + "/v1/rag/documents:delete", {method: "POST", mode: "no-cors", body});
    return "opaque " + r.type;
  });
  out.websocket = await completion_over_websocket();
  window.results = out;
})();
"""

ALLOWED_SCRIPT = """
(async () => {
  const out = {};
  const index = await fetch(API + "/v1/rag/index", {
    method: "POST", headers: {"content-type": "application/json"},
    body: JSON.stringify({documents: [{document_id: ALLOWED, text: "indexed by " + location.origin}]}),
  });
  out.index = index.status + " " + JSON.stringify(await index.json());
  const listed = await fetch(API + "/v1/rag/documents");
  out.list = listed.status;
  out.websocket = await completion_over_websocket();
  window.results = out;
})();
"""

# A WebSocket completion, as far as the page gets: "read chunk,...,done", or "closed <code>".
WEBSOCKET_SCRIPT = """
function completion_over_websocket() {
  return new Promise((resolve) => {
    const seen = [];
    const socket = new WebSocket(API.replace("http://", "ws://") + "/v1/ws/completions");
    socket.onopen = () => socket.send(JSON.stringify(
      {id: "1", type: "completion", request: {prompt: "Hi", max_tokens: 4}}));
    socket.onmessage = (message) => {
      seen.push(JSON.parse(message.data).type);
      if (seen.includes("done")) { socket.close(); resolve("read " + seen.join(",")); }
    };
    socket.onclose = (event) => resolve("closed " + event.code + (seen.length ? " after " + seen.join(",") : ""));
    setTimeout(() => resolve("no answer"), 30000);
  });
}
"""


def page(api: str, script: str) -> bytes:
    constants = {"API": api, "KEPT": KEPT_DOCUMENT, "ALLOWED": ALLOWED_DOCUMENT}
    declarations = "".join(f"const {name} = {json.dumps(value)};\n" for name, value in constants.items())
    return (
        f"<!doctype html><title>t</title><script>\n{declarations}{WEBSOCKET_SCRIPT}{script}</script>".encode()
    )


class _Pages(http.server.ThreadingHTTPServer):
    def __init__(self, port: int, body: bytes) -> None:
        self.body = body
        super().__init__(("127.0.0.1", port), _PageHandler)


class _PageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        body = self.server.body if self.path == "/" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def serve_page(port: int, body: bytes) -> tuple[_Pages, str]:
    pages = _Pages(port, body)
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    return pages, f"http://127.0.0.1:{pages.server_address[1]}/"


def documents(api: str) -> set[str]:
    reply = httpx.get(api + "/v1/rag/documents", timeout=30)
    assert reply.status_code == 200, reply.text
    return {d["document_id"] for d in reply.json()["documents"]}


def test_a_foreign_page_can_change_nothing(browser, guarded_server):
    api = guarded_server.url
    index = {"documents": [{"document_id": KEPT_DOCUMENT, "text": "The test indexed this one itself."}]}
    assert httpx.post(api + "/v1/rag/index", json=index, timeout=60).status_code == 200
    pages, url = serve_page(0, page(api, FOREIGN_SCRIPT))
    try:
        results = browser.run_page(url)
    finally:
        pages.shutdown()
        pages.server_close()
    # What the server did: nothing.
    stored = documents(api)
    assert not stored & set(FOREIGN_DOCUMENTS), f"a foreign page indexed {stored & set(FOREIGN_DOCUMENTS)}"
    assert KEPT_DOCUMENT in stored, "a foreign page deleted a document"
    # What the page saw: nothing readable, and no WebSocket.
    assert results["websocket"].startswith("closed 1006") and "after" not in results["websocket"], results
    assert results["text_plain"] == "error TypeError", results
    assert results["no_cors"] == "opaque opaque" and results["delete_no_cors"] == "opaque opaque", results


def test_an_allowed_origin_works(browser, guarded_server):
    api = guarded_server.url
    pages, url = serve_page(guarded_server.allowed_origin_port, page(api, ALLOWED_SCRIPT))
    try:
        results = browser.run_page(url)
    finally:
        pages.shutdown()
        pages.server_close()
    assert results["index"].startswith("200 ") and ALLOWED_DOCUMENT in results["index"], results
    assert results["list"] == 200, results
    assert results["websocket"].startswith("read chunk") and results["websocket"].endswith("done"), results
    assert ALLOWED_DOCUMENT in documents(api)
