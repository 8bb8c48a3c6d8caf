"""Speculative counters reach /metrics under vLLM's spec_decode names (protoserve_ prefix)."""

from __future__ import annotations

from types import SimpleNamespace

from protoserve.engine.stats import EngineStats
from protoserve.server.observability.metrics import EngineCollector


def test_spec_decode_counters_are_exposed():
    stats = EngineStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12,
                        spec_decode_num_accepted_tokens=9)
    engine = SimpleNamespace(stats=lambda: stats, config=SimpleNamespace(max_queue=8))
    served = SimpleNamespace(name="m", kind="chat", engine=engine)
    models = SimpleNamespace(all=lambda: [served], listing=lambda: [served])
    samples = {s.name: (s.labels, s.value) for family in EngineCollector(models).collect() for s in family.samples}
    assert samples["protoserve_spec_decode_num_drafts_total"] == ({"model_name": "m"}, 3)
    assert samples["protoserve_spec_decode_num_draft_tokens_total"] == ({"model_name": "m"}, 12)
    assert samples["protoserve_spec_decode_num_accepted_tokens_total"] == ({"model_name": "m"}, 9)
