"""The request log: one JSON line per finished request on the ``protoserve.requests`` logger.

A line looks like::

    {"event":"request_finished","request_id":"req-…","identity":"3f2a…","method":"/protoserve.v1.InferenceService/Generate",
     "model":"SmolLM2-135M-Instruct","operation":"text_completion","status":"OK","status_code":0,
     "finish_reason":"length","choice_finish_reasons":["length"],"prompt_tokens":7,"output_tokens":16,
     "cached_prompt_tokens":0,"started_at":1763770000.123456,"queue_time_s":0.0012,
     "time_to_first_token_s":0.031,"prefill_time_s":0.03,"decode_time_s":0.4,"e2e_time_s":0.44}

(on one line). ``identity`` is the identity hash, never the API key; no prompt
or completion text is logged. Failed requests add ``"error"``, the message the
caller got. Text a caller chose (request id, model) is cut past its cap, with
its size, so a line stays short. The lines are logged at INFO, so
``--log-level WARNING`` silences them; :func:`use_json_lines` makes the logger
write bare JSON lines (no timestamp prefix) so log shippers can parse them as
they are.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

from protoserve.server.calls.request_record import RequestRecord
from protoserve.server.errors import MAX_MESSAGE_BYTES, clip
from protoserve.server.limits import MAX_MODEL_NAME_CHARS, MAX_REQUEST_ID_CHARS

LOGGER_NAME = "protoserve.requests"
log = logging.getLogger(LOGGER_NAME)

# A refused request's fields are the caller's text, unchecked (a 3 MB model name, say): each is
# cut past the longest valid value, so a line stays short whatever the request held.
_FIELD_CHARS = {"request_id": MAX_REQUEST_ID_CHARS, "model": MAX_MODEL_NAME_CHARS}
_OTHER_CHARS = MAX_MESSAGE_BYTES


def line_fields(record: RequestRecord) -> dict:
    """The record's log fields with every text value cut to its bound."""
    return {
        key: clip(value, _FIELD_CHARS.get(key, _OTHER_CHARS)) if isinstance(value, str) else value
        for key, value in record.log_fields().items()
    }


def log_request(record: RequestRecord) -> None:
    """Write the record's line (skipped cheaply when INFO is off for the logger)."""
    if log.isEnabledFor(logging.INFO):
        log.info(json.dumps(line_fields(record), separators=(",", ":"), ensure_ascii=False))


class _JsonLines(logging.StreamHandler):
    """The handler :func:`use_json_lines` installs (a class of its own so it is installed once)."""


def use_json_lines(stream: TextIO | None = None) -> logging.Handler:
    """Send request lines to ``stream`` (stderr) as bare JSON, apart from the formatted server log.

    Idempotent: a second call (a second server in the process) reuses the handler.
    """
    for existing in log.handlers:
        if isinstance(existing, _JsonLines):
            return existing
    handler = _JsonLines(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.propagate = False
    return handler
