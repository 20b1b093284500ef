"""Kernel-level figures for ``make bench``: attention against the host's product rate, what a
batch-1 decode step spends outside the products and attention, and the old path (PyTorch ops,
gather + SDPA) against the new one (fastgen's native kernels) in the same run.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from ..batch import SeqInput, build_batch
from ..cache import KVPool
from ..config import cpu_flags
from ..model.attention import PagedAttention, SdpaAttention

ISA_FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")
PRODUCT_OPS = ("fastgen::gemv", "fastgen::qgemv", "fastgen::gemv_argmax", "fastgen::qgemv_argmax", "fastgen::qgemm",
               "fastgen::qgemm_a8", "mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm")
ATTENTION_OPS = ("fastgen::paged_attention", "aten::scaled_dot_product_attention")


def host_isa() -> str:
    """The ISA features that decide which kernels are fast here."""
    have = [f for f in ISA_FLAGS if f in cpu_flags()]
    return " ".join(have) if have else "no AVX2"


def _median_ms(fn: Callable[[], object], repeats: int, max_s: float = 10.0) -> float:
    fn()
    times = []
    t_end = time.perf_counter() + max_s
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            break
    return statistics.median(times) * 1e3


def _synthetic(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               specs: list[tuple[int, int]]):
    """A one-layer pool of random keys/values and a batch of sequences (start_pos, num_queries)."""
    g = torch.Generator().manual_seed(0)
    need = [math.ceil((sp + n) / block_size) for sp, n in specs]
    pool = KVPool(num_layers=1, num_blocks=sum(need), block_size=block_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, dtype=dtype, device=torch.device("cpu"))
    pool.keys[0].copy_(torch.randn(pool.keys[0].shape, generator=g))
    pool.values[0].copy_(torch.randn(pool.values[0].shape, generator=g))
    perm = torch.randperm(sum(need), generator=g).tolist()
    seqs, off = [], 0
    for (sp, n), nb in zip(specs, need):
        seqs.append(SeqInput([1] * n, sp, perm[off:off + nb], 1))
        off += nb
    batch = build_batch(seqs, block_size, torch.device("cpu"))
    t = batch.num_tokens
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    kv = pool.keys[0].view(-1, num_kv_heads, head_dim)[batch.slots]
    return pool, batch, q, kv, pool.values[0].view(-1, num_kv_heads, head_dim)[batch.slots]


def bench_attention(engine, matmul_gflops: float, bandwidth_gbps: float, repeats: int = 10) -> dict[str, Any]:
    """One layer's attention of the model's shape: 256 queries at position 1,792 (2,048 keys)
    and 32 decodes at 4,096 keys; native paged kernel against gather + SDPA."""
    mc, cfg = engine.model_config, engine.config
    out = {}
    for label, specs in (("chunk 256 q x 2k keys", [(1792, 256)]), ("32 decodes x 4k keys", [(4095, 1)] * 32)):
        pool, batch, q, k, v = _synthetic(mc.num_heads, mc.num_kv_heads, mc.head_dim, cfg.cache.block_size,
                                          cfg.dtype, specs)
        keys = sum(sp * n + n * (n + 1) / 2 for sp, n in specs)
        flops = 4.0 * keys * mc.num_heads * mc.head_dim
        kv_bytes = sum(sp + n for sp, n in specs) * 2 * mc.num_kv_heads * mc.head_dim * q.element_size()
        row: dict[str, Any] = {"flops": flops, "kv_bytes": kv_bytes}
        backends = [SdpaAttention(cfg.dtype, cfg.device)]
        if cfg.kernels == "native":
            backends.append(PagedAttention(cfg.dtype, cfg.device))
        for be in backends:
            plan = be.plan(batch)
            ms = _median_ms(lambda: be(0, q, k, v, plan, pool, mc.head_dim ** -0.5), repeats)
            row[be.name] = {"ms": ms, "gflops": flops / ms / 1e6, "kv_gbps": kv_bytes / ms / 1e6,
                            "of_matmul": flops / ms / 1e6 / matmul_gflops,
                            "of_bandwidth": kv_bytes / ms / 1e6 / bandwidth_gbps}
        out[label] = row
    return out


def decode_step_breakdown(engine, steps: int = 10) -> dict[str, Any]:
    """A batch-1 decode ``Engine.step()`` under the profiler: PyTorch ops per step, and the
    time in the weight products, in attention, and in everything else."""
    from ..request import SamplingParams

    rid = engine.add_request(list(range(1, 129)), SamplingParams(max_new_tokens=steps + 40, do_sample=False,
                                                                 ignore_eos=True))
    while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
        pass                                        # until its prompt is done and it decodes
    for _ in range(5):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.key_averages()
    ops = sum(e.count for e in events) / steps
    products = sum(e.self_cpu_time_total for e in events if e.key in PRODUCT_OPS) / steps / 1e3
    attention = sum(e.cpu_time_total for e in events if e.key in ATTENTION_OPS) / steps / 1e3
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    engine.abort(rid)
    engine.response(rid)
    return {"step_ms": step_ms, "profiled_step_ms": total, "ops_per_step": ops, "products_ms": products,
            "attention_ms": attention, "rest_ms": max(0.0, step_ms - products * step_ms / total
                                                     - attention * step_ms / total),
            "method": "rest = step time minus products and attention, their shares taken from a profiled run"}


def old_vs_new_decode(engine, batch: int = 32, context: int = 4096, repeats: int = 5) -> dict[str, Any] | None:
    """One forward of ``batch`` decodes at ``context`` keys each (random KV), through the
    engine's model (new) and the same checkpoint loaded with kernels="torch" (old)."""
    from ..model.loader import load_model

    cfg = engine.config
    if cfg.kernels != "native":
        return None
    bs = cfg.cache.block_size
    nb = math.ceil(context / bs)
    pool = engine.new_pool(batch * nb)
    seqs = [SeqInput([7], context - 1, list(range(i * nb, (i + 1) * nb)), 1) for i in range(batch)]
    b = build_batch(seqs, bs, cfg.device)
    old = load_model(cfg.model_path, dtype=cfg.dtype, device=cfg.device, max_positions=cfg.max_model_len,
                     kernels="torch", quantization="none")
    old_ms = _median_ms(lambda: old(b, pool), repeats)
    del old
    new_ms = _median_ms(lambda: engine.model(b, pool), repeats)
    return {"batch": batch, "context": context, "old_ms": old_ms, "new_ms": new_ms, "speedup": old_ms / new_ms}


def kv_int8_decode(engine, batch: int = 8, context: int = 1300, repeats: int = 15) -> dict[str, Any] | None:
    """One forward of ``batch`` decodes at ``context`` keys each (the paper's load's decode-only
    steps: 8 clients at ~1,200 prompt tokens), over a pool of the model's dtype and over an int8
    pool (``kv_cache_dtype="int8"``), alternating; blocks handed out in a scrambled order."""
    import random

    cfg = engine.config
    if cfg.kernels != "native":
        return None
    bs = cfg.cache.block_size
    nb = math.ceil(context / bs)
    order = list(range(batch * nb))
    random.Random(0).shuffle(order)
    seqs = [SeqInput([7], context - 1, order[i * nb:(i + 1) * nb], 1) for i in range(batch)]
    b = build_batch(seqs, bs, cfg.device)
    pools = {kv: engine.new_pool(batch * nb, kv_dtype=kv) for kv in ("auto", "int8")}
    times: dict[str, list[float]] = {"auto": [], "int8": []}
    for kv in pools:
        engine.model(b, pools[kv])
    for r in range(repeats):
        for kv in (("auto", "int8") if r % 2 else ("int8", "auto")):
            t0 = time.perf_counter()
            engine.model(b, pools[kv])
            times[kv].append((time.perf_counter() - t0) * 1e3)
    ms = {kv: statistics.median(t) for kv, t in times.items()}
    return {"batch": batch, "context": context, "kv_model_dtype_ms": ms["auto"], "kv_int8_ms": ms["int8"],
            "ratio": ms["int8"] / ms["auto"]}


def print_kernels(att: dict[str, Any], breakdown: dict[str, Any], old_new: dict[str, Any] | None,
                  matmul_gflops: float, kv8: dict[str, Any] | None = None) -> None:
    print(f"\n6. Kernels (host ISA: {host_isa()})")
    print(f"   attention, one layer        backend   ms      GFLOP/s  of matmul ({matmul_gflops:.0f})  KV GB/s")
    for label, row in att.items():
        for name in ("sdpa", "paged"):
            if name in row:
                r = row[name]
                print(f"   {label:26s}  {name:6s}  {r['ms']:7.2f}  {r['gflops']:7.1f}  {100 * r['of_matmul']:5.1f}%"
                      f"            {r['kv_gbps']:6.1f}")
    b = breakdown
    print(f"   batch-1 decode step: {b['step_ms']:.2f} ms; {b['ops_per_step']:.0f} PyTorch ops per step; profiled: "
          f"products {b['products_ms']:.2f} ms, attention {b['attention_ms']:.2f} ms; everything else "
          f"{b['rest_ms']:.2f} ms")
    if old_new:
        print(f"   {old_new['batch']} decodes at {old_new['context']} keys, one forward: old path (torch ops, gather + "
              f"SDPA) {old_new['old_ms']:.1f} ms, new {old_new['new_ms']:.1f} ms: {old_new['speedup']:.2f}x")
    if kv8:
        print(f"   {kv8['batch']} decodes at {kv8['context']} keys, one forward: KV cache in the model's dtype "
              f"{kv8['kv_model_dtype_ms']:.2f} ms, in int8 (kv_cache_dtype='int8') {kv8['kv_int8_ms']:.2f} ms: "
              f"{kv8['ratio']:.2f}x the time")
