"""What the ``fastgen`` command sets up for its process before anything else: a faster memory
allocator, preloaded where one is installed.

The engine allocates and frees tensors and kernel buffers hundreds of times a step; glibc's
malloc returns large blocks to the system and maps them again. Measured on the 2-core Zen 5 host
(AVX512-BF16), two long-lived processes run in alternating bursts: with tcmalloc preloaded
(``libtcmalloc_minimal``, Debian's ``libtcmalloc-minimal4``) a batch-1 decode ``Engine.step()``
took 0.89x the time (5.20 -> 4.63 ms, faster in 10 of 10 rounds) and a 1,024-token prefill 0.97x
(7 of 8 rounds); jemalloc measured level with tcmalloc (1.00x, 8 rounds); Intel's OpenMP runtime
(``libiomp5`` from the ``intel-openmp`` wheel) showed no consistent change and is not used.

So ``fastgen`` (every subcommand, when run as the command) re-executes itself once with the first
allocator of :data:`ALLOCATORS` that the dynamic loader finds in ``LD_PRELOAD``; the processes it
starts (replicas, tensor-parallel ranks) inherit it. ``FASTGEN_ALLOCATOR=system`` keeps glibc's
malloc; ``FASTGEN_ALLOCATOR=jemalloc`` (or another name of the list) asks for that one and fails
clearly if it is not installed. In-process use (``fastgen.pipeline``) is left as the host process
has it: preloading needs a fresh process.
"""
from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from typing import Callable, Mapping

log = logging.getLogger(__name__)

ALLOCATORS = ("tcmalloc_minimal", "tcmalloc", "jemalloc")
CHOICE_ENV = "FASTGEN_ALLOCATOR"      # auto (default) | system | one of ALLOCATORS
MARK_ENV = "FASTGEN_PRELOADED"        # set in the re-executed process: never twice


def preload_env(env: Mapping[str, str], find: Callable[[str], str | None] = ctypes.util.find_library,
                ) -> dict[str, str] | None:
    """The environment to re-execute in, with the allocator in ``LD_PRELOAD``; None when the
    process should run as it is (asked not to, already done, or none installed under ``auto``).
    ``ValueError`` for an unknown or missing allocator asked for by name."""
    choice = env.get(CHOICE_ENV, "auto")
    if choice == "system" or env.get(MARK_ENV):
        return None
    if choice != "auto" and choice not in ALLOCATORS:
        raise ValueError(f"{CHOICE_ENV}={choice!r}: expected auto, system or one of {list(ALLOCATORS)}")
    names = ALLOCATORS if choice == "auto" else (choice,)
    lib = next((found for found in map(find, names) if found), None)
    if lib is None:
        if choice != "auto":
            raise ValueError(f"{CHOICE_ENV}={choice!r}: lib{choice}.so is not installed "
                             f"(Debian: libtcmalloc-minimal4, libjemalloc2)")
        return None
    preloaded = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if any(os.path.basename(p).startswith(lib.split(".so")[0]) for p in preloaded):
        return None
    return {**env, "LD_PRELOAD": ":".join([lib, *preloaded]), MARK_ENV: lib}


def reexec_with_allocator(command: list[str]) -> None:
    """Replace this process by ``command`` (argv, the program first) with the allocator preloaded,
    where :func:`preload_env` says to; return otherwise. Linux only."""
    if not sys.platform.startswith("linux"):
        return
    try:
        env = preload_env(os.environ)
    except ValueError as e:
        raise SystemExit(f"fastgen: error: {e}") from None
    if env is None:
        return
    log.info("re-executing with %s preloaded", env[MARK_ENV])
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(command[0], command, env)
