"""The dashboard and what feeds it, on a live server under load: the page is served open and is
self-contained (no external URL), the SSE feed is keyed and yields valid step records and request
events while requests run, ``--trace-file`` holds the same records and ``fastgen trace`` draws
them; and two fixes a new user hit: ``max_tokens`` beyond the context is a 400, and a model's
own sampling defaults apply to requests that leave them out."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from fastgen.telemetry import read_trace

from .conftest import KEY, auth


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(key) if key else {}, timeout=60)


def read_feed(server, until, timeout_s: float = 20.0, headers=None) -> list[dict]:
    """Records of the feed until ``until(records)`` is true (or the time is up)."""
    records: list[dict] = []
    deadline = time.monotonic() + timeout_s
    with httpx.stream("GET", server.url + "/dashboard/feed", headers=headers or auth(), timeout=timeout_s) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                records.append(json.loads(line[6:]))
                if until(records) or time.monotonic() > deadline:
                    break
    return records


def test_page_is_served_open_and_self_contained(tiny_server):
    r = httpx.get(tiny_server.url + "/dashboard")  # no key: the page holds no data
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<canvas" in page and "dashboard/feed" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page loads something from outside"
    assert not re.search(r"https?://", page), "an external URL in the page"
    assert "Authorization" in page  # the key goes in a header, not the URL


def test_feed_needs_the_key(tiny_server):
    assert httpx.get(tiny_server.url + "/dashboard/feed").status_code == 401
    assert httpx.get(tiny_server.url + "/dashboard/feed", headers=auth("wrong")).status_code == 401


def test_feed_yields_step_records_and_request_events_while_requests_run(tiny_server):
    def load() -> None:
        for _ in range(3):
            post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": ["Hello there"] * 4,
                                                  "max_tokens": 24, "ignore_eos": True})

    t = threading.Thread(target=load)
    seen_finished = lambda recs: sum(1 for x in recs if x.get("event") == "finished") >= 12  # noqa: E731
    t.start()
    try:
        records = read_feed(tiny_server, seen_finished)
    finally:
        t.join(60)
    hello, rest = records[0], records[1:]
    assert hello["kind"] == "hello" and hello["model"] == "tiny" and hello["budget_tokens"] == 64
    assert hello["num_blocks"] == 256 and hello["block_size"] == 16
    steps = [x for x in rest if x["kind"] == "step"]
    events = [x for x in rest if x["kind"] == "request"]
    assert steps and events
    seqs = [x["seq"] for x in rest]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for s in steps:
        assert 0 < s["prompt_tokens"] + s["decode_tokens"] <= s["budget_tokens"] == 64
        assert s["num_seqs"] == len(s["progress"]) >= 1
        assert s["kv_blocks_used"] + s["kv_blocks_cached"] + s["kv_blocks_free"] == 256  # the whole pool
        assert s["step_time_s"] > 0 and s["wall_s"] > 1.7e9 and not s["failed"]
    assert any(s["decode_tokens"] == 4 for s in steps)  # four sequences decoding together
    assert steps[-1]["kv_blocks_cached"] > 0             # their full blocks stay cached after they finish
    kinds = {e["event"] for e in events}
    assert kinds == {"arrived", "scheduled", "first_token", "finished"}
    finished = [e for e in events if e["event"] == "finished"]
    assert all(e["finish_reason"] == "length" and e["output_tokens"] == 24 for e in finished)
    assert all(e["ttft_s"] > 0 for e in events if e["event"] == "first_token")


def test_a_page_connecting_later_gets_recent_records(tiny_server):
    post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4})
    [hello] = read_feed(tiny_server, lambda recs: True)
    assert hello["recent"] and hello["recent"][-1]["seq"] >= 1


def test_trace_file_holds_the_records_and_fastgen_trace_draws_them(tiny_server, trace_path, tmp_path):
    post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": ["Once", "upon a time"], "max_tokens": 8})
    records = read_trace(trace_path)
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and any(r["kind"] == "request" and r["event"] == "finished" for r in records)
    png = tmp_path / "steps.png"
    out = subprocess.run([sys.executable, "-m", "fastgen.cli", "trace", trace_path, "--out", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{len(steps)} steps" in out.stdout


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1020}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 5000},
     "max_completion_tokens"),
])
def test_max_tokens_beyond_the_context_is_a_400(tiny_server, path, body, param):
    r = post(tiny_server, path, {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "context_length_exceeded"
    assert "1024" in err["message"] and "max_length" not in err["message"] and "None" not in err["message"]


def test_a_prompt_too_long_does_not_mention_max_length_none(tiny_server):
    r = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": list(range(1, 1100))})
    assert r.status_code == 400
    assert "max_length" not in r.json()["error"]["message"]


def test_the_models_sampling_defaults_apply_when_the_request_gives_none(tiny_server):
    def text(**extra) -> str:
        r = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "The weather", "max_tokens": 12,
                                                   "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(seed=1) == text(seed=2) == greedy         # generation_config's top_k 1
    sampled = {text(seed=s, top_k=0, temperature=1.0) for s in range(4)}   # the request's own values win
    assert len(sampled) > 1


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(tiny_server):
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "docs/grafana/fastgen-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bfastgen_\w+", e)}
    exported = set(httpx.get(tiny_server.url + "/metrics").text.split())
    names = {w.split("{")[0] for w in exported if w.startswith("fastgen_")}
    missing = {m for m in used if m not in names and not m.startswith("fastgen_balancer_")}
    assert not missing, missing
    assert len(dashboard["panels"]) >= 8


def _chromium() -> str | None:
    import shutil

    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium on this machine (Debian: apt-get install chromium)")
def test_headless_chromium_sees_the_step_chart_update_and_the_request_table_fill(tiny_server, tmp_path):
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": ["Hello there", "Once upon a time"],
                                                  "max_tokens": 200, "ignore_eos": True})

    t = threading.Thread(target=load)
    t.start()
    try:
        for budget_ms in (6000, 12000, 20000):  # virtual time: a loaded machine may need more to connect
            out = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                                  "--window-size=1400,1000", f"--virtual-time-budget={budget_ms}",
                                  "--enable-logging=stderr", "--v=0", "--dump-dom",
                                  f"{tiny_server.url}/dashboard#key={KEY}"],
                                 capture_output=True, text=True, timeout=90, cwd=tmp_path)
            m = re.search(r"steps seen (\d+)", out.stdout)
            if m and int(m.group(1)) > 0 and '<tbody id="live"><tr>' in out.stdout:
                break
    finally:
        stop.set()
        t.join(60)
    dom = out.stdout
    assert m and int(m.group(1)) > 0, dom[-2000:]
    assert re.search(r'<tbody id="live"><tr><td>\d+-\d+</td>', dom), "the request table stayed empty"
    assert ">live<" in dom
    assert "Uncaught" not in out.stderr and "CONSOLE" not in out.stderr, out.stderr[-2000:]
