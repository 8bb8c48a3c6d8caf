"""/docs in a real browser: a key entered once, a chat completion sent from the page, its answer seen.

Headless Chromium (headless_chromium.py) opens the gateway's Swagger UI on ``protoserve serve``
with auth on and the default small model (live_server_auth), types an API key into
Authorize as a user would, opens ``POST /v1/chat/completions`` (which shows its example body,
ready to send) and executes it. The page must show 200 and the model's answer: the same
answer the test gets calling the route itself with that body (temperature 0). Then the page
is loaded again and ``GET /v1/models`` executed with no key typed: the key was kept. A
failure saves a screenshot of the page and names its path.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from headless_chromium import HeadlessChromium

# (element id, path, method) of the operations the test sends from the page.
CHAT = ("operations-OpenAIService-OpenAIService_CreateChatCompletion", "/v1/chat/completions", "post")
MODELS = ("operations-OpenAIService-OpenAIService_ListModels", "/v1/models", "get")
REQUEST_TIMEOUT_S = 120.0


def open_docs(browser: HeadlessChromium, api: str) -> None:
    browser.navigate(f"{api}/docs")
    browser.wait_for(
        "document.querySelectorAll('.opblock').length > 0 && !!document.querySelector('.btn.authorize')"
    )


def authorize(browser: HeadlessChromium, key: str) -> None:
    """Open Authorize, type the key into the bearer field, apply it, close the dialog."""
    browser.evaluate("document.querySelector('.btn.authorize').click()")
    field = "document.querySelector('#auth-bearer-value')"
    browser.wait_for(f"!!{field}")
    browser.evaluate(f"{field}.focus()")
    browser.type_text(key)
    browser.evaluate(f"{field}.closest('form').querySelector('button.authorize').click()")
    # Applied: the scheme's form now offers Logout instead of a field.
    browser.wait_for(
        "[...document.querySelectorAll('.auth-container button')].some(b => b.textContent === 'Logout')"
    )
    browser.evaluate("document.querySelector('.modal-ux button.close-modal').click()")


def execute(browser: HeadlessChromium, operation: tuple[str, str, str]) -> tuple[str, str | None, str]:
    """Open the operation, press Execute: (status shown, request body sent, response body shown)."""
    operation_id, path, method = operation
    root = f"document.getElementById({json.dumps(operation_id)})"
    browser.evaluate(f"{root}.querySelector('.opblock-summary-control').click()")
    browser.wait_for(f"!!{root}.querySelector('button.execute')")
    # Swagger UI resolves an opened operation (its body and content-type controls) in the background;
    # a press before that is lost, where a person's would not be: wait for it, as a person would.
    key = json.dumps(["paths", path, method])
    browser.wait_for(f"!!window.ui.specSelectors.specResolvedSubtree({key})")
    sent = browser.evaluate(f"{root}.querySelector('textarea.body-param__text')?.value ?? null")
    requested = f"!!window.ui.getState().getIn(['spec', 'requests', {json.dumps(path)}, {json.dumps(method)}])"
    browser.evaluate(f"{root}.querySelector('button.execute').click()")
    browser.wait_for(requested, timeout=30)
    status = browser.wait_for(
        f"{root}.querySelector('.live-responses-table tr.response .response-col_status')?.textContent.trim()",
        timeout=REQUEST_TIMEOUT_S,
    )
    shown = browser.evaluate(
        f"{root}.querySelector('.live-responses-table tr.response .highlight-code pre')"
        "?.textContent ?? ''"
    )
    return status, sent, shown


def test_a_chat_completion_from_the_docs_page(browser: HeadlessChromium, live_server_auth, tmp_path: Path):
    api = f"http://127.0.0.1:{live_server_auth.http_port}"
    key = live_server_auth.api_keys[0]
    # The page's request can only succeed with the key it was given.
    assert httpx.get(f"{api}/v1/models", timeout=30).status_code == 401
    document = httpx.get(f"{api}/openapi.json", timeout=30).json()
    example = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    example_body = example["examples"]["request"]["value"]
    screenshot = tmp_path / "docs-page.png"
    try:
        open_docs(browser, api)
        authorize(browser, key)
        status, sent, shown = execute(browser, CHAT)
        assert status == "200", shown
        assert json.loads(sent) == example_body, sent
        answer = json.loads(shown)["choices"][0]["message"]["content"]
        direct = httpx.post(
            f"{api}/v1/chat/completions",
            json=example_body,
            headers={"authorization": f"Bearer {key}"},
            timeout=REQUEST_TIMEOUT_S,
        ).raise_for_status()
        assert answer and answer == direct.json()["choices"][0]["message"]["content"], (answer, direct.text)

        # Entered once: a new page load keeps the key (persistAuthorization).
        open_docs(browser, api)
        status, _, shown = execute(browser, MODELS)
        assert status == "200", shown
        assert json.loads(shown)["data"], shown
    except (AssertionError, TimeoutError, RuntimeError) as failure:
        browser.screenshot(screenshot)
        raise AssertionError(f"{failure}\nscreenshot of the page: {screenshot}") from failure
