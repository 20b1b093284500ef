"""How the engine benchmark (``python -m fastgen.bench.engine``) times things: how much work each part
does (:class:`Sizes`), bounded timing loops (:func:`time_calls`), their summary record, and the
model forwards inside ``Engine.step()`` through the engine's ``forward_observer`` seam."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Sizes:
    """How much work each part of the benchmark does."""

    matmul_n: int                    # square matmul side
    bandwidth_bytes: int             # size of the big tensor summed / copied
    prefill_tokens: int
    decode_batches: tuple[int, ...]
    decode_prompt_tokens: int
    num_decode_steps: int            # timed decode steps per batch size
    step_tokens: tuple[int, ...]     # tokens per step for the forward-time curve
    num_repeats: int                 # timed repetitions of one measurement
    max_measure_s: float             # wall-clock cap of one measurement

    @property
    def budget_tokens(self) -> int:
        return max(self.prefill_tokens, max(self.step_tokens),
                   max(self.decode_batches) * self.decode_prompt_tokens)


FULL = Sizes(matmul_n=2048, bandwidth_bytes=1 << 30, prefill_tokens=2048,
             decode_batches=(1, 8, 32, 64), decode_prompt_tokens=32, num_decode_steps=32,
             step_tokens=(1, 8, 16, 32, 64, 128, 256, 384, 512, 1024), num_repeats=5,
             max_measure_s=30.0)
QUICK = Sizes(matmul_n=512, bandwidth_bytes=64 << 20, prefill_tokens=256,
              decode_batches=(1, 8, 32), decode_prompt_tokens=32, num_decode_steps=6,
              step_tokens=(1, 8, 32, 128), num_repeats=2, max_measure_s=5.0)


@dataclass(frozen=True)
class Summary:
    """Seconds of repeated timed calls."""

    min_s: float
    median_s: float
    mean_s: float
    num_samples: int

    @classmethod
    def of(cls, times_s: list[float]) -> "Summary":
        return cls(min(times_s), statistics.median(times_s), statistics.fmean(times_s), len(times_s))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, *, num_warmup: int,
               num_repeats: int, max_s: float, desc: str) -> list[float]:
    """Seconds of each of up to ``num_repeats`` timed calls of ``fn``, after ``num_warmup``
    untimed ones; stops early once ``max_s`` has passed (one timed call is always made)."""
    deadline = time.perf_counter() + max_s
    for _ in range(num_warmup):
        fn()
        if time.perf_counter() > deadline:
            break
    sync(device)
    times: list[float] = []
    for _ in tqdm(range(num_repeats), desc=desc, leave=False, disable=None):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return times


class ForwardTimes:
    """The seconds of each model forward the engine ran while installed (see :func:`timed_forward`)."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.times_s.append(seconds)


@contextlib.contextmanager
def timed_forward(engine) -> Iterator[ForwardTimes]:
    """Record every model forward inside ``engine.step()`` for the duration, through
    ``Engine.forward_observer`` (device-synchronised), so a step splits into forward and the rest."""
    times = ForwardTimes()
    previous = engine.forward_observer
    engine.forward_observer = times
    try:
        yield times
    finally:
        engine.forward_observer = previous
