"""``budget_tokens="auto"``: the token budget measured for this host and model.

Dynamic SplitFuse fixes one token budget per forward pass. The paper picks it for one GPU,
where a forward pass costs about the same from 1 to a few hundred tokens. On a CPU the
step time grows almost linearly past a few dozen tokens, and every running decode waits
for the whole step: the budget *is* the inter-token latency. So the budget is measured:

1. the forward time of one fresh prompt chunk of ``n`` tokens is measured for a ladder of
   ``n`` (:data:`LADDER`; a few seconds in all, each point the median of a few calls), and
   past its top, doubling up to :data:`MAX_LADDER`, while the step stays under the target
   (a GPU, where a step of a few thousand tokens costs little more than one of 512);
2. the *efficiency floor* is the smallest ``n`` whose tokens/s reaches
   :data:`EFFICIENT_FRACTION` of the best on the ladder: below it the products are too
   thin to use the hardware and throughput collapses;
3. the budget is the largest ``n`` whose step time stays under the target inter-token
   latency (``target_itl_ms``), but never below the floor.

The curve and the choice are cached per host (CPU flags, threads, torch), model file,
dtype and kernels in fastgen's cache folder, so a warm start does not measure again. A curve cut
short by :data:`MAX_MEASURE_S` (a slow host, or one busy with other work) serves that start only
and is not cached.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .batch import SeqInput, build_batch
from .cache import KVPool
from .config import cache_dir, cpu_flags
from .model.spec import local_kv_heads

log = logging.getLogger(__name__)

LADDER = (16, 32, 64, 96, 128, 192, 256, 384, 512)
MAX_LADDER = 8192
EFFICIENT_FRACTION = 0.8
NUM_REPEATS = 3
MAX_MEASURE_S = 20.0


@dataclass(frozen=True)
class BudgetChoice:
    budget_tokens: int
    target_itl_ms: float
    efficient_floor_tokens: int
    curve: tuple[tuple[int, float], ...]     # (tokens per step, ms per step)
    cached: bool = False

    def describe(self) -> str:
        pts = ", ".join(f"{n}:{ms:.0f}ms" for n, ms in self.curve)
        return (f"budget_tokens={self.budget_tokens} (target ITL {self.target_itl_ms:.0f} ms, efficiency floor "
                f"{self.efficient_floor_tokens}; forward curve {pts}{'; cached' if self.cached else ''})")


def choose_budget(curve: list[tuple[int, float]], target_itl_ms: float) -> tuple[int, int]:
    """``(budget, floor)`` from ``curve`` = [(tokens per step, ms per step)] (see module doc)."""
    if not curve:
        raise ValueError("empty forward-time curve")
    curve = sorted(curve)
    rates = [n / ms for n, ms in curve]
    best = max(rates)
    floor = next(n for (n, _), r in zip(curve, rates) if r >= EFFICIENT_FRACTION * best)
    within = [n for n, ms in curve if ms <= target_itl_ms]
    budget = max([floor, *within])
    return budget, floor


def _host_key(model_path: str, dtype: torch.dtype, kernels: str, num_threads: int, block_size: int,
              device: torch.device, tensor_parallel_size: int = 1, precision: str = "") -> str:
    h = hashlib.sha256()
    h.update(" ".join(sorted(cpu_flags())).encode() or platform.processor().encode())
    st = os.stat(model_path) if os.path.isfile(model_path) else None
    if kernels != "torch":   # a curve measured through other native kernels is stale
        from .kernels import build_name, load
        h.update(build_name().encode())
        if load() and torch.ops.fastgen.have_amx():   # AMX tiles in use (FASTGEN_AMX=0: not)
            h.update(b"|amx")
    h.update(f"{model_path}|{st.st_size if st else 0}|{st.st_mtime_ns if st else 0}|{dtype}|{kernels}|"
             f"{num_threads}|{block_size}|{device}|{torch.__version__}|{LADDER}|{MAX_LADDER}".encode()
             + (f"|tp{tensor_parallel_size}".encode() if tensor_parallel_size > 1 else b"")
             + (f"|{precision}".encode() if precision else b""))
    return h.hexdigest()[:16]


def measure_curve(model: torch.nn.Module, *, model_config, num_kv_heads: int,
                  block_size: int, dtype: torch.dtype, device: torch.device, ladder: tuple[int, ...] = LADDER,
                  max_tokens: int | None = None, progress: Callable[[int], None] | None = None,
                  extend_under_ms: float | None = None) -> tuple[list[tuple[int, float]], bool]:
    """``(curve, complete)``: the median forward ms of one fresh chunk of ``n`` tokens, for each ``n``
    of ``ladder`` and, while the last step took at most ``extend_under_ms``, for twice the last
    ``n`` up to :data:`MAX_LADDER`; ``complete`` is False where :data:`MAX_MEASURE_S` cut it short.
    On a model whose steps run as CUDA graphs the pool has their spare block, so that the curve is
    measured through them (each size's first call, not timed, captures its graphs)."""
    limit = max_tokens if max_tokens is not None else MAX_LADDER
    sizes = [n for n in ladder if n <= limit]
    vocab_size = model_config.vocab_size
    spare = 1 if getattr(model, "uses_cuda_graphs", False) else 0
    pool = None
    gen = torch.Generator().manual_seed(0)
    curve: list[tuple[int, float]] = []
    t_start = time.perf_counter()
    i = 0
    while i < len(sizes):
        n = sizes[i]
        blocks = math.ceil(n / block_size)
        if pool is None or pool.num_blocks < blocks:
            pool = None         # the old one first: CUDA graphs adopt a new pool once the old is gone
            pool = KVPool.for_model(model_config, num_kv_heads=num_kv_heads,
                                    num_blocks=max(blocks, math.ceil(sizes[-1] / block_size)), block_size=block_size,
                                    dtype=dtype, device=device, spare_blocks=spare)
        ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        batch = build_batch([SeqInput(ids, 0, list(range(blocks)), 1)], block_size, device)
        times = []
        for r in range(NUM_REPEATS + 1):
            t0 = time.perf_counter()
            model(batch, pool)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if r:  # the first call warms up
                times.append(time.perf_counter() - t0)
        curve.append((n, statistics.median(times) * 1e3))
        if progress is not None:
            progress(n)
        if time.perf_counter() - t_start > MAX_MEASURE_S:
            log.warning("budget calibration stopped at %d tokens after %.0f s", n, MAX_MEASURE_S)
            return curve, False
        i += 1
        if (i == len(sizes) and extend_under_ms is not None and curve[-1][1] <= extend_under_ms
                and 2 * n <= min(limit, MAX_LADDER)):
            sizes.append(2 * n)
    return curve, True


# other processes' average CPU use (CPUs) past which a measurement is used for this start only
OTHER_LOAD_LIMIT = 0.25


class OtherLoad:
    """The CPUs other processes kept busy, on average, while a ``with`` block ran: the machine's
    busy time (``/proc/stat``) less this process's own CPU time, over the block's wall time; None
    where the platform does not say. A calibration measured beside other work would cache a slow
    curve for every later start (seen here: a start while another server's engine was still
    shutting down measured 2-3x slow products, and cached a budget of 192 instead of 256)."""

    cpus: float | None = None

    @staticmethod
    def _machine_busy_s() -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]   # user .. steal
            return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def __enter__(self) -> "OtherLoad":
        self._wall0, self._own0, self._busy0 = time.perf_counter(), time.process_time(), self._machine_busy_s()
        return self

    def __exit__(self, *exc) -> None:
        busy1, wall = self._machine_busy_s(), time.perf_counter() - self._wall0
        if busy1 is None or self._busy0 is None or wall <= 0:
            return
        own = time.process_time() - self._own0
        self.cpus = max(0.0, (busy1 - self._busy0) - own) / wall

    @property
    def too_busy(self) -> bool:
        return self.cpus is not None and self.cpus > OTHER_LOAD_LIMIT


def calibrate_budget(model: torch.nn.Module, *, model_path: str, target_itl_ms: float, kernels: str,
                     num_threads: int, max_tokens: int, tensor_parallel_size: int = 1, precision: str = "",
                     **shape) -> BudgetChoice:
    """The budget for this host and model, measured once and cached (see module doc);
    ``precision``: the weights' and activations' mode, part of the cache key (its speed differs)."""
    key = _host_key(model_path, shape["dtype"], kernels, num_threads, shape["block_size"], shape["device"],
                    tensor_parallel_size, precision)
    path: Path = cache_dir() / "budget" / f"{key}.json"
    curve: list[tuple[int, float]] | None = None
    cached = complete = False
    try:
        data = json.loads(path.read_text())
        curve = [tuple(p) for p in data["curve"]]
        measured = {n for n, _ in curve}
        # a curve answers this start if it was measured whole, holds every ladder size this start
        # may use, and stopped climbing past the ladder for a step over this target (or at the top)
        cached = complete = (data.get("complete") is True
                             and all(n in measured for n in LADDER if n <= max_tokens)
                             and (curve[-1][1] > target_itl_ms or 2 * curve[-1][0] > min(max_tokens, MAX_LADDER)))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not cached:
        from tqdm.auto import tqdm

        bar = tqdm(total=len([n for n in LADDER if n <= max_tokens]), desc="calibrating token budget",
                   unit="size", leave=False)

        def step(n: int) -> None:
            if bar.n >= bar.total:   # past the ladder's top (a GPU): the bar grows with the curve
                bar.total += 1
            bar.update(1)
        with OtherLoad() as load:
            curve, complete = measure_curve(model, progress=step, max_tokens=max_tokens,
                                            extend_under_ms=target_itl_ms, **shape)
        bar.close()
        if load.too_busy:
            log.warning("budget calibration not cached: other processes kept %.1f CPUs busy while it measured; "
                        "the next start measures again", load.cpus)
            complete = False
    # a curve cut short by MAX_MEASURE_S (a slow host, or one busy with other work while this
    # measured: seen here, a machine compiling beside it measured 11.5 s for 16 tokens) is used
    # for this start only, not cached: the next start measures again
    if not complete:
        log.warning("budget calibration not cached: the curve stopped at %d tokens; the next start measures "
                    "again", curve[-1][0])
    elif not cached:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"curve": curve, "complete": True}))
            tmp.replace(path)
        except OSError as e:
            log.warning("could not cache the budget calibration (%s)", e)
    budget, floor = choose_budget([(n, ms) for n, ms in curve if n <= max_tokens], target_itl_ms)
    choice = BudgetChoice(budget, target_itl_ms, floor, tuple((int(n), float(ms)) for n, ms in curve), cached)
    log.info("%s", choice.describe())
    return choice


def calibrate_engine_budget(model: torch.nn.Module, model_config, config, target_itl_ms: float,
                            kernel_choice: str = "") -> BudgetChoice:
    """:func:`calibrate_budget` for a loaded model and its resolved ``EngineConfig``;
    ``kernel_choice``: what else decides which kernels the curve runs through (the measured row
    limits, fastgen/row_limits.py), part of the cache key."""
    return calibrate_budget(
        model, model_path=config.model_path, target_itl_ms=target_itl_ms, kernels=config.kernels,
        num_threads=config.num_threads, max_tokens=config.max_model_len, model_config=model_config,
        tensor_parallel_size=config.tensor_parallel_size, num_kv_heads=local_kv_heads(model, model_config),
        precision=f"{config.quantization}|a8={config.int8_activations}{kernel_choice}",
        block_size=config.cache.block_size, dtype=config.dtype, device=config.device)
