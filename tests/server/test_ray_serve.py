"""Replicas on Ray Serve, on a real two-node Ray cluster on this machine (one CPU per node, one
replica per node): the `openai` client streams through Serve's proxy, concurrent requests spread
over both replicas and nodes, the engine's queue (429) and Serve's (503) refuse clearly, and a
replica killed under load is replaced while the requests that had not started succeed elsewhere.

Every replica runs with max_seqs=2, max_queue=1 and Serve's max_ongoing_requests=2,
max_queued_requests=1, so that each limit is reached with a handful of streams.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest

with warnings.catch_warnings():  # Ray Serve's config models use pydantic's deprecated Field(**extra)
    warnings.simplefilter("ignore", DeprecationWarning)
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.cluster_utils import Cluster

    from fastgen.server import ray_app

from fastgen.errors import InvalidRequestError  # noqa: E402
from fastgen.server.launch import free_port  # noqa: E402

from .conftest import wait_until  # noqa: E402

PROMPT = "Once upon a time, in a land far away,"
DEPLOY_TIMEOUT_S = 240
# what `serve run fastgen.server.ray_app:build key=value ...` would pass: strings
ARGS = {"dtype": "float32", "num_blocks": "96", "max_model_len": "512", "budget_tokens": "128", "max_seqs": "2",
        "max_queue": "1", "replicas": "2", "num_cpus_per_replica": "1", "max_ongoing_requests": "2",
        "max_queued_requests": "1", "health_check_period_s": "1", "health_check_timeout_s": "10"}


@dataclass
class Deployed:
    url: str
    handle: object  # the ingress deployment's handle
    model: str

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@pytest.fixture(scope="module")
def deployed():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Ray's "no multi-node clusters here" switch: every node, the driver included, then uses
        # 127.0.0.1 instead of this machine's address, so all the cluster's traffic is loopback
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address)
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly",
                        logging_config={"log_level": "WARNING"})
            result: dict = {}
            runner = threading.Thread(target=lambda: result.update(
                handle=serve.run(ray_app.build(ARGS), name="fastgen", route_prefix="/")), daemon=True)
            runner.start()
            runner.join(DEPLOY_TIMEOUT_S)
            if "handle" not in result:
                pytest.fail(f"the fastgen application was not running after {DEPLOY_TIMEOUT_S} s: {serve.status()}")
            url = f"http://127.0.0.1:{port}"
            model = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).models.list().data[0].id
            yield Deployed(url, result["handle"], model)
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


def long_body(model: str, n: int = 1) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 300, "n": n, "stream": True, "ignore_eos": True}


@dataclass
class OpenStream:
    response: httpx.Response
    lines: object  # the response's line iterator: dropping it would close the connection

    @property
    def replica(self) -> str:
        return self.response.headers[ray_app.REPLICA_HEADER]

    @property
    def node(self) -> str:
        return self.response.headers[ray_app.NODE_HEADER]

    def rest(self) -> list[str]:
        """The stream's remaining data lines until it ends, or is cut (then without ``[DONE]``)."""
        out = []
        try:
            out += [line for line in self.lines if line.startswith("data: ")]
        except httpx.HTTPError:  # the connection ended mid-body
            pass
        return out


@contextmanager
def open_streams(d: Deployed, count: int, n: int = 1):
    """``count`` long streams, each open and past its first event before the next is sent (so
    Serve's router has counted it); closed, which aborts them, on exit."""
    with ExitStack() as stack:
        streams = []
        for _ in range(count):
            deadline = time.monotonic() + 10
            while True:
                r = stack.enter_context(httpx.stream("POST", d.v1 + "/completions", json=long_body(d.model, n),
                                                     timeout=60))
                # an aborted stream's queued choice leaves its replica's queue at the next step
                if r.status_code != 429 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            streams.append(OpenStream(r, lines))
        yield streams


def short_request(d: Deployed, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(d.v1 + "/completions", json={"model": d.model, "prompt": PROMPT, "max_tokens": 3},
                      timeout=timeout_s)


def replica_ids() -> set[str]:
    """The unique ids of the fastgen replicas the cluster holds (alive or being started)."""
    prefix = "SERVE_REPLICA::fastgen#fastgen#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def num_running_replicas() -> int:
    status = serve.status().applications["fastgen"].deployments["fastgen"]
    return status.replica_states.get("RUNNING", 0)


# -- builder arguments (no cluster) ------------------------------------------------------------------

def test_builder_arguments_are_the_serve_flags_and_bad_ones_are_refused():
    config, ray_config = ray_app.configs_from_args(
        {"num_blocks": "64", "budget_tokens": "auto", "prefix_caching": "false", "replicas": 3,
         "num_cpus_per_replica": "2.5", "max_queued_requests": "-1", "api_keys": "k1,k2"})
    assert dict(config.engine_options) == {"num_blocks": 64, "budget_tokens": "auto", "prefix_caching": False}
    assert config.replicas == 3 and config.api_keys == ("k1", "k2")
    assert ray_config.num_cpus_per_replica == 2.5 and ray_config.max_queued_requests == -1
    assert dict(ray_app.replica_threads(config, 2.5).engine_options)["num_threads"] == 2
    for args, param, words in [({"port": "8000"}, "port", "serve run --host/--port"),
                               ({"ray_address": "auto"}, "ray_address", "serve run --address"),
                               ({"num_block": "64"}, "num_block", "unknown argument; known: api_keys"),
                               ({"num_blocks": "many"}, "num_blocks", "expected int, got 'many'"),
                               ({"budget_tokens": "lots"}, "budget_tokens", "positive integer, got 'lots'"),
                               ({"num_blocks": "0"}, "num_blocks", "positive integer"),
                               ({"max_ongoing_requests": "0"}, "max_ongoing_requests", "must be >= 1")]:
        with pytest.raises(InvalidRequestError, match=words) as e:
            ray_app.configs_from_args(args)
        assert e.value.param == param


@pytest.mark.parametrize("flags, error", [
    (["--ray", "--num-cpus-per-replica", "0"], "num_cpus_per_replica: must be > 0, got 0.0"),
    (["--max-ongoing-requests", "4"], "--max-ongoing-requests needs --ray")])
def test_serve_refuses_bad_ray_options_before_starting_ray(flags, error):
    argv = [sys.executable, "-m", "fastgen.cli", "serve", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"fastgen: error: {error}"]


# -- on the cluster ----------------------------------------------------------------------------------

def test_openai_client_streams_through_the_ray_ingress(deployed):
    oai = openai.OpenAI(base_url=deployed.v1, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    chunks = list(oai.chat.completions.create(model=deployed.model, messages=messages, max_tokens=12,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # token by token, not at once
    assert chunks[-1].usage.completion_tokens == 12
    whole = oai.chat.completions.create(model=deployed.model, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text


def test_concurrent_streams_spread_over_both_replicas_and_nodes(deployed):
    with open_streams(deployed, 2) as (a, b):
        assert a.replica != b.replica and a.node != b.node
    # each replica's engine runs the one thread Ray reserved for it, not the node's every core
    info = deployed.handle.info.remote().result(timeout_s=30)
    assert info["num_cpus"] == 1 and info["num_threads"] == 1 and info["omp_num_threads"] == "1"


def test_full_engine_queue_answers_429_and_full_serve_queue_answers_503(deployed):
    oai = openai.OpenAI(base_url=deployed.v1, api_key="none", max_retries=0, timeout=60)
    # two choices of three run (max_seqs=2), one waits: that replica's queue (max_queue=1) is full
    with open_streams(deployed, 1, n=3):
        with httpx.stream("POST", deployed.v1 + "/completions", json=long_body(deployed.model, 3), timeout=60) as r:
            second = r.status_code  # 200 on the other replica, which fills its queue too; 429 on the same one
            with pytest.raises(openai.RateLimitError) as e:
                oai.completions.create(model=deployed.model, prompt=PROMPT, max_tokens=3)
    assert second in (200, 429)
    assert e.value.body["code"] == "queue_full" and e.value.response.headers["retry-after"] == "1"
    assert ray_app.REPLICA_HEADER in e.value.response.headers  # the replica's own refusal, through the proxy

    # both replicas hold max_ongoing_requests=2 streams: one request may wait in the proxy, more get 503
    with ThreadPoolExecutor(3) as pool:
        with open_streams(deployed, 4):
            requests = [pool.submit(short_request, deployed) for _ in range(3)]
            refused = [f for f in requests if _done_within(f, 3.0)]
            assert len(refused) >= 2 and all(f.result().status_code == 503 for f in refused)
            assert "backpressure" in refused[0].result().text
            waited = [f for f in requests if f not in refused]
        # the streams are closed: what waited in the proxy is answered
        assert all(f.result(timeout=60).status_code == 200 for f in waited)


def _done_within(future, timeout_s: float) -> bool:
    try:
        future.result(timeout=timeout_s)
    except TimeoutError:
        return False
    return True


def test_killed_replica_is_replaced_and_requests_that_had_not_started_succeed(deployed):
    before = replica_ids()
    assert len(before) == 2
    with ThreadPoolExecutor(1) as pool, open_streams(deployed, 4) as streams:
        victim = streams[0].replica
        survivor_streams = [s for s in streams if s.replica != victim]
        assert len(survivor_streams) == 2
        waiting = pool.submit(short_request, deployed)  # both replicas are full: it waits in the proxy
        assert not _done_within(waiting, 1.0)

        ray.kill(ray.get_actor(f"SERVE_REPLICA::fastgen#fastgen#{victim}", namespace="serve"), no_restart=True)
        t0 = time.monotonic()
        for cut in (s for s in streams if s.replica == victim):
            rest = cut.rest()
            assert "data: [DONE]" not in rest  # cut, not finished
        assert time.monotonic() - t0 < 30

        survivor_streams[0].response.close()  # a slot frees on the survivor: the waiting request goes there
        answer = waiting.result(timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers[ray_app.REPLICA_HEADER] == survivor_streams[0].replica
        assert json.loads(answer.text)["usage"]["completion_tokens"] == 3

    for _ in range(4):  # later requests all succeed while the victim is being replaced
        r = short_request(deployed)
        assert r.status_code == 200 and r.headers[ray_app.REPLICA_HEADER] != victim
    assert wait_until(lambda: num_running_replicas() == 2 and len(replica_ids() - before) == 1,
                      timeout_s=150, interval_s=1.0), (serve.status(), replica_ids())
    [replacement] = replica_ids() - before
    with open_streams(deployed, 2) as (a, b):
        assert {a.replica, b.replica} == {replacement, survivor_streams[0].replica}
