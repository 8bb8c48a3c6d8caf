"""SSE_EVENTS framing: OpenAI Responses' / Anthropic's typed events, named by their ``type``."""

from __future__ import annotations

from protoserve.gateway.runtime import framing
from protoserve.gateway.runtime.route import ErrorStyle, Framing


def test_each_message_is_named_by_its_type_and_no_done_follows():
    payload = {"type": "response.output_text.delta", "sequence_number": 4, "delta": "a\nb"}
    assert framing.message_frame(Framing.SSE_EVENTS, payload) == (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"sequence_number":4,"delta":"a\\nb"}\n\n'
    )
    assert framing.end_frame(Framing.SSE_EVENTS) == b""
    assert framing.content_type(Framing.SSE_EVENTS).startswith("text/event-stream")


def test_a_message_without_a_one_line_type_gets_no_event_line():
    # The event field ends at a line break, so a type holding one would forge a second field.
    assert framing.message_frame(Framing.SSE_EVENTS, {"type": "a\ndata: x"}).startswith(b"data: ")
    assert framing.message_frame(Framing.SSE_EVENTS, {"n": 1}) == b'data: {"n":1}\n\n'


def test_openai_error_event_is_flat_and_numbered_after_the_last_message():
    event = {"error": {"message": "boom", "type": "server_error", "param": None, "code": "internal"}}
    typed = framing.typed_error_event(ErrorStyle.OPENAI, event, {"type": "x", "sequence_number": 7})
    assert typed == {"type": "error", "code": "internal", "message": "boom", "param": None, "sequence_number": 8}
    assert framing.typed_error_event(ErrorStyle.OPENAI, event, None)["sequence_number"] == 0
    assert framing.error_frame(Framing.SSE_EVENTS, typed).startswith(b"event: error\ndata: {")


def test_other_styles_keep_the_error_object():
    event = {"error": {"code": 13, "message": "boom"}}
    typed = framing.typed_error_event(ErrorStyle.GOOGLE_RPC_STATUS, event, None)
    assert typed == {"type": "error", "error": {"code": 13, "message": "boom"}}
