"""One real replica behind the balancer, end to end: `fastgen serve --upstream URL` in front of a
`fastgen serve` of SmolLM2. The official client's completions (streamed and not) and chat come
through with the replica's text, the dashboard feed is relayed, and the balancer publishes the
replica's schema. Routing, retries and restarts are tests/server/test_balancer.py's, over fake
upstreams (they need several upstreams and a kill, not a model)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from .conftest import serving, wait_until

PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def replica():
    yield from serving("--dtype", "float32", "--num-blocks", "64")


@pytest.fixture(scope="module")
def balanced(replica):
    yield from serving("--upstream", replica.url)


def replicas(srv) -> list[dict]:
    return httpx.get(srv.url + "/replicas", timeout=10).json()["upstreams"]


@pytest.fixture(scope="module")
def model(balanced):
    assert wait_until(lambda: all(r["state"] == "up" for r in replicas(balanced)), timeout_s=240), replicas(balanced)
    return openai.OpenAI(base_url=balanced.v1, api_key="none", max_retries=0).models.list().data[0].id


def events(response):
    """The stream's SSE data lines. Keep the iterator: a dropped `iter_lines()` closes the connection."""
    return (line for line in response.iter_lines() if line.startswith("data: "))


def test_the_replicas_answers_come_through_the_balancer(balanced, replica, model):
    assert [u["url"] for u in replicas(balanced)] == [replica.url]
    direct = openai.OpenAI(base_url=replica.v1, api_key="none", max_retries=0, timeout=120)
    front = openai.OpenAI(base_url=balanced.v1, api_key="none", max_retries=0, timeout=120)
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    want = direct.completions.create(**kw).choices[0].text
    assert front.completions.create(**kw).choices[0].text == want
    streamed = front.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 6
    chat = front.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.usage.completion_tokens == 3
    assert wait_until(lambda: replicas(balanced)[0]["in_flight"] == 0 == replicas(balanced)[0]["outstanding_tokens"],
                      timeout_s=10)


def test_the_balancer_serves_the_dashboard_and_relays_the_replicas_feed(balanced, model):
    page = httpx.get(balanced.url + "/dashboard")
    assert page.status_code == 200 and "dashboard/feed" in page.text

    def load() -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
        httpx.post(balanced.v1 + "/completions", json=body, timeout=120)

    records = []
    loader = threading.Thread(target=load)
    deadline = time.monotonic() + 60
    with httpx.stream("GET", f"{balanced.url}/dashboard/feed?replica=0", timeout=60) as r:
        assert r.status_code == 200
        for line in events(r):
            records.append(json.loads(line[6:]))
            if len(records) == 2:
                loader.start()
            if any(x["kind"] == "step" for x in records[2:]) or time.monotonic() > deadline:
                break
    loader.join(120)
    assert records[0]["kind"] == "replicas" and records[0]["replica"] == 0 and len(records[0]["replicas"]) == 1
    assert records[1]["kind"] == "hello" and records[1]["num_blocks"] == 64
    assert any(x["kind"] == "step" for x in records[2:]), "the replica streamed no step records"


def test_the_balancer_publishes_the_replicas_schema(balanced, replica, model):
    ours = httpx.get(balanced.url + "/openapi.json", timeout=10).json()
    theirs = httpx.get(replica.url + "/openapi.json", timeout=10).json()
    proxied = {p: item for p, item in theirs["paths"].items() if p not in ("/health", "/metrics")}
    assert all(ours["paths"][p] == item for p, item in proxied.items())  # the same bodies and answers
    assert "/replicas" in ours["paths"] and ours["components"]["schemas"] == theirs["components"]["schemas"]
    assert httpx.get(balanced.url + "/docs", timeout=10).status_code == 200
