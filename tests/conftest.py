"""Shared fixtures. The real SmolLM2 is loaded once per session, in fp32, for exact comparisons."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(len(os.sched_getaffinity(0)))


def _session_cache_dir() -> None:
    """What a test run measures under its own load (the token budget's curve, the kernels' row
    limits) goes to a cache folder of this session, never into the user's, where the next
    `fastgen serve` would read it back: a curve measured beside the suite took 350 ms for 256
    tokens (125-165 ms on the quiet host) and gave that server a budget of 64. The built kernels
    and the converted GGUF metadata stay shared with the user's cache (both slow to make), and the
    servers the tests start inherit the folder."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    from fastgen.config import cache_dir

    real = cache_dir()
    session = Path(tempfile.mkdtemp(prefix="fastgen-test-cache-"))
    for shared in ("kernels", "gguf-meta"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        (session / shared).symlink_to(real / shared, target_is_directory=True)
    os.environ["FASTGEN_CACHE_DIR"] = str(session)
    atexit.register(shutil.rmtree, session, ignore_errors=True)


_session_cache_dir()
# the kernels' fixed row limits, whatever this host measures (fastgen/row_limits.py): which
# kernel takes a product stays the same on every host; tests/unit/test_row_limits.py measures
os.environ.setdefault("FASTGEN_ROW_LIMITS", "fixed")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from fastgen.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_pipe():
    import fastgen

    return fastgen.pipeline(dtype="float32")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' own GGUF loader and model: the reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
    return model.eval()


def _amx_here() -> bool:
    """Whether the native kernels run AMX tiles on this host (built with them, granted by the OS)."""
    from fastgen import kernels

    return bool(kernels.load() and torch.ops.fastgen.have_amx())


def pytest_generate_tests(metafunc):
    # tests that take the `amx` fixture run the vector path everywhere and the AMX path where the
    # CPU has it (collected only there: elsewhere the vector path is the only one)
    if "amx" in metafunc.fixturenames:
        params = [False, True] if _amx_here() else [False]
        metafunc.parametrize("amx", params, ids=["vector", "amx"][:len(params)], indirect=True)


@pytest.fixture
def amx(request):
    """The native kernels' bf16 paths for prompt rows (qgemm, the chunk attention): AVX512 vectors,
    or AMX tiles (fastgen/kernels/csrc/amx.h), by ``torch.ops.fastgen.set_amx``; put back after."""
    from fastgen import kernels

    if not kernels.load():
        pytest.fail("fastgen's native kernels did not build on this host")
    ops = torch.ops.fastgen
    was = ops.set_amx(request.param)
    assert ops.have_amx() is request.param
    yield request.param
    ops.set_amx(was)
