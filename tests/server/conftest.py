"""Real servers on 127.0.0.1 for the server tests: started as `fastgen serve` subprocesses on a
free port, waited for through /health, and always stopped (the whole process group) at teardown."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from fastgen.errors import ServerError
from fastgen.server.health import HealthProbe, wait_healthy
from fastgen.server.launch import free_port

START_TIMEOUT_S = 240


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: str
    saw_loading: bool = False  # /health answered 503 before it answered 200

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log_tail(self, num_chars: int = 3000) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-num_chars:]

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name (labels joined into the name)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Signal the server's process group; SIGKILL it if it has not exited in time."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
            except ProcessLookupError:
                pass
        return self.process.returncode


def start_server(*args: str, env: dict | None = None) -> ServerProcess:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="fastgen-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "fastgen.cli", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log.name)
    def note(answer: HealthProbe) -> None:
        server.saw_loading |= answer.status_code == 503

    try:
        wait_healthy(server.url, START_TIMEOUT_S, process=proc, on_probe=note)
    except ServerError as e:
        server.stop(signal.SIGKILL)
        pytest.fail(f"fastgen serve: {e}:\n{server.log_tail()}")
    return server


def serving(*args: str, env: dict | None = None) -> Iterator[ServerProcess]:
    """A fixture's body: a started server, stopped at teardown, which must exit 0 (a clean drain)."""
    srv = start_server(*args, env=env)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
