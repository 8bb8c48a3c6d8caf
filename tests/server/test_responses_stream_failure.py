"""A Responses stream that fails once it began ends with a ``response.failed`` event, not a bare status.

The engine double (server_engine_double.py) fails the request after its first output, as the real
engine does when an admin unloads the model under a running stream; the real grpc.aio server
serves ResponsesService over a real channel.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import json_format, struct_pb2
from server_engine_double import EngineDouble
from test_server_edge_cases import double_server

from protoserve.engine.api import ModelUnloadedError
from protoserve.openai.v1 import responses_pb2 as rs
from protoserve.openai.v1 import responses_pb2_grpc


def _request(max_output_tokens: int) -> rs.CreateResponseRequest:
    return rs.CreateResponseRequest(
        input=struct_pb2.Value(string_value="hello"), max_output_tokens=max_output_tokens, store=False
    )


async def _stream(engine: EngineDouble, request: rs.CreateResponseRequest, on_event=None):
    """The stream's events, and its status; ``on_event(events)`` after each one."""
    events = []
    async with double_server(engine) as (app, _, _):
        async with grpc.aio.insecure_channel(app.grpc_target) as channel:
            call = responses_pb2_grpc.ResponsesServiceStub(channel).CreateResponseStream(
                rs.CreateResponseStreamRequest(request=request)
            )
            async for event in call:
                events.append(event)
                if on_event is not None:
                    on_event(events)
            return events, await call.code()


async def test_an_engine_failure_mid_stream_is_a_response_failed_event():
    engine = EngineDouble(max_model_len=256)
    engine.fail_after_first = ModelUnloadedError("double")
    events, status = await _stream(engine, _request(20))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed", kinds
    assert "response.completed" not in kinds and status == grpc.StatusCode.OK
    assert [event.sequence_number for event in events] == list(range(len(events)))
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "model_unloaded"
    assert "unloaded" in failed.error.message
    # The text sent before the failure is in the failed response.
    [message] = json_format.MessageToDict(failed)["output"]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed and message["content"][0]["text"] == streamed


async def test_a_cancelled_stream_ends_incomplete_with_status_cancelled():
    """CancelRequest or a deadline ends the generation: the response says cancelled, never completed."""
    engine = EngineDouble(max_model_len=256)

    def cancel_at_first_text(events) -> None:
        if events[-1].type == "response.output_text.delta" and len(events) < 10:
            assert engine.abort(engine.submitted[-1].request_id)

    events, _ = await _stream(engine, _request(200), cancel_at_first_text)
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds, kinds
    final = events[-1].response
    assert final.status == "cancelled" and not final.HasField("incomplete_details")
    assert final.output[0].status == "incomplete"


async def test_a_cancelled_unary_response_says_cancelled():
    engine = EngineDouble(max_model_len=256)
    async with double_server(engine) as (app, _, _):
        async with grpc.aio.insecure_channel(app.grpc_target) as channel:
            call = responses_pb2_grpc.ResponsesServiceStub(channel).CreateResponse(_request(200))
            while not engine.submitted:
                await asyncio.sleep(0.01)
            assert engine.abort(engine.submitted[-1].request_id)
            reply = await call
    assert reply.response.status == "cancelled"
