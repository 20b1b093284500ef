"""The 8-bit KV cache (kv_cache_dtype="int8"): the rounding, the pool's layouts, the native write and
attention against references, the engine option."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen import kernels
from fastgen.cache import KVPool
from fastgen.cache.pool import quantize_rows
from fastgen.config import EngineOptions, resolve_engine_config
from fastgen.errors import InvalidRequestError
from fastgen.kernels.ops import NativeOps, TorchOps

from .test_kernels import _reference_attention, _scrambled_pool, rope_inputs

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert kernels.load(), "fastgen's native CPU kernels did not build"


def _pool(num_blocks, bs, kvh, d, dtype=torch.float32, kv_dtype="int8"):
    return KVPool(num_layers=1, num_blocks=num_blocks, block_size=bs, num_kv_heads=kvh, head_dim=d, dtype=dtype,
                  device=CPU, kv_dtype=kv_dtype)


def test_rows_round_to_within_half_a_step_and_zero_rows_stay_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[7, 1] = 0.0
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (50, 3)
    assert q.abs().max() <= 127 and (q.abs().amax(-1)[s > 0] == 127).all()   # each row's largest maps to 127
    err = (q.float() * s[..., None] - x).abs()
    assert (err <= s[..., None] / 2 * (1 + 1e-6)).all()
    assert s[7, 1] == 0 and (q[7, 1] == 0).all()


@settings(max_examples=20, deadline=None)
@given(kvh=st.sampled_from([1, 2, 3]), d=st.sampled_from([4, 16, 64]), bs=st.sampled_from([4, 8, 32]),
       n=st.integers(1, 40), seed=st.integers(0, 1000))
def test_the_pool_gives_back_what_was_written_through_its_layouts(kvh, d, bs, n, seed):
    """K and V are stored in the native kernel's layouts (not the nominal [blocks, bs, kvh, d]):
    tokens written at scrambled slots come back from gather() at their blocks' positions, as the
    rounding of quantize_rows gives them, and untouched slots stay zero."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-n // bs) + 2
    pool = _pool(num_blocks, bs, kvh, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g) * 3
    pool.write(0, slots, k, v)
    kg, vg = pool.gather(0, torch.arange(num_blocks).view(1, -1))
    kq, ks = quantize_rows(k)
    vq, vs = quantize_rows(v)
    torch.testing.assert_close(kg[0, slots], kq.float() * ks[..., None], atol=0, rtol=0)
    torch.testing.assert_close(vg[0, slots], vq.float() * vs[..., None], atol=0, rtol=0)
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (kg[0, untouched] == 0).all() and (vg[0, untouched] == 0).all()


def test_the_pool_counts_its_scales_and_rejects_odd_shapes():
    pool = _pool(10, 16, 2, 64)
    assert pool.num_bytes == 2 * 10 * 16 * 2 * 64 + 2 * 10 * 2 * 16 * 4
    assert pool.keys[0].dtype == torch.int8 and pool.quantized
    with pytest.raises(ValueError, match="divisible by 4"):
        _pool(4, 16, 2, 30)
    with pytest.raises(ValueError, match="kv_dtype"):
        _pool(4, 16, 2, 64, kv_dtype="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_write_stores_the_same_bytes_as_the_torch_ops(dtype):
    h, kvh, d, bs = 6, 2, 64, 8
    pools = [_pool(8, bs, kvh, d, dtype) for _ in range(2)]
    qkv, pos, slots, cos, sin = rope_inputs(h, kvh, d, dtype)
    got = NativeOps().rope_write_kv(qkv, pos, cos, sin, slots, pools[0], 0, h, kvh, d)
    want = TorchOps().rope_write_kv(qkv, pos, cos, sin, slots, pools[1], 0, h, kvh, d)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    # the values are not rotated: the same bytes and scales on both paths
    assert torch.equal(pools[0].values[0], pools[1].values[0])
    assert torch.equal(pools[0].value_scales[0], pools[1].value_scales[0])
    # the rotated keys differ in their last bits on the two paths (as the bf16 pool's do): within a step
    blocks = torch.arange(8).view(1, -1)
    step = pools[1].key_scales[0].max().item()
    torch.testing.assert_close(pools[0].gather(0, blocks)[0], pools[1].gather(0, blocks)[0], atol=step, rtol=0)
    torch.testing.assert_close(pools[0].key_scales[0], pools[1].key_scales[0], atol=0, rtol=1e-2)


def _int8_scrambled(specs, kvh, group, d, bs, dtype, g):
    """``_scrambled_pool``'s keys and values written into an 8-bit pool: the queries, q_starts, the
    block tables (list and tensor), the pool, and its dequantized K and V as [blocks, bs, kvh, d]."""
    q, kp, vp, q_starts, tables, bt = _scrambled_pool(specs, kvh, group, d, bs, dtype, g, spare_blocks=3)
    num_blocks = kp.shape[0]
    pool = _pool(num_blocks, bs, kvh, d, dtype)
    pool.write(0, torch.arange(num_blocks * bs), kp.float().reshape(-1, kvh, d), vp.float().reshape(-1, kvh, d))
    kd, vd = (t.reshape(num_blocks, bs, kvh, d).contiguous()
              for t in pool.gather(0, torch.arange(num_blocks).view(1, -1)))
    return q, q_starts, tables, bt, pool, kd, vd


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_paged_attention_over_an_int8_pool_matches_sdpa_on_its_values(data):
    """Decodes and prompt chunks of random lengths, scrambled blocks, windows: the kernel's output
    against fp32 SDPA over the pool's dequantized keys and values. Head dims 64, 128 and 256 take the
    in-place decode kernel (its query rounded to int8, its probabilities to 8 bits a block: within
    a few hundredths here, where the kernel on the bf16 pool is within 1e-2); 16 and 80 dequantize
    every sequence's blocks and take the other kernels (fp32: within 2e-5)."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    kvh = data.draw(st.sampled_from([1, 2, 3]))
    group = data.draw(st.sampled_from([1, 3, 5]))
    d = data.draw(st.sampled_from([16, 64, 80, 128, 256]))
    bs = data.draw(st.sampled_from([4, 16, 32]))
    specs = data.draw(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=5))
    window = data.draw(st.one_of(st.just(0), st.integers(1, 320)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, q_starts, tables, bt, pool, kd, vd = _int8_scrambled(specs, kvh, group, d, bs, dtype, g)
    got = torch.ops.fastgen.paged_attention_i8(
        q, pool.keys[0], pool.values[0], pool.key_scales[0], pool.value_scales[0],
        torch.tensor(q_starts, dtype=torch.int32), torch.tensor([sp for sp, _ in specs], dtype=torch.int32), bt,
        d ** -0.5, window)
    want = _reference_attention(q, kd.float(), vd.float(), q_starts, [sp for sp, _ in specs], tables, window)
    in_place = d in (64, 128, 256)
    tol = dict(atol=5e-2, rtol=5e-2) if in_place or dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), want, **tol)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_the_in_place_decode_rounds_only_the_query_where_values_are_widened(data):
    """Decodes over the 8-bit pool (head dims 64, 128, 256: the in-place kernel) against fp32 SDPA on
    the pool's values with each head's query rounded to int8 as the kernel rounds it (max|q| / 127,
    to nearest). Without VNNI (AVX2: P.V in fp32 on widened values) that is the kernel's only
    rounding, so the two agree to fp32's; with VNNI the probabilities are rounded to 8 bits as well,
    within a few hundredths. A wrong key, scale, mask or lane order moves the output by far more."""
    kvh = data.draw(st.sampled_from([1, 2, 3]))
    group = data.draw(st.sampled_from([1, 3, 4, 5]))
    d = data.draw(st.sampled_from([64, 128, 256]))
    bs = data.draw(st.sampled_from([4, 16, 32]))
    specs = data.draw(st.lists(st.tuples(st.integers(0, 300), st.just(1)), min_size=1, max_size=5))
    window = data.draw(st.one_of(st.just(0), st.integers(1, 320)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, q_starts, tables, bt, pool, kd, vd = _int8_scrambled(specs, kvh, group, d, bs, torch.float32, g)
    got = torch.ops.fastgen.paged_attention_i8(
        q, pool.keys[0], pool.values[0], pool.key_scales[0], pool.value_scales[0],
        torch.tensor(q_starts, dtype=torch.int32), torch.tensor([sp for sp, _ in specs], dtype=torch.int32), bt,
        d ** -0.5, window)
    amax = q.abs().amax(-1, keepdim=True)
    step = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q8 = torch.clamp(torch.round(q / step), -127, 127) * step
    want = _reference_attention(q8, kd, vd, q_starts, [sp for sp, _ in specs], tables, window)
    tol = dict(atol=5e-2, rtol=5e-2) if torch.ops.fastgen.have_vnni() else dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_prompt_chunks_over_an_int8_pool_match_the_fp32_kernel_on_its_values_bit_for_bit(data):
    """fp32 prompt chunks (beside decodes) over the 8-bit pool: packed straight from its layouts where
    the kernel packs (block sizes that are multiples of 8), else from a dequantized copy; either way
    the chunks' rows equal, bit for bit, the fp32 kernel's over a pool holding the dequantized values
    (x = q * s in fp32 both ways). A wrong byte, lane, scale or block of the packing changes them."""
    kvh = data.draw(st.sampled_from([1, 2, 3]))
    group = data.draw(st.sampled_from([1, 3, 5]))
    d = data.draw(st.sampled_from([64, 128, 256]))   # 256: Gemma 3
    bs = data.draw(st.sampled_from([4, 8, 16, 32]))
    specs = data.draw(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([1, 2, 9, 40, 130])),
                               min_size=1, max_size=4))
    window = data.draw(st.one_of(st.just(0), st.integers(1, 320)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, q_starts, tables, bt, pool, kd, vd = _int8_scrambled(specs, kvh, group, d, bs, torch.float32, g)
    args = (torch.tensor(q_starts, dtype=torch.int32), torch.tensor([sp for sp, _ in specs], dtype=torch.int32), bt,
            d ** -0.5, window)
    got = torch.ops.fastgen.paged_attention_i8(q, pool.keys[0], pool.values[0], pool.key_scales[0],
                                               pool.value_scales[0], *args)
    want = torch.ops.fastgen.paged_attention(q, kd, vd, *args)
    for s, (_, nq) in enumerate(specs):
        if nq > 1:
            assert torch.equal(got[q_starts[s]:q_starts[s + 1]], want[q_starts[s]:q_starts[s + 1]]), (s, specs)


def test_the_option_is_validated_and_sizes_the_pool():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineOptions(kv_cache_dtype="fp8")
    args = dict(kv_elems_per_token=30 * 2 * 3 * 64, model_max_len=2048, head_dim=64)
    plain = resolve_engine_config("m", EngineOptions(dtype="bfloat16", kernels="torch"), **args)
    small = resolve_engine_config("m", EngineOptions(dtype="bfloat16", kernels="torch", kv_cache_dtype="int8"),
                                  **args)
    assert small.kv_cache_dtype == "int8" and plain.kv_cache_dtype == "auto"
    # bf16: 2 bytes a value; int8: 1 byte and a 4-byte scale per 64 values
    assert small.cache.num_blocks == pytest.approx(plain.cache.num_blocks * 2 / (1 + 4 / 64), rel=0.01)
    with pytest.raises(InvalidRequestError, match="divisible by 4"):
        resolve_engine_config("m", EngineOptions(kv_cache_dtype="int8", kernels="torch"),
                              **{**args, "head_dim": 30})


def test_bad_int8_pools_are_rejected_with_a_message():
    q = torch.randn(1, 4, 64)
    kq = torch.zeros(4, 8, 2, 64, dtype=torch.int8)
    s = torch.zeros(4, 2, 8)
    meta = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.fastgen.paged_attention_i8(q, kq, kq, s.transpose(1, 2).contiguous(), s, *meta)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.fastgen.paged_attention_i8(q, kq.float(), kq.float(), s, s, *meta)
    qkv = torch.randn(1, (4 + 2 * 2) * 64)
    cos = sin = torch.ones(16, 64)
    with pytest.raises(RuntimeError, match="heads or head dim"):
        torch.ops.fastgen.rope_write_kv_i8(qkv, torch.tensor([0]), cos, sin, torch.tensor([0]), kq, kq, s, s, 4, 2, 32)
