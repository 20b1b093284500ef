"""The dashboard through the balancer (``--replicas 2``): the page is served, and the feed of
either replica is relayed, keyed, after a line listing the replicas."""
from __future__ import annotations

import json
import threading
import time

import httpx

from ..server.conftest import start_server, wait_until
from .conftest import KEY, SERVE_ARGS, auth


def test_the_balancer_serves_the_dashboard_and_relays_each_replicas_feed(tiny_model):
    srv = start_server(tiny_model, *SERVE_ARGS, "--replicas", "2", "--api-key", KEY, "--served-model-name", "tiny")
    try:
        assert wait_until(lambda: all(u["state"] == "up" for u in httpx.get(
            srv.url + "/replicas", headers=auth()).json()["upstreams"]), timeout_s=120)
        page = httpx.get(srv.url + "/dashboard")
        assert page.status_code == 200 and "dashboard/feed" in page.text
        assert httpx.get(srv.url + "/dashboard/feed?replica=1").status_code == 401
        assert httpx.get(srv.url + "/dashboard/feed?replica=7", headers=auth()).status_code == 400

        def load() -> None:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}
            threads = [threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions", json=body,
                                                                  headers=auth(), timeout=60)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for replica in (0, 1):
            records = []
            loader = threading.Thread(target=load)
            deadline = time.monotonic() + 30
            with httpx.stream("GET", f"{srv.url}/dashboard/feed?replica={replica}", headers=auth(), timeout=30) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    records.append(json.loads(line[6:]))
                    if len(records) == 2:
                        loader.start()
                    if any(x["kind"] == "step" for x in records[2:]) or time.monotonic() > deadline:
                        break
            loader.join(60)
            assert records[0]["kind"] == "replicas" and records[0]["replica"] == replica
            assert len(records[0]["replicas"]) == 2
            assert records[1]["kind"] == "hello" and records[1]["model"] == "tiny"
            assert any(x["kind"] == "step" for x in records[2:]), f"replica {replica} streamed no step records"
    finally:
        assert srv.stop() == 0, srv.log_tail()
