"""LLMEngine: continuous batching, one ``step()`` at a time: schedule -> forward -> sample -> postprocess.

Speculative drafts are proposed before the schedule and verified after the forward
(engine/speculative/speculator.py); a request's ``n`` choices fork off its first when the
prompt's logits arrive (engine/scheduling/forks.py).

Single-threaded by design; AsyncEngine drives it from its own thread. It knows
nothing about gRPC: requests come in as TokenizedRequest, results go out as
RequestOutput, refusals as the exceptions in engine.errors.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from protoserve.engine.config import EngineConfig, resolve_max_model_len
from protoserve.engine.errors import ConstraintFailedError, InvalidRequestError, QueueFullError
from protoserve.engine.execution.async_step import OverlappedSteps
from protoserve.engine.kv_offload.offloader import start_offload
from protoserve.engine.loader.load import LoadedModel, load_model
from protoserve.engine.lora.stack import AdapterStack, adapter_problems
from protoserve.engine.parallel.launch import join_tensor_parallel, serve_worker_rank
from protoserve.engine.parallel.runner import make_runner
from protoserve.engine.request import FinishReason, RequestOutput, TokenizedRequest
from protoserve.engine.running_request import RunningRequest
from protoserve.engine.sampling.constraints.compiler import (
    CompiledGrammar,
    ConstraintCompileError,
    GrammarCompiler,
    matcher_error,
)
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.constraints.fast_forward import FastForward
from protoserve.engine.sampling.constraints.grammar_state import GrammarState, advance_grammar
from protoserve.engine.sampling.constraints.masks import MaskFiller
from protoserve.engine.sampling.sampler import Sampler, SampleResult
from protoserve.engine.sampling.sampling_params import ContextPolicy
from protoserve.engine.sampling.stop_checker import check_token_stop
from protoserve.engine.scheduling.admission import AdmittedRequest, fit_to_context, prompt_problems
from protoserve.engine.scheduling.block_manager import BlockManager
from protoserve.engine.scheduling.forks import fork_pending_choices
from protoserve.engine.scheduling.logits_rows import DraftRows, SampleRow, StepRows, take_rows
from protoserve.engine.scheduling.scheduler import ScheduledBatch, Scheduler
from protoserve.engine.scheduling.sequence import Sequence, SequenceStatus
from protoserve.engine.speculative.draft_model import DraftModelProposer
from protoserve.engine.speculative.speculator import Speculator
from protoserve.engine.stats import EngineStats
from protoserve.engine.tracing import RequestSpan

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)


@dataclass
class RequestCounters:
    """Monotonic request and token totals (the scheduler keeps the cache and preemption ones)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    truncated_prompt_tokens: int = 0
    finished: int = 0
    cancelled: int = 0
    # Speculative decoding, as vLLM's spec_decode counters: verifications with drafts, drafted, accepted.
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class LLMEngine:
    """Batches every live request into one forward per step."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.config.validate()
        self.model_config = loaded.config
        self.quantization = loaded.quantization  # as served: "auto" resolved by the loader
        self.num_parameters = loaded.num_parameters
        self.model_summary = loaded.summary()  # family, active parameters, layer pattern (GetModel)
        self.sampling_defaults = loaded.sampling_defaults  # the checkpoint's recommendation; the server applies it
        self.tokenizer = loaded.tokenizer
        loaded.model.set_deterministic(self.config.deterministic)
        loaded.model.set_activation_precision(self.config.activation_precision)
        if loaded.device.type != self.config.device:
            raise ValueError(f"device is {self.config.device!r} but the model was loaded on {loaded.device}: "
                             "load it with load_model(device=...)")
        self.runner = make_runner(loaded.model, loaded.config, self.config, loaded.dtype, loaded.quantization,
                                  loaded.device)
        self.kv_cache_dtype = str(self.runner.kv_dtype).removeprefix("torch.")  # "auto" resolved
        self.adapters: AdapterStack | None = None  # LoRA adapters, once enable_lora is called
        self.max_model_len = resolve_max_model_len(
            self.config, loaded.config.max_position_embeddings, self.runner.num_blocks
        )
        # Every rank builds its engine here, so each shard's rope follows the served context too.
        loaded.model.serve_context(self.max_model_len)
        self.vocab_size = loaded.config.vocab_size
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else []
        self.eos_token_ids = frozenset(tokenizer_eos) | frozenset(loaded.config.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        # Prefix-cache blocks persisted on disk (engine/kv_offload); None without kv_offload_dir.
        self.kv_offload = start_offload(self.config, loaded, self.runner.kv_cache, self.block_manager)
        overlap = self.config.overlaps_steps()
        # Overlapped steps sample on the batched sampler (a device's); so does every step of their engine.
        self.sampler = Sampler(self.eos_token_ids, batch_rows=self.runner.device.type != "cpu" or overlap)
        self.speculator = Speculator(self.config, self.sampler)
        self.fast_forward = FastForward(self.config.grammar_fast_forward, self.sampler,
                                        self.config.token_budget())
        self.requests: dict[str, RunningRequest] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._touched: set[str] = set()  # requests with something to report after this step
        self.counters = RequestCounters()
        self._last_step = (0, 0, 0.0)  # tokens, sequences, seconds
        special = self.tokenizer.all_special_ids if self.tokenizer is not None else []
        self._special_ids = frozenset(special) | self.eos_token_ids
        self._text_vocab = self.tokenizer.vocab_size if self.tokenizer is not None else 0
        self.grammars = (GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
                         if self.tokenizer is not None else None)
        self._masks = MaskFiller(self.grammars.vocab_size) if self.grammars is not None else None
        self.overlap = OverlappedSteps(self) if overlap else None

    def _token_bytes(self, token_id: int) -> bytes:
        """Ids past the tokenizer's vocabulary (padded embeddings) have no text."""
        return self.tokenizer.token_bytes(token_id) if token_id < self._text_vocab else b""

    @classmethod
    def from_pretrained(cls, model_path: str | None = None, *, dtype: str = "float32", quantization: str = "none",
                        config: EngineConfig | None = None, progress: bool = True) -> LLMEngine:
        config = config or EngineConfig()
        shard = join_tensor_parallel(model_path, dtype, quantization, config)  # engine/parallel; None at TP=1
        loaded = load_model(model_path, dtype=dtype, quantization=quantization, progress=progress,
                            deterministic=config.deterministic, device=config.device, shard=shard,
                            group_size=config.quant_group_size)
        engine = cls(loaded, config)
        serve_worker_rank(engine)  # a rank other than 0 serves rank 0's steps here, then exits
        if config.speculative_model is not None:
            path = None if config.speculative_model == "default" else config.speculative_model
            engine.enable_draft_model(load_model(path, dtype=dtype, quantization=config.speculative_model_quantization,
                                                 progress=progress, deterministic=config.deterministic,
                                                 load_tokenizer=False))
        return engine

    def enable_draft_model(self, draft: LoadedModel) -> None:
        """Serve speculative method "draft" with ``draft`` (same vocabulary), its KV pool as large as ours."""
        if draft.config.vocab_size != self.vocab_size:
            raise ValueError(f"speculative_model has a vocabulary of {draft.config.vocab_size} tokens, the model "
                             f"{self.vocab_size}: a draft model must share the target's tokenizer")
        self.speculator.draft_proposer = DraftModelProposer(draft, self.config.block_size, self.runner.num_blocks)

    def enable_lora(self, max_loras: int) -> AdapterStack:
        """Serve LoRA adapters from ``max_loras`` slots (engine/lora); returns the stack to load them into."""
        if self.config.device != "cpu":
            raise ValueError(f"LoRA adapters are served on device cpu only, not {self.config.device!r}")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served with tensor_parallel_size > 1 "
                             f"(it is {self.config.tensor_parallel_size})")
        if self.adapters is None:
            self.adapters = AdapterStack(self.model_config, self.runner.model.dtype, max_loras)
            self.runner.model.adapters = self.adapters
            self.runner.lora_slots_of = self._lora_slots
        return self.adapters

    def _lora_slots(self, seqs: list[Sequence]) -> list[int]:
        return [self.adapters.slot_of(self.requests[s.request_id].request.adapter) for s in seqs]

    # -- requests ------------------------------------------------------------

    def prepare(self, request: TokenizedRequest) -> AdmittedRequest:
        """Validate (the parameters only when the caller has not: ``sampling_checked``), compile the
        constraint and apply the context policy.

        Touches no engine state but the thread-safe grammar cache, so any thread may call it; a
        constraint seen for the first time compiles here, on the caller's thread, not the step's.
        """
        sp = request.sampling
        bad = [] if request.sampling_checked else sp.validate(self.vocab_size)
        prompt = list(request.prompt_token_ids)
        bad.extend(prompt_problems(prompt, self.vocab_size))
        bad.extend(adapter_problems(self.adapters, request.adapter))
        spec = sp.speculative
        if spec is not None and spec.method == "draft" and self.speculator.draft_proposer is None:
            bad.append(("speculative.method", "\"draft\" needs a draft model, and this server has none "
                                              "(serve --speculative-model)"))
        if sp.n > self.config.max_num_seqs:  # its choices could never run together
            bad.append(("n", f"must not exceed the engine's max_num_seqs ({self.config.max_num_seqs})"))
        if bad:
            raise InvalidRequestError(bad)
        fitted = fit_to_context(prompt, ContextPolicy(request.context_policy), self.max_model_len, sp.max_tokens)
        grammar = self.compile_constraint(sp.constraint)
        return AdmittedRequest(request, fitted, grammar)

    def compile_constraint(self, constraint: Constraint | None) -> CompiledGrammar | None:
        """The compiled grammar of ``constraint`` (cached); InvalidRequestError on ``constraint.<kind>``
        when it does not compile. Thread-safe: the server compiles ahead, off its event loop."""
        if constraint is None:
            return None
        if self.grammars is None:
            raise InvalidRequestError([(constraint.field, "needs a tokenizer, and this model has none")])
        try:
            return self.grammars.compile(constraint)
        except ConstraintCompileError as exc:
            raise InvalidRequestError([(exc.field, exc.message)]) from None

    def add_request(self, request: TokenizedRequest | AdmittedRequest) -> list[str]:
        """Queue a request; raises InvalidRequestError, ContextLengthError or QueueFullError.

        At a full waiting queue a request may take the place of another tenant's that never ran
        (scheduling/queue_shedding.py): the ids of the requests so refused are returned, gone from
        the engine; their callers are owed a QueueFullError.
        """
        prepared = request if isinstance(request, AdmittedRequest) else self.prepare(request)
        req, fitted = prepared.request, prepared.fitted
        if req.request_id in self.requests:
            raise InvalidRequestError([("request_id", f"request {req.request_id!r} is already running")])
        # The adapter first: a refusal for want of a slot must come before another request is shed.
        if req.adapter is not None:  # pinned until the request leaves (_retire)
            self.adapters.acquire(req.adapter)
        shed = []
        if len(self.scheduler.waiting) >= self.config.max_queue:
            victim = self.scheduler.shed_for(req.tenant)
            if victim is None:
                self._release_adapter(req)
                raise QueueFullError(len(self.scheduler.waiting))
            shed.append(self._drop_shed(victim.request_id))
        state = RunningRequest(req, fitted.prompt_token_ids, fitted.truncated, self._token_bytes, self._special_ids)
        if req.trace is not None:
            state.span = RequestSpan(req.trace, req, len(fitted.prompt_token_ids),
                                     lambda: self._prompt_text(fitted.prompt_token_ids))
        matcher = prepared.grammar.new_matcher() if prepared.grammar is not None else None
        seq = self._new_seq(state, 0, fitted.max_len, matcher=matcher)
        seq.num_pending_forks = req.sampling.n - 1
        self.requests[req.request_id] = state
        if self.kv_offload is None or not self.kv_offload.park(seq):  # parked: its prefix comes off disk first
            self.scheduler.add(seq)
        self.counters.prompt_tokens += len(fitted.prompt_token_ids)
        self.counters.truncated_prompt_tokens += fitted.truncated
        return shed

    def _drop_shed(self, request_id: str) -> str:
        """Forget a request the scheduler shed from the waiting queue (it never ran: nothing to output)."""
        state = self.requests.pop(request_id)
        if state.span is not None:
            state.span.shed()
        self._release_adapter(state.request)
        self._touched.discard(request_id)
        return request_id

    def _release_adapter(self, req: TokenizedRequest) -> None:
        """Unpin the request's adapter (pinned by add_request), so its slot may be reused."""
        if req.adapter is not None:
            self.adapters.release(req.adapter)

    def _prompt_text(self, token_ids: list[int]) -> str:
        """The prompt as text, for traces that opted in to content capture."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _new_seq(self, state: RunningRequest, index: int, max_len: int, arrival: int | None = None,
                 matcher: LLMatcher | None = None) -> Sequence:
        req = state.request
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=req.request_id, index=index,
            token_ids=list(state.prompt_token_ids), num_prompt_tokens=len(state.prompt_token_ids),
            max_len=max_len, sampling=req.sampling, generator=state.generators[index], priority=req.priority,
            arrival_order=next(self._arrivals) if arrival is None else arrival,
            cache_salt=self.adapters.cache_salt(req.cache_salt, req.adapter) if req.adapter else req.cache_salt,
            tenant=req.tenant, matcher=matcher, mirostat_mu=2.0 * req.sampling.mirostat_tau,
        )
        state.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks now; its final output comes from the next step()."""
        state = self.requests.get(request_id)
        if state is None or state.finished:
            return False
        for seq in state.seqs:
            parked = self.kv_offload is not None and self.kv_offload.drop(seq)
            if parked and seq.num_preemptions == 0:  # parked on arrival: the scheduler never had it
                seq.status = SequenceStatus.FINISHED
            elif not seq.is_finished:
                self.scheduler.finish(seq)
        state.cancel()
        self.counters.cancelled += 1
        self._touched.add(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.overlap is not None:  # async scheduling (engine/execution/async_step.py)
            return self.overlap.step()
        start = time.monotonic()
        batch = self._schedule(start)
        self._run(batch)
        return self._end_step(batch, start)

    def _schedule(self, start: float) -> ScheduledBatch:
        if self.kv_offload is not None:  # prefix blocks evicted to disk come back first (engine/kv_offload)
            self.kv_offload.park_preempted(self.scheduler)
            self.kv_offload.hand_back(self.scheduler)
        self.speculator.propose(self.scheduler.running)
        self.fast_forward.propose(self.scheduler.running)
        batch = self.scheduler.schedule()  # drops the drafts it cannot schedule
        self._note_schedule(batch, start)
        return batch

    def _run(self, batch: ScheduledBatch) -> None:
        """Forward, sample and postprocess one scheduled batch, the host waiting for the device."""
        if batch.is_empty:
            return
        rows = StepRows.of(batch)
        masks = self._start_masks(rows.plain)
        forced_masks = self._start_forced_masks(rows.drafted)
        logits = self.runner.execute(batch.seqs, batch.num_new_tokens)
        self.scheduler.finish_step(batch)
        seqs, samples = self._sample(rows.plain, logits, masks)
        self._postprocess(seqs, samples)
        self._verify_drafts(rows.drafted, logits, forced_masks)

    def _end_step(self, batch: ScheduledBatch, start: float) -> list[RequestOutput]:
        self._last_step = (batch.num_tokens, len(batch.seqs), time.monotonic() - start)
        return self._collect_outputs()

    def close(self) -> None:
        """After the last step: persist the prefix cache's blocks (kv_offload_dir) and release the runner."""
        if self.kv_offload is not None:
            self.kv_offload.persist()
        self.runner.close()

    def _note_schedule(self, batch: ScheduledBatch, now: float) -> None:
        """Note on each request what the scheduler did to its sequences: preempted, or scheduled."""
        for seq in batch.preempted:
            self.requests[seq.request_id].note_preempted()
        for seq in batch.seqs:
            state = self.requests[seq.request_id]
            state.note_scheduled(now, batch.prefix_hit_tokens.get(seq.seq_id) if seq.index == 0 else None)
            state.note_blocks(self.runner.block_bytes)

    def _start_masks(self, plain: list[SampleRow]) -> Future[torch.Tensor] | None:
        """Start filling the grammar masks of this step's constrained rows; they fill while the forward runs.

        A row's mask depends only on its matcher, which took last step's token already; the
        choices forked off a row this step start at the grammar's start, as the row itself does.
        """
        if self._masks is None or all(r.seq.matcher is None for r in plain):
            return None
        return self._masks.start([r.seq.matcher for r in plain])

    def _start_forced_masks(self, drafted: list[DraftRows]) -> Future[list[torch.Tensor]] | None:
        """Start filling the grammar masks of the rows verifying forced tokens (constrained rows' drafts are
        theirs: sampling/constraints/fast_forward.py), one per logits row, while the forward runs."""
        jobs = [(r.seq.matcher, r.seq.token_ids[-r.seq.num_draft_tokens :]) for r in drafted
                if r.seq.matcher is not None]
        return self._masks.start_drafted(jobs) if jobs and self._masks is not None else None

    def _sample(self, plain: list[SampleRow], logits: torch.Tensor,
                masks: Future[torch.Tensor] | None) -> tuple[list[Sequence], list[SampleResult]]:
        """One token for each plain row, and for each choice forked off it (scheduling/forks.py)."""
        bitmask = masks.result() if masks is not None else None  # before forks copy the matchers it reads
        rows = fork_pending_choices(plain, self.scheduler, self._new_choice)
        seqs = [r.seq for r in rows]
        row_masks = bitmask[[r.mask_row for r in rows]] if bitmask is not None else None
        return seqs, self.sampler(take_rows(logits, [r.logits_row for r in rows]), seqs, row_masks)

    def _new_choice(self, parent: Sequence, index: int, matcher: LLMatcher | None) -> Sequence:
        return self._new_seq(self.requests[parent.request_id], index, parent.max_len, arrival=parent.arrival_order,
                             matcher=matcher)

    def _verify_drafts(self, drafted: list[DraftRows], logits: torch.Tensor,
                       forced_masks: Future[list[torch.Tensor]] | None) -> None:
        """Emit what verification keeps of each row's drafts (engine/speculative/speculator.py; a constrained
        row's are its forced tokens, verified under its grammar's masks), count it, and give back the K/V
        written for the rejected ones."""
        masks = iter(forced_masks.result() if forced_masks is not None else ())
        for row in drafted:
            seq = row.seq
            emit = partial(self._emit, now=time.monotonic())
            if seq.matcher is not None:
                self.fast_forward.verify(seq, logits[row.rows], next(masks), emit)
            else:
                verdict = self.speculator.verify(seq, logits[row.rows], emit)
                verdict.count_into(self.counters)
                verdict.count_into(self.requests[seq.request_id].stats)
            if not seq.is_finished:
                self.scheduler.rollback_drafts(seq)

    def _postprocess(self, seqs: list[Sequence], samples: list[SampleResult]) -> None:
        now = time.monotonic()
        for seq, sample in zip(seqs, samples, strict=True):
            self._emit(seq, sample, now)

    def _emit(self, seq: Sequence, sample: SampleResult, now: float) -> None:
        """Append a sampled token to its choice's output and end the choice where the token stops it."""
        if seq.is_finished:  # its request failed earlier in this step
            return
        state = self.requests[seq.request_id]
        choice = state.choices[seq.index]
        token = sample.token_id
        token_stop = check_token_stop(token, seq.num_generated + 1, seq.sampling, self.eos_token_ids)
        grammar: GrammarState = "open"
        if seq.matcher is not None:
            grammar = advance_grammar(seq.matcher, token, consume=token_stop is None)
            if grammar == "failed":
                self._fail_grammar(seq)
                return
        seq.append_token(token)
        state.note_token(now)
        self.counters.generation_tokens += 1
        self._touched.add(seq.request_id)
        stop_string = choice.add_token(token, sample.logprobs, render=token_stop is None)
        if token_stop is not None:
            self._finish(seq, *token_stop)
        elif stop_string is not None:
            self._finish(seq, FinishReason.STOP, stop_string)
        elif grammar == "complete":
            self._finish(seq, FinishReason.STOP)
        elif seq.num_tokens >= seq.max_len:
            self._finish(seq, FinishReason.LENGTH)

    def _fail_grammar(self, seq: Sequence) -> None:
        """End the sequence's request with the grammar engine's failure (a limit hit on the path the
        output took: the mask only allows what the grammar allows). Its other choices end with it, the
        token that failed is not output, and the compiled grammar is dropped from the cache, as the
        failure leaves its shared lexer unusable for later requests."""
        state = self.requests[seq.request_id]
        constraint = seq.sampling.constraint
        assert constraint is not None and self.grammars is not None and seq.matcher is not None
        reason = matcher_error(seq.matcher)
        tokens = f"{seq.num_generated} output token{'' if seq.num_generated == 1 else 's'}"
        log.info("request %s: its grammar failed after %s (%s); ending the request", seq.request_id, tokens, reason)
        message = f"the grammar engine hit one of its limits after {tokens} ({reason}); the request was ended there"
        for other in state.seqs:
            if not other.is_finished:
                self.scheduler.finish(other)
        state.fail(ConstraintFailedError([(state.request.constraint_field or constraint.field, message)]))
        self._touched.add(seq.request_id)
        self.grammars.forget(constraint)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.scheduler.finish(seq)
        state = self.requests[seq.request_id]
        state.choices[seq.index].finish(reason, stop_reason)

    def _collect_outputs(self) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        # The least-served callers' outputs first: a busy server's event loop writes them first, so one
        # caller's many streams do not delay another's first token (the order is fixed: rank, then id).
        rank = self.scheduler.fair.rank
        for request_id in sorted(self._touched, key=lambda rid: (rank(self.requests[rid].request.tenant), rid)):
            state = self.requests[request_id]
            out = state.make_output(now)
            if out is None:
                continue
            outputs.append(out)
            if state.span is not None:
                state.span.output(out)
            if out.finished:
                self._retire(state, out)
        self._touched.clear()
        return outputs

    def _retire(self, state: RunningRequest, last: RequestOutput) -> None:
        """The request's last output is out: its trace span ends, the engine forgets it, its adapter is unpinned."""
        if state.span is not None:
            state.span.finish(last.stats, [c.finish_reason for c in state.choices], last.error)
        del self.requests[state.request.request_id]
        self._release_adapter(state.request)
        if not state.cancelled:
            self.counters.finished += 1

    # -- stats ---------------------------------------------------------------

    def stats(self) -> EngineStats:
        total = self.block_manager.num_blocks
        free = self.block_manager.num_free_blocks
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting} - running
        if self.kv_offload is not None:
            waiting |= self.kv_offload.parked_request_ids()
        c = self.scheduler.counters
        tokens, seqs, seconds = self._last_step
        return EngineStats(
            running=len(running), waiting=len(waiting), kv_blocks_total=total, kv_blocks_free=free,
            kv_usage=1.0 - free / total, prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits, preemptions_total=c.preemptions,
            fair_preemptions_total=c.fair_preemptions,
            prompt_tokens_total=self.counters.prompt_tokens, generation_tokens_total=self.counters.generation_tokens,
            truncated_prompt_tokens_total=self.counters.truncated_prompt_tokens,
            requests_finished_total=self.counters.finished, requests_cancelled_total=self.counters.cancelled,
            num_steps=self.scheduler.num_steps, last_step_tokens=tokens, last_step_seqs=seqs,
            last_step_time_s=seconds, spec_decode_num_drafts=self.counters.spec_num_drafts,
            spec_decode_num_draft_tokens=self.counters.spec_draft_tokens,
            spec_decode_num_accepted_tokens=self.counters.spec_accepted_tokens,
            grammar_ff_draft_tokens=self.fast_forward.counts.draft_tokens,
            grammar_ff_accepted_tokens=self.fast_forward.counts.accepted_tokens,
        )

