"""The balancer's routing, retries and restarts against fake upstreams (tests/server/fake_upstream.py:
stdlib processes that stream "x" tokens and load no model), in-process on 127.0.0.1. One real
replica behind the balancer end to end is tests/server/test_replicas.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

import httpx
import uvicorn

from fastgen.server.balancer import Balancer, Upstream, UpstreamState, create_balancer_app
from fastgen.server.config import ServerConfig
from fastgen.server.health import wait_healthy
from fastgen.server.launch import free_port

from .conftest import wait_until

FAKE = os.path.join(os.path.dirname(__file__), "fake_upstream.py")


def spawn_fake(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, FAKE, str(port)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextmanager
def running_balancer(upstreams: list[Upstream], spawn=spawn_fake, *, health_interval_s: float = 0.1,
                     wait_for: list[Upstream] | None = None):
    """A balancer app over ``upstreams`` served by uvicorn in a thread, once ``wait_for`` (default:
    every upstream) is up; yields (url, balancer)."""
    balancer = Balancer(upstreams, spawn, health_interval_s=health_interval_s, max_failed_health=2,
                        drain_timeout_s=1.0)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_balancer_app(ServerConfig(port=port), balancer),
                                           host="127.0.0.1", port=port, log_level="error", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: all(u.state is UpstreamState.UP for u in (wait_for or upstreams)), timeout_s=30), \
            [u.describe() for u in balancer.upstreams]
        yield url, balancer
    finally:
        server.should_exit = True
        thread.join(30)
        for u in upstreams:  # the lifespan terminated local replicas; be sure
            if u.process is not None and u.process.poll() is None:
                u.process.kill()


def local_upstreams(n: int) -> list[Upstream]:
    ports = [free_port() for _ in range(n)]
    return [Upstream(f"http://127.0.0.1:{p}", port=p) for p in ports]


def events(response):
    return (line for line in response.iter_lines() if line.startswith("data: "))


def replicas(url: str) -> list[dict]:
    return httpx.get(url + "/replicas", timeout=10).json()["upstreams"]


def stream(url: str, max_tokens: int):
    body = {"model": "fake", "prompt": "p", "max_tokens": max_tokens, "stream": True}
    return httpx.stream("POST", url + "/v1/completions", json=body, timeout=30)


def test_requests_go_to_the_upstream_with_least_outstanding_work():
    with running_balancer(local_upstreams(2)) as (url, balancer):
        with stream(url, 500) as a:
            a_events = events(a)   # kept: a dropped iter_lines() closes the connection
            next(a_events)
            busy = [r for r in replicas(url) if r["in_flight"] == 1]
            assert len(busy) == 1 and busy[0]["outstanding_tokens"] > 500
            # a short request goes to the idle upstream, not round-robin onto the busy one
            short = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p", "max_tokens": 2},
                               timeout=30).json()
            idle = next(u for u in balancer.upstreams if u.url != busy[0]["url"])
            assert short["pid"] == idle.process.pid
            with stream(url, 500) as b:   # a second long one, too: the idle upstream, not the busy one
                b_events = events(b)
                next(b_events)
                assert sorted(r["in_flight"] for r in replicas(url)) == [1, 1]
        assert wait_until(lambda: all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in replicas(url)),
                          timeout_s=10)


def test_a_killed_upstream_fails_its_stream_clearly_and_is_restarted():
    with running_balancer(local_upstreams(2)) as (url, balancer):
        with stream(url, 2000) as r:
            lines = events(r)
            first = json.loads(next(lines)[6:])
            [victim] = [u for u in replicas(url) if u["in_flight"] == 1]
            assert victim["pid"] == first["pid"]
            os.kill(victim["pid"], signal.SIGKILL)
            rest = list(lines)
        error = json.loads(rest[-1][len("data: "):])["error"]
        assert error["code"] == "upstream_failed" and victim["url"] in error["message"]
        for _ in range(6):  # while the victim is down or restarting, every request still succeeds
            answer = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p", "max_tokens": 3},
                                timeout=30)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        assert wait_until(lambda: next(u for u in replicas(url) if u["url"] == victim["url"])["num_restarts"] == 1,
                          timeout_s=20)
        assert wait_until(lambda: all(u["state"] == "up" for u in replicas(url)), timeout_s=20)
        restarted = next(u for u in replicas(url) if u["url"] == victim["url"])
        assert restarted["pid"] != victim["pid"]
        assert "fastgen_balancer_failed_in_flight_total 1.0" in httpx.get(url + "/metrics").text


def test_a_refused_connection_moves_the_request_to_another_upstream():
    """An upstream taken for up that refuses connections has not started the request: it is
    retried on the next one, and that upstream is marked down."""
    port = free_port()
    alive = spawn_fake(port)
    dead, up = Upstream(f"http://127.0.0.1:{free_port()}"), Upstream(f"http://127.0.0.1:{port}")
    try:
        wait_healthy(up.url, 30, process=alive)   # before the balancer's one health round
        # one health round at the start, then none for a minute: the test decides what is "up"
        with running_balancer([dead, up], spawn=None, health_interval_s=60, wait_for=[up]) as (url, balancer):
            dead.state = UpstreamState.UP      # as if the health check had not noticed yet
            up.outstanding_tokens = 10_000     # so the balancer tries the dead one first
            answer = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "p", "max_tokens": 2},
                                timeout=30)
            assert answer.status_code == 200 and answer.json()["pid"] == alive.pid
            assert dead.state is UpstreamState.DOWN and "ConnectError" in dead.last_error
            assert "fastgen_balancer_retries_total 1.0" in httpx.get(url + "/metrics").text
    finally:
        alive.kill()
        alive.wait()


def test_upstream_mode_balances_over_servers_it_does_not_own():
    ports = [free_port() for _ in range(2)]
    fakes = [spawn_fake(p) for p in ports]
    try:
        with running_balancer([Upstream(f"http://127.0.0.1:{p}") for p in ports], spawn=None) as (url, balancer):
            pids = {httpx.post(url + "/v1/chat/completions", timeout=30,
                               json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2}).json()["pid"] for _ in range(4)}
            assert pids <= {f.pid for f in fakes} and len(pids) == 2  # ties go to the least routed
            assert all(u["pid"] is None for u in replicas(url))   # not its processes: never restarted
    finally:
        for f in fakes:
            f.kill()
            f.wait()


def test_the_dashboard_feed_of_each_upstream_is_relayed_after_a_line_listing_them():
    with running_balancer(local_upstreams(2)) as (url, balancer):
        assert httpx.get(url + "/dashboard/feed?replica=7").status_code == 400
        for index, u in enumerate(balancer.upstreams):
            with httpx.stream("GET", f"{url}/dashboard/feed?replica={index}", timeout=30) as r:
                lines = events(r)
                records = [json.loads(next(lines)[6:]) for _ in range(3)]
            assert records[0] == {"kind": "replicas", "replica": index,
                                  "replicas": [{"url": x.url, "state": "up"} for x in balancer.upstreams]}
            assert records[1]["kind"] == "hello" and records[1]["pid"] == u.process.pid
            assert records[2]["kind"] == "step"
