"""HTTP rules kept beside a proto instead of in it: a google.api.Service YAML's ``http.rules``.

Vendored protos stay unmodified, so their routes cannot be ``google.api.http`` annotations; the
same rules live in a service config file, as Envoy's transcoder and ESP accept them. Each rule is
read strictly into ``google.api.HttpRule`` (an unknown key or a misspelt verb fails generation).
``protoserve_body_codecs`` maps the last path segment of each binding to its
:class:`~protoserve.gateway.runtime.route.BodyCodec`; every binding must have one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from google.api import http_pb2
from google.protobuf import json_format

from protoserve.gateway.runtime.route import BodyCodec

CODECS_KEY = "protoserve_body_codecs"


class HttpRulesError(Exception):
    """The rule file cannot be served; the message names the file and the rule."""


@dataclass(frozen=True, slots=True)
class HttpRuleTable:
    """Rules by method full name (``package.Service.Method``) and each binding's body codec."""

    rules: dict[str, http_pb2.HttpRule]
    codecs: dict[str, BodyCodec]

    def codec(self, path_template: str) -> BodyCodec:
        last = path_template.rstrip("/").rsplit("/", 1)[-1].split(":")[0]
        if last not in self.codecs:
            raise HttpRulesError(f"{path_template}: no {CODECS_KEY} entry for {last!r}")
        return self.codecs[last]


def load_http_rules(path: Path) -> HttpRuleTable:
    """The table of the YAML file at ``path``."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise HttpRulesError(f"{path}: {exc}") from None
    if not isinstance(document, dict) or document.get("type") != "google.api.Service":
        raise HttpRulesError(f"{path}: not a google.api.Service config (type: google.api.Service)")
    rules: dict[str, http_pb2.HttpRule] = {}
    for index, raw in enumerate((document.get("http") or {}).get("rules") or []):
        try:
            rule = json_format.ParseDict(raw, http_pb2.HttpRule())
        except json_format.ParseError as exc:
            raise HttpRulesError(f"{path}: http.rules[{index}]: {exc}") from None
        if not rule.selector or rule.selector in rules:
            raise HttpRulesError(f"{path}: http.rules[{index}]: selector missing or given twice")
        rules[rule.selector] = rule
    codecs: dict[str, BodyCodec] = {}
    for segment, name in (document.get(CODECS_KEY) or {}).items():
        try:
            codecs[str(segment)] = BodyCodec(name)
        except ValueError:
            raise HttpRulesError(f"{path}: {CODECS_KEY}.{segment}: unknown codec {name!r}") from None
    return HttpRuleTable(rules, codecs)
