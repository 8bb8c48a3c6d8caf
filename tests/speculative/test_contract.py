"""GenerateRequest.speculative through the gRPC API: opt in, stats come back, bad values name the field."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protoserve.engine.speculative.params import SpeculativeParams
from protoserve.server.models.sampling_mapping import speculative_from_proto
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

COPY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork and "
        "polished the great lens until it shone.\nRepeat the passage exactly.")


def test_options_map_with_defaults_for_unset_fields():
    assert speculative_from_proto(pb.SpeculativeOptions()) == SpeculativeParams()
    opts = pb.SpeculativeOptions(method="off", num_speculative_tokens=0, prompt_lookup_max=5)
    assert speculative_from_proto(opts) == SpeculativeParams(method="off", num_speculative_tokens=0,
                                                             prompt_lookup_max=5)


async def _generate(target: str, request: pb.GenerateRequest) -> pb.GenerateResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        return await inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=120)


async def _violations(target: str, request: pb.GenerateRequest) -> set[str]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await _generate(target, request)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(exc.value)
    fields = set()
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields |= {v.field for v in bad.field_violations}
    return fields


async def test_generate_with_speculation_same_tokens_and_stats(inproc_server):
    sampling = pb.SamplingParams(max_tokens=24, temperature=0)
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content=COPY)])
    plain = await _generate(inproc_server.grpc_target, pb.GenerateRequest(chat=chat, sampling=sampling))
    spec = await _generate(inproc_server.grpc_target, pb.GenerateRequest(
        chat=chat, sampling=sampling, speculative=pb.SpeculativeOptions(num_speculative_tokens=4)))
    assert list(spec.choices[0].token_ids) == list(plain.choices[0].token_ids)
    assert spec.stats.spec_draft_tokens > 0 and spec.stats.spec_num_drafts > 0
    assert 0 < spec.stats.spec_accepted_tokens <= spec.stats.spec_draft_tokens
    assert plain.stats.spec_draft_tokens == 0


async def test_bad_options_are_refused_on_their_field(inproc_server):
    target = inproc_server.grpc_target
    bad_k = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOptions(num_speculative_tokens=0))
    assert await _violations(target, bad_k) == {"speculative.num_speculative_tokens"}
    bad_method = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOptions(method="eagle"))
    assert await _violations(target, bad_method) == {"speculative.method"}
    constrained = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOptions(),
                                     sampling=pb.SamplingParams(constraint=pb.Constraint(regex="[ab]+")))
    assert await _violations(target, constrained) == {"speculative"}
