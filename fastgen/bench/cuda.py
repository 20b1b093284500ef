"""The engine on a GPU: parity with transformers there, and steps eager against CUDA graphs.

    python -m fastgen.bench.cuda                   # shapes and tokenizer of the embedded SmolLM2
    python -m fastgen.bench.cuda --like DIR        # of an HF folder (its config.json and tokenizer)

Weights are random (a GPU machine may not hold the model's files): (1) a 4-layer Llama in fp32,
greedy against transformers' ``generate`` on the same device, alone and under a 7-token budget
that splits, fuses and preempts; (2) a model of the given shape in bf16: decode steps of batch
1 / 8 / 64 (and 32 at ~2k keys) and a 2,048-token prefill with ``cuda_graphs`` off and on,
against the bf16 matmul rate and read bandwidth measured in the same run. Figures of an H200:
docs/architecture.md, "CUDA: steps as CUDA graphs". Also runs on a CPU (``--device cpu``),
where there are no graphs to compare.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import tempfile
import time

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
           "Here is a short story about a robot who learns to paint. Once upon a time," * 6]


def _checkpoint(folder: str, config, tokenizer, dtype: torch.dtype, widen: float) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if widen:   # wider logits than the default init: greedy choices far from ties
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * widen)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def parity(folder: str, tokenizer, device: torch.device) -> None:
    from transformers import AutoModelForCausalLM

    from ..config import CacheConfig, SchedulerConfig
    from ..engine import Engine
    from ..pipeline import Pipeline, pipeline

    pipe = pipeline(folder, device=str(device), dtype="float32", budget_tokens=256)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    want = []
    for p in PROMPTS:
        ids = tokenizer(p, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = ref.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, ids.shape[1]:].tolist())
    got = [list(r.token_ids) for r in pipe(PROMPTS, max_new_tokens=32, do_sample=False, ignore_eos=True)]
    eng = pipe.engine
    tight = Engine(dataclasses.replace(eng.config, cache=CacheConfig(block_size=8, num_blocks=24),
                                       scheduler=SchedulerConfig(budget_tokens=7, max_seqs=6, reserve_blocks=1)),
                   eng.model, eng.tokenizer, eng.model_config)
    rs = Pipeline(tight)(PROMPTS, max_new_tokens=32, do_sample=False, ignore_eos=True)
    graphs = eng.model._step_graphs()
    print(f"greedy == transformers: alone {sum(g == w for g, w in zip(got, want))}/{len(want)}, "
          f"budget 7 with preemption {sum(list(r.token_ids) == w for r, w in zip(rs, want))}/{len(want)} "
          f"({sum(r.num_preemptions for r in rs)} preemptions); CUDA graphs: "
          f"{'none here' if graphs is None else f'{graphs.replays} of {graphs.runs} decode steps replayed, '}"
          f"{'' if graphs is None else f'{graphs.piece_runs} other steps in pieces'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig

    from ..model.loader import default_model_path, load_hf_config, load_tokenizer
    from ..pipeline import pipeline
    from ..request import SamplingParams
    from .machine import measure_matmul, measure_read, model_costs
    from .prefill_decode import bench_decode, bench_prefill
    from .timing import FULL

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--like", help="HF folder whose config and tokenizer to copy (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sizes = dataclasses.replace(FULL, matmul_n=8192 if cuda else 1024, num_decode_steps=60, num_repeats=3)
    src = args.like or default_model_path()
    tokenizer, hf = load_tokenizer(src), load_hf_config(src)
    print(f"device {device} ({torch.cuda.get_device_name(device) if cuda else 'cpu'}), "
          f"torch {torch.__version__}; model shape of {src}, random weights", flush=True)
    work = tempfile.mkdtemp(prefix="fastgen-cuda-")
    try:
        small = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
                            vocab_size=hf.vocab_size, bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id)
        parity(_checkpoint(os.path.join(work, "parity"), small, tokenizer, torch.float32, 0.05), tokenizer, device)
        shaped = _checkpoint(os.path.join(work, "shaped"), hf, tokenizer, torch.bfloat16, 0.0)
        mm = measure_matmul(torch.bfloat16, sizes.matmul_n, device, sizes).gflops
        read = measure_read(sizes.bandwidth_bytes, torch.bfloat16, device, sizes, "1 GiB").gbps
        print(f"limits: bf16 matmul {mm / 1e3:.2f} TFLOP/s, read {read:.0f} GB/s", flush=True)
        rng = random.Random(0)
        greedy = SamplingParams(max_new_tokens=10_000, do_sample=False, ignore_eos=True)
        rows = {}
        for graphs in ((False, True) if cuda else (False,)):
            t0 = time.perf_counter()
            eng = pipeline(shaped, device=str(device), cuda_graphs=graphs).engine
            start = time.perf_counter() - t0
            costs = model_costs(eng)
            label = "CUDA graphs" if graphs else "eager"
            print(f"[{label}] engine ready in {start:.1f} s ({eng.config.dtype}, budget "
                  f"{eng.config.scheduler.budget_tokens})", flush=True)
            for n, ctx in ((1, 128), (8, 128), (64, 128), (32, 2000)):
                dt = bench_decode(eng, n, dataclasses.replace(sizes, decode_prompt_tokens=ctx), greedy,
                                  rng).step.median_s
                rows.setdefault((n, ctx), {})[label] = dt
                extra = (f", {100 * costs.weight_bytes / (read * 1e9) / dt:.1f}% of the weights' bandwidth "
                         f"bound" if n == 1 else "")
                print(f"[{label}] decode batch {n} at ~{ctx} keys: {1e3 * dt:.2f} ms/step, {n / dt:.0f} tokens/s"
                      f"{extra}", flush=True)
            pre = bench_prefill(eng, costs, sizes, mm, rng)
            rows.setdefault(("prefill", pre.num_tokens), {})[label] = pre.num_tokens / pre.tokens_per_s
            print(f"[{label}] prefill of {pre.num_tokens:,} tokens in {pre.num_steps} step(s): "
                  f"{pre.tokens_per_s:.0f} tokens/s, {100 * pre.roofline_ratio:.2f}% of the matmul rate", flush=True)
            del eng
            if cuda:
                torch.cuda.empty_cache()
        if cuda:
            for (n, ctx), r in rows.items():
                what = f"prefill of {ctx:,} tokens" if n == "prefill" else f"decode batch {n} at ~{ctx} keys"
                print(f"{what}: CUDA graphs {r['eager'] / r['CUDA graphs']:.2f}x the eager speed", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
