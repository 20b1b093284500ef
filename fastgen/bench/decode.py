"""Batch-1 decode against the bandwidth bound, alone: ``python -m fastgen.bench.decode``.

    python -m fastgen.bench.decode --quantization none --dtype bfloat16     # dense bf16
    python -m fastgen.bench.decode --rounds 5 --out bench-results/decode.json

``make bench`` (fastgen/bench/engine.py) measures batch-1 decode after the prompts, in the
engine's dtype. This runs only its decode part, so that a dtype whose prompts would take the
full benchmark tens of minutes (bf16 on a host without native bf16: oneDNN's bf16 matmul ran at
0.3 GFLOP/s on the Zen 3 host) still gets its decode figure from the benchmark's own code: the
same reads (:func:`~fastgen.bench.machine.measure_reads`; no matmul is measured), the same
steps (:func:`~fastgen.bench.prefill_decode.bench_decode`) and the same rule for the bound (the
highest read of the run, the weight-sized reads taken again just before and after every run
of steps, :func:`~fastgen.bench.machine.read_beside`). A run is ``--rounds`` such runs of
steps; each round's ratio against its own two reads is printed beside the verdict, which takes
the highest read of the whole run, as ``make bench`` does.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine import Engine
from ..launcher import MARK_ENV
from ..request import SamplingParams
from .engine import add_engine_args
from .engine_report import GOAL_DECODE_BANDWIDTH
from .kernels import host_isa
from .machine import BANDWIDTH_BOUND_RULE, cpu_name, measure_reads, model_costs, read_beside
from .prefill_decode import DecodeResult, bench_decode
from .timing import FULL, QUICK, Sizes


@dataclass(frozen=True)
class DecodeRound:
    result: DecodeResult
    read_before_gbps: float
    read_after_gbps: float
    ratio_beside: float              # tokens/s against the bound at the higher of its two reads


@dataclass(frozen=True)
class DecodeBenchResults:
    model: str
    dtype: str
    quantization: str
    isa: str
    cpu: str
    num_threads: int
    allocator: str
    time: str
    weight_bytes: int
    machine_bound_gbps: float        # the highest of measure_reads' reads (before the rounds)
    rounds: tuple[DecodeRound, ...]
    bound_gbps: float                # the highest read of the run: the verdict's
    tokens_per_s: float              # median over the rounds
    ratio: float                     # tokens_per_s against bound_gbps
    goal: float = GOAL_DECODE_BANDWIDTH
    bandwidth_rule: str = BANDWIDTH_BOUND_RULE

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastgen.bench.decode", description=__doc__.split("\n")[0])
    add_engine_args(p)
    p.add_argument("--rounds", type=int, default=3, help="runs of timed steps, each between two reads")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke run")
    p.add_argument("--out", type=Path, default=Path("bench-results/decode.json"), help="JSON of every number")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def bench_batch1(engine: Engine, sizes: Sizes, rounds: int, rng: random.Random, meta: dict[str, Any]
                 ) -> DecodeBenchResults:
    """``rounds`` runs of batch-1 decode steps, each between two weight-sized reads, against the
    highest read of the run (measure_reads' and every read beside the steps)."""
    costs = model_costs(engine)
    machine_gbps = max(r.gbps for r in measure_reads(engine, costs, sizes))
    sampling = SamplingParams(max_new_tokens=sizes.num_decode_steps + 8, do_sample=False, ignore_eos=True)
    gb_per_token = costs.weight_bytes / 1e9   # read once a step
    out = []
    for r in range(rounds):
        before = read_beside(engine, costs, sizes)
        result = bench_decode(engine, 1, sizes, sampling, rng)
        after = read_beside(engine, costs, sizes)
        out.append(DecodeRound(result, before, after, result.tokens_per_s * gb_per_token / max(before, after)))
        print(f"   round {r + 1}: {result.step.median_s * 1e3:.2f} ms a step = {result.tokens_per_s:.1f} tokens/s; "
              f"reads beside {before:.1f} / {after:.1f} GB/s: {out[-1].ratio_beside:.1%} of their bound", flush=True)
    bound = max([machine_gbps] + [x for o in out for x in (o.read_before_gbps, o.read_after_gbps)])
    tps = statistics.median(o.result.tokens_per_s for o in out)
    return DecodeBenchResults(**meta, weight_bytes=costs.weight_bytes, machine_bound_gbps=machine_gbps,
                              rounds=tuple(out), bound_gbps=bound, tokens_per_s=tps, ratio=tps * gb_per_token / bound)


def run(args: argparse.Namespace) -> DecodeBenchResults:
    sizes = QUICK if args.quick else FULL
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, budget_tokens=sizes.budget_tokens, max_seqs=4,
                                    quantization=args.quantization, kernels=args.kernels)
    torch.set_num_threads(engine.config.num_threads)
    cfg = engine.config
    meta = dict(model=cfg.model_path, dtype=str(cfg.dtype), quantization=cfg.quantization, isa=host_isa(),
                cpu=cpu_name(), num_threads=cfg.num_threads, allocator=os.environ.get(MARK_ENV, "system malloc"),
                time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    print(f"fastgen batch-1 decode benchmark: {Path(meta['model']).name}, {meta['dtype']}, "
          f"quantization={meta['quantization']}, {meta['num_threads']} threads, {meta['cpu']} [{meta['isa']}], "
          f"allocator={meta['allocator']}")
    res = bench_batch1(engine, sizes, args.rounds, random.Random(0), meta)
    verdict = "PASS" if res.ratio >= res.goal else "MISS"
    print(f"   batch 1: {res.tokens_per_s:.1f} tokens/s (median of {len(res.rounds)} rounds) = {res.ratio:.1%} of "
          f"{res.weight_bytes / 1e6:.1f} MB at {res.bound_gbps:.1f} GB/s, the run's highest read "
          f"(goal >= {res.goal:.0%}): {verdict}")
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res.to_json(), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from ..launcher import reexec_with_allocator

    reexec_with_allocator([sys.executable, "-m", "fastgen.bench.decode", *sys.argv[1:]])   # as `fastgen` does
    sys.exit(main())
