"""LLM: the small synchronous API: prompts in, finished completions out.

    llm = LLM()                                          # SmolLM2 shipped with the package
    [c] = llm.generate("The capital of France is", max_tokens=8, temperature=0.0)
    print(c.choices[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from protoserve.engine.config import EngineConfig
from protoserve.engine.errors import EngineError
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import Choice, RequestStats, TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams


@dataclass
class Completion:
    """A finished request: its (possibly truncated) prompt size, choices in index order, stats.

    ``error`` is set when the request failed while generating (the choices then hold the output up
    to the failure, with no finish reason).
    """

    request_id: str
    choices: list[Choice]
    num_prompt_tokens: int = 0
    stats: RequestStats | None = None
    error: EngineError | None = None


class LLM:
    """Runs batches of prompts to completion on one LLMEngine."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        dtype: str = "float32",
        quantization: str = "none",
        config: EngineConfig | None = None,
        progress: bool = True,
        engine: LLMEngine | None = None,
    ) -> None:
        self.engine = engine or LLMEngine.from_pretrained(
            model_path, dtype=dtype, quantization=quantization, config=config, progress=progress
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | None = None,
        *,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        sampling: SamplingParams | None = None,
        **sampling_fields,
    ) -> list[Completion]:
        """Generate for every prompt (text, or token ids) at once, batched; results in prompt order.

        Sampling comes from ``sampling`` or from SamplingParams fields given as
        keywords (``max_tokens=8, temperature=0.0, seed=1, stop=["\\n"]``), not both;
        fields not given take SamplingParams' defaults.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give either prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else prompts
            token_lists = [self.tokenizer.encode(t) for t in texts]
        else:
            assert prompt_token_ids is not None
            token_lists = [prompt_token_ids] if prompt_token_ids and isinstance(prompt_token_ids[0], int) \
                else prompt_token_ids  # type: ignore[assignment]
        if sampling is not None and sampling_fields:
            raise ValueError(f"give sampling or SamplingParams fields, not both (got {', '.join(sampling_fields)})")
        params = sampling if sampling is not None else SamplingParams(**sampling_fields)
        requests = [TokenizedRequest(f"llm-{next(self._ids)}", list(ids), replace(params)) for ids in token_lists]
        return self.run(requests)

    def run(self, requests: list[TokenizedRequest]) -> list[Completion]:
        """Add the requests (validation errors raise here), step until all finish; results in request order."""
        for r in requests:
            self.engine.add_request(r)
        done: dict[str, Completion] = {
            r.request_id: Completion(r.request_id, [Choice(i) for i in range(r.sampling.n)]) for r in requests
        }
        pending = set(done)
        while pending:
            for out in self.engine.step():
                completion = done.get(out.request_id)
                if completion is None:
                    continue
                completion.num_prompt_tokens = out.num_prompt_tokens
                for d in out.deltas:
                    completion.choices[d.index].add(d)
                if out.finished:
                    completion.stats = out.stats
                    completion.error = out.error
                    pending.discard(out.request_id)
        return [done[r.request_id] for r in requests]
