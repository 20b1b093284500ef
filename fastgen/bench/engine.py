"""Engine micro-benchmark: how close one forward pass comes to what the machine allows.

    python -m fastgen.bench.engine                   # embedded SmolLM2-135M, bf16, full sizes
    python -m fastgen.bench.engine --quick           # smoke run: small sizes, a few repeats
    python -m fastgen.bench.engine --model DIR_OR_GGUF --dtype float32 --out results.json

One run measures, in order:

1. machine limits: square matmul GFLOP/s (bf16 and fp32) and memory read bandwidth
   (sum of a 1 GiB tensor and of a tensor the size of the model's weights; copy for reference);
2. prefill: one long prompt through ``Engine.step()`` (one step: the budget holds the prompt),
   against the matmul roofline for the model's FLOPs;
3. decode: steady-state ``Engine.step()`` calls in which every request decodes, batch 1..64;
   batch 1 against the bandwidth bound (weight bytes read per step / read bandwidth);
4. forward time against tokens per step: the curve that picks ``DEFAULT_BUDGET_TOKENS``;
5. host overhead: the part of a batch-32 decode step that is not the model forward (the
   forward inside ``Engine.step()`` is timed by wrapping ``engine.model`` for the run).

Machine limits are peaks (best of N); engine figures are medians of N, host overhead a
mean. The weight-sized read is there because a model smaller than the last-level cache
is not read from DRAM. Results go to stdout, every number to a JSON file (``--out``), and
the curve to a PNG beside it when matplotlib is installed. Every loop is bounded in
iterations and in seconds. Run it on an idle machine: it warns when other processes
keep CPUs busy, since the engine's threads then wait on each other.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..batch import RaggedBatch, SeqInput, build_batch
from ..cache import KVPool
from ..calibrate import calibrate_engine_budget
from ..config import DEFAULT_BUDGET_TOKENS, DEFAULT_TARGET_ITL_MS
from ..engine import Engine
from ..model.layers import Linear
from ..model.spec import local_kv_heads
from .kernels import bench_attention, decode_step_breakdown, host_isa, old_vs_new_decode, print_kernels
from ..request import FinishReason, SamplingParams
from ..sampling import SamplingRow, sample

FLOPS_FORMULA = (
    "FLOPs(prefill of T tokens from position 0) = 2*P_linear*T + 2*V*d*num_logits "
    "+ 2*L*H*Dh*T*(T+1); P_linear = weights of every linear layer except the output head, "
    "V*d = output head (lm_head or tied embedding), num_logits = 1 (the sampled token), "
    "last term = causal attention (QK^T and PV, 2 FLOPs per multiply-add, key count t+1 for "
    "query t); norms, RoPE, SiLU and softmax are not counted")
WEIGHT_BYTES_FORMULA = (
    "weight bytes read per decode step = every linear weight and bias + the output head "
    "(lm_head or tied embedding), in the model dtype; the embedding gather, norms and KV "
    "cache reads are not counted")
BANDWIDTH_BOUND_RULE = (
    "decode bound bandwidth = the highest read-only bandwidth measured (sum of a big tensor, "
    "1 GiB or 64 MiB with --quick, fp32 and bf16, and of a tensor as large as the weights, fp32 "
    "and model dtype); the copy is shown for reference only")

GOAL_PREFILL_ROOFLINE = 0.70
GOAL_DECODE_BANDWIDTH = 0.70
GOAL_HOST_OVERHEAD = 0.10
OVERHEAD_BATCH = 32
BUSY_CPUS_WARNING = 0.25


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


# -- timing -----------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
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
    _sync(device)
    times: list[float] = []
    for _ in tqdm(range(num_repeats), desc=desc, leave=False, disable=None):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return times


def summary(times_s: list[float]) -> dict[str, float]:
    return {"min_s": min(times_s), "median_s": statistics.median(times_s),
            "mean_s": statistics.fmean(times_s), "num_samples": len(times_s)}


class TimedForward:
    """Stands in for ``engine.model`` and records how long each forward call took
    (synchronised with the device), so a step can be split into forward and the rest."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.times_s: list[float] = []

    def __call__(self, batch: RaggedBatch, pool: KVPool) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.model(batch, pool)
        _sync(self.device)
        self.times_s.append(time.perf_counter() - t0)
        return logits


@contextlib.contextmanager
def timed_forward(engine: Engine) -> Iterator[TimedForward]:
    model = engine.model
    timer = TimedForward(model, engine.config.device)
    engine.model = timer
    try:
        yield timer
    finally:
        engine.model = model


# -- the model's costs ------------------------------------------------------------------

@dataclass(frozen=True)
class ModelCosts:
    num_linear_params: int           # every linear weight except the output head
    num_head_params: int             # vocab * hidden
    num_attention_dims: int          # num_layers * num_heads * head_dim
    weight_bytes: int                # read per decode step (see WEIGHT_BYTES_FORMULA)

    def prefill_flops(self, num_tokens: int, num_logits: int = 1) -> float:
        t = num_tokens
        return (2.0 * self.num_linear_params * t + 2.0 * self.num_head_params * num_logits
                + 2.0 * self.num_attention_dims * t * (t + 1))


def model_costs(engine: Engine) -> ModelCosts:
    mc = engine.model_config
    head = engine.model.head
    linear_params = linear_bytes = 0
    for module in engine.model.modules():
        if not isinstance(module, Linear) or module is head:
            continue
        linear_params += module.num_params
        linear_bytes += module.stream_bytes
    return ModelCosts(num_linear_params=linear_params, num_head_params=head.num_params,
                      num_attention_dims=mc.num_layers * mc.num_heads * mc.head_dim,
                      weight_bytes=linear_bytes + head.stream_bytes)


# -- 1. machine limits ------------------------------------------------------------------

def measure_matmul(dtype: torch.dtype, n: int, device: torch.device, sizes: Sizes) -> dict[str, Any]:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    out = torch.empty(n, n, dtype=dtype, device=device)
    with torch.inference_mode():
        times = time_calls(lambda: torch.matmul(a, b, out=out), device, num_warmup=2,
                           num_repeats=4 * sizes.num_repeats, max_s=sizes.max_measure_s,
                           desc=f"matmul {dtype}")
    flops = 2.0 * n ** 3
    return {"dtype": str(dtype), "n": n, "gflops": flops / min(times) / 1e9,
            "median_gflops": flops / statistics.median(times) / 1e9, **summary(times)}


def measure_read(num_bytes: int, dtype: torch.dtype, device: torch.device, sizes: Sizes,
                 label: str) -> dict[str, Any]:
    """Read bandwidth: ``x.sum()`` over ``num_bytes`` of ``dtype``; bytes moved = num_bytes."""
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    x = torch.ones(num_bytes // elem_bytes, dtype=dtype, device=device)
    with torch.inference_mode():
        times = time_calls(x.sum, device, num_warmup=1, num_repeats=3 * sizes.num_repeats,
                           max_s=sizes.max_measure_s, desc=f"read {label}")
    moved = x.numel() * elem_bytes
    return {"kind": "sum (read)", "label": label, "dtype": str(dtype), "bytes": moved,
            "gbps": moved / min(times) / 1e9, **summary(times)}


def measure_copy(num_bytes: int, device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """Copy bandwidth of fp32: bytes moved = 2 * num_bytes (read source + write destination)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    with torch.inference_mode():
        times = time_calls(lambda: dst.copy_(src), device, num_warmup=1,
                           num_repeats=3 * sizes.num_repeats, max_s=sizes.max_measure_s, desc="copy")
    moved = 2 * src.numel() * 4
    return {"kind": "copy (read + write)", "label": "big fp32", "dtype": "torch.float32",
            "bytes": moved, "gbps": moved / min(times) / 1e9, **summary(times)}


def measure_machine(engine: Engine, costs: ModelCosts, sizes: Sizes) -> dict[str, Any]:
    device, dtype = engine.config.device, engine.config.dtype
    matmul_dtypes = list(dict.fromkeys([torch.bfloat16, torch.float32, dtype]))
    matmul = {str(d): measure_matmul(d, sizes.matmul_n, device, sizes) for d in matmul_dtypes}
    reads = [measure_read(sizes.bandwidth_bytes, torch.float32, device, sizes, "big fp32"),
             measure_read(sizes.bandwidth_bytes, torch.bfloat16, device, sizes, "big bf16"),
             measure_read(costs.weight_bytes, torch.float32, device, sizes, "weight-sized fp32")]
    if dtype != torch.float32:
        reads.append(measure_read(costs.weight_bytes, dtype, device, sizes, f"weight-sized {dtype}"))
    copy = measure_copy(sizes.bandwidth_bytes, device, sizes)
    return {"num_threads": torch.get_num_threads(), "matmul": matmul, "bandwidth": reads + [copy],
            "decode_bound_gbps": max(r["gbps"] for r in reads), "bandwidth_rule": BANDWIDTH_BOUND_RULE}


# -- requests through the engine --------------------------------------------------------

def random_prompt(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    low = min(256, vocab_size // 2)  # keep clear of the special tokens at the start of the vocab
    return [rng.randrange(low, vocab_size) for _ in range(num_tokens)]


def release(engine: Engine, request_ids: list[str]) -> None:
    """Abort whatever is still running and forget every request; raise if one failed
    (a failed forward finishes its requests at once, which would look very fast)."""
    errors = []
    for rid in request_ids:
        engine.abort(rid)
        response = engine.response(rid)
        if response.finish_reason is FinishReason.ERROR:
            errors.append(f"{rid}: {response.error}")
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")


def bench_prefill(engine: Engine, costs: ModelCosts, sizes: Sizes, matmul_gflops: float,
                  rng: random.Random) -> dict[str, Any]:
    num_tokens = min(sizes.prefill_tokens, engine.config.max_model_len - 1)
    budget = engine.config.scheduler.budget_tokens
    max_steps = math.ceil(num_tokens / budget) + 2
    prompt = random_prompt(rng, engine.model_config.vocab_size, num_tokens)
    params = SamplingParams(max_new_tokens=1, do_sample=False, ignore_eos=True)
    step_s, forward_s, num_steps = [], [], 0
    deadline = time.perf_counter() + sizes.max_measure_s * 2
    with timed_forward(engine) as fwd:
        for i in tqdm(range(1 + sizes.num_repeats), desc="prefill", leave=False, disable=None):
            rid = engine.add_request(prompt, params)
            fwd.times_s.clear()
            t0 = time.perf_counter()
            for num_steps in range(1, max_steps + 1):
                engine.step()
                if not engine.has_unfinished():
                    break
            elapsed = time.perf_counter() - t0
            release(engine, [rid])
            if i > 0:  # the first run is warmup
                step_s.append(elapsed)
                forward_s.append(sum(fwd.times_s))
            if i > 0 and time.perf_counter() > deadline:
                break
    flops = costs.prefill_flops(num_tokens)
    med, fmed = statistics.median(step_s), statistics.median(forward_s)
    return {"num_tokens": num_tokens, "budget_tokens": budget, "num_steps": num_steps,
            "tokens_per_s": num_tokens / med, "forward_tokens_per_s": num_tokens / fmed,
            "gflop": flops / 1e9, "achieved_gflops": flops / med / 1e9,
            "roofline_gflops": matmul_gflops, "roofline_ratio": flops / med / 1e9 / matmul_gflops,
            "forward_roofline_ratio": flops / fmed / 1e9 / matmul_gflops,
            "step": summary(step_s), "forward": summary(forward_s), "flops_formula": FLOPS_FORMULA}


def bench_decode(engine: Engine, batch_size: int, sizes: Sizes, sampling: SamplingParams,
                 rng: random.Random) -> dict[str, Any]:
    """Time ``Engine.step()`` while all ``batch_size`` requests decode (no prompt work)."""
    num_warmup = 2
    prompts = [random_prompt(rng, engine.model_config.vocab_size, sizes.decode_prompt_tokens)
               for _ in range(batch_size)]
    ids = [engine.add_request(p, sampling) for p in prompts]
    started: set[str] = set()
    step_s: list[float] = []
    forward_s: list[float] = []
    num_mixed = 0
    try:
        max_prefill_steps = math.ceil(batch_size * sizes.decode_prompt_tokens
                                      / engine.config.scheduler.budget_tokens) + 2
        for _ in range(max_prefill_steps):
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
            if len(started) == batch_size:
                break
        if len(started) < batch_size:
            raise RuntimeError(f"only {len(started)} of {batch_size} requests started decoding "
                               f"after {max_prefill_steps} steps")
        deadline = time.perf_counter() + sizes.max_measure_s
        with timed_forward(engine) as fwd:
            bar = tqdm(range(num_warmup + sizes.num_decode_steps), desc=f"decode batch {batch_size}",
                       leave=False, disable=None)
            for i in bar:
                fwd.times_s.clear()
                t0 = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - t0
                stats = engine.stats()
                if stats.last_step_decode_tokens != batch_size or stats.last_step_prompt_tokens:
                    num_mixed += 1  # a request finished or was preempted: not a pure decode step
                elif i >= num_warmup:
                    step_s.append(elapsed)
                    forward_s.append(sum(fwd.times_s))
                if step_s and time.perf_counter() > deadline:
                    break
    finally:
        release(engine, ids)
    if not step_s:
        raise RuntimeError(f"no pure decode step at batch {batch_size} ({num_mixed} mixed steps)")
    step, forward = summary(step_s), summary(forward_s)
    overhead_s = step["mean_s"] - forward["mean_s"]
    return {"batch_size": batch_size, "tokens_per_s": batch_size / step["median_s"], "step": step,
            "forward": forward, "host_overhead_s": overhead_s,
            "host_overhead_fraction": overhead_s / step["mean_s"], "num_skipped_steps": num_mixed,
            "context_tokens": [sizes.decode_prompt_tokens + num_warmup + 1,
                               sizes.decode_prompt_tokens + num_warmup + len(step_s)]}


# -- 4. forward time against tokens per step --------------------------------------------

def bench_pool(engine: Engine, num_blocks: int) -> KVPool:
    """A private KV pool shaped like the engine's, so direct forwards leave the engine alone."""
    mc = engine.model_config
    return KVPool(num_layers=mc.num_layers, num_blocks=num_blocks,
                  block_size=engine.config.cache.block_size, num_kv_heads=local_kv_heads(engine.model, mc),
                  head_dim=mc.head_dim, dtype=engine.config.dtype, device=engine.config.device)


def bench_forward_curve(engine: Engine, sizes: Sizes, rng: random.Random) -> dict[str, Any]:
    """``model(build_batch([one fresh prompt chunk of n tokens]), pool)`` for each n."""
    block_size, device = engine.config.cache.block_size, engine.config.device
    pool = bench_pool(engine, math.ceil(max(sizes.step_tokens) / block_size))
    points = []
    for n in tqdm(sizes.step_tokens, desc="forward curve", leave=False, disable=None):
        seq = SeqInput(token_ids=random_prompt(rng, engine.model_config.vocab_size, n), start_pos=0,
                       block_ids=list(range(math.ceil(n / block_size))), num_logits=1)
        batch = build_batch([seq], block_size, device)
        times = time_calls(lambda: engine.model(batch, pool), device, num_warmup=1,
                           num_repeats=sizes.num_repeats, max_s=sizes.max_measure_s, desc=f"forward {n}")
        med = statistics.median(times)
        points.append({"tokens_per_step": n, "ms_per_step": med * 1e3, "tokens_per_s": n / med,
                       **summary(times)})
    best = max(p["tokens_per_s"] for p in points)
    knee = next(p["tokens_per_step"] for p in points if p["tokens_per_s"] >= 0.9 * best)
    return {"points": points, "suggested_budget_tokens": knee,
            "suggestion_rule": "smallest tokens per step within 10% of the best tokens/s",
            "default_budget_tokens": DEFAULT_BUDGET_TOKENS}


# -- 5. host overhead, split ------------------------------------------------------------

def bench_overhead_parts(engine: Engine, sizes: Sizes, sampling: SamplingParams,
                         rng: random.Random) -> dict[str, Any]:
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
    return {"batch_size": OVERHEAD_BATCH, "context_tokens": context,
            "build_batch": summary(build_s), "sample": summary(sample_s)}


# -- report -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Goal:
    name: str
    measured: float
    target: str
    passed: bool


def goals(results: dict[str, Any]) -> list[Goal]:
    prefill = results["prefill"]["roofline_ratio"]
    decode1 = results["decode_bandwidth"]["ratio"]
    overhead = results["host_overhead"]["fraction"]
    return [Goal("prefill / matmul roofline", prefill, f">= {GOAL_PREFILL_ROOFLINE:.0%}",
                 prefill >= GOAL_PREFILL_ROOFLINE),
            Goal("batch-1 decode / bandwidth bound", decode1, f">= {GOAL_DECODE_BANDWIDTH:.0%}",
                 decode1 >= GOAL_DECODE_BANDWIDTH),
            Goal(f"host overhead of a batch-{OVERHEAD_BATCH} decode step", overhead,
                 f"< {GOAL_HOST_OVERHEAD:.0%}", overhead < GOAL_HOST_OVERHEAD)]


def print_machine(m: dict[str, Any]) -> None:
    print(f"\n1. Machine limits ({m['num_threads']} threads; best of N)")
    for r in m["matmul"].values():
        print(f"   matmul {r['n']}x{r['n']} {r['dtype']:<15} {r['gflops']:9.1f} GFLOP/s")
    for r in m["bandwidth"]:
        print(f"   {r['kind']:<19} {r['label']:<26} {r['bytes'] / 2**20:7.0f} MiB  {r['gbps']:7.1f} GB/s")
    print(f"   decode bound bandwidth: {m['decode_bound_gbps']:.1f} GB/s (highest read-only figure)")


def print_prefill(p: dict[str, Any]) -> None:
    print(f"\n2. Prefill: one {p['num_tokens']}-token prompt, budget_tokens={p['budget_tokens']} "
          f"-> {p['num_steps']} step(s); median of {p['step']['num_samples']}")
    print(f"   {p['tokens_per_s']:9.1f} tokens/s  ({p['step']['median_s'] * 1e3:.1f} ms; "
          f"forward alone {p['forward']['median_s'] * 1e3:.1f} ms)")
    print(f"   {p['gflop']:.1f} GFLOP -> {p['achieved_gflops']:.1f} GFLOP/s = {p['roofline_ratio']:.1%} "
          f"of the {p['roofline_gflops']:.1f} GFLOP/s matmul roofline "
          f"(forward alone {p['forward_roofline_ratio']:.1%})")
    print(f"   {p['flops_formula']}")


def print_decode(decode: list[dict[str, Any]], bound: dict[str, Any]) -> None:
    print("\n3. Decode: Engine.step() with every request decoding (ms and tokens/s: median step; "
          "host: mean step - mean forward)")
    print("   batch   ms/step   tokens/s   forward ms   host %")
    for d in decode:
        print(f"   {d['batch_size']:5d} {d['step']['median_s'] * 1e3:9.2f} {d['tokens_per_s']:10.1f} "
              f"{d['forward']['median_s'] * 1e3:12.2f} {d['host_overhead_fraction']:8.1%}")
    print(f"   batch 1: {bound['tokens_per_s']:.1f} tokens/s = {bound['ratio']:.1%} of the bound "
          f"{bound['bound_tokens_per_s']:.1f} tokens/s ({bound['weight_bytes'] / 1e6:.1f} MB of weights "
          f"at {bound['bandwidth_gbps']:.1f} GB/s)")
    print(f"   {WEIGHT_BYTES_FORMULA}")


def print_curve(c: dict[str, Any]) -> None:
    print("\n4. Forward time against tokens per step (one fresh prompt chunk, model forward only)")
    print("   tokens/step   ms/step   tokens/s")
    for p in c["points"]:
        print(f"   {p['tokens_per_step']:11d} {p['ms_per_step']:9.2f} {p['tokens_per_s']:10.1f}")
    print(f"   suggested budget_tokens: {c['suggested_budget_tokens']} ({c['suggestion_rule']}); "
          f"DEFAULT_BUDGET_TOKENS = {c['default_budget_tokens']}")


def print_overhead(h: dict[str, Any]) -> None:
    print(f"\n5. Host overhead at batch-{h['batch_size']} decode "
          f"(mean of {h['num_steps']} pure decode steps)")
    print(f"   step {h['step_ms']:.2f} ms = forward {h['forward_ms']:.2f} ms "
          f"+ host {h['overhead_ms']:.2f} ms ({h['fraction']:.1%} of the step)")
    print(f"   host part, measured apart: build_batch {h['build_batch_ms']:.2f} ms, sample() "
          f"{h['sample_ms']:.2f} ms, scheduler + bookkeeping (the rest) {h['rest_ms']:.2f} ms")


def print_goals(gs: list[Goal]) -> None:
    print("\nGoals")
    print(f"   {'goal':<42} {'measured':>9} {'target':>8}  result")
    for g in gs:
        print(f"   {g.name:<42} {g.measured:9.1%} {g.target:>8}  {'PASS' if g.passed else 'MISS'}")


def plot_curve(curve: dict[str, Any], path: Path, title: str) -> str | None:
    """Write the curve as a PNG; returns why not when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; skipped the plot"
    xs = [p["tokens_per_step"] for p in curve["points"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [p["ms_per_step"] for p in curve["points"]], "o-", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("forward ms / step", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [p["tokens_per_s"] for p in curve["points"]], "s--", color="tab:orange")
    ax2.set_ylabel("tokens / s", color="tab:orange")
    ax.axvline(curve["default_budget_tokens"], color="gray", linestyle=":", label="DEFAULT_BUDGET_TOKENS")
    ax.axvline(curve["suggested_budget_tokens"], color="green", linestyle="--", label="within 10% of peak")
    ax.legend(loc="upper left")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# -- main -------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def busy_cpus(interval_s: float = 0.5) -> float | None:
    """CPUs kept busy by other processes during ``interval_s`` while this one sleeps (Linux).

    Other work on the cores makes every figure meaningless: the engine's threads wait on
    each other, and one forward can take ten times longer."""
    def snapshot() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user .. steal
        return sum(ticks), ticks[3] + ticks[4]                    # total, idle + iowait

    try:
        total0, idle0 = snapshot()
        time.sleep(interval_s)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total) if total else 0.0


def warn_if_busy(busy: float | None, when: str) -> None:
    if busy is not None and busy > BUSY_CPUS_WARNING:
        print(f"   warning: other processes kept {busy:.1f} CPUs busy {when}; the numbers are noisy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastgen.bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto",
                   choices=["bfloat16", "bf16", "float32", "fp32", "float16", "fp16", "auto"],
                   help="model and KV dtype (default auto: the host's best)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weights (default auto: a GGUF as shipped)")
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help="target of the calibrated budget shown (default: the engine's)")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke run")
    p.add_argument("--do-sample", action="store_true",
                   help="decode with do_sample=True (top_p=0.9) instead of greedy")
    p.add_argument("--out", type=Path, default=Path("bench-results/engine.json"),
                   help="JSON of every number; the plot goes beside it as .png")
    return p.parse_args(argv)


def decode_bandwidth(decode: list[dict[str, Any]], machine: dict[str, Any],
                     costs: ModelCosts) -> dict[str, Any]:
    """Batch-1 decode against reading every weight once per step at the measured bandwidth."""
    d1 = next(d for d in decode if d["batch_size"] == 1)
    bound_tps = machine["decode_bound_gbps"] * 1e9 / costs.weight_bytes
    return {"tokens_per_s": d1["tokens_per_s"], "bound_tokens_per_s": bound_tps,
            "ratio": d1["tokens_per_s"] / bound_tps, "weight_bytes": costs.weight_bytes,
            "bandwidth_gbps": machine["decode_bound_gbps"], "formula": WEIGHT_BYTES_FORMULA}


def host_overhead(decode: list[dict[str, Any]], parts: dict[str, Any]) -> dict[str, Any]:
    """The batch-32 decode step split into forward and host time, the host time into parts."""
    d = next(d for d in decode if d["batch_size"] == OVERHEAD_BATCH)
    overhead_ms = d["host_overhead_s"] * 1e3
    build_ms, sample_ms = parts["build_batch"]["median_s"] * 1e3, parts["sample"]["median_s"] * 1e3
    return {"batch_size": OVERHEAD_BATCH, "num_steps": d["step"]["num_samples"],
            "step_ms": d["step"]["mean_s"] * 1e3, "forward_ms": d["forward"]["mean_s"] * 1e3,
            "overhead_ms": overhead_ms, "fraction": d["host_overhead_fraction"],
            "build_batch_ms": build_ms, "sample_ms": sample_ms,
            "rest_ms": overhead_ms - build_ms - sample_ms, "parts": parts,
            "method": "Engine.step() time minus the model forward inside it (engine.model wrapped "
                      "with a timer); build_batch and sample() timed apart on a same-shaped batch"}


def run_meta(args: argparse.Namespace, engine: Engine, sizes: Sizes, costs: ModelCosts) -> dict[str, Any]:
    cfg = engine.config
    return {"model": cfg.model_path, "dtype": str(cfg.dtype), "device": str(cfg.device),
            "num_threads": cfg.num_threads, "cpu": cpu_name(), "torch": torch.__version__,
            "budget_tokens": cfg.scheduler.budget_tokens, "block_size": cfg.cache.block_size,
            "quick": args.quick, "do_sample": args.do_sample, "sizes": asdict(sizes),
            "model_costs": asdict(costs), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "isa": host_isa(), "kernels": cfg.kernels, "quantization": cfg.quantization,
            "resident_weight_bytes": sum(m.resident_bytes for m in engine.model.modules() if isinstance(m, Linear)),
            "calibrated_budget": None if engine.budget_choice is None else asdict(engine.budget_choice)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if args.quick else FULL
    rng = random.Random(0)
    busy_before = busy_cpus()
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, budget_tokens=sizes.budget_tokens,
                                    max_seqs=max(sizes.decode_batches), quantization=args.quantization,
                                    kernels=args.kernels)
    engine.budget_choice = calibrate_engine_budget(engine.model, engine.model_config, engine.config,
                                                   args.target_itl_ms or DEFAULT_TARGET_ITL_MS)
    torch.set_num_threads(engine.config.num_threads)
    sampling = SamplingParams(max_new_tokens=sizes.num_decode_steps + 8, do_sample=args.do_sample,
                              ignore_eos=True)
    costs = model_costs(engine)
    meta = run_meta(args, engine, sizes, costs)
    print(f"fastgen engine benchmark: {Path(meta['model']).name}, {meta['dtype']}, {meta['device']}, "
          f"{meta['num_threads']} threads, {meta['cpu']} [{meta['isa']}], kernels={meta['kernels']}, "
          f"quantization={meta['quantization']}{' (--quick)' if args.quick else ''}")
    if engine.budget_choice is not None:
        print(f"   calibrated {engine.budget_choice.describe()}")
    meta["busy_cpus_before"] = busy_before
    warn_if_busy(busy_before, "before the run")

    machine = measure_machine(engine, costs, sizes)
    print_machine(machine)
    prefill = bench_prefill(engine, costs, sizes, machine["matmul"][meta["dtype"]]["gflops"], rng)
    print_prefill(prefill)
    decode = [bench_decode(engine, b, sizes, sampling, rng)
              for b in tqdm(sizes.decode_batches, desc="decode", leave=False, disable=None)]
    bound = decode_bandwidth(decode, machine, costs)
    print_decode(decode, bound)
    curve = bench_forward_curve(engine, sizes, rng)
    print_curve(curve)
    overhead = host_overhead(decode, bench_overhead_parts(engine, sizes, sampling, rng))
    print_overhead(overhead)
    matmul = machine["matmul"][meta["dtype"]]["gflops"]
    attention = bench_attention(engine, matmul, machine["decode_bound_gbps"], repeats=sizes.num_repeats)
    breakdown = decode_step_breakdown(engine)
    old_new = None if args.quick else old_vs_new_decode(engine)
    print_kernels(attention, breakdown, old_new, matmul)

    results = {"meta": meta, "machine": machine, "prefill": prefill, "decode": decode,
               "decode_bandwidth": bound, "forward_curve": curve, "host_overhead": overhead,
               "attention": attention, "decode_step_breakdown": breakdown, "old_vs_new_decode": old_new}
    results["goals"] = [asdict(g) for g in goals(results)]
    print_goals(goals(results))
    meta["busy_cpus_after"] = busy_after = busy_cpus()
    warn_if_busy(busy_after, "after the run")
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    title = f"{Path(results['meta']['model']).name} {results['meta']['dtype']}, " \
            f"{results['meta']['num_threads']} threads"
    skipped = plot_curve(results["forward_curve"], png, title)
    print(f"\nwrote {args.out}" + (f"; {skipped}" if skipped else f" and {png}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
