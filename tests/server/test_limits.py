"""A server started with `fastgen.serve()` (one running sequence, a queue of one): the MII-style
client, 429 with Retry-After when the queue is full, and a SIGTERM that drains in-flight work.
And a server asked for a bad engine option, which refuses at once, before any model loads."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import fastgen

from fastgen.server.launch import free_port

from .conftest import wait_until

PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def served():
    client = fastgen.serve(dtype="float32", num_blocks=64, max_seqs=1, max_queue=1, startup_timeout_s=240)
    yield client
    client.terminate()


def metric(client, name: str) -> float:
    for line in httpx.get(client.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_serve_returns_a_ready_client(served):
    assert served.is_healthy()
    [r] = served.generate([PROMPT], max_new_tokens=4, do_sample=False)
    assert r.generated_length == 4 and r.finish_reason is fastgen.FinishReason.LENGTH
    assert "".join(served.stream(PROMPT, max_new_tokens=4, do_sample=False)) == r.generated_text


def test_full_queue_answers_429_with_retry_after(served):
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()  # kept: a dropped iterator would close the connection
        next(line for line in lines if line.startswith("data: "))  # it holds the only seat
        waiting: list = []
        t = threading.Thread(target=lambda: waiting.append(
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=2)))
        t.start()
        assert wait_until(lambda: metric(served, "fastgen_requests_queued") == 1, timeout_s=30)
        r = httpx.post(served.url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    t.join(60)  # the running stream was dropped: the waiting request gets the seat
    assert waiting and waiting[0].usage.completion_tokens == 2
    assert metric(served, "fastgen_requests_queued") == 0
    assert oai.completions.create(model=model, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_sigterm_drains_in_flight_streams_then_exits_cleanly(served):
    body = {"prompts": PROMPT, "stream": True, "max_new_tokens": 10, "do_sample": False, "ignore_eos": True}
    events = []
    with httpx.stream("POST", served.url + "/generate", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        events.append(next(lines))
        served.process.send_signal(signal.SIGTERM)
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][len("data: "):])["response"]
    assert final["finish_reason"] == "length" and final["generated_length"] == 10
    assert served.process.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.url + "/health")


@pytest.mark.parametrize("replicas", ["1", "2"])
def test_bad_engine_option_fails_at_once_without_loading(replicas):
    argv = [sys.executable, "-m", "fastgen.cli", "serve", "--port", str(free_port()), "--replicas", replicas,
            "--budget-tokens", "0"]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - start
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["fastgen: error: budget_tokens must be a positive integer, got 0"]
    assert elapsed < 5
    with pytest.raises(fastgen.InvalidRequestError) as e:
        fastgen.serve(budget_tokens=0, replicas=int(replicas))
    assert e.value.param == "budget_tokens"
