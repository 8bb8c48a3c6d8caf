"""The interactive ``/docs`` page: Swagger UI over ``/openapi.json``, from files a PyPI package ships.

The gateway must work offline, so nothing comes from a CDN: Swagger UI's dist files are
the ones the ``flask-swagger-ui`` wheel carries (Swagger UI 5, which reads OpenAPI 3.1;
``swagger-ui-bundle``'s 4.15 cannot render a 3.1 document). They are found through the
import system without importing that package, which would import Flask. The page and its
start script are ours: ``persistAuthorization`` keeps what was entered under Authorize in
the browser's localStorage, so a key is entered once, and "Try it out" starts enabled, so
every operation opens with its example ready to send. The page calls its own origin, which
the browser-safety Origin check lets through, with no CORS involved.

``/docs/reference`` keeps the static page rendered from the same document (the protos'
comments for every message and field, no scripts).
"""

from __future__ import annotations

import html
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Route

from protoserve.gateway.runtime.docs import render_docs

DIST_PACKAGE = "flask_swagger_ui"
PAGE_PATH = "/docs"
REFERENCE_PATH = "/docs/reference"
START_SCRIPT_PATH = "/docs/start.js"
ASSETS_PATH = "/docs/swagger-ui"
# The dist files the page loads, with their media types; nothing else in the folder is served.
ASSETS = {
    "swagger-ui.css": "text/css; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
# Swagger UI's options: https://swagger.io/docs/open-source-tools/swagger-ui/usage/configuration/
_CONFIG = {
    "dom_id": "#swagger-ui",
    "persistAuthorization": True,
    "tryItOutEnabled": True,
    "displayRequestDuration": True,
    "docExpansion": "list",
    "defaultModelsExpandDepth": 0,
    "deepLinking": True,
    # No badge fetched from validator.swagger.io: the page reaches nothing but this server.
    "validatorUrl": None,
}


def swagger_ui_dist() -> Path:
    """The folder of Swagger UI's dist files; RuntimeError naming the package when it is missing."""
    spec = importlib.util.find_spec(DIST_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        dist = Path(location) / "dist"
        if all((dist / name).is_file() for name in ASSETS):
            return dist
    raise RuntimeError(
        f"Swagger UI's files are missing: /docs serves them from the {DIST_PACKAGE.replace('_', '-')} "
        "package (a dependency of protoserve); reinstall protoserve"
    )


@dataclass(frozen=True)
class DocsPages:
    """The interactive page, its start script and assets, and the static reference, for one document."""

    page: str
    start_script: str
    reference: str
    dist: Path

    @classmethod
    def for_document(cls, document: dict[str, Any], openapi_url: str = "/openapi.json") -> DocsPages:
        title = html.escape(document.get("info", {}).get("title", "API"))
        page = (
            f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title} API</title>"
            '<meta name=viewport content="width=device-width,initial-scale=1">'
            f'<link rel=stylesheet href="{ASSETS_PATH}/swagger-ui.css">'
            f'<link rel=icon type=image/png href="{ASSETS_PATH}/favicon-32x32.png">'
            "<style>.docs-links{font:14px/1.5 system-ui,sans-serif;max-width:1460px;margin:12px auto 0;"
            "padding:0 20px}</style></head><body>"
            "<p class=docs-links><b>Authorize</b> takes an API key once (this browser keeps it); every "
            "operation opens with an example to send. "
            f'<a href="{REFERENCE_PATH}">Reference</a> (every message and field, from the protos) · '
            f'<a href="{html.escape(openapi_url)}">openapi.json</a></p>'
            '<div id="swagger-ui"></div>'
            f'<script src="{ASSETS_PATH}/swagger-ui-bundle.js"></script>'
            f'<script src="{START_SCRIPT_PATH}"></script></body></html>'
        )
        config = {"url": openapi_url, **_CONFIG}
        start_script = f"window.ui = SwaggerUIBundle({json.dumps(config, indent=2)});\n"
        reference = render_docs(document, openapi_url, interactive_url=PAGE_PATH)
        return cls(page, start_script, reference, swagger_ui_dist())

    def routes(self) -> list[Route]:
        """Starlette routes for ``/docs``, its script and assets, and ``/docs/reference``."""

        async def page(_: Request) -> Response:
            return HTMLResponse(self.page)

        async def start_script(_: Request) -> Response:
            return Response(self.start_script, media_type="text/javascript; charset=utf-8")

        async def reference(_: Request) -> Response:
            return HTMLResponse(self.reference)

        def asset(name: str):
            async def serve(_: Request) -> Response:
                return FileResponse(self.dist / name, media_type=ASSETS[name])

            return serve

        return [
            Route(PAGE_PATH, page, methods=["GET"]),
            Route(START_SCRIPT_PATH, start_script, methods=["GET"]),
            Route(REFERENCE_PATH, reference, methods=["GET"]),
            *(Route(f"{ASSETS_PATH}/{name}", asset(name), methods=["GET"]) for name in ASSETS),
        ]
