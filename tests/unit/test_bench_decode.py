"""``python -m fastgen.bench.decode``: batch-1 decode alone, held to the bound the way ``make bench``
holds it (the highest read of the run), each round also shown against the reads beside it."""
from __future__ import annotations

import json
import random
import statistics
from types import SimpleNamespace

import pytest

from fastgen.bench import decode as bench_decode_mod
from fastgen.bench.machine import model_costs
from fastgen.bench.timing import QUICK


META = {"model": "tiny", "dtype": "torch.float32", "quantization": "none", "isa": "", "cpu": "", "num_threads": 1,
        "allocator": "", "time": ""}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-decode-bench")))


@pytest.fixture(scope="module")
def tiny_engine(tiny_folder):
    from fastgen.engine import Engine

    return Engine.from_pretrained(tiny_folder, dtype="float32", budget_tokens=64, num_blocks=64)


def _fake_reads(monkeypatch, machine_gbps: float, reads: list[float]) -> list[float]:
    """measure_reads' highest is ``machine_gbps``; read_beside hands out ``reads`` in order."""
    left = list(reads)
    monkeypatch.setattr(bench_decode_mod, "measure_reads", lambda engine, costs, sizes: [
        SimpleNamespace(gbps=machine_gbps / 2), SimpleNamespace(gbps=machine_gbps)])
    monkeypatch.setattr(bench_decode_mod, "read_beside", lambda engine, costs, sizes: left.pop(0))
    return left


def test_the_verdict_takes_the_highest_read_of_the_run_and_each_round_its_own(tiny_engine, monkeypatch):
    left = _fake_reads(monkeypatch, 20.0, [10.0, 12.0, 30.0, 11.0, 9.0, 8.0])
    res = bench_decode_mod.bench_batch1(tiny_engine, QUICK, 3, random.Random(0), META)
    assert left == []                                    # two reads a round, no more
    per_gb = model_costs(tiny_engine).weight_bytes / 1e9
    assert [r.result.batch_size for r in res.rounds] == [1, 1, 1]
    assert all(r.result.num_skipped_steps == 0 and r.result.tokens_per_s > 0 for r in res.rounds)
    for r, own in zip(res.rounds, (12.0, 30.0, 9.0)):     # each round against the higher of its two reads
        assert r.ratio_beside == pytest.approx(r.result.tokens_per_s * per_gb / own)
    assert res.bound_gbps == 30.0                        # a read beside the steps above the machine's 20
    assert res.tokens_per_s == statistics.median(r.result.tokens_per_s for r in res.rounds)
    assert res.ratio == pytest.approx(res.tokens_per_s * per_gb / 30.0)
    assert tiny_engine.stats().num_running == 0          # every round's request is gone


def test_the_machine_limit_serves_when_no_read_beside_the_steps_is_higher(tiny_engine, monkeypatch):
    _fake_reads(monkeypatch, 50.0, [10.0, 12.0])
    res = bench_decode_mod.bench_batch1(tiny_engine, QUICK, 1, random.Random(1), META)
    assert res.bound_gbps == 50.0 and res.machine_bound_gbps == 50.0


def test_the_command_prints_its_verdict_and_writes_every_round(tiny_folder, monkeypatch, tmp_path, capsys):
    _fake_reads(monkeypatch, 40.0, [41.0, 39.0, 38.0, 37.0])
    out = tmp_path / "decode.json"
    assert bench_decode_mod.main(["--model", tiny_folder, "--dtype", "float32", "--quick", "--rounds", "2",
                                  "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 2 and data["bound_gbps"] == 41.0 and data["goal"] == 0.8
    printed = capsys.readouterr().out
    assert "round 2:" in printed and "the run's highest read" in printed
    assert ("PASS" if data["ratio"] >= 0.8 else "MISS") in printed


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit):
        bench_decode_mod.parse_args(["--rounds", "0"])


def test_the_reads_beside_a_bf16_decode_take_fp32_too_where_it_reads_the_same_bytes_faster(monkeypatch):
    import torch

    from fastgen.bench import machine

    seen = []

    def fake_read(num_bytes, dtype, device, sizes, label):
        seen.append((num_bytes, dtype))
        return SimpleNamespace(gbps={torch.bfloat16: 27.0, torch.float32: 38.0}[dtype])

    monkeypatch.setattr(machine, "measure_read", fake_read)
    monkeypatch.setattr(machine, "measure_read_huge_pages", lambda *a: SimpleNamespace(gbps=29.0))
    costs = SimpleNamespace(weight_bytes=1 << 20)
    bf16 = SimpleNamespace(config=SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu")))
    assert machine.read_beside(bf16, costs, QUICK) == 38.0
    assert sorted(seen, key=str) == sorted([(1 << 20, torch.bfloat16), (1 << 20, torch.float32)], key=str)
    seen.clear()
    fp32 = SimpleNamespace(config=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")))
    assert machine.read_beside(fp32, costs, QUICK) == 38.0 and seen == [(1 << 20, torch.float32)]
