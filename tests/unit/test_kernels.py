"""fastgen's native CPU kernels against the PyTorch reference ops (no model).

The kernels must build on the test machine (it has a C++ compiler); a build failure fails
these tests rather than skipping them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen import kernels
from fastgen.cache import KVPool
from fastgen.kernels.ops import NativeOps, TorchOps

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert kernels.load(), "fastgen's native CPU kernels did not build"


def _reference_attention(q, kp, vp, q_starts, start_pos, tables, window=0):
    """Per sequence: gather its keys, causal mask from its start position (and the sliding
    window: keys after ``q - window``), SDPA in fp32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    kvh, d = kp.shape[2], kp.shape[3]
    for s, sp in enumerate(start_pos):
        q0, q1 = q_starts[s], q_starts[s + 1]
        n = sp + q1 - q0
        idx = torch.tensor(tables[s])
        k = kp[idx].reshape(-1, kvh, d)[:n].float().transpose(0, 1)[None]
        v = vp[idx].reshape(-1, kvh, d)[:n].float().transpose(0, 1)[None]
        key_pos, q_pos = torch.arange(n)[None, :], torch.arange(sp, sp + q1 - q0)[:, None]
        mask = key_pos <= q_pos
        if window:
            mask &= key_pos > q_pos - window
        o = F.scaled_dot_product_attention(q[q0:q1].float().transpose(0, 1)[None], k, v, attn_mask=mask,
                                           enable_gqa=True, scale=d ** -0.5)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def _scrambled_pool(specs, kvh, group, d, bs, dtype, g, spare_blocks):
    """A KV pool of random keys and values whose sequences ((start position, queries) in ``specs``)
    own blocks in shuffled order, the queries, and the block tables as list and padded tensor."""
    need = [-(-(sp + nq) // bs) for sp, nq in specs]
    num_blocks = sum(need) + spare_blocks
    kp = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    vp = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, off = [], 0
    for n in need:
        tables.append(perm[off:off + n])
        off += n
    q_starts = [0]
    for _, nq in specs:
        q_starts.append(q_starts[-1] + nq)
    q = torch.randn(q_starts[-1], kvh * group, d, generator=g).to(dtype)
    width = max(need)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return q, kp, vp, q_starts, tables, bt


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_paged_attention_matches_sdpa_on_scrambled_blocks(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    kvh = data.draw(st.sampled_from([1, 2, 3]))
    group = data.draw(st.sampled_from([1, 2, 3, 4, 5]))   # query heads per KV head: 1-4 take the decode
    # path's register softmax over the group together, 5 the one-row update
    d = data.draw(st.sampled_from([16, 64, 80, 256]))     # 80: the generic (non-unrolled) head dim; 256: Gemma 3
    bs = data.draw(st.sampled_from([4, 16, 32]))
    specs = data.draw(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 6)), min_size=1, max_size=6))
    window = data.draw(st.one_of(st.just(0), st.integers(1, 320)))   # 0: no sliding window
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, kp, vp, q_starts, tables, bt = _scrambled_pool(specs, kvh, group, d, bs, dtype, g, spare_blocks=3)
    got = torch.ops.fastgen.paged_attention(q, kp, vp, torch.tensor(q_starts, dtype=torch.int32),
                                            torch.tensor([sp for sp, _ in specs], dtype=torch.int32), bt,
                                            d ** -0.5, window)
    want = _reference_attention(q, kp, vp, q_starts, [sp for sp, _ in specs], tables, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_is_the_same_alone_and_in_a_batch(dtype, window):
    """One decode alone takes the decode kernel with its prefetches in bursts; several decodes
    take it with their prefetches spread over each block's steps (cpu_kernels.cpp,
    DecodePrefetch). Both must give the reference's result, over whole blocks and a last partial
    one, with and without a window. (Alone a decode is split over more threads, so its partial
    softmaxes merge in another order: equal within rounding, not bit for bit.)"""
    g = torch.Generator().manual_seed(1)
    bs, kvh, d, num_blocks = 32, 3, 64, 200
    kp = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    vp = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    positions = [1234, 700, 95, 1500]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, off = [], 0
    for p in positions:
        n = p // bs + 1
        tables.append(perm[off:off + n])
        off += n
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(positions), 9, d, generator=g).to(dtype)
    together = torch.ops.fastgen.paged_attention(q, kp, vp, torch.arange(len(positions) + 1, dtype=torch.int32),
                                                 torch.tensor(positions, dtype=torch.int32), bt, d ** -0.5, window)
    for i, p in enumerate(positions):
        alone = torch.ops.fastgen.paged_attention(q[i:i + 1], kp, vp, torch.tensor([0, 1], dtype=torch.int32),
                                                  torch.tensor([p], dtype=torch.int32), bt[i:i + 1], d ** -0.5, window)
        want = _reference_attention(q[i:i + 1], kp, vp, [0, 1], [p], [tables[i]], window)
        torch.testing.assert_close(alone.float(), want, **TOL[dtype])
        torch.testing.assert_close(together[i:i + 1].float(), want, **TOL[dtype])


@pytest.mark.parametrize("window", [0, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_decode_is_split_and_merged_exactly(dtype, window):
    """One sequence at 3,000 keys is split over the threads (flash-decoding); the merge of the
    partial softmaxes must equal one pass. With a window, only its last 1,000 keys are split."""
    g = torch.Generator().manual_seed(0)
    bs, kvh, d = 32, 3, 64
    kp = torch.randn(100, bs, kvh, d, generator=g).to(dtype)
    vp = torch.randn(100, bs, kvh, d, generator=g).to(dtype)
    table = torch.randperm(100, generator=g)[:94].tolist()
    q = torch.randn(1, 9, d, generator=g).to(dtype)
    got = torch.ops.fastgen.paged_attention(q, kp, vp, torch.tensor([0, 1], dtype=torch.int32),
                                            torch.tensor([2999], dtype=torch.int32),
                                            torch.tensor([table], dtype=torch.int32), d ** -0.5, window)
    want = _reference_attention(q, kp, vp, [0, 1], [2999], [table], window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
# remainders of every vector loop; (40, 160): in bf16 two blocks of 16 rows summed together and 8 rows alone;
# (3, 203): AVX2's loops of 64 and of 8 (fp32) or 16 (bf16: x permuted to its widening's order) values, then the scalar rest
@pytest.mark.parametrize("shape", [(96, 64), (50, 72), (7, 33), (40, 160), (3, 203)])
def test_gemv_matches_linear(dtype, rows, shape):
    g = torch.Generator().manual_seed(rows)
    n, k = shape
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    want = F.linear(x.float(), w.float(), b.float())
    got = torch.ops.fastgen.gemv(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    torch.testing.assert_close(torch.ops.fastgen.gemv(x, w, None).float(), want - b.float(), **TOL[dtype])


def _assert_argmax_of(y, idx, best):
    """idx and best: torch.argmax of each row of y (as fp32) and the value there, NaN for NaN."""
    yf = y.float()
    assert torch.equal(idx, yf.argmax(-1))
    torch.testing.assert_close(best, yf.gather(1, idx[:, None]).squeeze(1), atol=0, rtol=0, equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.sampled_from([1, 2, 8]),
       # one block of the fused argmax (1,024 outputs), blocks and a rest, a share of each thread
       n=st.sampled_from([1, 5, 70, 1024, 1030, 2600, 5000]), k=st.sampled_from([64, 203]),
       special=st.sampled_from(["none", "nan", "nans", "-inf", "all -inf", "+inf", "tie"]),
       at=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_gemv_argmax_is_the_gemv_and_torch_argmax_of_it(dtype, rows, n, k, special, at, seed):
    """Greedy decoding's choice taken inside the GEMV, a block of outputs at a time while it is in
    cache: the same outputs bit for bit as gemv, and torch.argmax of them (the first of the
    largest value; the first NaN), wherever the special value lands among blocks and threads."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    j = min(n - 1, int(at * n))
    if special == "nan":
        b[j] = float("nan")
    elif special == "nans":
        b[j] = b[n - 1 - j] = float("nan")
    elif special == "-inf":
        b[j] = float("-inf")
    elif special == "all -inf":
        b[:] = float("-inf")
    elif special == "+inf":
        b[j] = b[n // 2] = float("inf")
    elif special == "tie" and n > 1:
        w[n - 1 - j] = w[j]
        b[n - 1 - j] = b[j]
        b[j] += 1000     # w[j]'s output is the largest, twice
        b[n - 1 - j] = b[j]
    y, idx, best = torch.ops.fastgen.gemv_argmax(x, w, b)
    torch.testing.assert_close(y, torch.ops.fastgen.gemv(x, w, b), atol=0, rtol=0, equal_nan=True)
    _assert_argmax_of(y, idx, best)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_small_ops_equal_the_torch_ops(dtype):
    g = torch.Generator().manual_seed(3)
    native, ref = NativeOps(), TorchOps()
    x = torch.randn(5, 48, generator=g).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **TOL[dtype])

    res_a, res_b = torch.randn(5, 48, generator=g).to(dtype), None
    res_b = res_a.clone()
    xa, xb = x.clone(), x.clone()
    native.add_rms_norm_(xa, res_a, w, 1e-5)
    ref.add_rms_norm_(xb, res_b, w, 1e-5)
    torch.testing.assert_close(res_a, res_b, atol=0, rtol=0)          # the residual sum is exact
    torch.testing.assert_close(xa, xb, **TOL[dtype])

    gu = torch.randn(5, 2 * 40, generator=g).to(dtype)
    torch.testing.assert_close(native.silu_mul(gu), ref.silu_mul(gu), **TOL[dtype])


def rope_inputs(h: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 4):
    """Five tokens' fused QKV rows, their positions and slots (scattered over 8 blocks of 4 or
    more), and RoPE tables of 32 positions: the inputs of rope_write_kv."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor([3, 9, 10, 11, 0])
    slots = torch.tensor([13, 21, 24, 25, 2])
    qkv = torch.randn(5, (h + 2 * kvh) * d, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(32).float(), inv)] * 2, dim=-1)
    return qkv, pos, slots, emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_kv_write_equal_the_torch_ops(dtype):
    h, kvh, d, bs = 6, 2, 16, 4
    pools = [KVPool(num_layers=1, num_blocks=8, block_size=bs, num_kv_heads=kvh, head_dim=d, dtype=dtype,
                    device=torch.device("cpu")) for _ in range(2)]
    qkv, pos, slots, cos, sin = rope_inputs(h, kvh, d, dtype)
    got = NativeOps().rope_write_kv(qkv, pos, cos, sin, slots, pools[0], 0, h, kvh, d)
    want = TorchOps().rope_write_kv(qkv, pos, cos, sin, slots, pools[1], 0, h, kvh, d)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])
    torch.testing.assert_close(pools[0].keys[0], pools[1].keys[0], **TOL[dtype])
    torch.testing.assert_close(pools[0].values[0], pools[1].values[0], atol=0, rtol=0)


def test_bad_inputs_are_rejected_with_a_message():
    q = torch.randn(2, 4, 8)
    kp = torch.zeros(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="q_starts"):
        torch.ops.fastgen.paged_attention(q, kp, kp, torch.tensor([0, 2], dtype=torch.int32),
                                          torch.tensor([0, 0], dtype=torch.int32),
                                          torch.zeros(2, 1, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="gemv"):
        torch.ops.fastgen.gemv(torch.randn(1, 8), torch.randn(4, 9), None)


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_register_blocked_chunk_path(dtype, d, window, amx):
    """bs = 32 and a head dim that is a multiple of 64: on hosts with AVX512-BF16 (bf16) or
    AVX-512 (fp32) the packed chunks (attend_chunk_vec, attend_chunk_f32), else the per-block path
    four rows at a time (qk4 / pv4; a build with FASTGEN_KERNEL_MARCH=cascadelake runs it for bf16
    here); 41 queries x 3 heads leave remainder rows for the one-row path. A window of 37 keys
    starts inside a block and skips whole blocks before it."""
    g = torch.Generator().manual_seed(d)
    bs, kvh = 32, 2
    kp = torch.randn(20, bs, kvh, d, generator=g).to(dtype)
    vp = torch.randn(20, bs, kvh, d, generator=g).to(dtype)
    tables = [torch.randperm(20, generator=g)[:9].tolist(), torch.randperm(20, generator=g)[:2].tolist()]
    specs = [(230, 41), (0, 35)]                    # a continuing chunk and a fresh one
    q_starts = [0, 41, 76]
    q = torch.randn(76, kvh * 3, d, generator=g).to(dtype)
    bt = torch.tensor([t + [0] * (9 - len(t)) for t in tables], dtype=torch.int32)
    got = torch.ops.fastgen.paged_attention(q, kp, vp, torch.tensor(q_starts, dtype=torch.int32),
                                            torch.tensor([sp for sp, _ in specs], dtype=torch.int32), bt,
                                            d ** -0.5, window)
    want = _reference_attention(q, kp, vp, q_starts, [sp for sp, _ in specs], tables, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,group,window", [(64, 3, 0), (64, 3, 150), (256, 4, 0), (96, 1, 70)])
def test_long_chunks_on_tiles_match_sdpa(d, group, window, dtype, amx):
    """Prompt chunks long enough to cross many chunks of 128 keys. bf16: on AMX tiles where the CPU
    has them (keys laid out once per sequence and kv head, 32-row tiles of query x head, the last
    padded) and on the vector path (the same layout through vdpbf16ps, 8-row passes, the last
    padded); fp32: the same chunks as K^T and V in fp32 through FMAs, 4-row passes, 64 keys and a
    last 32 a pass (AVX2 hosts: 16 keys a pass, the keys laid out by 8 x 8 transposes), fp32
    probabilities (attend_chunk_f32); head dims that are not a multiple of 64
    take the per-block path. A 300-query chunk after 450 cached keys, a fresh 77-query prompt, a
    decode and a 2-query chunk (fewer rows than the vector paths lay out keys for) in one call;
    head dims 64, 96 and 256 (Gemma 3), 1 to 4 heads a kv head, with and without a sliding window
    that starts inside a chunk."""
    g = torch.Generator().manual_seed(d + group + window)
    bs, kvh = 16, 2
    specs = [(450, 300), (0, 77), (200, 1), (130, 2)]
    q, kp, vp, q_starts, tables, bt = _scrambled_pool(specs, kvh, group, d, bs, dtype, g, spare_blocks=2)
    got = torch.ops.fastgen.paged_attention(q, kp, vp, torch.tensor(q_starts, dtype=torch.int32),
                                            torch.tensor([sp for sp, _ in specs], dtype=torch.int32), bt,
                                            d ** -0.5, window)
    want = _reference_attention(q, kp, vp, q_starts, [sp for sp, _ in specs], tables, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's build lock survives a build killed mid-way; the next load must not wait on it forever."""
    import subprocess
    import sys

    from fastgen.config import cache_dir
    from fastgen.kernels import build_name

    build_dir = cache_dir() / "kernels" / build_name()
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").touch()
    out = subprocess.run([sys.executable, "-c", "from fastgen import kernels; print(kernels.load())"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr
    assert not (build_dir / "lock").exists()


def test_a_build_started_in_the_background_is_the_one_a_later_load_waits_for(monkeypatch):
    """Engine.from_pretrained starts the kernels' load on a thread before converting the model's
    metadata; the load that needs them then waits for that build, and nothing builds twice."""
    import threading
    import time

    calls, results = [], []
    started, release = threading.Event(), threading.Event()

    def held_build(verbose):
        calls.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        return True

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_load", held_build)
    kernels.load_in_background()
    kernels.load_in_background()                     # a second start of it does nothing
    assert started.wait(10)
    waiter = threading.Thread(target=lambda: results.append(kernels.load()))
    waiter.start()
    time.sleep(0.3)
    assert results == []                             # the build is in flight: load() waits for it
    release.set()
    waiter.join(10)
    assert results == [True] and calls == ["fastgen-kernels-load"]
    kernels.load_in_background()                     # loaded: nothing more starts
    assert kernels.load() is True and calls == ["fastgen-kernels-load"]


def test_the_background_load_imports_the_extension_builder_before_its_thread_starts():
    """torch's extension builder brings setuptools and its import hook; imported on the load's
    thread it ran beside the engine's own imports (transformers), and a server once failed to
    start with "No module named 'huggingface_hub.utils'". In a fresh interpreter: the builder is
    imported by the time load_in_background returns (the thread may not have run at all), and
    transformers then imports while the load runs."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from fastgen import kernels\n"
            "before = 'torch.utils.cpp_extension' in sys.modules\n"
            "kernels.load_in_background()\n"
            "after = 'torch.utils.cpp_extension' in sys.modules\n"
            "from transformers import AutoConfig\n"
            "print(before, after, kernels.load())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr


def test_a_first_build_shows_its_progress_by_the_files_it_writes(tmp_path, capsys):
    """The bar of a first build counts the object files and the library written since it began;
    files an earlier build left do not count, and a failed build still ends the bar's thread."""
    import os
    import time

    from fastgen.kernels import SOURCES, BuildProgress

    since = time.time() - 1.0
    progress = BuildProgress(tmp_path, "ext")
    assert progress.steps_done(since) == 0
    old = tmp_path / f"{SOURCES[0].stem}.o"
    old.write_bytes(b"")
    os.utime(old, (since - 100, since - 100))     # left by an earlier build
    assert progress.steps_done(since) == 0
    (tmp_path / f"{SOURCES[1].stem}.o").write_bytes(b"")
    assert progress.steps_done(since) == 1
    (tmp_path / "ext.so").write_bytes(b"")
    assert progress.steps_done(since) == 2
    (tmp_path / "unrelated.o").write_bytes(b"")
    assert progress.steps_done(since) == 2

    with pytest.raises(RuntimeError, match="build failed"):
        with BuildProgress(tmp_path, "ext") as bar:
            time.sleep(0.6)
            raise RuntimeError("build failed")
    assert bar._thread is not None and not bar._thread.is_alive()
    assert "building native CPU kernels" in capsys.readouterr().err


def test_direct_calls_equal_the_registered_ops_and_keep_the_dispatchers_checks():
    """fastgen.kernels.direct() (what the model's hot paths call) runs the same kernels as
    torch.ops.fastgen, bit for bit, and still goes through the dispatcher: a tensor on a device
    the kernels do not cover and a bad shape are refused with an error, not read as host memory."""
    from fastgen.model.quant import quantize

    d = kernels.direct()
    assert d is not None
    torch.manual_seed(0)
    ops = torch.ops.fastgen
    x = torch.randn(3, 64).bfloat16()
    q = quantize(torch.randn(48, 64), 4)
    sc, mn = q.scales.half(), q.mins.half()
    assert torch.equal(d.qgemv(x, q.qweight, sc, mn, 4, False), ops.qgemv(x, q.qweight, sc, mn, 4, False))
    xs = torch.randn(20, 64).bfloat16()
    assert torch.equal(d.qgemm(xs, q.qweight, sc, mn, 4, None, False), ops.qgemm(xs, q.qweight, sc, mn, 4, None, False))
    ids = torch.tensor([0, 5, 47])
    assert torch.equal(d.qembed(ids, q.qweight, sc, mn, 4, torch.bfloat16),
                       ops.qembed(ids, q.qweight, sc, mn, 4, torch.bfloat16))
    w = torch.ones(64).bfloat16()
    assert torch.equal(d.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    a, r, a2, r2 = x.clone(), x.clone() * 2, x.clone(), x.clone() * 2
    d.add_rms_norm_(a, r, w, 1e-6)
    ops.add_rms_norm_(a2, r2, w, 1e-6)
    assert torch.equal(a, a2) and torch.equal(r, r2) and not torch.equal(r, x * 2)   # in place, as the op
    assert torch.equal(d.silu_mul(x), ops.silu_mul(x))
    with pytest.raises(NotImplementedError, match="qgemv"):
        d.qgemv(x.to("meta"), q.qweight.to("meta"), sc.to("meta"), mn.to("meta"), 4, False)
    with pytest.raises(RuntimeError, match="qgemv"):
        d.qgemv(torch.randn(1, 60).bfloat16(), q.qweight, sc, mn, 4, False)
    with pytest.raises(RuntimeError, match="gemv"):
        d.gemv(torch.randn(1, 8), torch.randn(4, 9), None)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_native_argmax_gives_torchs_indices(data):
    """Greedy sampling's argmax (fastgen.sampling.argmax_rows, native for fp32 CPU rows): the
    first index of each row's largest value, as torch.argmax, with ties, infinities and NaN
    (the first NaN wins) anywhere in rows shorter and longer than the kernel's 64-value steps."""
    from fastgen.sampling import argmax_rows

    n = data.draw(st.integers(1, 5))
    v = data.draw(st.sampled_from([1, 5, 16, 63, 64, 65, 130, 1000]))
    vals = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), -float("inf"), float("nan")])
    x = torch.randn(n, v).mul(2).round()      # rounded: many ties
    for _ in range(data.draw(st.integers(0, 6))):
        x[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, v - 1))] = data.draw(vals)
    assert kernels.direct() is not None
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    flipped = x.flip(1).contiguous()
    assert torch.equal(argmax_rows(flipped), flipped.argmax(-1))


def test_every_native_product_op_counts_as_a_product_in_the_decode_breakdown():
    """make bench splits a batch-1 step into products, attention and everything else by op name
    (fastgen/bench/kernels.py): a product op missing from the list (the head's fused argmax was,
    at first) would be counted as everything else."""
    import re

    from fastgen.bench.kernels import PRODUCT_OPS

    native = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastgen::")}
    products = {n for n in native if re.fullmatch(r"fastgen::q?gem[mv](_a8|_argmax)?", n)}
    assert {"fastgen::gemv", "fastgen::gemv_argmax", "fastgen::qgemv_argmax", "fastgen::qgemm_a8"} <= products
    assert products <= set(PRODUCT_OPS)
