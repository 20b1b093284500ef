"""The launcher's allocator preload (fastgen/launcher.py): what it puts in the environment, and
that a re-executed process really runs with the allocator mapped."""
from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from fastgen.launcher import ALLOCATORS, CHOICE_ENV, MARK_ENV, preload_env

INSTALLED = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}


def fake_find(name: str) -> str | None:
    return INSTALLED.get(name)


def test_the_first_installed_allocator_is_preloaded_once_before_what_was_there():
    env = preload_env({"PATH": "/bin", "LD_PRELOAD": "/opt/libx.so"}, fake_find)
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/opt/libx.so"
    assert env[MARK_ENV] == "libtcmalloc_minimal.so.4" and env["PATH"] == "/bin"
    assert preload_env(env, fake_find) is None                      # the re-executed process stays
    assert preload_env({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, fake_find) is None


def test_the_allocator_can_be_chosen_or_declined():
    assert preload_env({CHOICE_ENV: "system"}, fake_find) is None
    assert preload_env({CHOICE_ENV: "jemalloc"}, fake_find)["LD_PRELOAD"] == "libjemalloc.so.2"
    assert preload_env({}, lambda name: None) is None               # auto, none installed: run as is
    with pytest.raises(ValueError, match="libtcmalloc.so is not installed"):
        preload_env({CHOICE_ENV: "tcmalloc"}, fake_find)
    with pytest.raises(ValueError, match="expected auto, system or one of"):
        preload_env({CHOICE_ENV: "mimalloc"}, fake_find)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")
def test_a_reexecuted_process_runs_with_the_allocator_mapped():
    lib = next(filter(None, map(ctypes.util.find_library, ALLOCATORS)), None)
    if lib is None:
        pytest.skip("no tcmalloc or jemalloc installed (make setup installs libtcmalloc-minimal4 where it may)")
    show = "import os; print(os.environ.get('FASTGEN_PRELOADED')); print(open('/proc/self/maps').read())"
    code = ("import sys; from fastgen.launcher import reexec_with_allocator; "
            f"reexec_with_allocator([sys.executable, '-c', {show!r}]); print('not re-executed')")
    env = {k: v for k, v in os.environ.items() if k not in (MARK_ENV, CHOICE_ENV)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.splitlines()[0] == lib and lib.split(".so")[0] in out
    declined = subprocess.run([sys.executable, "-c", code], env={**env, CHOICE_ENV: "system"}, capture_output=True,
                              text=True, timeout=60, check=True).stdout
    assert declined.strip() == "not re-executed"
