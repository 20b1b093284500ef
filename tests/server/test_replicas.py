"""`fastgen serve --replicas 2`: routing by outstanding work, and a replica killed under load:
its in-flight stream fails clearly, later requests all succeed, and it is restarted."""
from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest

from .conftest import start_server, wait_until

PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def balanced():
    srv = start_server("--replicas", "2", "--dtype", "float32", "--num-blocks", "64")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def replicas(srv) -> list[dict]:
    return httpx.get(srv.url + "/replicas", timeout=10).json()["upstreams"]


def all_up(srv) -> bool:
    return all(r["state"] == "up" for r in replicas(srv))


@pytest.fixture(scope="module")
def model(balanced):
    assert wait_until(lambda: all_up(balanced), timeout_s=240), replicas(balanced)
    return openai.OpenAI(base_url=balanced.v1, api_key="none", max_retries=0).models.list().data[0].id


def long_stream(srv, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    return httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=60)


def events(response):
    """The stream's SSE data lines. Keep the iterator: a dropped `iter_lines()` closes the connection."""
    return (line for line in response.iter_lines() if line.startswith("data: "))


def test_requests_go_to_the_replica_with_least_outstanding_work(balanced, model):
    with long_stream(balanced, model) as a, long_stream(balanced, model) as b:
        a_events, b_events = events(a), events(b)
        next(a_events)
        next(b_events)
        assert sorted(r["in_flight"] for r in replicas(balanced)) == [1, 1]
        assert all(r["outstanding_tokens"] > 1500 for r in replicas(balanced))
    assert wait_until(lambda: all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0
                                  for r in replicas(balanced)), timeout_s=10)
    oai = openai.OpenAI(base_url=balanced.v1, api_key="none", max_retries=0, timeout=120)
    texts = {oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
             for _ in range(4)}
    assert len(texts) == 1  # the same greedy text whichever replica answered


def test_killed_replica_fails_its_stream_and_later_requests_succeed(balanced, model):
    with long_stream(balanced, model) as r:
        stream = events(r)
        next(stream)
        [victim] = [u for u in replicas(balanced) if u["in_flight"] == 1]
        os.kill(victim["pid"], signal.SIGKILL)
        rest = list(stream)
    error = json.loads(rest[-1][len("data: "):])["error"]
    assert error["code"] == "upstream_failed" and victim["url"] in error["message"]

    oai = openai.OpenAI(base_url=balanced.v1, api_key="none", max_retries=0, timeout=120)
    for _ in range(6):
        assert oai.completions.create(model=model, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    assert wait_until(lambda: next(u for u in replicas(balanced) if u["url"] == victim["url"])["num_restarts"] == 1,
                      timeout_s=20)
    assert wait_until(lambda: all_up(balanced), timeout_s=240), replicas(balanced)
    restarted = next(u for u in replicas(balanced) if u["url"] == victim["url"])
    assert restarted["pid"] != victim["pid"]
    metrics = httpx.get(balanced.url + "/metrics").text
    assert "fastgen_balancer_failed_in_flight_total 1.0" in metrics


def test_upstream_mode_balances_over_other_servers(balanced, model):
    front = start_server("--upstream", balanced.url)
    try:
        assert [u["url"] for u in replicas(front)] == [balanced.url]
        oai = openai.OpenAI(base_url=front.v1, api_key="none", max_retries=0, timeout=120)
        r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        assert front.stop() == 0, front.log_tail()


def test_the_balancer_serves_the_dashboard_and_relays_each_replicas_feed(balanced, model):
    """The page through the balancer, and each replica's feed relayed after a line listing them."""
    import threading
    import time

    assert wait_until(lambda: all_up(balanced), timeout_s=240), replicas(balanced)
    page = httpx.get(balanced.url + "/dashboard")
    assert page.status_code == 200 and "dashboard/feed" in page.text
    assert httpx.get(balanced.url + "/dashboard/feed?replica=7").status_code == 400

    def load() -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
        threads = [threading.Thread(target=lambda: httpx.post(balanced.v1 + "/completions", json=body, timeout=120))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    for replica in (0, 1):
        records = []
        loader = threading.Thread(target=load)
        deadline = time.monotonic() + 60
        with httpx.stream("GET", f"{balanced.url}/dashboard/feed?replica={replica}", timeout=60) as r:
            assert r.status_code == 200
            for line in events(r):
                records.append(json.loads(line[6:]))
                if len(records) == 2:
                    loader.start()
                if any(x["kind"] == "step" for x in records[2:]) or time.monotonic() > deadline:
                    break
        loader.join(120)
        assert records[0]["kind"] == "replicas" and records[0]["replica"] == replica
        assert len(records[0]["replicas"]) == 2
        assert records[1]["kind"] == "hello" and records[1]["num_blocks"] == 64
        assert any(x["kind"] == "step" for x in records[2:]), f"replica {replica} streamed no step records"


def test_the_balancer_publishes_the_replicas_schema(balanced, model):
    ours = httpx.get(balanced.url + "/openapi.json", timeout=10).json()
    replica = httpx.get(replicas(balanced)[0]["url"] + "/openapi.json", timeout=10).json()
    proxied = {p: item for p, item in replica["paths"].items() if p not in ("/health", "/metrics")}
    assert all(ours["paths"][p] == item for p, item in proxied.items())  # the same bodies and answers
    assert "/replicas" in ours["paths"] and ours["components"]["schemas"] == replica["components"]["schemas"]
    assert httpx.get(balanced.url + "/docs", timeout=10).status_code == 200
