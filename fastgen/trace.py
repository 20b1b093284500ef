"""``fastgen trace PATH``: a picture of what each forward pass carried, from a trace file
(``fastgen serve --trace-file`` or ``fastgen bench --trace-file``; JSON lines of
:mod:`fastgen.telemetry` records).

Top: each step as a stacked bar over time (decode tokens, prompt-chunk tokens, unused budget),
failed steps in red. Middle: step time. Bottom: KV blocks used (and cached) against the pool, and
the waiting/running queues, with preemptions marked.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .telemetry import read_trace


def summarize(records: list[dict]) -> str:
    steps = [r for r in records if r.get("kind") == "step"]
    events = [r for r in records if r.get("kind") == "request"]
    finished = [e for e in events if e.get("event") == "finished"]
    if not steps:
        return f"0 steps, {len(finished)} requests finished"
    budget = sum(s["budget_tokens"] for s in steps)
    used = sum(s["prompt_tokens"] + s["decode_tokens"] for s in steps)
    span = steps[-1]["wall_s"] - steps[0]["wall_s"] + steps[0]["step_time_s"]
    return (f"{len(steps)} steps over {span:.2f} s, {len(finished)} requests finished; budget filled "
            f"{used / budget:.0%} on average ({sum(s['decode_tokens'] for s in steps)} decode + "
            f"{sum(s['prompt_tokens'] for s in steps)} prompt tokens), "
            f"{sum(s['num_preempted'] for s in steps)} preemptions, {sum(s['failed'] for s in steps)} failed steps")


def render(records: list[dict], out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("kind") == "step"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(12, 8), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 1.2, 1.8]})
    if not steps:
        ax1.text(0.5, 0.5, "no step records", ha="center", va="center", transform=ax1.transAxes)
    else:
        t0 = steps[0]["wall_s"] - steps[0]["step_time_s"]
        start = [s["wall_s"] - s["step_time_s"] - t0 for s in steps]
        width = [max(s["step_time_s"], 1e-4) for s in steps]
        decode = [s["decode_tokens"] for s in steps]
        prompt = [s["prompt_tokens"] for s in steps]
        unused = [max(0, s["budget_tokens"] - d - p) for s, d, p in zip(steps, decode, prompt)]
        kw = dict(width=width, align="edge", linewidth=0)
        ax1.bar(start, decode, color="#2f6fb5", label="decode tokens", **kw)
        ax1.bar(start, prompt, bottom=decode, color="#e8871e", label="prompt-chunk tokens", **kw)
        ax1.bar(start, unused, bottom=[d + p for d, p in zip(decode, prompt)], color="#dddddd",
                label="unused budget", **kw)
        failed = [(x, s["budget_tokens"]) for x, s in zip(start, steps) if s["failed"]]
        if failed:
            ax1.bar([x for x, _ in failed], [b for _, b in failed], color="#c0392b", label="failed step",
                    width=[width[start.index(x)] for x, _ in failed], align="edge", linewidth=0)
        ax1.set_ylabel("tokens per step")
        ax1.legend(loc="upper right", fontsize=8)
        ax2.plot(start, [s["step_time_s"] * 1000 for s in steps], color="#333333", linewidth=0.8)
        ax2.set_ylabel("step time (ms)")
        ax3.fill_between(start, [s["kv_blocks_used"] for s in steps], step="post", color="#7b52ab", alpha=0.35,
                         label="KV blocks used")
        cached = [s["kv_blocks_used"] + s["kv_blocks_cached"] for s in steps]
        if any(s["kv_blocks_cached"] for s in steps):
            ax3.plot(start, cached, color="#3aa17e", drawstyle="steps-post", label="used + cached")
        pool = steps[0]["kv_blocks_used"] + steps[0]["kv_blocks_free"] + steps[0]["kv_blocks_cached"]
        ax3.axhline(pool, color="#7b52ab", linestyle=":", linewidth=0.8, label=f"pool ({pool} blocks)")
        ax3.set_ylabel("KV blocks")
        ax4 = ax3.twinx()
        ax4.plot(start, [s["num_waiting"] for s in steps], color="#e8871e", drawstyle="steps-post", label="waiting")
        ax4.plot(start, [s["num_running"] for s in steps], color="#2f6fb5", drawstyle="steps-post", label="running")
        pre = [(x, s["num_running"]) for x, s in zip(start, steps) if s["num_preempted"]]
        if pre:
            ax4.scatter([x for x, _ in pre], [y for _, y in pre], color="#c0392b", marker="v", s=12,
                        label="preemption", zorder=3)
        ax4.set_ylabel("sequences")
        h1, l1 = ax3.get_legend_handles_labels()
        h2, l2 = ax4.get_legend_handles_labels()
        ax3.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax3.set_xlabel("seconds since the first step")
    fig.suptitle(title or "fastgen: batch composition over time", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fastgen trace", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a trace file (JSON lines) from --trace-file")
    p.add_argument("--out", default=None, help="PNG to write (default: PATH with .png)")
    p.add_argument("--title", default="")
    p.add_argument("--last-s", type=float, default=None, help="only the last this many seconds of steps")
    args = p.parse_args(argv)
    try:
        records = read_trace(args.path)
    except OSError as e:
        print(f"fastgen trace: error: {e}", file=sys.stderr)
        return 2
    if args.last_s is not None:
        steps = [r for r in records if r.get("kind") == "step"]
        if steps:
            cut = steps[-1]["wall_s"] - args.last_s
            records = [r for r in records if r.get("wall_s", 0) >= cut]
    out = args.out or (args.path.rsplit(".", 1)[0] if args.path.endswith(".jsonl") else args.path) + ".png"
    render(records, out, args.title)
    print(f"{summarize(records)}; wrote {out}")
    return 0
