"""`fastgen serve --tensor-parallel-size 2`: the official client streams from a two-rank replica
with the same greedy text as one rank; a rank killed under a stream ends the replica with a
clear error and exit code 1, in bounded time, and SIGTERM stops every rank."""
from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil
import pytest

from ..tiny_model import make_tiny_model

from .conftest import start_server, wait_until

OPTS = ("--dtype", "float32", "--num-blocks", "64", "--budget-tokens", "64")


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> tuple[str, ...]:
    return (make_tiny_model(str(tmp_path_factory.mktemp("tiny"))), *OPTS)


def ranks(srv) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.process.pid).children(recursive=True)
            if "fastgen.parallel.worker" in " ".join(p.cmdline())]


def greedy_text(srv, n: int = 12) -> str:
    oai = openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    chunks = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=n,
                                    temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def one_rank_text(args: tuple[str, ...], n: int = 12) -> str:
    """The greedy text of one rank, in process (no server: the server's greedy text equals the
    pipeline's, which tests/server/test_openai_server.py checks for the Python client)."""
    import fastgen

    pipe = fastgen.pipeline(args[0], dtype="float32", num_blocks=64, budget_tokens=64)
    try:
        [r] = pipe(["The capital of France is"], max_new_tokens=n, do_sample=False)
        return r.generated_text
    finally:
        pipe.engine.close()


def test_two_ranks_serve_the_same_text_and_stop_together(args):
    expected = one_rank_text(args)
    two = start_server(*args, "--tensor-parallel-size", "2")
    try:
        [worker] = ranks(two)
        assert greedy_text(two) == expected
    finally:
        assert two.stop() == 0, two.log_tail()
    assert wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, timeout_s=20)


def test_a_killed_rank_ends_the_replica_with_a_clear_error(args):
    srv = start_server(*args, "--tensor-parallel-size", "2")
    try:
        [worker] = ranks(srv)
        body = {"model": "x", "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
        oai_model = httpx.get(srv.v1 + "/models", timeout=10).json()["data"][0]["id"]
        with httpx.stream("POST", srv.v1 + "/completions", json={**body, "model": oai_model}, timeout=60) as r:
            lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
            next(lines)
            os.kill(worker.pid, signal.SIGKILL)
            rest = list(lines)      # the stream ends (it does not hang) with an error
        assert any("error" in ln for ln in rest), rest[-3:]
        srv.process.wait(60)
        assert srv.process.returncode == 1
        log = srv.log_tail(6000)
        assert "tensor parallelism failed (rank 1 exited with code -9)" in log, log
    finally:
        srv.stop(signal.SIGKILL)
