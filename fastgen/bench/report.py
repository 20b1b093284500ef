"""Results of a benchmark: the JSON file, the markdown tables and the PNG plots.

A benchmark is a list of *series* (one per scheduling policy, or one per HTTP endpoint), each
a sweep of *load points*; a point keeps every request's timestamps. Every summary figure is
computed from those timestamps (``metrics.summarize``), so a saved JSON can be summarized
again under another SLA, or merged with another run's (``fastgen bench report``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .engine_target import RunResult
from .load import ClosedLoop, Load, load_from_json, load_to_json
from .metrics import SLA, GoodputSLO, RequestRecord, Summary, best_effective_throughput, summarize

FORMAT_VERSION = 1
TOKEN_PERCENTILES = ("p50", "p90", "p95")


@dataclass(frozen=True)
class Point:
    load: Load
    run: RunResult


@dataclass(frozen=True)
class Series:
    label: str                   # the policy, or a name for an HTTP endpoint
    target: str                  # "engine" or the endpoint's URL
    points: tuple[Point, ...]


@dataclass(frozen=True)
class Report:
    series: tuple[Series, ...]
    sla: SLA
    slo: GoodputSLO
    meta: dict[str, Any] = field(default_factory=dict)
    summaries: dict[tuple[str, int], Summary] = field(default_factory=dict, init=False, repr=False,
                                                      compare=False)

    def __post_init__(self) -> None:
        for s in self.series:
            for i, p in enumerate(s.points):
                self.summaries[(s.label, i)] = summarize(p.run.records, p.run.duration_s, self.sla, self.slo)

    def summary(self, series: Series, index: int) -> Summary:
        return self.summaries[(series.label, index)]

    def sweep(self, series: Series) -> list[Summary]:
        return [self.summary(series, i) for i in range(len(series.points))]

    def effective(self, series: Series, rate: float) -> tuple[float, str | None]:
        """Best effective throughput of the series' sweep at ``rate``, and the load it was at."""
        value, at = best_effective_throughput(self.sweep(series), rate)
        return value, None if at is None else series.points[at].load.label


# -- JSON -------------------------------------------------------------------------------------

def to_json(report: Report) -> dict[str, Any]:
    series = []
    for s in report.series:
        points = [{"load": load_to_json(p.load), "duration_s": p.run.duration_s, "timed_out": p.run.timed_out,
                   "summary": asdict(report.summary(s, i)),
                   "requests": [asdict(r) for r in p.run.records]} for i, p in enumerate(s.points)]
        series.append({"label": s.label, "target": s.target, "points": points})
    effective = [{"label": s.label, "gen_tokens_per_s": rate, "requests_per_s": v, "at": at}
                 for s in report.series for rate in report.sla.gen_tokens_per_s
                 for v, at in [report.effective(s, rate)]]
    return {"format_version": FORMAT_VERSION, "meta": report.meta, "sla": asdict(report.sla),
            "goodput_slo": asdict(report.slo), "effective_throughput": effective, "series": series}


def from_json(data: dict[str, Any], sla: SLA | None = None, slo: GoodputSLO | None = None) -> Report:
    """Rebuild a report from its JSON; ``sla``/``slo`` replace the saved ones when given."""
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"unsupported results format {data.get('format_version')!r} (expected {FORMAT_VERSION})")
    series = []
    for s in data["series"]:
        points = tuple(Point(load_from_json(p["load"]),
                             RunResult(tuple(RequestRecord(**r) for r in p["requests"]),
                                       p["duration_s"], p["timed_out"]))
                       for p in s["points"])
        series.append(Series(s["label"], s["target"], points))
    saved_sla = data["sla"]
    sla = sla or SLA(saved_sla["prompt_tokens_per_s"], tuple(saved_sla["gen_tokens_per_s"]), saved_sla["ema_span"])
    return Report(tuple(series), sla, slo or GoodputSLO(**data["goodput_slo"]), data.get("meta", {}))


def merge(reports: Sequence[Report]) -> Report:
    """One report of every series of ``reports`` (labels made unique), under the first's SLA."""
    series, seen = [], set()
    for rep in reports:
        for s in rep.series:
            label, k = s.label, 2
            while label in seen:
                label, k = f"{s.label} ({k})", k + 1
            seen.add(label)
            series.append(dataclasses.replace(s, label=label))
    first = reports[0]
    return Report(tuple(series), first.sla, first.slo, {"merged": [r.meta for r in reports]})


# -- markdown -------------------------------------------------------------------------------

def _f(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def points_table(report: Report) -> str:
    rates = report.sla.gen_tokens_per_s
    head = ["series", "load", "done", "req/s", "out tok/s", "TTFT mean (s)", "TTFT P95 (s)",
            "token P50 (ms)", "token P95 (ms)", "TPOT mean (ms)", "e2e mean (s)", "e2e P95 (s)",
            *[f"SLA@{r:g}" for r in rates]]
    if report.slo.is_set:
        head.append("goodput (req/s)")
    rows = []
    for s in report.series:
        for i, p in enumerate(s.points):
            m = report.summary(s, i)
            row = [s.label, p.load.label, f"{m.num_completed}/{m.num_requests}", _f(m.request_throughput, digits=3),
                   _f(m.output_token_throughput, digits=1), _f(m.ttft_s.mean), _f(m.ttft_s.p95),
                   _f(m.token_gap_s.p50, 1e3, 0), _f(m.token_gap_s.p95, 1e3, 0), _f(m.tpot_s.mean, 1e3, 0),
                   _f(m.e2e_s.mean), _f(m.e2e_s.p95), *[f"{r.fraction:.0%}" for r in m.sla]]
            if report.slo.is_set:
                row.append(_f(m.goodput, digits=3))
            rows.append(row)
    return _table(head, rows)


def effective_table(report: Report) -> str:
    head = ["series", *[f"R = {r:g} tok/s" for r in report.sla.gen_tokens_per_s]]
    rows = []
    for s in report.series:
        cells = []
        for rate in report.sla.gen_tokens_per_s:
            v, at = report.effective(s, rate)
            cells.append(f"{v:.3f} ({at})" if at is not None else "0")
        rows.append([s.label, *cells])
    return _table(head, rows)


def token_latency_load(report: Report) -> Load | None:
    """The load at which token latency percentiles are compared: the heaviest closed loop that
    every series ran (else the last point of the first series)."""
    common = None
    for s in report.series:
        loads = {p.load for p in s.points if isinstance(p.load, ClosedLoop)}
        common = loads if common is None else common & loads
    if common:
        return max(common, key=lambda c: c.num_clients)
    return report.series[0].points[-1].load if report.series and report.series[0].points else None


def _point_at(report: Report, series: Series, load: Load) -> Summary | None:
    for i, p in enumerate(series.points):
        if p.load == load:
            return report.summary(series, i)
    return None


def token_latency_table(report: Report) -> str:
    load = token_latency_load(report)
    head = ["series", "load", "token P50 (ms)", "token P90 (ms)", "token P95 (ms)", "token P99 (ms)"]
    rows = []
    for s in report.series:
        m = _point_at(report, s, load) if load is not None else None
        if m is not None:
            g = m.token_gap_s
            rows.append([s.label, load.label, _f(g.p50, 1e3, 0), _f(g.p90, 1e3, 0), _f(g.p95, 1e3, 0),
                         _f(g.p99, 1e3, 0)])
    return _table(head, rows)


def comparison_table(report: Report, reference: str) -> str:
    """How many times better ``reference`` is than each other series: effective throughput
    (reference / other) per rate, and mean end-to-end and P95 token latency (other / reference)
    at each load point both ran."""
    ref = next((s for s in report.series if s.label == reference), None)
    if ref is None:
        return ""
    head = ["vs", *[f"eff. thr. x @{r:g}" for r in report.sla.gen_tokens_per_s], "load",
            "mean e2e latency x", "P95 token latency x"]
    rows = []
    for s in report.series:
        if s is ref:
            continue
        eff = []
        for rate in report.sla.gen_tokens_per_s:
            a, b = report.effective(ref, rate)[0], report.effective(s, rate)[0]
            eff.append(f"{a / b:.2f}" if b > 0 else ("inf" if a > 0 else "-"))
        for p in ref.points:
            mr, mo = _point_at(report, ref, p.load), _point_at(report, s, p.load)
            if mr is None or mo is None:
                continue
            lat = _ratio(mo.e2e_s.mean, mr.e2e_s.mean)
            tok = _ratio(mo.token_gap_s.p95, mr.token_gap_s.p95)
            rows.append([s.label, *eff, p.load.label, lat, tok])
            eff = [""] * len(eff)
    return _table(head, rows)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: Report, reference: str | None = None) -> str:
    sla = report.sla
    parts = [
        "### Load points\n",
        points_table(report),
        f"\nSLA@R: share of completed requests with TTFT <= prompt tokens / {sla.prompt_tokens_per_s:g} s "
        f"and EMA (span {sla.ema_span}) of token gaps < 1/R s at every token.\n",
        "### Effective throughput (requests/s meeting the SLA, best load point)\n",
        effective_table(report),
        "\n### Token latency (gaps between streamed tokens)\n",
        token_latency_table(report),
    ]
    if reference is not None and len(report.series) > 1:
        parts += [f"\n### {reference} against the others (x = times better)\n",
                  comparison_table(report, reference)]
    return "\n".join(parts) + "\n"


# -- plots -------------------------------------------------------------------------------------

def plot(report: Report, out_dir: Path, title: str = "") -> list[Path]:
    """latency_throughput.png, effective_throughput.png, token_latency.png in ``out_dir``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in report.series:
        sweep = report.sweep(s)
        for kind, style in ((ClosedLoop, "o-"), (None, "s--")):
            idx = [i for i, p in enumerate(s.points) if isinstance(p.load, ClosedLoop) == (kind is ClosedLoop)]
            if not idx:
                continue
            xs = [sweep[i].request_throughput for i in idx]
            name = s.label if kind is ClosedLoop else f"{s.label} (poisson)"
            for ax, metric in zip(axes, ("e2e_s", "ttft_s")):
                ax.plot(xs, [getattr(sweep[i], metric).mean for i in idx], style, label=name)
            for i, x in zip(idx, xs):
                load = s.points[i].load
                tag = str(load.num_clients) if isinstance(load, ClosedLoop) else f"{load.rate_per_s:g}/s"
                axes[0].annotate(tag, (x, sweep[i].e2e_s.mean or 0), fontsize=7,
                                 textcoords="offset points", xytext=(3, 3))
    for ax, name in zip(axes, ("mean end-to-end latency (s)", "mean time to first token (s)")):
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Latency against throughput (labels: clients){' - ' + title if title else ''}", fontsize=10)
    paths.append(_save(fig, out_dir / "latency_throughput.png"))

    rates = report.sla.gen_tokens_per_s
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(report.series))
    for k, s in enumerate(report.series):
        values = [report.effective(s, r)[0] for r in rates]
        ax.bar([i + k * width for i in range(len(rates))], values, width, label=s.label)
    ax.set_xticks([i + width * (len(report.series) - 1) / 2 for i in range(len(rates))],
                  [f"{r:g} tokens/s" for r in rates])
    ax.set_xlabel("SLA generation rate R")
    ax.set_ylabel("effective throughput (requests/s)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"Effective throughput{' - ' + title if title else ''}", fontsize=10)
    paths.append(_save(fig, out_dir / "effective_throughput.png"))

    load = token_latency_load(report)
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, s in enumerate(report.series):
        m = _point_at(report, s, load) if load is not None else None
        if m is None:
            continue
        values = [(getattr(m.token_gap_s, q) or 0.0) * 1e3 for q in TOKEN_PERCENTILES]
        ax.bar([i + k * width for i in range(len(TOKEN_PERCENTILES))], values, width, label=s.label)
    ax.set_xticks([i + width * (len(report.series) - 1) / 2 for i in range(len(TOKEN_PERCENTILES))],
                  [q.upper() for q in TOKEN_PERCENTILES])
    ax.set_ylabel("token latency (ms)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"Token latency at {load.label if load else '-'}{' - ' + title if title else ''}", fontsize=10)
    paths.append(_save(fig, out_dir / "token_latency.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(report: Report, out_dir: Path, *, reference: str | None = None, title: str = "",
          plots: bool = True) -> dict[str, Path]:
    """results.json, summary.md and the plots in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "summary.md"}
    paths["json"].write_text(json.dumps(to_json(report), indent=1) + "\n")
    paths["markdown"].write_text(markdown(report, reference))
    if plots:
        for p in plot(report, out_dir, title):
            paths[p.stem] = p
    return paths
