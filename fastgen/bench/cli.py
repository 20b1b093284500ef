"""``fastgen bench``: the paper's serving benchmark, against the in-process engine or an
OpenAI-compatible server.

    python -m fastgen.bench                                   # 3 policies, cpu-600-30, 1..8 clients
    python -m fastgen.bench --workload paper-1200-60 --clients 1,2,4,8,16,32   # the paper's sweep
    python -m fastgen.bench --scheduler splitfuse --rates 0.5,1,2             # Poisson arrivals
    python -m fastgen.bench --url http://127.0.0.1:8000 --label fastgen-server
    python -m fastgen.bench report a/results.json b/results.json --out cmp    # merge, re-summarize

Writes ``results.json`` (every request's timestamps, every summary figure), ``summary.md`` and
three PNG plots to ``--out``. See docs/benchmark.md for the metrics and a reproduction.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..config import KV_CACHE_DTYPES, PROMPT_ORDERS, SCHEDULERS
from ..errors import FastgenError
from .machine import busy_cpus, cpu_name
from .engine_target import EngineTarget, RunResult, engines, warm_up
from .http_target import HTTPTarget, HTTPTargetError
from .load import ClosedLoop, Load, Poisson, RunLimits
from .metrics import SLA, GoodputSLO, summarize
from .report import Point, Report, Series, from_json, markdown, merge, write
from .workload import PRESETS, BenchRequest, Corpus, Workload, WorkloadError, build_requests, workload_from_args

DESCRIPTION = ("The paper's serving benchmark (effective throughput under an SLA, latency against "
               "throughput, token latency) against the in-process engine or an OpenAI-compatible server.")
DEFAULT_WORKLOAD = "cpu-600-30"
DEFAULT_CLIENTS = "1,2,4,8"
DEFAULT_OUT = Path("bench-results/serving")
BUSY_CPUS_WARNING = 0.25


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _policies(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in SCHEDULERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"schedulers must be among {', '.join(SCHEDULERS)}, got {text!r}")
    return names


def _goodput(items: Sequence[str] | None) -> GoodputSLO:
    """``ttft:MS tpot:MS e2e:MS`` (vLLM's ``--goodput``, milliseconds) -> seconds."""
    keys = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s", "e2e": "e2e_s"}
    values: dict[str, float] = {}
    for item in items or ():
        name, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if name not in keys or not value > 0:
            raise argparse.ArgumentTypeError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        values[keys[name]] = value / 1e3
    return GoodputSLO(**values)


def _add_sla_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SLA (effective throughput) and goodput")
    g.add_argument("--sla-prompt-tps", type=float, default=None, metavar="TOKENS_PER_S",
                   help="TTFT must be <= prompt tokens / this (paper: 512)")
    g.add_argument("--sla-rates", type=_floats, default=None, metavar="R,...",
                   help="generation rates R in tokens/s: EMA of token gaps < 1/R (paper: 2,4,6)")
    g.add_argument("--sla-ema-span", type=int, default=None, metavar="N", help="EMA span (paper: 16)")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="vllm bench serve's goodput SLOs, e.g. --goodput ttft:2000 tpot:200 (milliseconds)")


def _sla(args: argparse.Namespace, base: SLA | None = None) -> SLA | None:
    """The SLA from the command line, over ``base`` (None if nothing was given and no base)."""
    if base is None and args.sla_prompt_tps is None and args.sla_rates is None and args.sla_ema_span is None:
        return None
    base = base or SLA()
    try:
        return SLA(args.sla_prompt_tps or base.prompt_tokens_per_s,
                   tuple(args.sla_rates) if args.sla_rates else base.gen_tokens_per_s,
                   args.sla_ema_span or base.ema_span)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run_parser() -> argparse.ArgumentParser:
    epilog = "workload presets:\n" + "\n".join(f"  {w.describe()}" for w in PRESETS.values())
    p = argparse.ArgumentParser(prog="fastgen bench", description=DESCRIPTION,
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target (default: the in-process engine, one series per scheduler)")
    t.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    t.add_argument("--scheduler", type=_policies, default=list(SCHEDULERS), metavar="P,...",
                   help=f"policies to compare in-process (default: {','.join(SCHEDULERS)})")
    t.add_argument("--dtype", default="auto")
    t.add_argument("--device", default=None)
    t.add_argument("--budget-tokens", type=int, default=None)
    t.add_argument("--max-seqs", type=int, default=None)
    t.add_argument("--prompt-order", choices=list(PROMPT_ORDERS), default=None,
                   help="in-process: the order waiting prompts are admitted in (default arrival)")
    t.add_argument("--num-blocks", type=int, default=None)
    t.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="in-process: the KV cache's storage (default auto: the model's dtype)")
    t.add_argument("--url", default=None, help="benchmark this OpenAI-compatible server instead")
    t.add_argument("--label", default=None,
                   help="series name for --url (default: the URL); in-process, added after each policy's name")
    t.add_argument("--served-model", default=None, help="model name for --url (default: the first of /v1/models)")
    t.add_argument("--api-key", default=None)
    t.add_argument("--no-length-extensions", dest="length_extensions", action="store_false",
                   help="do not send ignore_eos/min_tokens (for servers that reject them)")
    t.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on",
                   help="in-process: engines with the prefix cache, without it, or both "
                        "(series '<policy>' and '<policy> no-prefix-cache'; default on)")
    t.add_argument("--no-cache-salt", dest="cache_salt", action="store_false",
                   help="do not send a cache_salt per load point (each point then may hit the prefix "
                        "cache of the points before it, which sent the same requests)")
    t.add_argument("--wait-ready-s", type=float, default=120.0,
                   help="wait this long for --url's /health to answer 200 (default 120)")
    t.add_argument("--tokenizer", default=None,
                   help="cut prompts with this model's tokenizer (default: --model's)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default=None, choices=list(PRESETS),
                   help=f"a preset (default {DEFAULT_WORKLOAD} unless both means are given)")
    w.add_argument("--prompt-mean", type=int, default=None, help="mean prompt tokens (std 0.3 x mean)")
    w.add_argument("--gen-mean", type=int, default=None, help="mean generated tokens (std 0.3 x mean)")
    w.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load (every point bounded in requests and time)")
    ld.add_argument("--clients", type=_ints, default=None, metavar="N,...",
                    help=f"closed-loop client counts (default {DEFAULT_CLIENTS} unless --rates is given)")
    ld.add_argument("--rates", type=_floats, default=None, metavar="RPS,...", help="Poisson arrival rates (requests/s)")
    ld.add_argument("--num-requests", type=int, default=16, help="requests per load point, at least (default 16)")
    ld.add_argument("--requests-per-client", type=int, default=4,
                    help="closed loop: at least this many requests per client (default 4)")
    ld.add_argument("--max-duration-s", type=float, default=300.0,
                    help="wall-clock limit of one load point; running requests are then cut off (default 300)")
    _add_sla_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    o.add_argument("--title", default="", help="added to the plots' titles")
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--trace-file", default=None, metavar="PATH",
                   help="in-process engine: keep its step records and request events as JSON lines "
                        "(one file per scheduler: PATH.POLICY.jsonl with several); `fastgen trace PATH` draws them")
    return p


def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastgen bench report",
                                description="Summarize saved results again (merged, under another SLA).")
    p.add_argument("results", nargs="+", type=Path, help="results.json files of earlier runs")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reference", default=None, help="series the comparison table is relative to")
    p.add_argument("--title", default="")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    _add_sla_args(p)
    return p


# -- running --------------------------------------------------------------------------------------

def load_points(args: argparse.Namespace) -> list[tuple[Load, RunLimits]]:
    points: list[tuple[Load, RunLimits]] = []
    clients = args.clients if args.clients is not None else ([] if args.rates else _ints(DEFAULT_CLIENTS))
    for n in clients:
        num = max(args.num_requests, args.requests_per_client * n)
        points.append((ClosedLoop(n), RunLimits(num, args.max_duration_s)))
    for rate in args.rates or ():
        points.append((Poisson(rate, args.seed), RunLimits(args.num_requests, args.max_duration_s)))
    return points


def describe_point(label: str, load: Load, run: RunResult, sla: SLA) -> str:
    m = summarize(run.records, run.duration_s, sla)
    sla_part = " ".join(f"SLA@{r.gen_tokens_per_s:g} {r.fraction:.0%}" for r in m.sla)
    if m.prefix_hit_rate is not None:
        sla_part += f", prefix hits {m.prefix_hit_rate:.0%}"
    ttft = f"{m.ttft_s.mean:.2f}" if m.ttft_s.mean is not None else "-"
    e2e = f"{m.e2e_s.mean:.2f}" if m.e2e_s.mean is not None else "-"
    errors = sorted({r.error for r in run.records if r.error})
    return (f"{label:>14} {load.label:>16}: {m.num_completed}/{m.num_requests} done in {m.duration_s:6.1f} s, "
            f"{m.request_throughput:.3f} req/s, TTFT {ttft} s, e2e {e2e} s, {sla_part}"
            + ("  (time limit hit)" if run.timed_out else "")
            + (f"\n{'':>32}{m.num_failed} failed, e.g. {errors[0]}" if errors else ""))


def engine_series(args: argparse.Namespace, workload: Workload, points, sla: SLA,
                  meta: dict[str, Any]) -> Iterator[Series]:
    options = {k: v for k, v in {"dtype": args.dtype, "device": args.device, "budget_tokens": args.budget_tokens,
                                 "max_seqs": args.max_seqs, "num_blocks": args.num_blocks,
                                 "prompt_order": args.prompt_order, "kv_cache_dtype": args.kv_cache_dtype}.items()
               if v is not None}
    requests: list[BenchRequest] | None = None
    caching = {"on": (True,), "off": (False,), "both": (True, False)}[args.prefix_caching]
    for policy, engine in engines(args.model, args.scheduler, options, caching):
        if requests is None:
            requests = _requests(workload, points, Corpus.shipped(engine.tokenizer), args.seed,
                                 engine.config.max_model_len, meta)
            cfg = engine.config
            meta.update(model=cfg.model_path, dtype=str(cfg.dtype), device=str(cfg.device),
                        num_threads=cfg.num_threads, budget_tokens=cfg.scheduler.budget_tokens,
                        max_seqs=cfg.scheduler.max_seqs, num_blocks=cfg.cache.num_blocks,
                        block_size=cfg.cache.block_size, max_model_len=cfg.max_model_len,
                        kv_cache_dtype=cfg.kv_cache_dtype)
        warm_up(engine)
        target = EngineTarget(engine, salt_per_run=args.cache_salt,
                              trace=_trace_writer(args.trace_file, policy, len(args.scheduler) * len(caching)))
        label = f"{policy} {args.label}" if args.label else policy
        done = []
        for load, limits in points:
            run = target.run(requests, load, limits, desc=f"{label} {load.label}")
            print(describe_point(label, load, run, sla), flush=True)
            done.append(Point(load, run))
        yield Series(label, "engine", tuple(done))


def _trace_writer(path: str | None, policy: str, num_policies: int):
    if not path:
        return None
    from ..telemetry import TraceWriter

    if num_policies > 1:
        stem, dot, ext = path.rpartition(".")
        name = policy.replace(" ", "-")
        path = f"{stem}.{name}.{ext}" if dot and "/" not in ext else f"{path}.{name}.jsonl"
    return TraceWriter(path)


def http_series(args: argparse.Namespace, workload: Workload, points, sla: SLA,
                meta: dict[str, Any]) -> Iterator[Series]:
    from ..model.llama import ModelConfig
    from ..model.loader import load_hf_config, load_tokenizer, resolve_model_path

    path = resolve_model_path(args.tokenizer or args.model)
    max_len = ModelConfig.from_hf(load_hf_config(path)).max_position_embeddings
    requests = _requests(workload, points, Corpus.shipped(load_tokenizer(path)), args.seed, max_len, meta)
    target = HTTPTarget(args.url, args.served_model, api_key=args.api_key,
                        length_extensions=args.length_extensions, wait_ready_s=args.wait_ready_s,
                        salt_per_run=args.cache_salt)
    _check_busy(meta)   # after the server's /health answered: a server still loading is busy
    label = args.label or args.url
    meta.update(url=args.url, served_model=target.model, tokenizer=path, max_model_len=max_len)
    done = []
    for load, limits in points:
        run = target.run(requests, load, limits, desc=f"{label} {load.label}")
        print(describe_point(label, load, run, sla), flush=True)
        done.append(Point(load, run))
    yield Series(label, args.url, tuple(done))


def _check_busy(meta: dict[str, Any]) -> None:
    """Record (and warn of) CPUs kept busy by other processes before the load starts."""
    meta["busy_cpus_before"] = busy = busy_cpus()
    if busy is not None and busy > BUSY_CPUS_WARNING:
        print(f"warning: other processes keep {busy:.1f} CPUs busy; latencies will be inflated", flush=True)


def _requests(workload: Workload, points, corpus: Corpus, seed: int, max_model_len: int,
              meta: dict[str, Any]) -> list[BenchRequest]:
    num = max(limits.num_requests for _, limits in points)
    requests = build_requests(workload, num, corpus, seed=seed, max_model_len=max_model_len)
    meta.update(corpus=corpus.source, corpus_tokens=len(corpus.token_ids), num_distinct_requests=num)
    return requests


def run(args: argparse.Namespace) -> int:
    both_means = args.prompt_mean is not None and args.gen_mean is not None
    name = args.workload or (None if both_means else DEFAULT_WORKLOAD)
    workload = workload_from_args(name, args.prompt_mean, args.gen_mean)
    sla = _sla(args) or SLA()
    slo = _goodput(args.goodput)
    points = load_points(args)
    if not points:
        raise argparse.ArgumentTypeError("no load points: give --clients and/or --rates")
    meta: dict[str, Any] = {
        "command": shlex.join(["fastgen", "bench", *args.argv]),
        "workload": {"name": workload.name, "prompt_mean_tokens": workload.prompt_mean_tokens,
                     "gen_mean_tokens": workload.gen_mean_tokens, "rel_std": workload.rel_std},
        "seed": args.seed, "cpu": cpu_name(), "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if not args.url:   # a server is checked once it is ready (http_series): its start-up would count
        _check_busy(meta)
    print(f"fastgen bench: {workload.describe()}; "
          f"{', '.join(f'{load.label} ({lim.num_requests} requests)' for load, lim in points)}", flush=True)
    make = http_series if args.url else engine_series
    started = time.perf_counter()
    series: tuple[Series, ...] = ()
    for done in make(args, workload, points, sla, meta):
        series += (done,)
        # what is measured so far survives an interrupted run
        write(Report(series, sla, slo, {**meta, "partial": True}), args.out, plots=False)
    meta["wall_s"] = time.perf_counter() - started
    meta["busy_cpus_after"] = busy_cpus()
    report = Report(series, sla, slo, meta)
    reference = "splitfuse" if any(s.label == "splitfuse" for s in series) else None
    title = args.title or workload.name
    paths = write(report, args.out, reference=reference, title=title, plots=args.plots)
    print("\n" + markdown(report, reference))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def report(args: argparse.Namespace) -> int:
    reports = []
    for path in args.results:
        data = json.loads(path.read_text())
        saved = from_json(data)
        reports.append(from_json(data, _sla(args, saved.sla), _goodput(args.goodput) if args.goodput else None))
    merged = reports[0] if len(reports) == 1 else merge(reports)
    paths = write(merged, args.out, reference=args.reference, title=args.title, plots=args.plots)
    print(markdown(merged, args.reference))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        parser, action = report_parser(), report
        argv = argv[1:]
    else:
        parser, action = run_parser(), run
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return action(args)
    except (FastgenError, WorkloadError, HTTPTargetError, argparse.ArgumentTypeError, OSError) as e:
        parser.error(str(e))
    return 2
