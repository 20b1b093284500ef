"""Host overhead: the part of a batch-32 decode step that is not the model forward, and its parts
(``build_batch`` and ``sample()`` timed apart on a same-shaped batch; the rest is scheduling and
per-request bookkeeping)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from ..batch import SeqInput, build_batch
from ..request import SamplingParams
from ..sampling import SamplingRow, sample
from .prefill_decode import DecodeResult, random_prompt
from .timing import Sizes, Summary, time_calls

OVERHEAD_BATCH = 32
METHOD = ("Engine.step() time minus the model forward inside it (timed through Engine.forward_observer); "
          "build_batch and sample() timed apart on a same-shaped batch")


@dataclass(frozen=True)
class OverheadParts:
    batch_size: int
    context_tokens: int
    build_batch: Summary
    sample: Summary


@dataclass(frozen=True)
class HostOverhead:
    batch_size: int
    num_steps: int
    step_ms: float                   # mean
    forward_ms: float                # mean
    overhead_ms: float
    fraction: float                  # of the step
    build_batch_ms: float            # median, measured apart
    sample_ms: float                 # median, measured apart
    rest_ms: float                   # overhead - build_batch - sample
    parts: OverheadParts
    method: str = METHOD


def bench_overhead_parts(engine, sizes: Sizes, sampling: SamplingParams, rng: random.Random) -> OverheadParts:
    """build_batch and sample() alone on a batch shaped like the batch-32 decode steps;
    the rest of the host overhead is scheduling and per-request bookkeeping."""
    block_size, device = engine.config.cache.block_size, engine.config.device
    vocab = engine.model_config.vocab_size
    context = sizes.decode_prompt_tokens + 2 + sizes.num_decode_steps // 2
    blocks_per_seq = math.ceil((context + 1) / block_size)
    seqs = [SeqInput(token_ids=[rng.randrange(vocab)], start_pos=context,
                     block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), num_logits=1)
            for i in range(OVERHEAD_BATCH)]
    build_s = time_calls(lambda: build_batch(seqs, block_size, device), device, num_warmup=2,
                         num_repeats=10 * sizes.num_repeats, max_s=sizes.max_measure_s, desc="build_batch")
    rows = [SamplingRow(sampling, random_prompt(rng, vocab, sizes.decode_prompt_tokens), [1] * context,
                        None, ()) for _ in range(OVERHEAD_BATCH)]
    logits = torch.randn(OVERHEAD_BATCH, vocab, device=device)  # [batch, vocab] fp32, like the model's
    generator = torch.Generator().manual_seed(0)
    # no penalties and nothing suppressed, so sample() leaves the logits as they are between calls
    sample_s = time_calls(lambda: sample(logits, rows, generator), device, num_warmup=2,
                          num_repeats=10 * sizes.num_repeats, max_s=sizes.max_measure_s, desc="sample")
    return OverheadParts(OVERHEAD_BATCH, context, Summary.of(build_s), Summary.of(sample_s))


def host_overhead(decode: list[DecodeResult], parts: OverheadParts) -> HostOverhead:
    """The batch-32 decode step split into forward and host time, the host time into parts."""
    d = next(d for d in decode if d.batch_size == OVERHEAD_BATCH)
    overhead_ms = d.host_overhead_s * 1e3
    build_ms, sample_ms = parts.build_batch.median_s * 1e3, parts.sample.median_s * 1e3
    return HostOverhead(OVERHEAD_BATCH, d.step.num_samples, d.step.mean_s * 1e3, d.forward.mean_s * 1e3,
                        overhead_ms, d.host_overhead_fraction, build_ms, sample_ms,
                        overhead_ms - build_ms - sample_ms, parts)
