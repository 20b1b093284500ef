"""Waiting for a server to be healthy: the one ``GET /health`` poll loop that the Python client
(:func:`fastgen.serve`), the load generator's HTTP target, the soak run and the test fixtures share.
The balancer's periodic check (``Balancer._check``) probes through :func:`probe_async` with the
same reading of the answer. Imports only httpx (no torch, no FastAPI): the client and the
balancer's processes stay light.
"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from ..errors import ServerError


@dataclass(frozen=True)
class HealthProbe:
    """One answer of ``/health``. ``status_code`` is ``None`` when nothing answered; ``state`` is the
    body's ``status`` field (``ok``, ``loading``, ``failed``...) when it had one; ``detail`` says
    what was seen, for error messages (``HTTP 503``, ``ConnectError: ...``)."""

    status_code: int | None
    state: str | None
    detail: str

    @property
    def ok(self) -> bool:
        return self.status_code == 200


def _read(r: httpx.Response) -> HealthProbe:
    state = None
    if r.status_code in (200, 503):
        try:
            body = r.json()
            state = body.get("status") if isinstance(body, dict) else None
        except ValueError:
            state = None
    return HealthProbe(r.status_code, state, f"HTTP {r.status_code}")


def _no_answer(e: Exception) -> HealthProbe:
    return HealthProbe(None, None, f"{type(e).__name__}: {e}")


def probe(url: str, *, headers: dict[str, str] | None = None, timeout_s: float = 2.0) -> HealthProbe:
    """``GET {url}/health`` once."""
    try:
        return _read(httpx.get(url + "/health", headers=headers, timeout=timeout_s))
    except httpx.HTTPError as e:
        return _no_answer(e)


async def probe_async(client: httpx.AsyncClient, url: str, timeout_s: float) -> HealthProbe:
    """``GET {url}/health`` once, on ``client`` (the balancer's)."""
    try:
        return _read(await client.get(url + "/health", timeout=timeout_s))
    except httpx.HTTPError as e:
        return _no_answer(e)


def wait_healthy(url: str, timeout_s: float, *, headers: dict[str, str] | None = None, poll_s: float = 0.25,
                 ready_statuses: tuple[int, ...] = (200,), process: subprocess.Popen | None = None,
                 on_probe: Callable[[HealthProbe], None] | None = None) -> HealthProbe:
    """Poll ``{url}/health`` until it answers one of ``ready_statuses``; return that answer.

    Probes at least once, however small ``timeout_s``. Raises :class:`ServerError` (status 503)
    with code ``server_exited`` when ``process`` exits first, or ``timeout`` once ``timeout_s``
    has passed (the message ends with the last answer seen, e.g. ``(HTTP 503)``). ``on_probe``
    sees every answer (a test fixture notes that the server answered 503 while loading).
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if process is not None and process.poll() is not None:
            raise ServerError(f"the server at {url} exited with code {process.returncode} before it was ready",
                              503, "server_exited")
        answer = probe(url, headers=headers, timeout_s=min(10.0, max(1.0, poll_s * 8)))
        if on_probe is not None:
            on_probe(answer)
        if answer.status_code in ready_statuses:
            return answer
        last = answer.detail
        if time.monotonic() > deadline:
            raise ServerError(f"the server at {url} was not ready after {timeout_s:g} s ({last})", 503, "timeout")
        time.sleep(poll_s)
