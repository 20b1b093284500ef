"""Quality of a precision mode: perplexity on shipped public-domain text, greedy agreement.

    fastgen eval-ppl                           # every mode of the default model, one table
    fastgen eval-ppl --modes float32:none bfloat16:auto --tokens 1024
    fastgen eval-ppl --modes bfloat16:auto+a8 bfloat16:auto+a8+kv8    # the KV cache in int8 against bf16

Perplexity is teacher-forced over the last ``tokens`` tokens of the shipped Shakespeare
text (fastgen/bench/data; the benchmark cuts its prompts from the whole file, so this is
"held out" only from training, not from the benchmark), in windows of ``window`` tokens.
It is computed twice: on the *decode path*, one token per forward pass, so each product goes
through the kernel a decode step uses (the quantized GEMV where the mode has one), and on the
*prompt path*, each window as one forward pass whose every row gives logits, so the products
take the many-row kernel a prompt chunk uses (with ``+a8``, int8 activations). Greedy agreement: for each of a fixed set
of prompts, how many of the first ``max_new_tokens`` greedy tokens equal the fp32
reference's before the first divergence.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from importlib import resources

import torch

from .batch import SeqInput, build_batch

PROMPTS = (
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
    "To be, or not to be,", "import numpy as np\n", "Water boils at", "The quick brown fox",
)
DEFAULT_MODES = ("float32:none", "float32:auto", "bfloat16:none", "bfloat16:auto", "bfloat16:auto+a8",
                 "bfloat16:auto+a8+kv8", "bfloat16:int8", "bfloat16:int4")


@dataclass(frozen=True)
class Quality:
    mode: str
    perplexity: float                 # decode path (one token per forward pass)
    prompt_perplexity: float          # prompt path (one forward pass per window)
    num_tokens: int
    agreement: tuple[int, ...]        # greedy tokens equal to the reference's, per prompt
    max_new_tokens: int
    resident_weight_bytes: int
    seconds: float


def heldout_tokens(tokenizer, num_tokens: int) -> list[int]:
    text = resources.files("fastgen.bench").joinpath("data/shakespeare.txt").read_text(encoding="utf-8")
    ids = tokenizer(text[-num_tokens * 8:], add_special_tokens=False)["input_ids"]
    return list(ids[-num_tokens:])


@torch.inference_mode()
def _perplexity(engine, token_ids: list[int], window: int, one_token_per_pass: bool) -> float:
    """exp(mean NLL) of ``token_ids`` in windows of ``window`` (each window a fresh sequence), fed
    one token per forward pass or each window as one prompt chunk with every row's logits."""
    model, cfg = engine.model, engine.config
    bs = cfg.cache.block_size
    pool = engine.new_pool(math.ceil(window / bs))
    blocks = list(range(pool.num_blocks))
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window + 1]
        passes = [(pos, chunk[pos:pos + 1]) for pos in range(len(chunk) - 1)] if one_token_per_pass \
            else [(0, chunk[:-1])]
        for pos, ids in passes:
            batch = build_batch([SeqInput(ids, pos, blocks, len(ids))], bs, cfg.device)
            logp = torch.log_softmax(model(batch, pool), dim=-1)      # [len(ids), vocab]
            targets = torch.tensor(chunk[pos + 1:pos + 1 + len(ids)])
            nll -= logp[torch.arange(len(ids)), targets].sum().item()
            count += len(ids)
    return math.exp(nll / count)


def decode_perplexity(engine, token_ids: list[int], window: int = 256) -> float:
    """Perplexity of ``token_ids`` fed one token per forward pass (the decode path's kernels)."""
    return _perplexity(engine, token_ids, window, one_token_per_pass=True)


def prompt_perplexity(engine, token_ids: list[int], window: int = 256) -> float:
    """Perplexity of ``token_ids`` with each window fed as one prompt chunk (the many-row kernels)."""
    return _perplexity(engine, token_ids, window, one_token_per_pass=False)


def greedy_tokens(pipe, max_new_tokens: int) -> list[tuple[int, ...]]:
    out = pipe(list(PROMPTS), max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
    return [r.token_ids for r in out]


def agreement(got: list[tuple[int, ...]], want: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Per prompt: tokens equal to the reference's before the first divergence."""
    counts = []
    for g, w in zip(got, want):
        n = 0
        while n < min(len(g), len(w)) and g[n] == w[n]:
            n += 1
        counts.append(n)
    return tuple(counts)


def evaluate(model: str | None, modes: tuple[str, ...], num_tokens: int, max_new_tokens: int,
             window: int = 256, **engine_options) -> list[Quality]:
    from .model.layers import weight_bytes
    from .pipeline import pipeline

    results = []
    reference: list[tuple[int, ...]] | None = None
    for mode in ("float32:none", *[m for m in modes if m != "float32:none"]):
        dtype, quantization = mode.split(":")
        quantization, *flags = quantization.split("+")     # "+a8": int8 activations, "+kv8": an int8 KV cache
        unknown = set(flags) - {"a8", "kv8"}
        if unknown:
            raise ValueError(f"mode {mode!r}: unknown flag(s) {sorted(unknown)}; known: +a8, +kv8")
        t0 = time.perf_counter()
        pipe = pipeline(model, dtype=dtype, quantization=quantization, budget_tokens=256,
                        int8_activations="a8" in flags, kv_cache_dtype="int8" if "kv8" in flags else "auto",
                        **engine_options)
        engine = pipe.engine
        ids = heldout_tokens(engine.tokenizer, num_tokens)
        ppl = decode_perplexity(engine, ids, window)
        prompt_ppl = prompt_perplexity(engine, ids, window)
        toks = greedy_tokens(pipe, max_new_tokens)
        if reference is None:
            reference = toks
        resident = weight_bytes(engine.model)      # every weight once: linear formats, embedding, norms
        if mode in modes or mode == "float32:none":
            results.append(Quality(mode, ppl, prompt_ppl, num_tokens, agreement(toks, reference), max_new_tokens, resident,
                                   time.perf_counter() - t0))
        del pipe, engine
    return results


def format_table(results: list[Quality]) -> str:
    ref, prompt_ref = results[0].perplexity, results[0].prompt_perplexity
    lines = ["| mode (dtype:quantization) | perplexity, decode path | vs fp32 reference | prompt path | vs fp32 "
             "reference | greedy tokens equal to the reference (per prompt) | weights resident |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        agree = ", ".join(str(a) for a in r.agreement)
        full = sum(a == r.max_new_tokens for a in r.agreement)
        lines.append(f"| {r.mode} | {r.perplexity:.3f} | {100 * (r.perplexity / ref - 1):+.2f}% | "
                     f"{r.prompt_perplexity:.3f} | {100 * (r.prompt_perplexity / prompt_ref - 1):+.2f}% | {agree} "
                     f"({full}/{len(r.agreement)} identical for {r.max_new_tokens}) | "
                     f"{r.resident_weight_bytes / 1e6:.0f} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fastgen eval-ppl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), metavar="DTYPE:QUANTIZATION[+a8][+kv8]",
                    help="+a8: int8 activations (prompt rows; decode rows where that pays); +kv8: the KV cache in "
                         "int8 (kv_cache_dtype='int8')")
    ap.add_argument("--tokens", type=int, default=1024, help="held-out tokens for perplexity (default 1024)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ns = ap.parse_args(argv)
    results = evaluate(ns.model, tuple(ns.modes), ns.tokens, ns.max_new_tokens)
    print(format_table(results))
    return 0
