"""The engine's public modules: ``api`` loads no torch, ``runtime`` runs models, and its measuring
hooks see exactly what the engine computes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny_checkpoint_ids import TINY_VOCAB

from protoserve.engine import api, runtime
from protoserve.engine.api import SamplingParams, TokenizedRequest
from protoserve.engine.runtime import LLM, all_position_logits, timed_fused_steps
from protoserve.kernels.cpu import step_phases


def request(rid: str, prompt: list[int], max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_the_api_module_loads_without_torch() -> None:
    # The server and the CLI name requests and configs before (or without) loading a model.
    probe = "import sys\nimport protoserve.engine.api\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1:] == ["False"], done.stdout[-2000:] + done.stderr[-2000:]


def test_each_public_name_is_exported_once() -> None:
    for module in (api, runtime):
        assert len(set(module.__all__)) == len(module.__all__), module.__name__
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__} lists {missing} but does not define them"
    # One home per name: a light type re-exported by runtime would invite importing torch for it.
    assert not set(api.__all__) & set(runtime.__all__)


def test_all_position_logits_predict_the_engines_greedy_tokens(make_engine, tiny_loaded) -> None:
    prompt = [(13 * i + 5) % 256 for i in range(21)]
    [done] = LLM(engine=make_engine()).run([request("greedy", prompt, 12)])
    generated = list(done.choices[0].token_ids)
    logits = all_position_logits(tiny_loaded.model, prompt + generated)
    assert logits.shape == (len(prompt) + len(generated), TINY_VOCAB)
    # Row i predicts token i + 1: the rows from the prompt's last token on are the greedy choices.
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == generated


def test_all_position_logits_refuses_an_empty_sequence(tiny_loaded) -> None:
    with pytest.raises(ValueError, match="empty"):
        all_position_logits(tiny_loaded.model, [])


def test_timed_fused_steps_records_each_forward_of_the_block_only(make_engine, tiny_loaded) -> None:
    engine = make_engine()
    assert tiny_loaded.model.fused_step is not None, "the tiny model runs on the fused step here"
    prompts = [[(3 * i + 1) % 256 for i in range(5)], [(11 * i + 2) % 256 for i in range(7)]]
    with timed_fused_steps() as calls:
        LLM(engine=engine).run([request(f"r{i}", p, 4) for i, p in enumerate(prompts)])
    # One prefill of both prompts (12 tokens), then a decode step per further token of each.
    assert [c.num_tokens for c in calls] == [12, 2, 2, 2]
    assert [c.mean_seq_len for c in calls] == [6.0, 7.0, 8.0, 9.0]
    assert all(c.seconds > 0 and c.phases == {} for c in calls)
    LLM(engine=engine).run([request("after", prompts[0], 2)])
    assert len(calls) == 4  # the hook is gone with the block


def test_timed_fused_steps_splits_each_call_by_phase(make_engine) -> None:
    with timed_fused_steps(phases=True) as calls:
        LLM(engine=make_engine()).run([request("phases", [1, 2, 3, 4, 5], 3)])
    assert len(calls) == 3
    for call in calls:
        assert list(call.phases) == list(step_phases.PHASES)
        assert all(seconds >= 0 for seconds in call.phases.values())
