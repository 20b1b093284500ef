"""What the per-step records cost: one engine, the same batches run with recording on and off in
alternating rounds (so that both see the same machine load), and the record-building itself timed
alone. ``python -m fastgen.bench.telemetry_cost [--model PATH] [--rounds 6]``; figures in
docs/reliability.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

from ..engine import Engine
from ..request import SamplingParams
from ..telemetry import EventLog


def run_round(engine: Engine, num_requests: int, prompt_tokens: int, new_tokens: int) -> list[float]:
    vocab = engine.model_config.vocab_size
    for i in range(num_requests):
        engine.add_request([(7 * i + j) % (vocab - 1) + 1 for j in range(prompt_tokens)],
                           SamplingParams(max_new_tokens=new_tokens, do_sample=False, ignore_eos=True))
    times = []
    ids = list(engine._requests)
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.response(rid)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastgen.bench.telemetry_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per mode, alternating (default 6)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--budget-tokens", type=int, default=128)
    args = p.parse_args(argv)
    engine = Engine.from_pretrained(args.model, budget_tokens=args.budget_tokens)
    run_round(engine, 2, 16, 4)  # warm-up
    on, off = [], []
    for i in range(2 * args.rounds):
        recording = i % 2 == 0
        engine.events = EventLog() if recording else EventLog(capacity=0)
        (on if recording else off).extend(run_round(engine, args.requests, args.prompt_tokens, args.new_tokens))
    # the record alone: build one step record of a full batch, many times
    engine.events = EventLog()
    from ..scheduler.base import StepPlan
    from ..batch import ScheduledChunk

    for i in range(args.requests):
        engine.add_request([1 + j for j in range(8)], SamplingParams(max_new_tokens=4, do_sample=False),
                           request_id=f"cost-{i}")
    plan = StepPlan(tuple(ScheduledChunk(f"cost-{i}", 1) for i in range(args.requests)))
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        engine._record_step(plan, t)
    per_record_us = (time.perf_counter() - t) / n * 1e6
    mean_on, mean_off = statistics.mean(on), statistics.mean(off)
    med_on, med_off = statistics.median(on), statistics.median(off)
    print(f"model {engine.config.model_path}, {engine.config.num_threads} threads, budget {args.budget_tokens}, "
          f"{args.requests} requests x ({args.prompt_tokens} prompt + {args.new_tokens} new), "
          f"{args.rounds} rounds per mode, alternating")
    print(f"step time, recording on : mean {mean_on * 1e3:.3f} ms, median {med_on * 1e3:.3f} ms ({len(on)} steps)")
    print(f"step time, recording off: mean {mean_off * 1e3:.3f} ms, median {med_off * 1e3:.3f} ms ({len(off)} steps)")
    print(f"difference of medians: {(med_on - med_off) * 1e6:+.1f} us ({(med_on / med_off - 1) * 100:+.2f} %)")
    print(f"one step record of a {args.requests}-sequence batch, built alone: {per_record_us:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
