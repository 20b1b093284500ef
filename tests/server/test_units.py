"""The server's parts without a model: the engine loop over a fake engine, the protocol's
mapping onto SamplingParams and its response bodies, the native wire format, error bodies,
and the balancer's routing."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pydantic
import pytest

from fastgen.engine import EngineStats, StepOutput
from fastgen.errors import EngineDeadError, InvalidRequestError
from fastgen.request import FinishReason, Response, SamplingParams, Timings, TokenLogprob
from fastgen.server.balancer import Balancer, Upstream, UpstreamState, estimate_tokens
from fastgen.server.engine_loop import EngineLoop
from fastgen.server.errors import QueueFullError, from_invalid_request, from_validation_error
from fastgen.server.protocol import PARAM_NAMES, ChatCompletionRequest, CompletionRequest
from fastgen.server.responses import ChatBodies, CompletionBodies
from fastgen.server.wire import response_from_json, response_to_json


class FakeEngine:
    """Generates token 7 ("x") once per step for up to ``max_running`` requests at a time
    (with logprob -0.5 when asked for logprobs). Satisfies fastgen.engine_protocol.StepEngine,
    as the real Engine does (tests/unit/test_engine_protocol.py)."""

    def __init__(self, max_running: int = 64, step_s: float = 0.002) -> None:
        self.max_running = max_running
        self.step_s = step_s
        self.order: list[str] = []
        self.left: dict[str, int] = {}
        self.done: dict[str, tuple[FinishReason, int]] = {}
        self.want_logprobs: dict[str, bool] = {}

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None, *,
                    tenant: str | None = None, cache_salt: str | None = None) -> str:
        if prompt == [666]:
            raise InvalidRequestError("prompt: token 666 is cursed", param="prompt")
        self.order.append(request_id)
        self.left[request_id] = params.max_new_tokens
        self.want_logprobs[request_id] = params.logprobs is not None
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self) -> list[StepOutput]:
        time.sleep(self.step_s)
        outs = []
        for rid in [r for r in self.order if r in self.left][:self.max_running]:
            self.left[rid] -= 1
            lps = (TokenLogprob(7, -0.5, {}),) if self.want_logprobs[rid] else ()
            if self.left[rid] == 0:
                self._finish(rid, FinishReason.LENGTH)
                outs.append(StepOutput(rid, (7,), "x", FinishReason.LENGTH, lps))
            else:
                outs.append(StepOutput(rid, (7,), "x", None, lps))
        return outs

    def _finish(self, rid: str, reason: FinishReason) -> None:
        self.done[rid] = (reason, 0)
        del self.left[rid]

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        if request_id in self.left:
            self._finish(request_id, reason)

    def response(self, request_id: str) -> Response:
        reason, _ = self.done.pop(request_id)
        return Response(request_id=request_id, generated_text="", token_ids=(), prompt_length=1, generated_length=0,
                        finish_reason=reason, timings=Timings(None, None, (), None))

    def stats(self) -> EngineStats:
        return EngineStats(num_waiting=max(0, len(self.left) - self.max_running),
                           num_running=min(len(self.left), self.max_running), num_free_blocks=10,
                           num_used_blocks=len(self.left), num_preemptions=0,
                           last_step_prompt_tokens=0, last_step_decode_tokens=len(self.left))


def run_with_loop(engine: FakeEngine, body, **loop_kwargs):
    async def main():
        loop = EngineLoop(lambda: engine, **loop_kwargs)
        loop.start(asyncio.get_running_loop())
        for _ in range(200):
            if loop.state != "loading":
                break
            await asyncio.sleep(0.01)
        try:
            return await asyncio.wait_for(body(loop), timeout=10)
        finally:
            loop.stop()

    return asyncio.run(main())


def params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def test_loop_streams_every_choice_to_its_end():
    async def body(loop):
        stream = await loop.submit([[1], [2]], [params(3), params(5)])
        texts = {0: "", 1: ""}
        finals = {}
        async for d in stream:
            texts[d.index] += d.text
            if d.finish_reason:
                finals[d.index] = d
        assert loop.num_queued == 0
        return texts, finals

    texts, finals = run_with_loop(FakeEngine(), body)
    assert texts == {0: "xxx", 1: "xxxxx"}
    assert {i: d.finish_reason for i, d in finals.items()} == {0: "length", 1: "length"}
    assert all(d.response is not None for d in finals.values())


def test_streamed_deltas_carry_their_tokens_logprobs():
    async def body(loop):
        stream = await loop.submit([[1], [2]], [SamplingParams(max_new_tokens=4, logprobs=0), params(4)])
        return [d async for d in stream]

    deltas = run_with_loop(FakeEngine(), body)
    assert [len(d.logprobs) for d in deltas if d.index == 0] == [len(d.token_ids) for d in deltas if d.index == 0]
    assert sum(len(d.logprobs) for d in deltas if d.index == 0) == 4
    assert all(not d.logprobs for d in deltas if d.index == 1)


def test_quiet_stream_delivers_first_and_last_delta_and_reports_every_token():
    reports = []

    async def body(loop):
        loop.on_step = reports.append
        stream = await loop.submit([[1]], [params(5)], quiet=True)
        return [d async for d in stream]

    deltas = run_with_loop(FakeEngine(), body)
    assert [d.finish_reason for d in deltas] == [None, "length"]
    assert sum(r.num_new_tokens for r in reports) == 5 and sum(r.stepped for r in reports) == 5


def test_loop_admits_all_or_none():
    engine = FakeEngine()

    async def body(loop):
        with pytest.raises(InvalidRequestError):
            await loop.submit([[1], [666]], [params(), params()])
        assert loop.num_queued == 0
        await asyncio.sleep(0.05)

    run_with_loop(engine, body)
    assert not engine.left and not engine.done  # the first was aborted and forgotten


def test_close_aborts_and_deadline_times_out():
    engine = FakeEngine(step_s=0.01)

    async def body(loop):
        s1 = await loop.submit([[1]], [params(10_000)])
        await s1.__anext__()
        s1.close()
        last = [d async for d in s1][-1]
        s2 = await loop.submit([[1]], [params(10_000)], timeout_s=0.1)
        t0 = time.perf_counter()
        last2 = [d async for d in s2][-1]
        return last, last2, time.perf_counter() - t0

    aborted, timed_out, elapsed = run_with_loop(engine, body)
    assert aborted.finish_reason == "abort" and aborted.response.finish_reason is FinishReason.ABORT
    assert timed_out.finish_reason == "timeout" and timed_out.response.finish_reason is FinishReason.TIMEOUT
    assert 0.09 < elapsed < 2
    assert not engine.left


def test_queue_bound_counts_unscheduled_sequences():
    async def body(loop):
        running = await loop.submit([[1]], [params(10_000)])
        await running.__anext__()                  # scheduled: it no longer counts
        waiting = await loop.submit([[2]], [params(1)])
        assert loop.num_queued == 1
        with pytest.raises(QueueFullError):
            await loop.submit([[3]], [params(1)])
        running.close()
        async for _ in waiting:
            pass
        assert loop.num_queued == 0
        again = await loop.submit([[3]], [params(1)])
        return [d.finish_reason async for d in again][-1]

    assert run_with_loop(FakeEngine(max_running=1), body, max_queue=1) == "length"


def test_failed_load_is_reported():
    def broken():
        raise OSError("no such model")

    async def main():
        loop = EngineLoop(broken)
        loop.start(asyncio.get_running_loop())
        for _ in range(200):
            if loop.state != "loading":
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):
            await loop.submit([[1]], [params()])
        return loop.state, loop.error

    state, error = asyncio.run(main())
    assert state == "failed" and isinstance(error, OSError)


class FailingEngine(FakeEngine):
    """A FakeEngine whose ``fail_at``-th step raises, as a broken kernel would."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.num_steps = 0
        self.fail_at = fail_at

    def step(self) -> list[StepOutput]:
        self.num_steps += 1
        if self.num_steps == self.fail_at:
            raise RuntimeError("kernel exploded")
        return super().step()


class HangingEngine(FakeEngine):
    """A FakeEngine whose second step hangs until ``release`` is set (``hanging`` says it has
    begun): a ping sent then cannot slip in between two steps, however loaded the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.num_steps = 0
        self.hanging = threading.Event()
        self.release = threading.Event()

    def step(self) -> list[StepOutput]:
        self.num_steps += 1
        if self.num_steps == 2:
            self.hanging.set()
            self.release.wait(10)
        return super().step()


def test_ping_is_answered_between_steps_while_the_engine_works():
    async def body(loop):
        stream = await loop.submit([[1]], [params(10_000)])
        await stream.__anext__()
        t0 = time.perf_counter()
        for _ in range(5):
            await loop.ping(timeout_s=1.0)
        elapsed = time.perf_counter() - t0
        stream.close()
        return elapsed

    assert run_with_loop(FakeEngine(step_s=0.01), body) < 0.5  # one step (10 ms) per ping at most


def test_ping_fails_when_the_engine_failed_hangs_or_stopped():
    async def failed(loop):
        stream = await loop.submit([[1]], [params(100)])
        [d async for d in stream]  # the failing step ends it with finish_reason "error"
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await loop.ping(timeout_s=1.0)

    run_with_loop(FailingEngine(fail_at=3), failed)

    hanging = HangingEngine()

    async def hung(loop):
        stream = await loop.submit([[1]], [params(10)])
        await stream.__anext__()
        assert await asyncio.to_thread(hanging.hanging.wait, 5)  # the engine is inside a step that hangs
        with pytest.raises(EngineDeadError, match="did not answer within 0.2 s"):
            await loop.ping(timeout_s=0.2)
        hanging.release.set()
        stream.close()

    run_with_loop(hanging, hung)

    async def stopped(loop):
        loop.stop()
        with pytest.raises(EngineDeadError, match="stopped"):
            await loop.ping(timeout_s=1.0)

    run_with_loop(FakeEngine(), stopped)


# -- protocol ---------------------------------------------------------------------------------------

def test_openai_defaults_and_extensions_map_onto_sampling_params():
    req = CompletionRequest.model_validate_json('{"model": "m", "prompt": "hi"}')
    [p] = req.sampling_params(16, None)
    assert (p.do_sample, p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (True, 1.0, 1.0, 0, 16)
    req = CompletionRequest.model_validate_json(
        '{"model": "m", "prompt": ["a", "b"], "temperature": 0, "n": 2, "seed": 5, "stop": "x", "top_k": 3,'
        ' "min_p": 0.1, "min_tokens": 2, "ignore_eos": true, "repetition_penalty": 1.2, "logprobs": 3}')
    ps = req.sampling_params(8, req.logprobs)
    assert [p.seed for p in ps] == [5, 6] and all(not p.do_sample for p in ps)
    assert ps[0].stop == ("x",) and ps[0].top_k == 3 and ps[0].min_new_tokens == 2 and ps[0].logprobs == 3
    assert req.prompts() == ["a", "b"]
    assert CompletionRequest.model_validate_json('{"model": "m", "prompt": [1, 2]}').prompts() == [[1, 2]]


def test_chat_request_fields():
    req = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be"},'
        ' {"type": "text", "text": " brief"}]}, {"role": "user", "content": "hi"}],'
        ' "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 2}')
    assert req.messages[0].as_template_dict() == {"role": "system", "content": "be brief"}
    assert req.requested_max_tokens == 7 and req.num_logprobs == 2


@pytest.mark.parametrize("body, param", [
    ('{"model": "m", "prompt": "a", "temperature": "0.5"}', "temperature"),
    ('{"model": "m", "prompt": "a", "max_tokens": 1.5}', "max_tokens"),
    ('{"model": "m", "prompt": "a", "top_p": 0}', "top_p"),
    ('{"model": "m", "prompt": "a", "n": 0}', "n"),
    ('{"model": "m", "prompt": "a", "bogus": 1}', "bogus"),
    ('{"prompt": "a"}', "model"),
    ('{"model": "m", "prompt": 5}', "prompt"),
    ('{"model": "m", "prompt": "a", "logprobs": 21}', "logprobs"),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(pydantic.ValidationError) as e:
        CompletionRequest.model_validate_json(body)
    err = from_validation_error(e.value)
    assert err.status == 400 and err.param == param and param in err.message


def test_malformed_json_and_engine_errors_become_400():
    with pytest.raises(pydantic.ValidationError) as e:
        CompletionRequest.model_validate_json("{nope")
    assert from_validation_error(e.value).code == "invalid_json"
    err = from_invalid_request(InvalidRequestError("max_new_tokens: too big", param="max_new_tokens"), PARAM_NAMES)
    assert err.param == "max_tokens" and err.message == "max_tokens: too big"


def test_stream_chunks_carry_the_logprobs_of_the_whole_response():
    texts = {1: "ab", 2: "c", 3: "de"}
    lps = (TokenLogprob(1, -0.1, {1: -0.1, 2: -2.5}), TokenLogprob(2, -0.2, {2: -0.2}),
           TokenLogprob(3, -0.3, {3: -0.3}))
    r = Response(request_id="0", generated_text="abcde", token_ids=(1, 2, 3), prompt_length=1, generated_length=3,
                 finish_reason=FinishReason.LENGTH, timings=Timings(None, None, (), None), logprobs=lps)
    for kind, bodies in (("completion", CompletionBodies), ("chat", ChatBodies)):
        builder = bodies("m", texts.__getitem__)
        whole = builder.full([r], 1)["choices"][0]["logprobs"]
        chunks = [builder.chunk(0, "ab", None, first=True, include_usage=False, logprobs=lps[:1]),
                  builder.chunk(0, "cde", "length", first=False, include_usage=False, logprobs=lps[1:]),
                  builder.chunk(0, "", "length", first=False, include_usage=False)]
        parts = [c["choices"][0]["logprobs"] for c in chunks]
        assert parts[2] is None
        if kind == "completion":
            assert whole["text_offset"] == [0, 2, 3]
            assert {k: parts[0][k] + parts[1][k] for k in whole} == whole
        else:
            assert parts[0]["content"] + parts[1]["content"] == whole["content"]


def test_native_wire_round_trips_a_timeout():
    r = Response(request_id="0", generated_text="x", token_ids=(7,), prompt_length=1, generated_length=1,
                 finish_reason=FinishReason.TIMEOUT, timings=Timings(0.0, 0.1, (0.1,), 0.2),
                 logprobs=(TokenLogprob(7, -0.5, {7: -0.5}),))
    body = json.loads(json.dumps(response_to_json(r)))
    assert body["finish_reason"] == "timeout" and body["error"] is None
    assert response_from_json(body) == r


# -- balancer ---------------------------------------------------------------------------------------

def test_estimate_tokens_counts_prompts_choices_and_new_tokens():
    one = estimate_tokens("/v1/completions", {"prompt": "x" * 400, "max_tokens": 100})
    assert 190 < one < 210
    assert estimate_tokens("/v1/completions", {"prompt": ["x" * 400] * 2, "max_tokens": 100, "n": 3}) \
        == pytest.approx(6 * one, rel=0.05)
    assert estimate_tokens("/v1/completions", {"prompt": "hi"}) == 16 + 2


def test_pick_routes_to_least_outstanding_work_among_healthy():
    a, b, c = Upstream("http://a"), Upstream("http://b"), Upstream("http://c")
    a.state = b.state = UpstreamState.UP
    balancer = Balancer([a, b, c])
    a.outstanding_tokens = 500
    assert balancer.pick(set()) is b
    b.outstanding_tokens = 900
    assert balancer.pick(set()) is a
    assert balancer.pick({a}) is b
    assert balancer.pick({a, b}) is None  # c is not healthy
