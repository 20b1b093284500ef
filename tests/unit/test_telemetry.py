"""The per-step record ring, its JSON form and trace files; the model's sampling defaults."""
from __future__ import annotations

import json

from fastgen.generation_defaults import GenerationDefaults, read_generation_defaults
from fastgen.request import FinishReason
from fastgen.telemetry import (EventKind, EventLog, RequestEvent, RequestProgress, StepRecord, TraceWriter,
                               read_trace, to_json)


def step(log: EventLog, **kw) -> StepRecord:
    fields = dict(time_s=1.0, step_time_s=0.01, budget_tokens=64, prompt_tokens=10, decode_tokens=3, num_seqs=4,
                  num_waiting=1, num_running=4, num_preempted=0, kv_blocks_used=5, kv_blocks_free=11,
                  kv_blocks_cached=0, failed=False, progress=(RequestProgress("a", 12, 10, 0),))
    fields.update(kw)
    r = StepRecord(log.next_seq(), **fields)
    log.append(r)
    return r


def test_since_returns_the_newer_records_and_the_ring_drops_the_oldest():
    log = EventLog(capacity=4)
    recs = [step(log) for _ in range(10)]
    assert [r.seq for r in log.since(0)] == [7, 8, 9, 10]   # a reader 10 behind lost 6: the gap says so
    assert log.since(8) == tuple(recs[8:])
    assert log.since(10) == () and log.last_seq == 10


def test_a_disabled_log_records_nothing():
    log = EventLog(capacity=0)
    assert not log.enabled and log.since(0) == ()


def test_json_form_keeps_enums_as_values_and_adds_wall_clock():
    log = EventLog()
    s = to_json(step(log))
    assert s["kind"] == "step" and s["progress"] == [["a", 12, 10, 0]] and s["wall_s"] > 1e9
    e = to_json(RequestEvent(log.next_seq(), 2.0, EventKind.FINISHED, "a", 12, 5, 8, FinishReason.LENGTH, e2e_s=1.5))
    assert e["kind"] == "request" and e["event"] == "finished" and e["finish_reason"] == "length"
    json.dumps(e)


def test_trace_file_round_trip_skips_a_torn_last_line(tmp_path):
    log = EventLog()
    path = str(tmp_path / "t.jsonl")
    w = TraceWriter(path)
    w.write([step(log), step(log, failed=True)])
    with open(path, "a") as f:
        f.write('{"kind": "step", "seq"')  # a process killed mid-line
    got = read_trace(path)  # readable while the writer is open: it flushes each batch
    assert [r["seq"] for r in got] == [1, 2] and got[1]["failed"] is True
    w.close()


def test_generation_defaults_from_a_hf_folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "repetition_penalty": 500, "do_sample": True}))
    d = read_generation_defaults(str(tmp_path))
    assert d.as_dict() == {"temperature": 0.6, "top_p": 0.9}   # top_k 0 = off; 500 is out of range
    assert d.source == "generation_config.json" and "temperature=0.6" in d.describe()
    assert read_generation_defaults(str(tmp_path / "missing")) == GenerationDefaults()


def test_generation_defaults_from_gguf_sampling_keys(tmp_path):
    import gguf

    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_float32("general.sampling.temp", 0.25)
    w.add_int32("general.sampling.top_k", 40)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    d = read_generation_defaults(path)
    assert d.as_dict() == {"temperature": 0.25, "top_k": 40}


def test_the_embedded_model_ships_no_defaults():
    from fastgen.model.loader import default_model_path

    d = read_generation_defaults(default_model_path())
    assert d.as_dict() == {} and "OpenAI" in d.describe()
