"""The load generators without a model: the in-process driver over a fake engine on a fake clock,
and the HTTP client against a fake OpenAI-compatible server on 127.0.0.1."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fastgen.bench.engine_target import CUT_OFF, EngineTarget
from fastgen.bench.http_target import HTTPTarget, HTTPTargetError
from fastgen.bench.load import ClosedLoop, Poisson, RunLimits
from fastgen.bench.metrics import SLA, summarize
from fastgen.bench.workload import BenchRequest
from fastgen.engine import EngineStats, StepOutput
from fastgen.errors import PromptTooLongError
from fastgen.request import FinishReason

STEP_S = 0.1


def requests_of(*gens: int, prompt: int = 4) -> list[BenchRequest]:
    return [BenchRequest(i, tuple(range(10, 10 + prompt)), "w " * prompt, g) for i, g in enumerate(gens)]


class FakeEngine:
    """One token per request per step after a one-step prompt; each step takes STEP_S of fake time.
    Satisfies fastgen.engine_protocol.StepEngine, as the real Engine does (test_engine_protocol.py)."""

    def __init__(self, reject_prompt_len: int | None = None) -> None:
        self.now = 0.0
        self.running: dict[str, list[int]] = {}     # id -> [tokens generated, tokens wanted]
        self.finished: dict[str, FinishReason] = {}
        self.submitted: list[tuple[str, float]] = []
        self.max_running = 0
        self.aborted: list[str] = []
        self.reject_prompt_len = reject_prompt_len
        self.salts: list[str | None] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def add_request(self, prompt, params, request_id=None, *, tenant=None, cache_salt=None):
        self.salts.append(cache_salt)
        if len(prompt) == self.reject_prompt_len:
            raise PromptTooLongError("too long", param="prompt")
        assert params.ignore_eos and not params.do_sample
        self.running[request_id] = [0, params.max_new_tokens]
        self.submitted.append((request_id, self.now))
        self.max_running = max(self.max_running, len(self.running))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> list[StepOutput]:
        self.now += STEP_S
        outs = []
        for rid, state in list(self.running.items()):
            state[0] += 1
            done = state[0] == state[1]
            outs.append(StepOutput(rid, (7,), "x", FinishReason.LENGTH if done else None))
            if done:
                self.finished[rid] = FinishReason.LENGTH
                del self.running[rid]
        return outs

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        if request_id in self.running:
            del self.running[request_id]
            self.finished[request_id] = reason
            self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_waiting=0, num_running=len(self.running), num_free_blocks=0, num_used_blocks=0,
                           num_preemptions=0, last_step_prompt_tokens=0, last_step_decode_tokens=len(self.running))

    def response(self, request_id: str):
        rid = request_id
        class R:
            pass
        r = R()
        r.finish_reason = self.finished.pop(rid)
        r.generated_length = 1
        r.error = None
        r.num_cached_tokens = 3
        return r


def target(engine: FakeEngine) -> EngineTarget:
    return EngineTarget(engine, clock=engine.clock, sleep=engine.sleep)


def test_closed_loop_keeps_n_requests_in_flight():
    engine = FakeEngine()
    reqs = requests_of(3, 1, 2, 4, 2, 1)
    run = target(engine).run(reqs, ClosedLoop(2), RunLimits(6, 100.0))
    assert engine.max_running == 2 and not run.timed_out
    recs = {r.index: r for r in run.records}
    assert len(recs) == 6 and all(r.completed for r in recs.values())
    assert [len(recs[i].token_times_s) for i in range(6)] == [3, 1, 2, 4, 2, 1]
    assert recs[0].arrival_s == recs[1].arrival_s == 0.0
    finishes = sorted(r.finish_s for r in recs.values())
    # every later request arrives the moment an earlier one finished
    for i in range(2, 6):
        assert any(recs[i].arrival_s == pytest.approx(f) for f in finishes)
    assert recs[2].arrival_s == pytest.approx(recs[1].finish_s)          # request 1 ended first
    assert run.duration_s == pytest.approx(max(finishes))
    # tokens are stamped when the step returns: 0.1 s apart
    assert recs[3].token_gaps_s == pytest.approx([STEP_S] * 3)
    assert all(r.cached_prompt_tokens == 3 for r in recs.values())


def test_each_load_point_has_its_own_cache_salt():
    """Points send the same requests: each under its own salt, so none hits its predecessors' blocks."""
    engine = FakeEngine()
    t = target(engine)
    for _ in range(2):
        t.run(requests_of(1, 1), ClosedLoop(1), RunLimits(2, 100.0))
    assert len(set(engine.salts)) == 2 and engine.salts[0] == engine.salts[1] != engine.salts[2]
    off = FakeEngine()
    EngineTarget(off, clock=off.clock, sleep=off.sleep, salt_per_run=False).run(
        requests_of(1), ClosedLoop(1), RunLimits(1, 100.0))
    assert off.salts == [None]


def test_closed_loop_is_bounded_in_requests():
    engine = FakeEngine()
    run = target(engine).run(requests_of(*[2] * 10), ClosedLoop(3), RunLimits(5, 100.0))
    assert len(run.records) == 5 and len(engine.submitted) == 5


def test_poisson_sends_each_request_at_its_arrival_time():
    engine = FakeEngine()
    load = Poisson(2.0, seed=1)
    run = target(engine).run(requests_of(*[3] * 8), load, RunLimits(8, 100.0))
    arrivals = load.arrival_times_s(8)
    assert [r.arrival_s for r in run.records] == arrivals
    for (rid, sent), arrival in zip(engine.submitted, arrivals):
        assert arrival <= sent < arrival + STEP_S + 1e-9     # at most one step late
    assert all(r.ttft_s >= STEP_S - 1e-9 for r in run.records)


def test_poisson_arrivals_are_seeded_exponential():
    times = Poisson(4.0, seed=0).arrival_times_s(4000)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and times == Poisson(4.0, seed=0).arrival_times_s(4000)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    assert times != Poisson(4.0, seed=1).arrival_times_s(4000)


def test_time_limit_cuts_off_running_requests():
    engine = FakeEngine()
    run = target(engine).run(requests_of(100, 100, 100), ClosedLoop(2), RunLimits(3, 1.0))
    assert run.timed_out and run.duration_s > 1.0
    assert [r.error for r in run.records] == [CUT_OFF, CUT_OFF]
    assert len(engine.aborted) == 2 and not engine.running
    assert summarize(run.records, run.duration_s, SLA()).num_failed == 2


def test_rejected_request_is_recorded_and_the_client_goes_on():
    engine = FakeEngine(reject_prompt_len=9)
    reqs = requests_of(2, 2, 2)
    reqs[1] = BenchRequest(1, tuple(range(9)), "x", 2)
    run = target(engine).run(reqs, ClosedLoop(1), RunLimits(3, 100.0))
    assert [r.completed for r in run.records] == [True, False, True]
    assert run.records[1].error.startswith("rejected")


# -- HTTP ----------------------------------------------------------------------------------------

class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-word chunks 10 ms apart, then usage (prompt_tokens = words)."""

    bodies: list[dict] = []
    health: list[int] = []      # statuses /health answers in turn, then 200

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send_json(FakeOpenAI.health.pop(0) if FakeOpenAI.health else 200, {})
            return
        self._send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.bodies.append(body)
        if body["prompt"].startswith("bad"):
            self._send_json(400, {"error": {"message": "bad prompt", "type": "invalid_request_error"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            time.sleep(0.01)
            self._event({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}], "usage": None})
        self._event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                              "completion_tokens": body["max_tokens"]}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def fake_server():
    FakeOpenAI.bodies = []
    FakeOpenAI.health = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_closed_loop_streams_and_checks_usage(fake_server):
    reqs = requests_of(5, 3, 4, 2, prompt=4)
    reqs[3] = BenchRequest(3, (1, 2, 3, 4), "w w w", 2)    # the server will count 3 prompt tokens
    t = HTTPTarget(fake_server + "/v1")
    assert t.model == "fake-model"
    run = t.run(reqs, ClosedLoop(2), RunLimits(4, 30.0))
    recs = {r.index: r for r in run.records}
    assert all(r.completed for r in recs.values()) and not run.timed_out
    assert [len(recs[i].token_times_s) for i in range(4)] == [5, 3, 4, 2]
    assert [recs[i].num_output_tokens for i in range(4)] == [5, 3, 4, 2]
    # chunk k leaves the server 10 ms x k after the request came in (two may arrive together)
    assert all(r.token_times_s[-1] - r.arrival_s >= 0.01 * len(r.token_times_s) for r in recs.values())
    assert summarize(run.records, run.duration_s, SLA()).num_prompt_token_mismatches == 1
    body = FakeOpenAI.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"]
    assert body["model"] == "fake-model" and body["temperature"] == 0.0


def test_http_poisson_without_extensions_and_errors(fake_server):
    reqs = requests_of(2, 2, 2)
    reqs[1] = BenchRequest(1, (1,), "bad prompt", 2)
    t = HTTPTarget(fake_server, "m", length_extensions=False)
    run = t.run(reqs, Poisson(20.0, seed=0), RunLimits(3, 30.0))
    recs = {r.index: r for r in run.records}
    assert recs[0].completed and recs[2].completed
    assert recs[1].error.startswith("HTTP 400")
    assert all("ignore_eos" not in b and "min_tokens" not in b for b in FakeOpenAI.bodies)
    assert [r.arrival_s for r in sorted(run.records, key=lambda r: r.index)] == Poisson(20.0, 0).arrival_times_s(3)


def test_http_time_limit_cuts_off(fake_server):
    run = HTTPTarget(fake_server, "m").run(requests_of(200, 200), ClosedLoop(2), RunLimits(2, 0.3))
    assert run.timed_out and all(r.error == CUT_OFF for r in run.records)


def test_http_waits_for_health(fake_server):
    FakeOpenAI.health = [503, 503]
    assert HTTPTarget(fake_server, wait_ready_s=10.0).model == "fake-model"
    assert FakeOpenAI.health == []
    FakeOpenAI.health = [503] * 100
    with pytest.raises(HTTPTargetError, match="not ready after 0.2 s .HTTP 503"):
        HTTPTarget(fake_server, wait_ready_s=0.2)


def test_http_unreachable_server_names_the_problem():
    with pytest.raises(HTTPTargetError, match="not ready"):
        HTTPTarget("http://127.0.0.1:9")
