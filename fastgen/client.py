"""The client of a persistent deployment (MII's ``client``): the pipeline's API over HTTP.

    client = fastgen.serve()                     # or fastgen.client("http://127.0.0.1:8000")
    [r] = client.generate(["The capital of France is"], max_new_tokens=8, do_sample=False)
    for delta in client.stream("Once upon a time", max_new_tokens=32):
        print(delta, end="")
    client.terminate()                           # stops the server if this client started it

It speaks fastgen's native ``POST /generate``, so prompts and generate arguments mean exactly
what they mean to :func:`fastgen.pipeline` and the answers are the same :class:`Response`
objects. For OpenAI's API, point the ``openai`` package at ``<url>/v1``.
"""
from __future__ import annotations

import json
import subprocess
from typing import Any, Iterator

import httpx

from .errors import InvalidRequestError, ServerError
from .request import Response
from .server.health import probe, wait_healthy
from .server.wire import response_from_json

__all__ = ["Client", "ServerError", "client"]  # ServerError: fastgen.errors' own, named here as before


def _raise_for(status: int, body: bytes) -> None:
    try:
        err = json.loads(body)["error"]
        message, code, param = err["message"], err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError):
        message, code, param = body.decode("utf-8", "replace") or f"HTTP {status}", None, None
    if status in (400, 404):
        raise InvalidRequestError(message, param=param)
    raise ServerError(f"HTTP {status}: {message}", status, code, param)


class Client:
    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float | None = None,
                 process: subprocess.Popen | None = None) -> None:
        self.url = url.rstrip("/")
        self.process = process
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=10.0))

    def generate(self, prompts: Any, **generate_kwargs: Any) -> list[Response]:
        """Like calling the pipeline: one :class:`Response` per prompt, in input order."""
        r = self._http.post("/generate", json={"prompts": prompts, **generate_kwargs})
        if r.status_code != 200:
            _raise_for(r.status_code, r.content)
        return [response_from_json(b) for b in r.json()["responses"]]

    __call__ = generate

    def stream(self, prompt: Any, **generate_kwargs: Any) -> Iterator[str]:
        """Yield text deltas of one prompt as they are generated; closing the iterator early
        cancels the request on the server."""
        body = {"prompts": prompt, "stream": True, **generate_kwargs}
        with self._http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                _raise_for(r.status_code, r.read())
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    raise ServerError(err.get("message", "the request failed"), 500, err.get("code"))
                if event.get("text"):
                    yield event["text"]

    def is_healthy(self) -> bool:
        return probe(self.url, headers=dict(self._http.headers), timeout_s=5.0).ok

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until ``/health`` answers 200; raises if the server process exits or time runs out."""
        wait_healthy(self.url, timeout_s, process=self.process)

    def terminate(self, timeout_s: float = 60.0) -> None:
        """Close this client; stop the server (SIGTERM: it drains, then exits) if this client started it."""
        self._http.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()


def client(url: str, *, api_key: str | None = None, timeout_s: float | None = None) -> Client:
    """A client of the fastgen server at ``url`` (e.g. ``http://127.0.0.1:8000``)."""
    return Client(url, api_key=api_key, timeout_s=timeout_s)
