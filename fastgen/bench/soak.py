"""A soak: ``fastgen serve`` on 127.0.0.1 under a load that keeps its KV pool exhausted and its
admission queue full, for a bounded time and request count, while the server's resident memory
and open file descriptors are sampled.

    python -m fastgen.bench.soak --duration-s 1800             # `make soak` (30 min)
    python -m fastgen.bench.soak --duration-s 120 --model PATH --out soak.json

Each client runs a closed loop: a streamed completion (one in ``--drop-every`` is dropped after
its first tokens, as a user closing a tab), then the next. Every request is classified:
completed (a final chunk with a finish reason, then ``[DONE]``), refused (429, the only refusal
expected), dropped (by the client, on purpose), failed (any other error body or status) and
lost (the connection ended without a final answer: the number that must be 0). Memory and fd
slopes are least-squares fits over the second half of the run (after warm-up); latency drift
compares the median end-to-end latency of the first and last thirds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from ..errors import ServerError
from ..server.health import wait_healthy
from ..server.launch import free_port


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    refused: int = 0
    dropped: int = 0
    failed: int = 0
    lost: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    e2e_s: list[tuple[float, float]] = field(default_factory=list)   # (start offset, e2e)


def _proc_sample(pid: int) -> tuple[float, int]:
    """(resident MiB, open fds) of ``pid``, from /proc."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t_s, value) samples, per minute."""
    if len(samples) < 3:
        return 0.0
    ts = [t for t, _ in samples]
    vs = [v for _, v in samples]
    mt, mv = statistics.mean(ts), statistics.mean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return 0.0 if den == 0 else sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den * 60


async def client_loop(i: int, url: str, model: str, args, tally: Tally, t0: float, stop_at: float) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        n = 0
        while time.monotonic() < stop_at and tally.sent < args.max_requests:
            n += 1
            tally.sent += 1
            drop = args.drop_every > 0 and (i * 7919 + n) % args.drop_every == 0
            body = {"model": model, "prompt": f"Request {i}-{n}: " + "tell me a story " * rng.randint(2, 30),
                    "max_tokens": rng.randint(8, args.max_tokens), "stream": True, "ignore_eos": True,
                    "temperature": 0.8, "seed": n}
            start = time.monotonic()
            final = done = False
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code == 429:
                        tally.refused += 1
                        await asyncio.sleep(float(r.headers.get("retry-after", "1")) * rng.random())
                        continue
                    if r.status_code != 200:
                        key = f"HTTP {r.status_code}"
                        tally.failures[key] = tally.failures.get(key, 0) + 1
                        tally.failed += 1
                        continue
                    chunks = 0
                    error = None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            error = obj["error"].get("code") or obj["error"].get("type")
                        elif obj["choices"] and obj["choices"][0].get("finish_reason"):
                            final = True
                        chunks += 1
                        if drop and chunks == 2:
                            break
                if drop and not done:
                    tally.dropped += 1
                elif error is not None:
                    tally.failures[error] = tally.failures.get(error, 0) + 1
                    tally.failed += 1
                elif final and done:
                    tally.completed += 1
                    tally.e2e_s.append((start - t0, time.monotonic() - start))
                else:
                    tally.lost += 1
            except httpx.HTTPError as e:
                key = type(e).__name__
                tally.failures[key] = tally.failures.get(key, 0) + 1
                tally.lost += 1


async def run_load(url: str, model: str, args, tally: Tally, pid: int) -> dict:
    t0 = time.monotonic()
    stop_at = t0 + args.duration_s
    samples: list[tuple[float, float, int]] = []

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            rss, fds = _proc_sample(pid)
            samples.append((time.monotonic() - t0, rss, fds))
            await asyncio.sleep(args.sample_s)

    task = asyncio.create_task(sampler())
    await asyncio.gather(*(client_loop(i, url, model, args, tally, t0, stop_at) for i in range(args.clients)))
    task.cancel()
    elapsed = time.monotonic() - t0
    half = [s for s in samples if s[0] >= elapsed / 2] or samples
    thirds = sorted(tally.e2e_s)
    first = [e for s, e in thirds if s < elapsed / 3]
    last = [e for s, e in thirds if s >= 2 * elapsed / 3]
    return {
        "duration_s": round(elapsed, 1),
        "rss_mib": {"start": samples[0][1], "end": samples[-1][1], "max": max(s[1] for s in samples),
                    "slope_mib_per_min_2nd_half": round(slope_per_min([(t, r) for t, r, _ in half]), 3)},
        "open_fds": {"start": samples[0][2], "end": samples[-1][2], "max": max(s[2] for s in samples),
                     "slope_per_min_2nd_half": round(slope_per_min([(t, f) for t, _, f in half]), 3)},
        "e2e_median_s": {"first_third": round(statistics.median(first), 3) if first else None,
                         "last_third": round(statistics.median(last), 3) if last else None},
        "num_samples": len(samples),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastgen.bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--duration-s", type=float, default=1800.0, help="load time (default 1800 = 30 min)")
    p.add_argument("--max-requests", type=int, default=200000, help="stop after this many requests at most")
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--drop-every", type=int, default=10, help="one request in N is dropped mid-stream (0 = none)")
    p.add_argument("--num-blocks", type=int, default=48, help="a small KV pool, so that it stays exhausted")
    p.add_argument("--max-queue", type=int, default=16, help="a short admission queue, so that it stays full")
    p.add_argument("--budget-tokens", type=int, default=128)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("serve_args", nargs="*", help="more `fastgen serve` options, after --")
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fastgen.cli", "serve", *([args.model] if args.model else []),
           "--host", "127.0.0.1", "--port", str(port), "--num-blocks", str(args.num_blocks),
           "--max-queue", str(args.max_queue), "--budget-tokens", str(args.budget_tokens),
           "--served-model-name", "soak", *args.serve_args]
    log = open(os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        try:
            wait_healthy(url, 600, poll_s=0.5, process=proc)
        except ServerError as e:
            print(f"soak: {e}", file=sys.stderr)
            return 1
        tally = Tally()
        figures = asyncio.run(run_load(url, "soak", args, tally, proc.pid))
        metrics = httpx.get(url + "/metrics", timeout=10).text
        preemptions = next((float(l.split()[1]) for l in metrics.splitlines()
                            if l.startswith("fastgen_preemptions_total ")), None)
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    result = {"command": " ".join(["python -m fastgen.bench.soak", *(argv if argv is not None else sys.argv[1:])]),
              "requests": {k: v for k, v in asdict(tally).items() if k != "e2e_s"},
              "preemptions": preemptions, "server_exit_code": rc, **figures}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if tally.lost == 0 and rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
