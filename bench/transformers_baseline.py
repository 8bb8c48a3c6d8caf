"""The Hugging Face transformers baseline: the same GGUF, ``model.generate`` on static batches.

The model is loaded with ``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=name)`` (transformers dequantizes the same Q4_1 weights to float32,
as our loader does) and run in this process with the same thread count.
Batches are left-padded, greedy, and generate exactly the requested tokens
(``min_new_tokens`` keeps EOS from ending a row early). A batch runs until its
longest request is done: that is how static batching works, and only the
tokens each request asked for count as output.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.timeline import RequestTimeline
from bench.workload import RequestSpec


class _TimingStreamer:
    """A generate() streamer that only notes when each step's tokens arrive.

    generate() first puts the prompt, then one tensor per step (one token per row).
    """

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self.step_times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush: only arrival times are kept."""


class TransformersBaseline:
    """One transformers model and the measurements the harness compares against."""

    def __init__(self, gguf_path: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        # The GGUF conversion draws its own tqdm bar on stderr (not switchable): keep the
        # harness's progress log readable, and show what was captured only if loading fails.
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                self.model: Any = AutoModelForCausalLM.from_pretrained(
                    str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
                ).eval()
        except Exception:
            sys.stderr.write(captured.getvalue()[-4000:])
            raise
        eos = self.model.config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        self.pad_token_id = int(eos if eos is not None else 0)

    def generate_batch(self, specs: Sequence[RequestSpec]) -> list[RequestTimeline]:
        """One static batch: every request sent at the start, tokens timed by the streamer.

        Each row's timeline gets the steps up to its own ``max_tokens``; the
        steps the batch runs beyond that are the padding cost of static batching.
        """
        longest = max(s.prompt_len for s in specs)
        max_new = max(s.max_tokens for s in specs)
        ids = torch.full((len(specs), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(specs), longest), dtype=torch.long)
        for row, spec in enumerate(specs):
            ids[row, longest - spec.prompt_len :] = torch.tensor(spec.prompt_token_ids)
            mask[row, longest - spec.prompt_len :] = 1
        streamer = _TimingStreamer()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self.pad_token_id,
                streamer=streamer,
            )
        end = time.perf_counter()
        timelines = []
        for spec in specs:
            timeline = RequestTimeline(sent=start, prompt_tokens=spec.prompt_len)
            for at in streamer.step_times[: spec.max_tokens]:
                timeline.add_chunk(at, 1)
            # A row is done for its caller when its last wanted token exists; the batch ends later.
            timeline.finish(timeline.chunks[-1][0] if timeline.chunks else end)
            timelines.append(timeline)
        return timelines

    def generate_batches(self, specs: Sequence[RequestSpec], batch_size: int) -> list[RequestTimeline]:
        """Static batches of ``batch_size`` in order, one after another (the offline baseline)."""
        timelines: list[RequestTimeline] = []
        for i in range(0, len(specs), batch_size):
            timelines.extend(self.generate_batch(specs[i : i + batch_size]))
        return timelines
