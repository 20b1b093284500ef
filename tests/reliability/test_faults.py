"""Faults: the engine raising inside a step (that step's requests fail with a clear error, the
server keeps serving), and clients disconnecting mid-stream by the dozen (their KV blocks are
free within a step or two, measured from the engine's own step records)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from fastgen.engine import Engine
from fastgen.server.app import create_app
from fastgen.server.config import ServerConfig
from fastgen.server.launch import free_port
from fastgen.telemetry import read_trace

from ..server.conftest import wait_until
from .conftest import KEY, auth

OPTIONS = dict(dtype="float32", num_blocks=256, block_size=16, budget_tokens=64, num_threads=1)


class InjectedFault(RuntimeError):
    pass


class FaultInjectingModel:
    """TEST ONLY: wraps the real model; ``fail_next_forward()`` makes its next forward pass raise,
    as a kernel or an out-of-memory error would, inside ``Engine.step``."""

    def __init__(self, model) -> None:
        self.model = model
        self._armed = threading.Event()
        self.num_raised = 0

    def fail_next_forward(self) -> None:
        self._armed.set()

    def __call__(self, batch, pool):
        if self._armed.is_set():
            self._armed.clear()
            self.num_raised += 1
            raise InjectedFault("injected fault in the forward pass (test)")
        return self.model(batch, pool)


@pytest.fixture(scope="module")
def faulty_server(tiny_model):
    """An in-process server whose engine's model is wrapped by :class:`FaultInjectingModel`."""
    import uvicorn

    wrapper: list[FaultInjectingModel] = []

    def load() -> Engine:
        engine = Engine.from_pretrained(tiny_model, **OPTIONS)
        wrapper.append(FaultInjectingModel(engine.model))
        engine.model = wrapper[0]
        return engine

    port = free_port()
    config = ServerConfig(model=tiny_model, port=port, served_model_name="tiny")
    server = uvicorn.Server(uvicorn.Config(create_app(config, load), host="127.0.0.1", port=port,
                                           log_level="error", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(healthy, timeout_s=120)
    yield url, wrapper[0]
    server.should_exit = True
    thread.join(30)


def test_a_step_that_raises_fails_its_requests_and_the_server_keeps_serving(faulty_server):
    url, model = faulty_server
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    outs: list[list] = [[] for _ in range(5)]
    started = [threading.Event() for _ in outs]

    def run(out: list, ev: threading.Event) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    ev.set()

    threads = [threading.Thread(target=run, args=(o, e)) for o, e in zip(outs, started)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started)
    model.fail_next_forward()
    for t in threads:
        t.join(60)
    assert model.num_raised == 1
    for out in outs:  # all five were decoding in the step that raised
        assert out[-1] == "[DONE]"
        err = json.loads(out[-2])["error"]
        assert err["type"] == "server_error" and "step failed" in err["message"] and "injected fault" in err["message"]
        assert len(out) < 400
    # the server serves on: a new request completes, greedy and whole
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8,
                                                   "ignore_eos": True, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    assert 'fastgen_requests_finished_total{finish_reason="error"} 5.0' in text
    assert "fastgen_kv_blocks_used 0.0" in text


def test_a_non_streamed_request_in_a_failing_step_gets_a_500_naming_the_failure(faulty_server):
    url, model = faulty_server
    result: list = []
    t = threading.Thread(target=lambda: result.append(httpx.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": "Hi", "max_tokens": 600, "ignore_eos": True}, timeout=60)))
    t.start()
    assert wait_until(lambda: "fastgen_requests_running 1.0" in httpx.get(url + "/metrics").text, timeout_s=20)
    model.fail_next_forward()
    t.join(60)
    [r] = result
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]


NUM_CLIENTS = 48


def test_dozens_of_clients_disconnecting_mid_stream_free_their_blocks_within_a_step(tiny_server, trace_path):
    """48 streams, each dropped after its first tokens, while one long request keeps the engine
    stepping; from the trace, count the steps between the last drop and the pool back to the
    long request's own blocks."""
    url = tiny_server.url
    keep = {"model": "tiny", "prompt": "Background", "max_tokens": 900, "ignore_eos": True, "stream": True}
    drop = {"model": "tiny", "prompt": "Some prompt to drop " * 5, "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    closed_at: list[float] = []

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60, headers=auth(),
                                     limits=httpx.Limits(max_connections=NUM_CLIENTS + 4)) as client:
            async with client.stream("POST", url + "/v1/completions", json=keep) as bg:
                lines = bg.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass

                async def one() -> None:
                    async with client.stream("POST", url + "/v1/completions", json=drop) as r:
                        assert r.status_code == 200
                        n = 0
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                n += 1
                                if n == 3:
                                    break

                await asyncio.gather(*(one() for _ in range(NUM_CLIENTS)))   # each closes on leaving
                closed_at.append(time.time())
                await asyncio.sleep(0.5)          # the background stream goes on meanwhile
                async for line in lines:          # then read it to the end
                    pass

    asyncio.run(asyncio.wait_for(scenario(), 120))
    records = read_trace(trace_path)
    steps = [r for r in records if r["kind"] == "step" and r["wall_s"] >= closed_at[0] - 0.002]
    aborted = [r for r in records if r["kind"] == "request" and r.get("finish_reason") == "abort"]
    assert len(aborted) >= NUM_CLIENTS
    # blocks of the background request alone: (prompt + generated) / 16, at most 57
    freed = next(i for i, s in enumerate(steps) if s["num_running"] <= 1 and s["kv_blocks_used"] <= 57)
    freed_s = steps[freed]["wall_s"] - closed_at[0]
    print(f"\nKV freed {freed} step(s), {freed_s * 1e3:.0f} ms after the last of {NUM_CLIENTS} clients disconnected")
    # within 2 steps, or within 0.1 s where steps run faster than the server notices 48 closes
    # (3 ms steps of the tiny model under the full suite's load: 4 steps, ~20 ms). Blocks kept
    # until the dropped requests' ends would come back ~497 tokens later: over a second of steps
    assert freed <= 2 or freed_s <= 0.1, steps[:freed + 1]
