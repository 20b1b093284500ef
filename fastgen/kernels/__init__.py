"""fastgen's native CPU kernels, built once per host and loaded as ``torch.ops.fastgen.*``.

``csrc/cpu_kernels.cpp`` holds the work around the weight products, fused (RMSNorm with
the residual add, SiLU*up, RoPE with the KV-pool write) and attention that reads the KV
block pool in place (``paged_attention``). It is compiled by
``torch.utils.cpp_extension`` with ``-O3 -march=native`` into fastgen's cache folder,
keyed by the source, the torch version and the CPU's flags, so a rebuild happens only
when one of them changes. ``make setup`` builds it (``python -m fastgen.kernels``); an
engine that finds it missing builds it at start-up (about a minute on 2 cores, logged).

Where no compiler is present or the build fails, :func:`load` returns False and the
engine runs the pure-PyTorch path: the kernels are a speed-up, never a requirement.
They are CPU-only; on CUDA the PyTorch path runs.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from ..config import cache_dir, cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# every source of the extension (qgemm.cpp: quantized weights times many rows; qgemm_a8.cpp:
# the same with x quantized to int8; direct.cpp: the module of direct calls, see direct()), the
# longest compiles first: ninja starts them in this order, two at a time on two cores, so the
# two short ones fill in after them (compiles on the 2-core Zen 4 host: direct 17 s, cpu_kernels
# 19 s, qgemm_a8 10 s, qgemm 9 s; the other order left direct to run alone at the end)
SOURCES = (SOURCE.with_name("direct.cpp"), SOURCE, SOURCE.with_name("qgemm_a8.cpp"), SOURCE.with_name("qgemm.cpp"))
# included by the sources: part of the build key
HEADERS = (SOURCE.with_name("amx.h"), SOURCE.with_name("quant_rows.h"), SOURCE.with_name("gemm_tile.h"), SOURCE.with_name("fast_math.h"))
_lock = threading.Lock()
_background_lock = threading.Lock()   # load_in_background's flag only (never held while building)
_state: dict[str, bool] = {}
_module: list = []     # the extension's Python module, once loaded (see direct())


# -fno-trapping-math: without it GCC keeps floor() scalar, and with it every loop that calls
# fast_exp (SiLU: 336 us -> see docs for 256 x 1536); no code here relies on FP traps.
# FASTGEN_KERNEL_MARCH builds for another ISA than this host's (e.g. "icelake-server": AVX-512
# and VNNI, no AMX or AVX512-BF16), to run the kernels another kind of host would build; any
# -march value the compiler knows, and the build key changes with it
MARCH = os.environ.get("FASTGEN_KERNEL_MARCH", "native")
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def build_name() -> str:
    """Extension name: changes with the source, the flags, torch and the CPU's ISA (``-march=native``)."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(" ".join(sorted(cpu_flags())).encode() or platform.processor().encode())
    return f"fastgen_cpu_kernels_{h.hexdigest()[:12]}"


def load(verbose: bool = False) -> bool:
    """Build (first time on this host) and load the kernels; True when ``torch.ops.fastgen`` works."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        _state["ok"] = _load(verbose)
        return _state["ok"]


def load_in_background() -> None:
    """Start :func:`load` on a thread and return: a first start builds the kernels (~40 s on 2
    cores, in a compiler subprocess) while the caller converts the model's GGUF metadata (~7.5 s
    of Python), instead of after it. The caller's own :func:`load` then waits for that one. Never
    waits itself (a load in flight holds the build lock: only the flag's own lock is taken here)."""
    with _background_lock:
        if "ok" in _state or "background" in _state:
            return
        _state["background"] = True
    # torch's extension builder is imported here, on the caller's thread (~0.1 s), not on the
    # new one: its import brings setuptools, whose import hook (_distutils_hack) joins
    # sys.meta_path, and on the thread it ran while the caller imported transformers (the
    # engine's config, right after this call). A CI run once failed in that window, in a
    # server's start: "No module named 'huggingface_hub.utils'" from transformers' import,
    # with the package installed, not seen before or after; the thread now imports nothing new
    from torch.utils import cpp_extension  # noqa: F401
    threading.Thread(target=load, name="fastgen-kernels-load", daemon=True).start()


def _load(verbose: bool) -> bool:
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return False
    name = build_name()
    build_dir = cache_dir() / "kernels" / name
    # the `ninja` wheel puts its binary beside the interpreter; a venv is not always on PATH
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        built = any(build_dir.glob(f"{name}*.so"))
        if not built:
            log.warning("building fastgen's native CPU kernels for this host (once; about a minute)...")
        t0 = time.perf_counter()
        # torch's build lock is a plain file that a killed build (Ctrl-C, a test run stopped
        # mid-build) leaves behind, and every later load then waits on it forever. Builders take
        # an OS lock first, which dies with its process: whoever holds it is the only builder, so
        # a torch lock found then is stale.
        with open(build_dir / "fastgen-build.lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            with BuildProgress(build_dir, name, enabled=not built):
                module = cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                                            build_directory=str(build_dir), extra_cflags=CFLAGS,
                                            extra_ldflags=["-fopenmp"], is_python_module=True, verbose=verbose)
        if not built:
            log.warning("native CPU kernels built in %.0f s (%s)", time.perf_counter() - t0, build_dir)
        ok = hasattr(torch.ops.fastgen, "paged_attention") and hasattr(torch.ops.fastgen, "qgemm")
        if ok:
            _module.append(module)
        return ok
    except Exception as e:  # no compiler, no headers, a build error: the PyTorch path still works
        log.warning("fastgen's native CPU kernels are unavailable (%s); using the PyTorch path",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


class BuildProgress:
    """A progress bar over a first build: one step per object file that ninja has written in
    ``build_dir`` (one a source) and one for the linked library, polled twice a second while the
    build runs (torch's loader shows nothing of it otherwise: the ~40 s of a first start on a
    2-core host would pass in silence)."""

    def __init__(self, build_dir: Path, name: str, enabled: bool = True) -> None:
        self.build_dir, self.name, self.enabled = build_dir, name, enabled
        self._done = threading.Event()
        self._ok = False
        self._thread: threading.Thread | None = None

    def steps_done(self, since: float) -> int:
        """Files of this build written since ``since`` (time.time()): its objects and its library."""
        outputs = [self.build_dir / (src.stem + ".o") for src in SOURCES]
        outputs.append(self.build_dir / f"{self.name}.so")
        return sum(1 for p in outputs if p.is_file() and p.stat().st_mtime >= since)

    def _watch(self, since: float) -> None:
        from tqdm.auto import tqdm

        with tqdm(total=len(SOURCES) + 1, desc="building native CPU kernels", unit="file", leave=False) as bar:
            while True:
                finished = self._done.wait(0.5)
                # a built library counts every step (ninja skips objects an earlier build left)
                done = bar.total if self._ok else self.steps_done(since)
                if done != bar.n:   # only on a step: a log (no terminal) gets a line a step, not one a poll
                    bar.update(done - bar.n)
                if finished:
                    return

    def __enter__(self) -> "BuildProgress":
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, args=(time.time() - 1.0,),
                                            name="fastgen-build-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._ok = exc_type is None
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def direct():
    """The extension's module of direct calls (csrc/direct.cpp), or None before :func:`load`
    succeeded: ``direct().qgemv(...)`` takes the arguments of ``torch.ops.fastgen.qgemv`` and
    calls the same kernel through the dispatcher, without torch.ops' per-call Python work
    (~1 us less a call: 1.72 -> 0.73 us for an op that only allocates its output). The model's
    hot paths call these; tests and tracing may use either."""
    return _module[0] if _module else None


def fast_op(name: str):
    """The quickest callable of op ``name`` (``direct().<name>``, else the ``torch.ops.fastgen``
    overload): what the model's hot paths hold."""
    d = direct()
    if d is not None and hasattr(d, name):
        return getattr(d, name)
    return getattr(torch.ops.fastgen, name).default
