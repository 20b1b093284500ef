"""The in-process target: an :class:`~fastgen.engine.Engine` driven in this thread by simulated
clients.

One loop plays every client and the server: it submits the requests whose arrival time has
come, runs one ``Engine.step()``, and stamps every token the step produced with the time the
step returned (when a streaming client would have received it). A request that arrives while
a step runs waits for it, as it would behind a server's engine thread; its arrival time is
still the one it was sent at. Requests are sent as token ids (see ``workload``), greedy, with
EOS ignored, so each generates exactly its drawn number of tokens.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from tqdm.auto import tqdm

from ..engine import Engine
from ..engine_protocol import StepEngine
from ..telemetry import TraceWriter
from ..errors import InvalidRequestError
from ..request import FinishReason, SamplingParams
from .load import ClosedLoop, Load, RunLimits
from .metrics import RequestRecord
from .workload import BenchRequest

CUT_OFF = "cut off by the run's time limit"
WARMUP_PROMPT_TOKENS = 512
WARMUP_NEW_TOKENS = 4


@dataclass(frozen=True)
class RunResult:
    """The records of every request sent in one load point, and how long the point ran."""

    records: tuple[RequestRecord, ...]
    duration_s: float            # start -> end of the last request (or the time limit)
    timed_out: bool


def run_duration(records: Sequence[RequestRecord], end_s: float, timed_out: bool) -> float:
    if timed_out:
        return end_s
    return max((r.finish_s for r in records if r.finish_s is not None), default=end_s)


def sampling_for(request: BenchRequest) -> SamplingParams:
    return SamplingParams(max_new_tokens=request.max_new_tokens, do_sample=False, ignore_eos=True)


class EngineTarget:
    """Runs load points against one engine. ``clock`` and ``sleep`` are injectable for tests."""

    def __init__(self, engine: StepEngine, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, salt_per_run: bool = True,
                 trace: TraceWriter | None = None) -> None:
        self.engine = engine
        # each load point under its own cache salt: a point never hits the blocks of the points
        # before it (they send the same requests), only what its own requests share
        self.salt_per_run = salt_per_run
        self.clock = clock
        self.sleep = sleep
        self._num_runs = 0
        self.trace = trace          # gets the engine's step records and request events (--trace-file)
        self._seen_seq = engine.events.last_seq if trace is not None else 0

    def run(self, requests: Sequence[BenchRequest], load: Load, limits: RunLimits,
            desc: str = "") -> RunResult:
        requests = list(requests[:limits.num_requests])
        self._num_runs += 1
        prefix = f"r{self._num_runs}-"
        if isinstance(load, ClosedLoop):
            arrivals = deque((0.0, r) for r in requests[:load.num_clients])
            backlog = iter(requests[load.num_clients:])
        else:
            arrivals = deque(zip(load.arrival_times_s(len(requests)), requests))
            backlog = iter(())
        records: list[RequestRecord] = []
        in_flight: dict[str, RequestRecord] = {}
        t0 = self.clock()
        timed_out = False
        with tqdm(total=len(requests), desc=desc, leave=False, disable=None) as bar:
            while arrivals or in_flight:
                now = self.clock() - t0
                if now > limits.max_duration_s:
                    timed_out = True
                    self._cut_off(in_flight)
                    break
                while arrivals and arrivals[0][0] <= now:
                    arrival_s, req = arrivals.popleft()
                    rec = RequestRecord(req.index, req.num_prompt_tokens, req.max_new_tokens, arrival_s)
                    records.append(rec)
                    if not self._submit(prefix, req, rec, in_flight):
                        bar.update()
                        self._next(load, backlog, arrivals, now)
                if not in_flight:
                    if arrivals:
                        self.sleep(max(0.0, min(arrivals[0][0], limits.max_duration_s) - now))
                    continue
                outputs = self.engine.step()
                now = self.clock() - t0
                if self.trace is not None:
                    new = self.engine.events.since(self._seen_seq)
                    if new:
                        self._seen_seq = new[-1].seq
                        self.trace.write(new)
                for out in outputs:
                    rec = in_flight[out.request_id]
                    rec.token_times_s.extend(now for _ in out.new_token_ids)
                    if out.finish_reason is not None:
                        self._finished(out.request_id, rec, now)
                        del in_flight[out.request_id]
                        bar.update()
                        self._next(load, backlog, arrivals, now)
        return RunResult(tuple(records), run_duration(records, self.clock() - t0, timed_out), timed_out)

    def _submit(self, prefix: str, req: BenchRequest, rec: RequestRecord,
                in_flight: dict[str, RequestRecord]) -> bool:
        """Add the request to the engine; False (and the record failed) if the engine refuses it."""
        rid = f"{prefix}{req.index}"
        try:
            self.engine.add_request(list(req.prompt_token_ids), sampling_for(req), request_id=rid,
                                    cache_salt=prefix if self.salt_per_run else None)
        except InvalidRequestError as e:
            rec.error = f"rejected: {e}"
            return False
        in_flight[rid] = rec
        return True

    def _finished(self, rid: str, rec: RequestRecord, now: float) -> None:
        response = self.engine.response(rid)
        rec.finish_s = now
        rec.num_output_tokens = response.generated_length
        rec.cached_prompt_tokens = response.num_cached_tokens
        if response.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
            rec.error = response.error or response.finish_reason.value

    @staticmethod
    def _next(load: Load, backlog: Iterator[BenchRequest], arrivals: deque, now: float) -> None:
        """Closed loop: the client whose request just ended sends its next one now."""
        if isinstance(load, ClosedLoop):
            req = next(backlog, None)
            if req is not None:
                arrivals.append((now, req))

    def _cut_off(self, in_flight: dict[str, RequestRecord]) -> None:
        for rid, rec in in_flight.items():
            self.engine.abort(rid)
            self.engine.response(rid)
            rec.error = CUT_OFF
        in_flight.clear()


def warm_up(engine: Engine) -> None:
    """One short request through the engine, untimed: the first forward passes of a process
    pay for kernel selection and memory first-touch, which belongs to no policy."""
    n = min(WARMUP_PROMPT_TOKENS, engine.config.max_model_len - WARMUP_NEW_TOKENS - 1)
    vocab = engine.model_config.vocab_size
    prompt = [(1000 + 7 * i) % vocab for i in range(n)]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=WARMUP_NEW_TOKENS, do_sample=False,
                                                    ignore_eos=True), request_id="bench-warmup")
    while engine.has_unfinished():
        engine.step()
    engine.response(rid)


def engines(model: str | None, policies: Sequence[str], options: dict[str, Any],
            caching: Sequence[bool] = (True,)) -> Iterator[tuple[str, Engine]]:
    """An engine per policy (and per prefix-caching setting) over one loaded model: the weights
    and tokenizer are shared, each engine gets its own KV pool and scheduler, so that only the
    scheduling differs. Names: the policy, plus " no-prefix-cache" for an engine without it."""
    combos = [(p, c) for p in policies for c in caching]
    first = Engine.from_pretrained(model, scheduler=combos[0][0], prefix_caching=combos[0][1], **options)
    config, shared = first.config, (first.model, first.tokenizer, first.model_config)

    def name(policy: str, cached: bool) -> str:
        return policy if cached else f"{policy} no-prefix-cache"

    yield name(*combos[0]), first
    del first
    for policy, cached in combos[1:]:
        cfg = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, policy=policy),
                                  cache=dataclasses.replace(config.cache, prefix_caching=cached))
        yield name(policy, cached), Engine(cfg, *shared)
