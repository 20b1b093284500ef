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
   forward inside ``Engine.step()`` is timed through ``Engine.forward_observer``).

Machine limits are peaks (best of N); engine figures are medians of N, host overhead a
mean. The weight-sized read is there because a model smaller than the last-level cache
is not read from DRAM. Results go to stdout, every number to a JSON file (``--out``), and
the curve to a PNG beside it when matplotlib is installed. Every loop is bounded in
iterations and in seconds. Run it on an idle machine: it warns when other processes
keep CPUs busy, since the engine's threads then wait on each other.

The parts live by what they measure: timing.py (sizes, timing loops), machine.py (machine limits,
the model's costs), prefill_decode.py (2-4), overhead.py (5), kernels.py (6), engine_report.py
(verdicts, printing, the plot); this module runs them in order and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..calibrate import calibrate_engine_budget
from ..config import DEFAULT_TARGET_ITL_MS
from ..engine import Engine
from ..launcher import MARK_ENV
from ..model.layers import weight_bytes
from ..request import SamplingParams
from .engine_report import (Goal, goals, plot_curve, print_chunk, print_curve, print_decode, print_goals,
                            print_machine, print_overhead, print_prefill)
from .kernels import bench_attention, decode_step_breakdown, host_isa, kv_int8_decode, old_vs_new_decode, print_kernels
from .machine import (MachineLimits, ModelCosts, PairedRates, busy_cpus, cpu_name, measure_machine, measure_matmul,
                      model_costs, prompt_roofline, read_beside, warn_if_busy)
from .overhead import HostOverhead, bench_overhead_parts, host_overhead
from .prefill_decode import (ChunkResult, DecodeBound, DecodeResult, ForwardCurve, PrefillResult, bench_decode,
                             bench_chunk, bench_forward_curve, bench_prefill, decode_bandwidth)
from .timing import FULL, QUICK, Sizes

__all__ = ["EngineBenchResults", "RunMeta", "busy_cpus", "cpu_name", "main", "run"]


@dataclass(frozen=True)
class RunMeta:
    """What was measured, where, and how busy the host was."""

    model: str
    dtype: str
    device: str
    num_threads: int
    cpu: str
    torch: str
    budget_tokens: int
    block_size: int
    quick: bool
    do_sample: bool
    sizes: Sizes
    model_costs: ModelCosts
    time: str
    isa: str
    kernels: str
    quantization: str
    resident_weight_bytes: int
    calibrated_budget: dict[str, Any] | None
    row_limits: dict[str, Any] | None = None      # fastgen/row_limits.py, where measured
    busy_cpus_before: float | None = None
    busy_cpus_after: float | None = None


@dataclass(frozen=True)
class EngineBenchResults:
    """One run's records; :meth:`to_json` is the ``--out`` file. ``attention``, ``decode_step_breakdown``,
    ``old_vs_new_decode`` and ``kv_int8_decode`` are kernels.py's JSON sections (``None``: not measured)."""

    meta: RunMeta
    machine: MachineLimits
    prefill: PrefillResult
    decode: tuple[DecodeResult, ...]
    decode_bandwidth: DecodeBound
    forward_curve: ForwardCurve
    host_overhead: HostOverhead
    attention: dict[str, Any]
    decode_step_breakdown: dict[str, Any]
    old_vs_new_decode: dict[str, Any] | None
    goals: tuple[Goal, ...]
    chunk: ChunkResult | None = None     # a 256-token chunk at position 1,792 (--quick: 64 at 192)
    kv_int8_decode: dict[str, Any] | None = None   # 8 decodes at 1,300 keys over a pool of the model's dtype / int8

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options of the benchmarks that load one (this one and fastgen/bench/decode.py)."""
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto",
                   choices=["bfloat16", "bf16", "float32", "fp32", "float16", "fp16", "auto"],
                   help="model and KV dtype (default auto: the host's best)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weights (default auto: a GGUF as shipped)")
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "torch"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastgen.bench.engine", description=__doc__.split("\n")[0])
    add_engine_args(p)
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help="target of the calibrated budget shown (default: the engine's)")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke run")
    p.add_argument("--do-sample", action="store_true",
                   help="decode with do_sample=True (top_p=0.9) instead of greedy")
    p.add_argument("--out", type=Path, default=Path("bench-results/engine.json"),
                   help="JSON of every number; the plot goes beside it as .png")
    return p.parse_args(argv)


def run_meta(args: argparse.Namespace, engine: Engine, sizes: Sizes, costs: ModelCosts) -> RunMeta:
    cfg = engine.config
    return RunMeta(
        model=cfg.model_path, dtype=str(cfg.dtype), device=str(cfg.device), num_threads=cfg.num_threads,
        cpu=cpu_name(), torch=torch.__version__, budget_tokens=cfg.scheduler.budget_tokens,
        block_size=cfg.cache.block_size, quick=args.quick, do_sample=args.do_sample, sizes=sizes,
        model_costs=costs, time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), isa=host_isa(), kernels=cfg.kernels,
        quantization=cfg.quantization,
        resident_weight_bytes=weight_bytes(engine.model),   # every weight once, the embedding included
        calibrated_budget=None if engine.budget_choice is None else asdict(engine.budget_choice),
        row_limits=None if engine.row_limits is None else asdict(engine.row_limits))


def run(args: argparse.Namespace) -> EngineBenchResults:
    sizes = QUICK if args.quick else FULL
    rng = random.Random(0)
    busy_before = busy_cpus()
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, budget_tokens=sizes.budget_tokens,
                                    max_seqs=max(sizes.decode_batches), quantization=args.quantization,
                                    kernels=args.kernels)
    engine.budget_choice = calibrate_engine_budget(engine.model, engine.model_config, engine.config,
                                                   args.target_itl_ms or DEFAULT_TARGET_ITL_MS,
                                                   "" if engine.row_limits is None else engine.row_limits.key)
    torch.set_num_threads(engine.config.num_threads)
    sampling = SamplingParams(max_new_tokens=sizes.num_decode_steps + 8, do_sample=args.do_sample,
                              ignore_eos=True)
    costs = model_costs(engine)
    meta = replace(run_meta(args, engine, sizes, costs), busy_cpus_before=busy_before)
    print(f"fastgen engine benchmark: {Path(meta.model).name}, {meta.dtype}, {meta.device}, "
          f"{meta.num_threads} threads, {meta.cpu} [{meta.isa}], kernels={meta.kernels}, "
          f"quantization={meta.quantization}, allocator={os.environ.get(MARK_ENV, 'system malloc')}"
          f"{' (--quick)' if args.quick else ''}")
    if engine.budget_choice is not None:
        print(f"   calibrated {engine.budget_choice.describe()}")
    if engine.row_limits is not None:
        print(f"   measured {engine.row_limits.describe()}")
    warn_if_busy(busy_before, "before the run")

    machine = measure_machine(engine, costs, sizes)
    print_machine(machine)
    matmul = machine.matmul[meta.dtype].gflops
    # with int8 activations the prompt's products are integer ones: its roofline takes them at
    # _int_mm's rate and its attention at the dtype's matmul rate. Where _int_mm is slower than the
    # dtype's own products (AVX2 hosts: torch has no fast int8 CPU product there, 2.4 against 141
    # GFLOP/s fp32 on a Zen 3), the products' limit is the faster of the two
    int8 = machine.matmul.get("int8")
    if int8 is not None and int8.gflops < matmul:
        print(f"   int8 _int_mm {int8.gflops:.1f} GOP/s is below {meta.dtype}'s {matmul:.1f} GFLOP/s on this "
              f"host: the prompt's products are held to {meta.dtype}'s rate")
        int8 = None
    # where the measured row limits send prompt rows back to qgemm (bf16 on AMX tiles: qgemm_a8
    # keeps only a middle range of rows), the prompt's products are the dtype's, and so is the limit
    limits = engine.row_limits
    if int8 is not None and limits is not None and limits.max_a8_rows < min(256, sizes.prefill_tokens):
        print(f"   prompt rows past {limits.max_a8_rows} take {meta.dtype} products (qgemm"
              f"{', AMX tiles' if torch.ops.fastgen.have_amx() else ''}): the prompt's roofline is "
              f"{meta.dtype}'s {matmul:.1f} GFLOP/s")
        int8 = None
    chunk_tokens, chunk_start = (256, 1792) if not args.quick else (64, 192)

    def rooflines(matmul: float, int8_gflops: float | None = None) -> tuple[float, float]:
        """The prefill's and the chunk's rooflines for the dtype's matmul rate ``matmul`` (and
        _int_mm's, ``int8_gflops``, where the prompt's products are integer ones)."""
        if int8 is None:
            return matmul, matmul
        i8 = int8.gflops if int8_gflops is None else int8_gflops
        return (prompt_roofline(costs, min(sizes.prefill_tokens, engine.config.max_model_len - 1), i8, matmul),
                prompt_roofline(costs, chunk_tokens, i8, matmul, start=chunk_start))

    roofline, chunk_roofline = rooflines(matmul)
    if int8 is not None:
        print(f"   prefill roofline {roofline:.1f} GFLOP/s: products at int8 _int_mm's "
              f"{int8.gflops:.1f}, attention at {meta.dtype}'s {matmul:.1f}")
    # the rooflines measured again beside every timed prompt run (paired_ratio)
    rates = PairedRates(engine.config.dtype, sizes.matmul_n, engine.config.device, int8 is not None, sizes)
    prefill = bench_prefill(engine, costs, sizes, roofline, rng, limit=lambda: rooflines(*rates())[0])
    chunk = bench_chunk(engine, costs, sizes, chunk_roofline, rng, chunk_tokens, chunk_start,
                        limit=lambda: rooflines(*rates())[1])
    # the dtype's matmul limit measured again after the prompts: on a shared VM its rate swings
    # between phases (oneDNN's bf16 2048^2 at 688 / 2,473 / 882 GFLOP/s in three runs on the AMX
    # host, 12-05), and a limit caught in a slow phase would flatter the ratios; the higher serves
    again = measure_matmul(engine.config.dtype, sizes.matmul_n, engine.config.device, sizes).gflops
    if again > matmul:
        print(f"   {meta.dtype} matmul measured again after the prompts: {again:.1f} GFLOP/s (was {matmul:.1f}); "
              f"the prompt ratios are taken against it")
        matmul = again
        machine.matmul[meta.dtype] = replace(machine.matmul[meta.dtype], gflops=again)
        roofline, chunk_roofline = rooflines(matmul)
        prefill = replace(prefill, roofline_gflops=roofline, roofline_ratio=prefill.achieved_gflops / roofline,
                          forward_roofline_ratio=prefill.forward_roofline_ratio * prefill.roofline_gflops / roofline)
        if chunk is not None:
            chunk = replace(chunk, roofline_gflops=chunk_roofline,
                            roofline_ratio=chunk.achieved_gflops / chunk_roofline)
    print_prefill(prefill)
    print_chunk(chunk)
    # the read bound measured again just before and just after batch-1 decode's steps, as the
    # matmul limit is after the prompts: the VM's memory swings between phases, and a bound caught
    # in a slow one flatters the ratio (12-06, Zen 4, fp32: batch-1 decode at 113.9% of a 35.4 GB/s
    # bound read at the run's start, its steps streaming 40 GB/s); the highest figure serves
    beside = [read_beside(engine, costs, sizes)] if 1 in sizes.decode_batches else []
    decode = []
    for b in tqdm(sizes.decode_batches, desc="decode", leave=False, disable=None):
        decode.append(bench_decode(engine, b, sizes, sampling, rng))
        if b == 1:
            beside.append(read_beside(engine, costs, sizes))
    read_again = max(beside, default=0.0)
    if read_again > machine.decode_bound_gbps:
        print(f"   read bound measured again beside batch-1 decode: {read_again:.1f} GB/s (was "
              f"{machine.decode_bound_gbps:.1f}); batch 1's ratio is taken against it")
        machine = replace(machine, decode_bound_gbps=read_again)
    bound = decode_bandwidth(decode, machine, costs)
    print_decode(decode, bound)
    curve = bench_forward_curve(engine, sizes, rng)
    print_curve(curve)
    overhead = host_overhead(decode, bench_overhead_parts(engine, sizes, sampling, rng))
    print_overhead(overhead)
    attention = bench_attention(engine, matmul, machine.decode_bound_gbps, repeats=sizes.num_repeats)
    breakdown = decode_step_breakdown(engine)
    old_new = None if args.quick else old_vs_new_decode(engine)
    kv8 = None if args.quick else kv_int8_decode(engine)
    print_kernels(attention, breakdown, old_new, matmul, kv8)

    verdicts = tuple(goals(prefill, bound, overhead, chunk))
    print_goals(list(verdicts))
    busy_after = busy_cpus()
    warn_if_busy(busy_after, "after the run")
    return EngineBenchResults(replace(meta, busy_cpus_after=busy_after), machine, prefill, tuple(decode), bound,
                              curve, overhead, attention, breakdown, old_new, verdicts, chunk, kv8)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results.to_json(), indent=2) + "\n")
    png = args.out.with_suffix(".png")
    meta = results.meta
    skipped = plot_curve(results.forward_curve, png, f"{Path(meta.model).name} {meta.dtype}, {meta.num_threads} threads")
    print(f"\nwrote {args.out}" + (f"; {skipped}" if skipped else f" and {png}"))
    return 0


if __name__ == "__main__":
    from ..launcher import reexec_with_allocator

    reexec_with_allocator([sys.executable, "-m", "fastgen.bench.engine", *sys.argv[1:]])   # as `fastgen` does
    sys.exit(main())
