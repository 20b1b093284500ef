"""The HTTP target: any OpenAI-compatible server, measured with the same client.

Each request is a streaming ``POST /v1/completions`` of the prompt's text with
``max_tokens`` = its generation length, ``temperature`` 0 and ``stream_options.include_usage``;
by default also the ``ignore_eos`` and ``min_tokens`` extensions (vLLM, SGLang and fastgen
accept them) so that every request generates its full length. Each streamed chunk with text
is stamped on arrival: a chunk is a token for fastgen's server, possibly several for others,
so token gaps over HTTP are gaps between chunks (as ``vllm bench serve``'s ITL). The final
usage chunk gives the generated count and ``prompt_tokens``, which is checked against the
tokens the workload sent.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Sequence

import httpx
from tqdm.auto import tqdm

from ..errors import ServerError
from ..server.health import wait_healthy
from .engine_target import CUT_OFF, RunResult, run_duration
from .load import ClosedLoop, Load, RunLimits
from .metrics import RequestRecord
from .workload import BenchRequest

CONNECT_TIMEOUT_S = 10.0
MAX_ERROR_CHARS = 300


# The endpoint cannot be benchmarked (unreachable, or no model to name): the clients' one error class.
HTTPTargetError = ServerError


class HTTPTarget:
    def __init__(self, base_url: str, model: str | None = None, *, api_key: str | None = None,
                 length_extensions: bool = True, wait_ready_s: float = 0.0, salt_per_run: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.length_extensions = length_extensions
        # each load point sends its own cache_salt (fastgen's and vLLM's field), so it never hits
        # the prefix cache of the points before it, which sent the same requests
        self.salt_per_run = salt_per_run
        self._num_runs = 0
        self.wait_ready(wait_ready_s)
        self.model = model or self._served_model()

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Wait until ``GET /health`` answers 200 (a server without that route: at once)."""
        wait_healthy(self.base_url, timeout_s, headers=self.headers, poll_s=poll_s, ready_statuses=(200, 404))

    def _served_model(self) -> str:
        try:
            r = httpx.get(f"{self.base_url}/v1/models", headers=self.headers, timeout=CONNECT_TIMEOUT_S)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ServerError(f"cannot list the models of {self.base_url}/v1/models ({e}); pass the model name",
                              getattr(getattr(e, "response", None), "status_code", None)) from None

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": req.prompt_text, "max_tokens": req.max_new_tokens,
                                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        if self.length_extensions:
            body.update(ignore_eos=True, min_tokens=req.max_new_tokens)
        if self.salt_per_run:
            body["cache_salt"] = f"fastgen-bench-point-{self._num_runs}"
        return body

    def run(self, requests: Sequence[BenchRequest], load: Load, limits: RunLimits,
            desc: str = "") -> RunResult:
        self._num_runs += 1
        return asyncio.run(self._run(list(requests[:limits.num_requests]), load, limits, desc))

    async def _run(self, requests: list[BenchRequest], load: Load, limits: RunLimits, desc: str) -> RunResult:
        records: list[RequestRecord] = []
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        conn_limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        with tqdm(total=len(requests), desc=desc, leave=False, disable=None) as bar:
            async with httpx.AsyncClient(timeout=timeout, limits=conn_limits, headers=self.headers) as client:

                async def send(req: BenchRequest, arrival_s: float) -> None:
                    rec = RequestRecord(req.index, req.num_prompt_tokens, req.max_new_tokens, arrival_s)
                    records.append(rec)
                    try:
                        await self._stream(client, req, rec, clock)
                    except asyncio.CancelledError:
                        rec.error = CUT_OFF
                        raise
                    except httpx.HTTPError as e:
                        rec.error = f"{type(e).__name__}: {e}"
                    bar.update()

                if isinstance(load, ClosedLoop):
                    backlog = iter(requests)

                    async def client_loop() -> None:
                        for req in backlog:  # shared: each client takes the next request
                            await send(req, clock())

                    tasks = [asyncio.create_task(client_loop()) for _ in range(load.num_clients)]
                else:
                    async def at(req: BenchRequest, arrival_s: float) -> None:
                        await asyncio.sleep(max(0.0, arrival_s - clock()))
                        await send(req, arrival_s)

                    times = load.arrival_times_s(len(requests))
                    tasks = [asyncio.create_task(at(r, t)) for r, t in zip(requests, times)]
                _, pending = await asyncio.wait(tasks, timeout=limits.max_duration_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        timed_out = bool(pending)
        return RunResult(tuple(sorted(records, key=lambda r: r.arrival_s)),
                         run_duration(records, clock(), timed_out), timed_out)

    async def _stream(self, client: httpx.AsyncClient, req: BenchRequest, rec: RequestRecord, clock) -> None:
        num_chunks = 0
        async with client.stream("POST", f"{self.base_url}/v1/completions", json=self.body(req)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {text[:MAX_ERROR_CHARS]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                now = clock()
                try:
                    event = json.loads(payload)
                except ValueError:
                    rec.error = f"malformed stream event: {payload[:MAX_ERROR_CHARS]}"
                    return
                if "error" in event:
                    rec.error = f"stream error: {json.dumps(event['error'])[:MAX_ERROR_CHARS]}"
                    return
                if any(c.get("text") for c in event.get("choices") or []):
                    rec.token_times_s.append(now)
                    num_chunks += 1
                usage = event.get("usage")
                if usage:
                    rec.num_output_tokens = usage.get("completion_tokens", 0)
                    rec.reported_prompt_tokens = usage.get("prompt_tokens")
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if cached is not None:
                        rec.cached_prompt_tokens = cached
        rec.finish_s = clock()
        if not rec.num_output_tokens:
            rec.num_output_tokens = num_chunks
        if not rec.token_times_s:
            rec.error = "the stream carried no text"
