"""Ending a server: SIGTERM under load drains and exits 0; streams that outlive the drain timeout
end with a final chunk, an error event and ``[DONE]`` (no ASGI traceback in the log); and a port
already in use fails at once, before any model is loaded."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from ..server.conftest import start_server, wait_until
from .conftest import SERVE_ARGS


def stream_lines(url: str, body: dict, out: list, started: threading.Event | None = None) -> None:
    """Every SSE data line of one streamed completion, into ``out`` (an exception, if any, too)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    if started is not None:
                        started.set()
    except Exception as e:  # recorded: the test says which stream broke and how
        out.append(e)


def test_sigterm_under_load_drains_what_finishes_and_cuts_the_rest_cleanly(tiny_model):
    """One server, SIGTERM with a 1.5 s drain: six short requests (three streamed, three not)
    finish during the drain; four long streams are cut, each with a final chunk, an error event
    and [DONE]; the process exits 0 and its log names both, without a traceback."""
    srv = start_server(tiny_model, *SERVE_ARGS, "--drain-timeout-s", "1.5", "--served-model-name", "tiny")
    try:
        _drain_and_cut(srv)
    finally:
        srv.stop(signal.SIGKILL, timeout_s=10)  # only if a failed check left it running


def _drain_and_cut(srv) -> None:
    long_body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 1000, "ignore_eos": True,
                 "stream": True}
    short_body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
    long_outs = [[] for _ in range(4)]
    started = [threading.Event() for _ in long_outs]
    short_streams = [[] for _ in range(3)]
    plain: list = []

    def one_plain() -> None:
        try:
            plain.append(httpx.post(srv.url + "/v1/completions", json=short_body, timeout=60))
        except Exception as e:  # recorded, asserted on below
            plain.append(e)

    threads = [threading.Thread(target=stream_lines, args=(srv.url, long_body, o, e))
               for o, e in zip(long_outs, started)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started)
    shorts = [threading.Thread(target=stream_lines, args=(srv.url, {**short_body, "stream": True}, o))
              for o in short_streams] + [threading.Thread(target=one_plain) for _ in range(3)]
    for t in shorts:
        t.start()
    def reached_engine() -> float:  # running, waiting or already finished: a short may end before the last arrives
        m = srv.metrics()
        return m.get("fastgen_requests_running", 0) + m.get("fastgen_requests_waiting", 0) + \
            sum(v for k, v in m.items() if k.startswith("fastgen_requests_finished_total"))

    assert wait_until(lambda: reached_engine() >= 10, timeout_s=20, interval_s=0.01)
    assert srv.metrics().get("fastgen_requests_running", 0) >= 4    # the long ones at least
    assert srv.stop(signal.SIGTERM) == 0, srv.log_tail()
    for t in threads + shorts:
        t.join(60)
    for out in short_streams:  # drained: they ran to their end
        assert out[-1] == "[DONE]" and json.loads(out[-2])["choices"][0]["finish_reason"] == "length", out[-3:]
    assert len(plain) == 3
    for r in plain:
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 40
    for out in long_outs:  # cut: a final chunk that says so, an error event, [DONE]
        assert not any(isinstance(x, Exception) for x in out), out[-3:]
        assert out[-1] == "[DONE]", out[-3:]
        final, error = json.loads(out[-3]), json.loads(out[-2])
        assert final["choices"][0]["finish_reason"] == "abort"
        assert error["error"]["code"] == "server_shutdown" and "drain timeout" in error["error"]["message"]
        assert 1 < len(out) - 3 < 1000  # it was cut, after streaming some tokens
    log = srv.log_tail(20000)
    assert re.search(r"draining (\d+) request\(s\) in flight for up to 1.5 s", log), log
    assert "cutting 4 request(s) still running" in log, log
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log


def test_a_port_in_use_fails_at_once_before_loading(tiny_model):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "fastgen.cli", "serve", tiny_model, "--port", str(port),
                              "--dtype", "float32"], capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "already in use" in out.stderr
    assert "serving at" not in out.stderr and "loading" not in out.stderr.lower()
    assert "Traceback" not in out.stderr and "Errno" not in out.stderr
    assert elapsed < 30

