"""The engine: schedule -> build the ragged batch -> forward -> sample -> update. No I/O.

``Engine.step()`` runs one forward pass over whatever the scheduler planned and returns
what each touched request produced. Callers (the pipeline, the server loop) add requests,
call ``step`` while ``has_unfinished()``, and collect finished requests with ``response``.
Its drivers' view of it is :class:`fastgen.engine_protocol.StepEngine`.

Seams: ``new_pool`` shapes every KV pool for this model (the engine's, and private ones for
evaluation and benchmarks); ``forward_observer`` (None by default) sees each forward's seconds.

Size: about 450 lines, over the house's ~400, on purpose: the request table (``_requests``),
the step (plan -> batch -> forward -> sample -> commit) and the request lifecycle (add, abort,
finish, response) all write that one table, which is the engine's to own; split across modules,
each part would reach into the others' state.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .batch import SeqInput, build_batch
from .cache import BlockAllocator, KVPool, root_hash
from .calibrate import BudgetChoice, calibrate_engine_budget
from .config import EngineConfig, EngineOptions, resolve_engine_config, wants_native_kernels
from .errors import InvalidRequestError, PromptTooLongError, RankFailedError
from .generation_defaults import read_generation_defaults
from .kernels import load_in_background as load_kernels_in_background
from .model.llama import ModelConfig
from .model.spec import local_kv_heads
from .model.loader import load_hf_config, load_model, load_tokenizer, resolve_model_path
from .request import FinishReason, Request, Response, SamplingParams, TokenLogprob
from .row_limits import RowLimits, calibrate_row_limits
from .sampling import NO_TOKEN, SamplingRow, argmax_decides, argmax_tokens, sample
from .scheduler import StepPlan, make_scheduler
from .structured import GrammarCompiler, grammar_bias
from .telemetry import EventKind, EventLog, RequestEvent, RequestProgress, StepRecord
from .text import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What one request produced in one step (possibly nothing, if its prompt is still being split)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...] = ()   # of new_token_ids, when the request asked for them


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_used_blocks: int
    num_preemptions: int
    last_step_prompt_tokens: int
    last_step_decode_tokens: int
    num_cached_free_blocks: int = 0       # prefix caching: unreferenced blocks kept for hits
    prefix_queried_tokens: int = 0        # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0            # of those, found cached


def _apply_cuda_graphs_option(model: torch.nn.Module, on: bool) -> None:
    """The engine option ``cuda_graphs`` (EngineConfig) on a model that can run its steps as CUDA
    graphs (fastgen/model/cuda_graphs.py); other models have no such steps."""
    if hasattr(model, "_step_graphs"):
        model.__dict__["use_cuda_graphs"] = on


class Engine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer: Any,
                 model_config: ModelConfig) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        cache = config.cache
        _apply_cuda_graphs_option(model, config.cuda_graphs)
        self.pool = self.new_pool(cache.num_blocks)
        if getattr(model, "uses_cuda_graphs", False):   # CUDA graphs of steps, made now for this pool
            model._step_graphs().capture_all(self.pool, config.scheduler.max_seqs, config.scheduler.budget_tokens)
        # Benchmarks' seam: called with the seconds of each model forward (device-synchronised).
        # None (the default) costs one attribute test per step.
        self.forward_observer: Callable[[float], None] | None = None
        self.allocator = BlockAllocator(cache.num_blocks)
        self.scheduler = make_scheduler(config.scheduler, self.allocator, cache.block_size,
                                        prefix_caching=cache.prefix_caching)
        # what separates this engine's cached blocks from any other model's, before tenant and salt
        self._cache_model_key = f"{config.model_path}|{config.dtype}|{config.quantization}"
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, TextStream] = {}
        self._ids = itertools.count()
        self._generator = torch.Generator().manual_seed(secrets.randbits(63))
        self._num_preemptions = 0
        self._last_step = (0, 0)
        # constrained requests whose grammar is compiling: they join the scheduler when it is ready
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future]] = {}
        self.grammars = GrammarCompiler(tokenizer, model_config.vocab_size, list(self.eos_token_ids))
        self.budget_choice: BudgetChoice | None = None   # set when budget_tokens="auto" was measured
        self.row_limits: RowLimits | None = None         # set when the kernels' row limits were measured
        self.events = EventLog()          # per-step records and request lifecycle events (telemetry.py)
        self.generation_defaults = None   # GenerationDefaults of the model's files, set by from_pretrained

    def new_pool(self, num_blocks: int, kv_dtype: str | None = None) -> KVPool:
        """A KV pool of ``num_blocks`` shaped for this engine's model (its layers, the KV heads this
        rank holds, head dim, dtype, device, block size): the engine's own, or a private one for
        direct forwards (evaluation, benchmarks) that leaves the engine's blocks alone; ``kv_dtype``
        another storage than the engine's ``kv_cache_dtype`` (a benchmark's comparison)."""
        mc, cfg = self.model_config, self.config
        # a spare block for the padding rows of CUDA-graphed steps (fastgen/model/cuda_graphs.py)
        spare = 1 if getattr(self.model, "uses_cuda_graphs", False) else 0
        return KVPool.for_model(mc, num_kv_heads=local_kv_heads(self.model, mc), num_blocks=num_blocks,
                                block_size=cfg.cache.block_size, dtype=cfg.dtype, device=cfg.device,
                                spare_blocks=spare, kv_dtype=kv_dtype or cfg.kv_cache_dtype)

    @classmethod
    def from_pretrained(cls, model: str | None = None, **options: Any) -> "Engine":
        """Load ``model`` (a HF folder or .gguf file; None = the embedded SmolLM2) and build an engine."""
        opts = EngineOptions.from_kwargs(options)
        path = resolve_model_path(model)
        if wants_native_kernels(opts.kernels, opts.device):
            load_kernels_in_background()   # a first build overlaps the metadata's conversion
        hf_config = load_hf_config(path)
        model_config = ModelConfig.from_hf(hf_config)
        config = resolve_engine_config(path, opts, kv_elems_per_token=model_config.kv_elems_per_token,
                                       head_dim=model_config.head_dim,
                                       model_max_len=model_config.max_position_embeddings)
        torch.set_num_threads(config.num_threads)
        if config.tensor_parallel_size > 1:
            from .parallel.replica import start_replica

            net, config = start_replica(path, config, hf_config)   # rank 0 of N; threads per rank
        else:
            net = load_model(path, dtype=config.dtype, device=config.device,
                             max_positions=config.max_model_len, hf_config=hf_config, kernels=config.kernels,
                             quantization=config.quantization, int8_activations=config.int8_activations)
        try:
            # which kernel takes how many rows, measured for this host (before the budget's curve,
            # which runs through them)
            row_limits = calibrate_row_limits(net, config) if config.tensor_parallel_size == 1 else None
            _apply_cuda_graphs_option(net, config.cuda_graphs)   # the budget's curve runs as steps will
            budget = None
            if opts.budget_tokens == "auto":
                budget = calibrate_engine_budget(net, model_config, config, opts.target_itl_ms,
                                                 "" if row_limits is None else row_limits.key)
                config = dataclasses.replace(
                    config, scheduler=dataclasses.replace(config.scheduler, budget_tokens=budget.budget_tokens))
            engine = cls(config, net, load_tokenizer(path), model_config)
        except BaseException:
            close = getattr(net, "close", None)
            if close is not None:
                close()
            raise
        engine.budget_choice = budget
        engine.row_limits = row_limits
        engine.generation_defaults = read_generation_defaults(path)
        return engine

    # -- requests ---------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, *, tenant: str | None = None,
                    cache_salt: str | None = None) -> str:
        """Validate and queue a request. Raises :class:`InvalidRequestError` naming the problem.

        With prefix caching, a request reuses cached blocks only of requests with the same
        ``tenant`` (the server passes one per API key) and the same ``cache_salt``."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        prompt_ids, prompt_text = self._tokenize(prompt)
        n = len(prompt_ids)
        limit = min(self.config.max_model_len, params.max_length or self.config.max_model_len)
        if n >= limit:
            why = f"max_model_len={self.config.max_model_len}" + (
                "" if params.max_length is None else f", max_length={params.max_length}")
            raise PromptTooLongError(
                f"prompt has {n} tokens; the limit is {limit - 1} so that at least one token can be "
                f"generated ({why})", param="prompt")
        max_total_tokens = min(limit, n + params.max_new_tokens)
        capacity = self.config.cache.num_blocks * self.config.cache.block_size
        if max_total_tokens - 1 > capacity:  # the last generated token is never fed back
            raise PromptTooLongError(
                f"request needs up to {max_total_tokens - 1} KV slots but the whole KV pool holds {capacity}; "
                f"lower max_new_tokens or enlarge the pool", param="max_new_tokens")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:  # a caller chose this name
                request_id = f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        req = Request(request_id=request_id, prompt_token_ids=prompt_ids, params=params,
                      max_total_tokens=max_total_tokens, prompt_text=prompt_text,
                      generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
                      logprobs=[] if params.logprobs is not None else None,
                      prompt_logprobs=[] if params.prompt_logprobs is not None else None,
                      cache_root=root_hash(self._cache_model_key, tenant, cache_salt))
        self._requests[request_id] = req
        self._texts[request_id] = TextStream(self.tokenizer.backend_tokenizer, params.stop)
        spec = params.structured
        if spec is None:
            self.scheduler.add(req)
        else:
            self._compiling[request_id] = (req, self.grammars.submit(spec))
        self._event(EventKind.ARRIVED, req)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            if not ids:
                raise InvalidRequestError("prompt is empty after tokenization", param="prompt")
            if max(ids) >= self.model_config.vocab_size:
                raise InvalidRequestError("the tokenizer produced ids beyond the model's vocabulary "
                                          "(added tokens the model has no embedding for)", param="prompt")
            return list(ids), prompt
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("prompt token list is empty", param="prompt")
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
            return list(prompt), None
        raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                  param="prompt")

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request now (cancelled, or past its deadline with ``FinishReason.TIMEOUT``);
        its blocks are freed at once. Unknown or finished ids are ignored."""
        req = self._requests.get(request_id)
        if req is not None and not req.is_finished:
            self._finish(req, reason)

    def close(self) -> None:
        """Release what outlives the process's objects: a tensor-parallel replica's other ranks
        (they exit). Idempotent; an engine without them has nothing to release."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling)

    def response(self, request_id: str) -> Response:
        """The finished request's :class:`Response`; forgets the request."""
        req = self._requests[request_id]
        if not req.is_finished:
            raise InvalidRequestError(f"request {request_id!r} has not finished", param="request_id")
        del self._requests[request_id]
        text = self._texts.pop(request_id).text
        if req.params.return_full_text:
            prompt = req.prompt_text if req.prompt_text is not None else self.tokenizer.decode(req.prompt_token_ids)
            text = prompt + text
        return Response(
            request_id=request_id, generated_text=text, token_ids=tuple(req.output_token_ids),
            prompt_length=req.num_prompt_tokens, generated_length=req.num_output_tokens,
            finish_reason=req.finish_reason, timings=req.timings(),
            logprobs=None if req.logprobs is None else tuple(req.logprobs),
            prompt_logprobs=None if req.prompt_logprobs is None else tuple(req.prompt_logprobs),
            num_preemptions=req.num_preemptions, error=req.error, num_cached_tokens=req.num_cached_tokens)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=self.scheduler.num_waiting + len(self._compiling), num_running=self.scheduler.num_running,
            num_free_blocks=self.allocator.num_free_blocks, num_used_blocks=self.allocator.num_used_blocks,
            num_preemptions=self._num_preemptions, last_step_prompt_tokens=self._last_step[0],
            last_step_decode_tokens=self._last_step[1],
            num_cached_free_blocks=self.allocator.num_cached_free_blocks,
            prefix_queried_tokens=self.scheduler.queues.prefix_queried_tokens,
            prefix_hit_tokens=self.scheduler.queues.prefix_hit_tokens)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        failed = self._admit_compiled()
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        self._num_preemptions += len(plan.preempted_ids)
        if not plan.chunks:
            if not failed and self._compiling:  # nothing to run but grammars to wait for
                concurrent.futures.wait([f for _, f in self._compiling.values()], timeout=self.COMPILE_WAIT_S,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return failed
        try:
            return failed + self._run(plan)
        finally:
            if self.events.enabled:
                self._record_step(plan, start)

    COMPILE_WAIT_S = 0.05   # an idle engine waits this long for a grammar before step() returns

    def _forward(self, batch, greedy: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The model's logits for ``batch`` and, when ``greedy`` (every row samples by plain argmax:
        sampling.argmax_decides) and the head's kernel takes it, each logits row's argmax and its
        value (``forward_greedy``, where the model says its head ``fuses_greedy``); timed for
        ``forward_observer`` where one is set."""
        t0 = time.perf_counter()
        if greedy and getattr(self.model, "fuses_greedy", False):
            logits, choice = self.model.forward_greedy(batch, self.pool)
        else:
            logits, choice = self.model(batch, self.pool), None
        if self.forward_observer is not None:
            if self.config.device.type == "cuda":
                torch.cuda.synchronize(self.config.device)
            self.forward_observer(time.perf_counter() - t0)
        return logits, choice

    def _admit_compiled(self) -> list[StepOutput]:
        """Hand requests whose grammar has compiled to the scheduler; end those whose compile failed."""
        failed = []
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                req.grammar_state = self.grammars.matcher(future.result(), req.params.structured)
            except Exception as e:  # InvalidRequestError naming the constraint, or xgrammar's own
                failed.append(self._finish(req, FinishReason.ERROR, str(e)))
                continue
            self.scheduler.add(req)
        return failed

    def _run(self, plan: StepPlan) -> list[StepOutput]:
        reqs = [self._requests[c.request_id] for c in plan.chunks]
        want_prompt_lp = [r.needs_prompt_logprobs for r in reqs]
        seqs = [self._seq_input(r, c.num_tokens, w) for r, c, w in zip(reqs, plan.chunks, want_prompt_lp)]
        num_decode = sum(1 for r in reqs if r.is_decoding)
        self._last_step = (plan.num_tokens - num_decode, num_decode)
        now = time.perf_counter()
        for r in reqs:
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
                self._event(EventKind.SCHEDULED, r)
        samplers = [(i, r) for i, (r, c) in enumerate(zip(reqs, plan.chunks))
                    if r.num_computed_tokens + c.num_tokens == r.num_tokens]
        masks = self._fill_masks(samplers)
        srows = self._sampling_rows(samplers)
        # every row that samples takes its logits' plain argmax, and no other row wants logits:
        # the head's kernel may take the argmax inside the product (Engine._forward)
        greedy = bool(srows) and not any(want_prompt_lp) and all(argmax_decides(s) for s in srows)
        try:
            batch = build_batch(seqs, self.config.cache.block_size, self.config.device)
            logits, choice = self._forward(batch, greedy)      # [num_logits, vocab] fp32
            rows: dict[int, torch.Tensor] = {}
            row = 0
            for i in batch.order:
                rows[i] = logits[row:row + seqs[i].num_logits]
                row += seqs[i].num_logits
            for i, r in enumerate(reqs):
                if want_prompt_lp[i]:
                    self._record_prompt_logprobs(r, r.num_computed_tokens, rows[i])
            if choice is not None:   # no prompt logprobs: one logits row a sampler, in batch order
                tokens = dict(zip((i for i in batch.order if seqs[i].num_logits), argmax_tokens(*choice)))
                sampled = ([tokens[i] for i, _ in samplers], [None] * len(samplers))
            else:
                sampled = self._sample(samplers, srows, rows, masks) if samplers else ([], [])
        except RankFailedError as e:  # a tensor-parallel rank is gone: this replica cannot serve on
            log.error("%s", e)
            self._step_failed = True
            for r in reqs:
                self._finish(r, FinishReason.ERROR, str(e))
            raise
        except Exception as e:  # a step-wide failure: fail this step's requests, keep serving
            log.exception("step failed")
            self._step_failed = True
            return [self._finish(r, FinishReason.ERROR, f"step failed: {e}") for r in reqs]

        tokens, lps = sampled
        self.scheduler.commit(plan, {r.request_id: tok for (_, r), tok in zip(samplers, tokens)})
        outputs = [StepOutput(r.request_id, (), "", None) for r in reqs if r.num_computed_tokens < r.num_tokens]
        now = time.perf_counter()
        for (i, r), tok, lp in zip(samplers, tokens, lps):
            if tok == NO_TOKEN:  # nothing to sample: this request ends, its batch mates go on
                r.output_token_ids.pop()
                outputs.append(self._finish(r, FinishReason.ERROR, self._no_token_error(r, rows[i][-1])))
                continue
            try:
                outputs.append(self._after_token(r, tok, lp, now))
            except Exception as e:  # e.g. a detokenizer failure: only this request ends
                log.exception("request %s failed", r.request_id)
                outputs.append(self._finish(r, FinishReason.ERROR, str(e)))
        return outputs

    def _no_token_error(self, r: Request, raw_logits: torch.Tensor) -> str:
        """The error of a request that sampling left no token (sampling.NO_TOKEN), with what the
        step knew: how many of the model's logits were finite and, under an output constraint,
        how many tokens the constraint allowed."""
        finite = int(torch.isfinite(raw_logits).sum())
        why = f"the model's logits hold {finite} finite values of {raw_logits.numel()}"
        if r.grammar_state is not None:
            allowed = int((grammar_bias([(0, r.grammar_state)], r.grammar_state.vocab_size)[0] == 0).sum())
            why += f"; the output constraint allows {allowed} tokens after {r.grammar_state.num_accepted} generated"
        log.warning("request %s: no token to sample (%s); params %s", r.request_id, why, r.params)
        return f"no token could be sampled: every candidate is -inf or NaN after the output constraint and penalties ({why})"

    @staticmethod
    def _seq_input(r: Request, n: int, want_prompt_logprobs: bool) -> SeqInput:
        start = r.num_computed_tokens
        samples = start + n == r.num_tokens
        num_logits = n if want_prompt_logprobs else int(samples)
        return SeqInput(r.token_ids_slice(start, start + n), start, r.block_ids, num_logits)

    def _record_prompt_logprobs(self, r: Request, start: int, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens that ``logits`` (rows for positions ``start``...) predict."""
        first = len(r.prompt_logprobs) + 1                # next prompt position without a logprob
        stop = min(start + logits.shape[0] + 1, r.num_prompt_tokens)
        if first >= stop or first < start + 1:
            return
        lp = torch.log_softmax(logits[first - start - 1:stop - start - 1], dim=-1)  # rows predicting first..stop-1
        targets = r.prompt_token_ids[first:stop]
        chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(1).tolist()
        k = r.params.prompt_logprobs
        tops: list[dict[int, float]] = [{} for _ in targets]
        if k:
            vals, ids = lp.topk(k, dim=-1)
            tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        r.prompt_logprobs.extend(TokenLogprob(t, c, top) for t, c, top in zip(targets, chosen, tops))

    def _fill_masks(self, samplers: list[tuple[int, Request]]) -> concurrent.futures.Future | None:
        """Start computing the grammar masks of the constrained rows that sample this step, on the
        mask thread while the forward pass runs. Only sampling rows get one: a prompt chunk
        that does not end its prompt neither reads nor advances its matcher."""
        states = [(j, r.grammar_state) for j, (_, r) in enumerate(samplers) if r.grammar_state is not None]
        if not states:
            return None
        assert all(r.grammar_state is None or r.grammar_state.num_accepted == r.num_output_tokens
                   for _, r in samplers), "a matcher has accepted exactly the generated tokens"
        return self.grammars.bias_async(states)

    def _sampling_rows(self, samplers: list[tuple[int, Request]]) -> list[SamplingRow]:
        return [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.generator,
                            tuple(self.eos_token_ids) if r.num_output_tokens < r.params.min_new_tokens else (),
                            r.grammar_state)
                for _, r in samplers]

    def _sample(self, samplers: list[tuple[int, Request]], srows: list[SamplingRow], rows: dict[int, torch.Tensor],
                masks: concurrent.futures.Future | None) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = torch.cat([rows[i][-1:] for i, _ in samplers])     # [num_sampling, vocab]
        return sample(logits, srows, self._generator, None if masks is None else masks.result())

    def _after_token(self, r: Request, tok: int, lp, now: float) -> StepOutput:
        """``tok`` was appended by the scheduler's commit: time it, detokenize, decide the finish."""
        r.token_times.append(now)
        if len(r.token_times) == 1:
            self._event(EventKind.FIRST_TOKEN, r)
        if r.logprobs is not None:
            r.logprobs.append(lp)
        reason = None
        delta = ""
        if r.grammar_state is not None and not r.grammar_state.accept(tok):
            return self._finish(r, FinishReason.ERROR, f"the output constraint rejected token {tok}")
        if (tok in self.eos_token_ids and not r.params.ignore_eos) or (
                r.grammar_state is not None and r.grammar_state.is_terminated):
            reason = FinishReason.STOP
        else:
            delta, stopped = self._texts[r.request_id].push(
                tok, check_stop=r.num_output_tokens >= r.params.min_new_tokens)
            if stopped:
                reason = FinishReason.STOP
            elif r.num_tokens >= r.max_total_tokens:
                reason = FinishReason.LENGTH
        lps = (lp,) if lp is not None else ()
        if reason is None:
            return StepOutput(r.request_id, (tok,), delta, None, lps)
        end = self._finish(r, reason)
        return StepOutput(r.request_id, (tok,), delta + end.text_delta, reason, lps)

    def _finish(self, r: Request, reason: FinishReason, error: str | None = None) -> StepOutput:
        delta = self._texts[r.request_id].flush()  # empty after a stop-string match
        compiling = self._compiling.pop(r.request_id, None)
        if compiling is not None:
            compiling[1].cancel()
        r.finish_reason = reason
        r.error = error
        r.finished_time = time.perf_counter()
        self.scheduler.finish(r)
        self._event(EventKind.FINISHED, r)
        return StepOutput(r.request_id, (), delta, reason)

    # -- telemetry (telemetry.py): one small frozen record per step and per lifecycle event ------

    _step_failed = False

    def _event(self, kind: EventKind, r: Request) -> None:
        events = self.events
        if not events.enabled:
            return
        t0 = r.arrival_time
        now = time.perf_counter()
        events.append(RequestEvent(
            events.next_seq(), now, kind, r.request_id, r.num_prompt_tokens, r.num_output_tokens,
            r.params.max_new_tokens, r.finish_reason if kind is EventKind.FINISHED else None,
            ttft_s=r.token_times[0] - t0 if kind is EventKind.FIRST_TOKEN else None,
            e2e_s=r.finished_time - t0 if kind is EventKind.FINISHED else None))

    def _record_step(self, plan, start: float) -> None:
        events, reqs, sched = self.events, self._requests, self.scheduler
        num_decode = self._last_step[1]
        progress = []
        for c in plan.chunks:
            r = reqs.get(c.request_id)
            if r is not None:
                progress.append(RequestProgress(r.request_id, r.num_prompt_tokens, r.num_computed_tokens,
                                                r.num_output_tokens))
        now = time.perf_counter()
        failed, self._step_failed = self._step_failed, False
        events.append(StepRecord(
            events.next_seq(), now, now - start, self.config.scheduler.budget_tokens,
            plan.num_tokens - num_decode, num_decode, len(plan.chunks), sched.num_waiting, sched.num_running,
            len(plan.preempted_ids), self.allocator.num_used_blocks,
            self.allocator.num_free_blocks - self.allocator.num_cached_free_blocks,
            self.allocator.num_cached_free_blocks,
            failed, tuple(progress)))
