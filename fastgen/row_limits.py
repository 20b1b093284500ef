"""The row limits of the quantized kernels, measured for this host and model at start-up.

A :class:`~fastgen.model.quant.QuantWeight` with int8 activations sends a product to one of three
kernels by its number of rows: ``qgemv`` (each weight streamed once, every row summed alone) up
to ``max_qgemv_rows``, ``qgemm`` (the weights dequantized a panel at a time, the rows multiplied
in tiles) above that, and ``qgemm_a8`` (the same tiles in int8 through VNNI) from
``min_a8_rows``. Where one kernel overtakes another depends on the host: on the Zen 5 host
``qgemm_a8`` lost to ``qgemm`` at 16 rows and was level at 64; on the Zen 4 host qgemv won up to
12-14 rows, where the exact kernels' limit had been 6. So, as for the token budget
(fastgen/calibrate.py), the engine measures them once per host and model:

0. on AVX-512 hosts, which of ``qgemm_a8``'s two many-row kernels runs: the lane kernel (one
   output feature per vector lane) against the block kernels (one row per lane), over the
   model's 4-bit layer products at :data:`A8_KERNEL_ROWS` rows. Their outputs are the same bit
   for bit; their speed is the host's and its build's (Zen 4: the lane kernel 0.93x the block
   kernels' time over a prefill; Zen 5: twice their time while its build kept the lane kernel's
   sums in memory, level after that was fixed). The faster is set for the process
   (``torch.ops.fastgen.set_a8_lanes``) before the ladders below run through it;
1. ``qgemm`` against ``qgemm_a8`` over the model's own 4-bit layer products, two threads, from
   memory (all of them each pass, as a prompt chunk reads them), at the rows of
   :data:`A8_LADDER`; ``min_a8_rows`` to ``max_a8_rows`` is the run of those points over which
   ``qgemm_a8`` saves the most time in all (unbounded where the run reaches the last point; none
   where ``qgemm`` is the faster at every point). On hosts with AMX, ``qgemm`` in
   bf16 runs on tiles and overtakes ``qgemm_a8`` past a few dozen rows (2-core Xeon, AMX:
   SmolLM2's layer products at 64 rows 20.7 against 24.3 ms, at 256 rows 36 against 71 ms), so
   there ``qgemm_a8`` keeps a middle range of rows;
2. then ``qgemv`` against the many-row path those rows would take, at the rows of
   :data:`QGEMV_LADDER`; ``max_qgemv_rows`` is the largest of them up to which ``qgemv`` is the
   faster at every one;
3. the output head, where it has an int8 format (SmolLM2's tied embedding: 8-bit rows), the same
   two steps over its own product at the rows of :data:`HEAD_LADDER`: its rows are decode batches,
   and its crossovers are its own.

Each point is the first kernel's median over :data:`NUM_REPEATS` passes and, for the second, that
plus the median of the paired differences (the two kernels back to back, in alternating order). The points
and the choice are cached in fastgen's cache folder with the budget's key (CPU flags, threads,
torch, model file, dtype, precision), so a warm start measures nothing. Measuring stops after
:data:`MAX_MEASURE_S`; the formats then keep their fixed limits and nothing is cached.
``FASTGEN_ROW_LIMITS=fixed`` keeps the fixed limits (the class constants) without measuring.
The limits change which kernel runs, never what a kernel computes.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .calibrate import OtherLoad, _host_key
from .config import cache_dir
from .model.quant import QuantWeight

log = logging.getLogger(__name__)

ENV = "FASTGEN_ROW_LIMITS"          # "auto" (default) | "fixed"
QGEMV_LADDER = (2, 4, 6, 8, 10, 12, 16, 20, 24)
# from 8 rows: a block of up to 8 rows takes qgemm_a8's 256-bit micro-kernel (12-04), which beat
# qgemv at 8 rows on the Zen 4 host (SmolLM2's 120 layer products from memory: 14.4 against 15-18 ms)
# from 2 rows: up to 32 rows qgemm_a8 takes its few-row path (12-05), which beat qgemv from 4 rows on
# the Zen 4 host (SmolLM2's 120 layer products from memory, 8 rows: 7.3 against 11.0 ms)
A8_LADDER = (2, 4, 8, 12, 16, 32, 64, 128)
# the output head (SmolLM2: its tied embedding, 8-bit rows) is measured apart, on its own points:
# its rows are decode batches (a prompt step takes logits of its sampled rows only), and its
# crossovers differ from the layers' (Zen 4, SmolLM2's Q8_0 head, ms qgemv / qgemm_a8 / qgemm: 8
# rows 3.2 / 2.0 / 6.0, 16: 6.6 / 3.1 / 5.0; it had the fixed limit, qgemv to 8, qgemm past it)
HEAD_LADDER = (2, 4, 8, 12, 16)
# the rows at which qgemm_a8's lane kernel and block kernels are compared: a prompt chunk's rows,
# past the few-row path (up to 32 rows) where both run (Zen 5, SmolLM2's layer products, two
# threads, GOP/s of the lane / block kernels: 507 / 562 at 64 rows, 686 / 660 at 256, 856 / 779 at
# 512; before the lane kernel's sums were kept in registers 235 / 461, 250 / 559, 413 / 835)
A8_KERNEL_ROWS = 128
NUM_REPEATS = 3
MAX_MEASURE_S = 20.0
NEVER = QuantWeight.MAX_A8_ROWS     # past any row count: min_a8_rows where qgemm_a8 never wins, max_a8_rows unbounded


@dataclass(frozen=True)
class RowLimits:
    max_qgemv_rows: int
    min_a8_rows: int
    qgemv_points: tuple[tuple[int, float, float], ...]   # (rows, qgemv ms, many-row path ms)
    a8_points: tuple[tuple[int, float, float], ...]      # (rows, qgemm_a8 ms, qgemm ms)
    cached: bool = False
    # the output head's (None where it has no int8 format): the same, over its own product
    head: "RowLimits | None" = None
    max_a8_rows: int = NEVER            # qgemm_a8 up to this many rows, qgemm past it
    # (rows, lane kernel ms, block kernels ms) of qgemm_a8's many-row kernels; None where the build
    # has the block kernels only (AVX2)
    a8_kernel: tuple[int, float, float] | None = None

    @property
    def a8_lanes(self) -> bool:
        """Whether qgemm_a8's many rows take the lane kernel (the faster where both were measured)."""
        return lanes_win(self.a8_kernel)

    @property
    def key(self) -> str:
        """The choice, as the budget's cache key takes it (its curve runs through these kernels)."""
        head = ("" if self.head is None else
                f",head<={self.head.max_qgemv_rows},a8>={self.head.min_a8_rows},a8<={self.head.max_a8_rows}")
        kernel = "" if self.a8_kernel is None else f",a8={'lanes' if self.a8_lanes else 'blocks'}"
        return f"|rows<={self.max_qgemv_rows},a8>={self.min_a8_rows},a8<={self.max_a8_rows}{kernel}{head}"

    def describe(self) -> str:
        a8 = "never" if self.min_a8_rows >= NEVER else str(self.min_a8_rows)
        if self.min_a8_rows < NEVER and self.max_a8_rows < NEVER:
            a8 += f" to {self.max_a8_rows}"
        gv = ", ".join(f"{n}:{a:.1f}/{b:.1f}" for n, a, b in self.qgemv_points)
        q8 = ", ".join(f"{n}:{a:.1f}/{b:.1f}" for n, a, b in self.a8_points)
        head = "" if self.head is None else f"; output head: {self.head.describe().removeprefix('row limits: ')}"
        kernel = ""
        if self.a8_kernel is not None:
            rows, lanes, blocks = self.a8_kernel
            kernel = (f", its many rows in the {'lane kernel' if self.a8_lanes else 'block kernels'} "
                      f"(ms lane/block kernels at {rows} rows {lanes:.1f}/{blocks:.1f})")
        return (f"row limits: qgemv up to {self.max_qgemv_rows} rows, qgemm_a8 from {a8}{kernel} (ms qgemv/other "
                f"{gv}; ms qgemm_a8/qgemm {q8}{'; cached' if self.cached else ''}){head}")


def choose_limits(qgemv_points, a8_points) -> tuple[int, int, int]:
    """``(max_qgemv_rows, min_a8_rows, max_a8_rows)`` from the measured points (see the module)."""
    points = sorted(a8_points)
    min_a8 = max_a8 = NEVER
    # the run of ladder points over which qgemm_a8 saves the most time in all (ties: the longer
    # run); a single loss inside it no longer gives up the wins on its far side (Zen 4, before
    # the few-row path's passes were split: qgemm_a8 won by 9-11 ms at 2-8 rows, lost by 2.5 at
    # 32 and won again from 64, and the rule that every point from the limit up must win sent 2-16
    # rows to the kernels that took twice its time)
    best = (0.0, 0)
    for i in range(len(points)):
        saved = 0.0
        for j in range(i, len(points)):
            saved += points[j][2] - points[j][1]
            if saved > 0 and (saved, j - i) > best:
                best = (saved, j - i)
                min_a8 = points[i][0]
                max_a8 = NEVER if j == len(points) - 1 else points[j][0]
    max_qgemv = 1
    for n, gemv, other in sorted(qgemv_points):
        if gemv > other:
            break
        max_qgemv = n
    return max_qgemv, min_a8, max_a8


def a8_formats(model: torch.nn.Module) -> list[QuantWeight]:
    """The model's 4-bit layer formats with int8 activations, in model order (8-bit layer rows
    keep their fixed limits; the output head is measured apart, :func:`head_format`)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return [m.format for m in layers.modules()
            if type(getattr(m, "format", None)) is QuantWeight and m.format.act_int8 and m.format.quant.kind == 4]


def head_format(model: torch.nn.Module) -> QuantWeight | None:
    """The output head's format where it takes int8 activations (any kind with an int8 kernel)."""
    fmt = getattr(getattr(model, "head", None), "format", None)
    return fmt if type(fmt) is QuantWeight and fmt.act_int8 else None


def _timer(formats: list[QuantWeight], dtype: torch.dtype) -> Callable[[int, Callable], float]:
    xs: dict[tuple[int, int], torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)

    def one_pass(rows: int, kernel: Callable) -> float:
        t0 = time.perf_counter()
        for f in formats:
            q = f.quant
            k = q.qweight.shape[1] * (2 if q.kind == 4 else 1)
            x = xs.get((rows, k))
            if x is None:
                x = xs[(rows, k)] = torch.randn(rows, k, generator=gen).to(dtype)
            kernel(f, x)
        return (time.perf_counter() - t0) * 1e3
    return one_pass


def _qgemv(f: QuantWeight, x: torch.Tensor) -> None:
    q = f.quant
    f._qgemv(x, q.qweight, q.scales, q.mins, q.kind, True)


def _qgemm(f: QuantWeight, x: torch.Tensor) -> None:
    q = f.quant
    f._qgemm(x, q.qweight, q.scales, q.mins, q.kind, None, False)


def _qgemm_a8(f: QuantWeight, x: torch.Tensor) -> None:
    q = f.quant
    f._qgemm_a8(x, q.qweight, q.scales, q.mins, q.kind, None, False)


def _compare(one_pass: Callable[[int, Callable], float], rows: int, first: Callable, second: Callable,
             progress: Callable[[], None] | None = None) -> tuple[int, float, float]:
    """(rows, first's median ms, that plus the median of the paired differences second - first):
    each pair is measured back to back, in alternating order, so a slow minute of the VM weighs on
    both kernels of a pair. (With the medians of each kernel alone, one point of the Zen 3 host's
    ladder came out 300 against 277 ms at 128 rows, where the runs before and after gave 145
    against 181: qgemm_a8 lost its prompt rows past 64, 1.2x the products' time.)"""
    one_pass(rows, first), one_pass(rows, second)        # warm-up: buffers, first touch
    a, diffs = [], []
    for i in range(NUM_REPEATS):
        if i % 2 == 0:
            ta = one_pass(rows, first)
            tb = one_pass(rows, second)
        else:
            tb = one_pass(rows, second)
            ta = one_pass(rows, first)
        a.append(ta)
        diffs.append(tb - ta)
    if progress is not None:
        progress()
    med = statistics.median(a)
    return rows, med, med + statistics.median(diffs)


def lanes_win(kernel: tuple[int, float, float] | None) -> bool:
    """Whether the lane kernel is the faster of ``(rows, lane kernel ms, block kernels ms)`` (ties:
    it is); False where nothing was measured (the build has the block kernels only)."""
    return kernel is not None and kernel[1] <= kernel[2]


def apply_a8_kernel(kernel: tuple[int, float, float] | None) -> None:
    """Set the measured choice for the process (nothing where nothing was measured): the host's,
    whichever engine measured it; the ladders then run through it."""
    if kernel is not None:
        torch.ops.fastgen.set_a8_lanes(lanes_win(kernel))


def measure_a8_kernel(formats: list[QuantWeight], dtype: torch.dtype, progress: Callable[[], None] | None = None,
                      rows: int = A8_KERNEL_ROWS) -> tuple[int, float, float] | None:
    """``(rows, lane kernel ms, block kernels ms)`` of qgemm_a8 over ``formats`` at ``rows``; None
    where this build has the block kernels only. Leaves the process's choice as it found it."""
    ops = torch.ops.fastgen
    if not ops.have_a8_lanes():
        return None
    was = ops.set_a8_lanes(True)

    def kernel(lanes: bool) -> Callable:
        def run(f: QuantWeight, x: torch.Tensor) -> None:
            ops.set_a8_lanes(lanes)
            _qgemm_a8(f, x)
        return run
    try:
        return _compare(_timer(formats, dtype), rows, kernel(True), kernel(False), progress)
    finally:
        ops.set_a8_lanes(was)


def measure_points(formats: list[QuantWeight], dtype: torch.dtype, progress: Callable[[], None] | None = None,
                   max_s: float = MAX_MEASURE_S, a8_ladder: tuple[int, ...] = A8_LADDER,
                   qgemv_ladder: tuple[int, ...] = QGEMV_LADDER):
    """``(qgemv_points, a8_points)``, or None when measuring ran past ``max_s``."""
    one_pass = _timer(formats, dtype)
    start = time.perf_counter()

    def compare(rows: int, first: Callable, second: Callable) -> tuple[int, float, float]:
        return _compare(one_pass, rows, first, second, progress)

    a8_points = []
    for n in a8_ladder:
        a8_points.append(compare(n, _qgemm_a8, _qgemm))
        if time.perf_counter() - start > max_s:
            return None
    _, min_a8, max_a8 = choose_limits([], a8_points)
    qgemv_points = []
    for n in qgemv_ladder:
        qgemv_points.append(compare(n, _qgemv, _qgemm_a8 if min_a8 <= n <= max_a8 else _qgemm))
        if time.perf_counter() - start > max_s:
            return None
        if qgemv_points[-1][1] > qgemv_points[-1][2]:   # qgemv lost: the limit is found
            break
    return tuple(qgemv_points), tuple(a8_points)


def apply_limits(model: torch.nn.Module, formats: list[QuantWeight], max_qgemv_rows: int, min_a8_rows: int,
                 max_a8_rows: int = NEVER) -> None:
    for f in formats:
        f.max_qgemv_rows = f.max_qgemv_rows_bf16 = max_qgemv_rows
        f.min_a8_rows, f.max_a8_rows = min_a8_rows, max_a8_rows
    model.__dict__["_stack"] = None        # the native stack's row limit follows (built again)


def calibrate_row_limits(model: torch.nn.Module, config) -> RowLimits | None:
    """Measure (or read from the cache) and apply the row limits of ``model``'s int8 formats;
    None where it has none, or where ``FASTGEN_ROW_LIMITS=fixed``."""
    if os.environ.get(ENV, "auto") == "fixed":
        return None
    if os.environ.get(ENV, "auto") != "auto":
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected auto or fixed")
    formats = a8_formats(model)
    if not formats or config.device.type != "cpu":
        return None
    key = _host_key(config.model_path, config.dtype, config.kernels, config.num_threads, config.cache.block_size,
                    config.device, config.tensor_parallel_size,
                    f"{config.quantization}|a8={config.int8_activations}|rows{QGEMV_LADDER}{A8_LADDER}"
                    f"|head{HEAD_LADDER}|kernel{A8_KERNEL_ROWS}")
    head = head_format(model)
    path: Path = cache_dir() / "row-limits" / f"{key}.json"
    points, head_points, kernel, cached = None, None, None, False
    try:
        data = json.loads(path.read_text())
        kernel = None if data["a8_kernel"] is None else tuple(data["a8_kernel"])
        apply_a8_kernel(kernel)
        points = (tuple(tuple(p) for p in data["qgemv"]), tuple(tuple(p) for p in data["a8"]))
        if head is not None:
            head_points = (tuple(tuple(p) for p in data["head_qgemv"]), tuple(tuple(p) for p in data["head_a8"]))
        cached = True
    except (OSError, ValueError, KeyError, TypeError):
        points = None
    if points is None:
        from tqdm.auto import tqdm

        total = 1 + len(A8_LADDER) + len(QGEMV_LADDER) + (2 * len(HEAD_LADDER) if head is not None else 0)
        start = time.perf_counter()
        with torch.inference_mode(), OtherLoad() as load, tqdm(total=total, desc="measuring kernel row limits",
                                                               unit="size", leave=False) as bar:
            kernel = measure_a8_kernel(formats, config.dtype, progress=lambda: bar.update(1))
            apply_a8_kernel(kernel)   # kept even where the ladders run out of time
            points = measure_points(formats, config.dtype, progress=lambda: bar.update(1),
                                    max_s=MAX_MEASURE_S - (time.perf_counter() - start))
            if points is not None and head is not None:
                head_points = measure_points([head], config.dtype, progress=lambda: bar.update(1),
                                             max_s=MAX_MEASURE_S - (time.perf_counter() - start),
                                             a8_ladder=HEAD_LADDER, qgemv_ladder=HEAD_LADDER)
        if points is None or (head is not None and head_points is None):
            log.warning("kernel row limits not measured (past %.0f s): the fixed limits serve", MAX_MEASURE_S)
            return None
        try:
            if load.too_busy:   # used for this start only
                raise OSError(f"other processes kept {load.cpus:.1f} CPUs busy while it measured")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            record = {"qgemv": points[0], "a8": points[1], "a8_kernel": kernel}
            if head_points is not None:
                record.update(head_qgemv=head_points[0], head_a8=head_points[1])
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
        except OSError as e:
            log.warning("could not cache the kernel row limits (%s)", e)
    head_limits = None
    if head is not None:
        head_qgemv, head_a8, head_a8_max = choose_limits(*head_points)
        apply_limits(model, [head], head_qgemv, head_a8, head_a8_max)
        head_limits = RowLimits(head_qgemv, head_a8, head_points[0], head_points[1], cached, max_a8_rows=head_a8_max)
    max_qgemv, min_a8, max_a8 = choose_limits(*points)
    apply_limits(model, formats, max_qgemv, min_a8, max_a8)
    limits = RowLimits(max_qgemv, min_a8, points[0], points[1], cached, head_limits, max_a8, kernel)
    log.info("%s", limits.describe())
    return limits
