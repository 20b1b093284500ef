"""``python -m fastgen.bench.structured``: what structured outputs cost, in one run.

1. Grammar compile time for a JSON schema: the first compile, and the compiler's cache hit.
2. The per-step cost of the grammar masks, in ms per constrained row, measured around the two
   calls while the constrained requests of (3) run: filling each row's token bitmask and
   unpacking it (on the mask thread, while the forward pass runs), and adding the masks to the
   logits (on the engine thread).
3. Generated tokens/s of ``--num-requests`` concurrent constrained requests against as many
   unconstrained ones (same prompts, same number of tokens each: the schema cannot complete
   within ``--max-new-tokens`` and the unconstrained requests ignore EOS), alternating the two
   ``--repeats`` times; the ratio of the medians is the throughput kept.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

from .. import sampling, structured
from ..engine import Engine
from ..request import SamplingParams
from .kernels import host_isa

PROMPTS = ["List the books you read this year, as JSON.", "Describe the planets of the solar system as JSON records.",
           "Give the inventory of a small shop as JSON.", "Write the cast of a play as JSON.",
           "Tell me about five cities, as JSON.", "Record a week of weather as JSON.",
           "Catalogue the animals of a farm as JSON.", "Summarise a football season as JSON."]
# An array that cannot close within the benchmark's tokens: every constrained request runs them all.
SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "count", "tags", "kind"]}}


class MaskTimer:
    """Wraps the bitmask fill and the mask application; records (seconds, rows) per call of each."""

    def __init__(self) -> None:
        self.fills: list[tuple[float, int]] = []
        self.applies: list[tuple[float, int]] = []
        self._fill = structured.grammar_bias
        self._apply = sampling.apply_grammar_masks

    def __enter__(self) -> "MaskTimer":
        def fill(states, vocab_size):
            t0 = time.perf_counter()
            out = self._fill(states, vocab_size)
            self.fills.append((time.perf_counter() - t0, len(states)))
            return out

        def apply(logits, states, bias=None):
            t0 = time.perf_counter()
            self._apply(logits, states, bias)
            if states:
                self.applies.append((time.perf_counter() - t0, len(states)))
        structured.grammar_bias = fill
        sampling.apply_grammar_masks = apply
        return self

    def __exit__(self, *exc) -> None:
        structured.grammar_bias = self._fill
        sampling.apply_grammar_masks = self._apply


def _run(engine: Engine, params: SamplingParams, num_requests: int) -> tuple[float, int]:
    """Seconds and generated tokens for ``num_requests`` concurrent requests."""
    t0 = time.perf_counter()
    ids = [engine.add_request(PROMPTS[i % len(PROMPTS)], params) for i in range(num_requests)]
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - t0
    return seconds, sum(engine.response(i).generated_length for i in ids)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastgen.bench.structured", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    spec = SamplingParams(json_schema=SCHEMA).structured
    engine.grammars.compile(SamplingParams(json_schema={"type": "string", "maxLength": 3}).structured)  # warm
    t0 = time.perf_counter()
    engine.grammars.compile(spec)
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    engine.grammars.compile(spec)
    hit_ms = (time.perf_counter() - t0) * 1e3

    n, tokens = args.num_requests, args.max_new_tokens
    free = SamplingParams(max_new_tokens=tokens, do_sample=False, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=tokens, do_sample=False, json_schema=SCHEMA)
    _run(engine, free, n)  # warm-up
    rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    timer = MaskTimer()
    for _ in range(args.repeats):
        s, k = _run(engine, free, n)
        rates["unconstrained"].append(k / s)
        with timer:
            s, k = _run(engine, constrained, n)
        rates["constrained"].append(k / s)

    def per_row_ms(calls: list[tuple[float, int]]) -> float:
        return statistics.median(sec * 1e3 / rows for sec, rows in calls)

    def full_ms(calls: list[tuple[float, int]]) -> float:
        return statistics.median(sec * 1e3 for sec, rows in calls if rows == n)
    free_rate, cons_rate = (statistics.median(rates[k]) for k in ("unconstrained", "constrained"))
    print(f"host: {host_isa()}; threads {engine.config.num_threads}; dtype {engine.config.dtype}; "
          f"budget {engine.config.scheduler.budget_tokens} tokens")
    print(f"compile (JSON schema, {len(str(SCHEMA))} chars): first {first_ms:.1f} ms, cached {hit_ms:.2f} ms")
    fill, apply = timer.fills, timer.applies
    print(f"mask fill: {per_row_ms(fill):.3f} ms per constrained row per step, {full_ms(fill):.2f} ms per step "
          f"of {n} rows (mask thread, beside the forward pass); median of {len(fill)} steps")
    print(f"mask apply: {per_row_ms(apply):.3f} ms per constrained row per step, {full_ms(apply):.2f} ms per step "
          f"of {n} rows (engine thread)")
    print(f"{n} concurrent requests x {tokens} tokens, generated tokens/s (median of {args.repeats}): "
          f"unconstrained {free_rate:.1f} {[round(r, 1) for r in rates['unconstrained']]}, "
          f"constrained {cons_rate:.1f} {[round(r, 1) for r in rates['constrained']]}")
    print(f"constrained / unconstrained throughput: {cons_rate / free_rate:.3f} "
          f"({(1 - cons_rate / free_rate) * 100:+.1f}% loss)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
