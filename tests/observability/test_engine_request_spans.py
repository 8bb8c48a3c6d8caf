"""The engine's request spans on their own: parents, preemption events, timings, untraced requests."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.tracing import RequestTrace


@pytest.fixture(scope="module")
def loaded(tiny_obs_model):
    from protoserve.engine.loader.load import load_model

    return load_model(str(tiny_obs_model), dtype="float32", quantization="none", progress=False)


@pytest.fixture
def tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def test_preempted_requests_say_so_and_every_span_ends(loaded, tracing):
    tracer, exporter = tracing
    # 14 blocks of 16 tokens for 8 requests of up to 100 tokens: preemption is certain.
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=14, max_model_len=200))
    with tracer.start_as_current_span("caller") as caller:
        parent = trace.set_span_in_context(caller)
        requests = [
            TokenizedRequest(
                f"p{i}",
                [(7 * i + j) % 256 for j in range(20 + 5 * i)],
                SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                trace=RequestTrace(tracer, parent, model="tiny", response_id=f"public-{i}"),
            )
            for i in range(8)
        ]
        completions = LLM(engine=engine).run(requests)
    assert engine.stats().preemptions_total > 0
    spans = {s.attributes["gen_ai.response.id"]: s for s in exporter.get_finished_spans() if s.name != "caller"}
    assert sorted(spans) == sorted(f"public-{i}" for i in range(8))
    for i, completion in enumerate(completions):
        span = spans[f"public-{i}"]
        assert span.parent.span_id == caller.get_span_context().span_id
        events = [e.name for e in span.events]
        assert events[:3] == ["queued", "scheduled", "first_token"] and events[-1] == "finished"
        preemptions = events.count("preempted")
        assert preemptions == completion.stats.preemptions
        # Every preemption is followed by the request being scheduled again.
        assert events.count("scheduled") == 1 + preemptions
        assert span.attributes["gen_ai.usage.output_tokens"] == 40
        assert len(completion.stats.inter_token_latencies_s) == 39
        assert all(t > 0 for t in completion.stats.inter_token_latencies_s)
        times = [e.timestamp for e in span.events]
        assert span.start_time <= times[0] and times == sorted(times) and times[-1] <= span.end_time


def test_untraced_requests_make_no_spans(loaded, tracing):
    _, exporter = tracing
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=64))
    [completion] = LLM(engine=engine).run([TokenizedRequest("plain", [1, 2, 3], SamplingParams(max_tokens=3))])
    assert completion.choices[0].token_ids
    assert exporter.get_finished_spans() == ()


def test_a_speculative_requests_span_carries_its_draft_counts(loaded, tracing):
    from protoserve.engine.speculative.params import SpeculativeParams

    class AlwaysDrafts:
        """Drafts two fixed tokens every step: some are accepted or not, but every step verifies a draft."""

        def propose(self, seq, params, max_drafts):
            return [3, 4][:max_drafts]

    tracer, exporter = tracing
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=64))
    engine.speculator.proposer = AlwaysDrafts()
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                              speculative=SpeculativeParams(num_speculative_tokens=2))
    request = TokenizedRequest("s", [1, 2, 3, 4, 5], sampling,
                               trace=RequestTrace(tracer, None, model="tiny", response_id="spec"))
    [completion] = LLM(engine=engine).run([request])
    [span] = exporter.get_finished_spans()
    stats = completion.stats
    assert stats.spec_num_drafts > 0 and stats.spec_draft_tokens >= stats.spec_num_drafts
    assert span.attributes["protoserve.spec_decode.num_drafts"] == stats.spec_num_drafts
    assert span.attributes["protoserve.spec_decode.num_draft_tokens"] == stats.spec_draft_tokens
    assert span.attributes["protoserve.spec_decode.num_accepted_tokens"] == stats.spec_accepted_tokens
