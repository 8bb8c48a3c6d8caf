"""A readable, self-contained HTML page for an OpenAPI document (served at ``/docs/reference``).

Rendered on the server from the document itself, with inline CSS and no
scripts: every operation, message and field with its proto comment on one
page that reads without JavaScript. The interactive page is ``/docs``
(gateway.swagger_ui).
"""

from __future__ import annotations

import html
import re
from typing import Any

_REF_PREFIX = "#/components/schemas/"
_CSS = """
body{font:15px/1.5 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:0 24px 48px;color:#1b1f24}
h1{margin-top:32px}h2{border-bottom:2px solid #d0d7de;padding-bottom:4px;margin-top:40px}
code{background:#f3f4f6;border-radius:4px;padding:1px 4px;font-size:90%}
.op{border:1px solid #d0d7de;border-radius:8px;margin:16px 0;padding:8px 16px}
.verb{display:inline-block;min-width:60px;text-align:center;border-radius:4px;color:#fff;font-weight:600;
padding:2px 8px;margin-right:8px}.get{background:#1f6feb}.post{background:#1a7f37}.put{background:#9a6700}
.delete{background:#cf222e}.patch{background:#8250df}.path{font-family:monospace;font-size:16px;font-weight:600}
table{border-collapse:collapse;width:100%;margin:8px 0}th,td{border:1px solid #d0d7de;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f6f8fa}.schema{margin:24px 0}.muted{color:#57606a}
nav a{margin-right:12px}
"""


def _text(description: str | None) -> str:
    """Comment text as paragraphs, with `code` spans."""
    if not description:
        return ""
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", description.strip()):
        escaped = html.escape(paragraph)
        escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
        paragraphs.append(f"<p>{escaped.replace(chr(10), '<br>')}</p>")
    return "".join(paragraphs)


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _type(schema: dict[str, Any] | None) -> str:
    """A short human label for a schema, linking to referenced components."""
    if not schema:
        return "any JSON value"
    if "$ref" in schema:
        name = schema["$ref"].removeprefix(_REF_PREFIX)
        return f'<a href="#{_anchor(name)}">{html.escape(name.rsplit(".", 1)[-1])}</a>'
    if "anyOf" in schema:
        return " or ".join(_type(option) for option in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(_type({**schema, "type": k}) for k in kind)
    if kind == "array":
        return f"array of {_type(schema.get('items'))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of string to {_type(schema['additionalProperties'])}"
    label = html.escape(str(kind or "any JSON value"))
    if schema.get("format") and kind in ("integer", "number", "string"):
        label += f" ({html.escape(schema['format'])})"
    if schema.get("enum"):
        label += ": " + ", ".join(f"<code>{html.escape(str(v))}</code>" for v in schema["enum"])
    return label


def _operation(path: str, verb: str, operation: dict[str, Any]) -> str:
    parts = [
        f'<div class="op" id="{html.escape(operation.get("operationId", ""))}">',
        f'<p><span class="verb {verb}">{verb.upper()}</span><span class="path">{html.escape(path)}</span>'
        f' <span class="muted">{html.escape(operation.get("summary", ""))}</span></p>',
        _text(operation.get("description")),
    ]
    if "security" in operation:
        needs = "an API key, when the server runs with keys" if operation["security"] else "none"
        parts.append(f"<p><b>Auth</b>: {needs}</p>")
    parameters = operation.get("parameters", [])
    if parameters:
        rows = "".join(
            f"<tr><td><code>{html.escape(p['name'])}</code></td><td>{p['in']}</td>"
            f"<td>{_type(p.get('schema'))}</td><td>{_text(p.get('description'))}</td></tr>"
            for p in parameters
        )
        parts.append(
            f"<table><tr><th>Parameter</th><th>In</th><th>Type</th><th>Description</th></tr>{rows}</table>"
        )
    body = operation.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            parts.append(f"<p><b>Request body</b> ({html.escape(media)}): {_type(content.get('schema'))}</p>")
    for status, response in operation.get("responses", {}).items():
        kinds = "; ".join(
            f"{html.escape(media)}: {_type(content.get('schema'))}"
            for media, content in response.get("content", {}).items()
        )
        parts.append(f"<p><b>{html.escape(status)}</b> {kinds}</p>{_text(response.get('description'))}")
    parts.append("</div>")
    return "".join(parts)


def _schema(name: str, schema: dict[str, Any]) -> str:
    parts = [
        f'<div class="schema" id="{_anchor(name)}"><h3>{html.escape(name)}</h3>',
        _text(schema.get("description")),
    ]
    properties = schema.get("properties")
    if properties:
        rows = "".join(
            f"<tr><td><code>{html.escape(field)}</code></td><td>{_type(prop)}</td>"
            f"<td>{_text(prop.get('description'))}</td></tr>"
            for field, prop in properties.items()
        )
        parts.append(f"<table><tr><th>Field</th><th>Type</th><th>Description</th></tr>{rows}</table>")
    elif "description" not in schema or schema.get("enum"):
        parts.append(f"<p>{_type(schema)}</p>")
    parts.append("</div>")
    return "".join(parts)


def render_docs(
    document: dict[str, Any], openapi_url: str = "/openapi.json", interactive_url: str | None = None
) -> str:
    """The whole page: operations grouped by tag, then every schema (linking to the interactive page)."""
    info = document.get("info", {})
    title = html.escape(info.get("title", "API"))
    by_tag: dict[str, list[str]] = {}
    for path, verbs in document.get("paths", {}).items():
        for verb, operation in verbs.items():
            tag = (operation.get("tags") or ["default"])[0]
            by_tag.setdefault(tag, []).append(_operation(path, verb, operation))
    tag_text = {tag["name"]: tag.get("description") for tag in document.get("tags", [])}
    sections = []
    for tag, operations in by_tag.items():
        sections.append(f'<h2 id="tag-{html.escape(tag)}">{html.escape(tag)}</h2>{_text(tag_text.get(tag))}')
        sections.extend(operations)
    schemas = document.get("components", {}).get("schemas", {})
    nav = "".join(f'<a href="#tag-{html.escape(tag)}">{html.escape(tag)}</a>' for tag in by_tag)
    if interactive_url:
        nav += f'<a href="{html.escape(interactive_url)}">Try requests</a>'
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title}</title>"
        f'<meta name=viewport content="width=device-width,initial-scale=1"><style>{_CSS}</style></head><body>'
        f"<h1>{title} <span class=muted>{html.escape(info.get('version', ''))}</span></h1>"
        f"{_text(info.get('description'))}"
        f'<nav>{nav}<a href="#schemas">Schemas</a><a href="{html.escape(openapi_url)}">openapi.json</a></nav>'
        + "".join(sections)
        + '<h2 id="schemas">Schemas</h2>'
        + "".join(_schema(name, schema) for name, schema in schemas.items())
        + "</body></html>"
    )
