"""Benchmark outputs: the JSON round trip, the markdown tables, the plots, and `fastgen bench report`."""
from __future__ import annotations

import json

import pytest

from fastgen.bench import cli_main
from fastgen.bench.engine_target import RunResult
from fastgen.bench.load import ClosedLoop, Poisson
from fastgen.bench.metrics import SLA, GoodputSLO, RequestRecord
from fastgen.bench.report import Point, Report, Series, from_json, markdown, merge, to_json, write


def run_of(num: int, ttft: float, gap: float, duration_s: float) -> RunResult:
    recs = []
    for i in range(num):
        times = [ttft + gap * k for k in range(6)]
        recs.append(RequestRecord(i, 512, 6, 0.0, token_times_s=times, finish_s=times[-1], num_output_tokens=6))
    return RunResult(tuple(recs), duration_s, False)


@pytest.fixture()
def report() -> Report:
    fast = Series("splitfuse", "engine", (Point(ClosedLoop(1), run_of(4, 0.5, 0.1, 4.0)),
                                          Point(ClosedLoop(2), run_of(8, 0.8, 0.2, 4.0))))
    slow = Series("prefill-first", "engine", (Point(ClosedLoop(1), run_of(4, 0.5, 0.1, 4.0)),
                                              Point(ClosedLoop(2), run_of(8, 2.0, 0.4, 8.0)),
                                              Point(Poisson(1.0), run_of(4, 0.5, 0.1, 4.0))))
    return Report((fast, slow), SLA(), GoodputSLO(ttft_s=1.0), {"note": "test"})


def test_effective_throughput_of_each_series(report):
    fast, slow = report.series
    # splitfuse: 2 req/s at 2 clients, all within TTFT <= 1 s and EMA gap 0.2 s < 1/4 s
    assert report.effective(fast, 4.0) == (pytest.approx(2.0), "2 clients")
    assert report.effective(fast, 6.0) == (pytest.approx(1.0), "1 client")      # 0.2 s > 1/6 s at 2 clients
    assert report.effective(slow, 4.0) == (pytest.approx(1.0), "1 client")      # TTFT 2 s misses at 2 clients


def test_json_round_trip_and_resummary(report):
    data = json.loads(json.dumps(to_json(report)))
    again = from_json(data)
    assert again.summaries == report.summaries
    assert again.meta == {"note": "test"} and again.slo == report.slo
    assert data["series"][0]["points"][1]["requests"][0]["token_times_s"][:2] == pytest.approx([0.8, 1.0])
    eff = {(e["label"], e["gen_tokens_per_s"]): e["requests_per_s"] for e in data["effective_throughput"]}
    assert eff[("splitfuse", 4.0)] == pytest.approx(2.0)
    looser = from_json(data, SLA(gen_tokens_per_s=(2.0,)))
    assert looser.effective(looser.series[1], 2.0)[0] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        from_json({**data, "format_version": 99})


def test_markdown_tables(report):
    md = markdown(report, reference="splitfuse")
    assert "| splitfuse | 2 clients | 8/8 | 2.000 |" in md
    assert "| splitfuse | 2.000 (2 clients) |" in md
    assert "goodput" in md
    # splitfuse against prefill-first at 2 clients: effective 2.0 / 1.0, e2e 4.0 s vs 1.8 s
    assert "| prefill-first | 2.00 | 2.00 | 1.00 | 1 client | 1.00 | 1.00 |" in md
    assert "| prefill-first |  |  |  | 2 clients | 2.22 | 2.00 |" in md


def test_merge_keeps_labels_unique(report):
    merged = merge([report, report])
    assert [s.label for s in merged.series] == ["splitfuse", "prefill-first", "splitfuse (2)", "prefill-first (2)"]


def test_write_and_report_command(report, tmp_path):
    paths = write(report, tmp_path / "run", reference="splitfuse", title="t")
    assert {p.name for p in paths.values()} == {"results.json", "summary.md", "latency_throughput.png",
                                                 "effective_throughput.png", "token_latency.png"}
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert cli_main(["report", str(paths["json"]), str(paths["json"]), "--out", str(tmp_path / "cmp"),
                     "--sla-rates", "1", "--no-plots", "--reference", "splitfuse"]) == 0
    data = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert data["sla"]["gen_tokens_per_s"] == [1.0] and len(data["series"]) == 4
    assert "splitfuse (2)" in (tmp_path / "cmp" / "summary.md").read_text()


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--scheduler", "fifo"])
    with pytest.raises(SystemExit):
        cli_main(["--clients", "0"])
    with pytest.raises(SystemExit):
        cli_main(["report", "x.json", "--out", "o", "--goodput", "ttft"])
    assert "schedulers must be among" in capsys.readouterr().err


def test_the_prompt_roofline_takes_each_part_at_its_own_rate():
    """Products at one rate, attention at another: the prefill's FLOPs over the two parts' times."""
    from fastgen.bench.machine import ModelCosts, prompt_roofline

    costs = ModelCosts(num_linear_params=1000, num_head_params=0, num_attention_dims=10, weight_bytes=0)
    t = 99                                        # products 2e3 * 99, attention 2 * 10 * 99 * 100: equal
    assert prompt_roofline(costs, t, 500.0, 500.0) == pytest.approx(500.0)
    assert prompt_roofline(costs, t, 1500.0, 500.0) == pytest.approx(2 / (1 / 1500 + 1 / 500))
