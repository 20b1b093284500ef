"""The reliability suite runs on a tiny random-weight model (tests/tiny_model.py): what it checks is
the server's and the engine's behaviour under faults and load, not the text. One shared server
(``tiny_server``) keeps the suite fast; tests that end a server start their own."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from ..server.conftest import start_server
from ..tiny_model import make_tiny_model

KEY = "reliability-key"
# one thread: the tiny model's steps take ~1-3 ms, and on a shared 2-core machine two threads
# spin against each other (measured 56 ms/step at load average 5.6, against 2.7 ms with one)
SERVE_ARGS = ("--dtype", "float32", "--num-blocks", "256", "--block-size", "16", "--budget-tokens", "64",
              "--num-threads", "1")
# the shared server's model ships sampling defaults: top_k 1 makes a request that sets none greedy
GENERATION_CONFIG = {"temperature": 0.9, "top_k": 1}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_model_with_defaults(tiny_model, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-llama-gen") / "model")
    shutil.copytree(tiny_model, folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    return folder


@pytest.fixture(scope="session")
def trace_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trace") / "steps.jsonl")


@pytest.fixture(scope="session")
def tiny_server(tiny_model_with_defaults, trace_path):
    srv = start_server(tiny_model_with_defaults, *SERVE_ARGS, "--api-key", KEY, "--served-model-name", "tiny",
                       "--trace-file", trace_path)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
