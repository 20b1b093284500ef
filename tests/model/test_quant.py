"""Quantized weights: GGUF blocks as shipped, the quantized GEMV and GEMM, the quantized embedding,
int8/int4 at load, resident memory and quality pins."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from fastgen import kernels
from fastgen.model.loader import load_hf_config, load_model
from fastgen.model.llama import ModelConfig
from fastgen.model.quant import (GGUF_KINDS, QuantEmbedding, QuantRows, QuantWeight, from_gguf, quantize,
                                 reference_matmul)

from .ragged import ragged_logits
from .test_parity import TINY, _tiny_configs, random_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert kernels.load(), "fastgen's native CPU kernels did not build"


def test_gguf_blocks_as_shipped_equal_gguf_dequantization(smollm2_path):
    reader = gguf.GGUFReader(smollm2_path)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_1", "Q8_0") and t.tensor_type.name not in seen:
            rows = from_gguf(t.tensor_type.name, np.asarray(t.data).reshape(t.data.shape[0], -1))
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            np.testing.assert_array_equal(rows.dequantize().numpy(), want.astype(np.float32))
            seen.add(t.tensor_type.name)
    assert seen == {"Q4_1", "Q8_0"}


def _random_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of ``qtype`` (any bytes are valid quants), with fp16 super-block
    scales of a trained model's size (1e-4 .. 3e-3) where gguf-py's layout puts them."""
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // block * size), dtype=np.uint8)
    b = raw.reshape(rows, -1, size)
    at = {"Q4_0": [0], "Q8_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
          "Q5_K": [0, 2], "Q6_K": [size - 2], "Q3_K": [size - 2], "Q2_K": [size - 4, size - 2]}[qtype]
    for o in at:
        b[..., o:o + 2] = rng.uniform(1e-4, 3e-3, size=b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", sorted(GGUF_KINDS))
def test_every_kept_gguf_type_is_within_its_stated_error(qtype):
    """Each GGUF type kept quantized against gguf-py's own dequantization: exact where
    from_gguf says so; Q4_K within the fp16 rounding of its multiplied-out scale and minimum
    (measured: 6.7e-4 of a group's largest weight); the requantized types within half an
    8-bit step (1/254 of a group's largest weight, measured 3.94e-3)."""
    raw = _random_blocks(qtype, 8, 512)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(8, -1)
    rows = from_gguf(qtype, raw)
    assert rows.kind == GGUF_KINDS[qtype] and rows.scales.dtype == torch.float16
    got = rows.dequantize().numpy()
    if qtype in ("Q4_0", "Q4_1", "Q8_0", "Q5_0"):
        np.testing.assert_array_equal(got, want)
        return
    err = np.abs(got - want).reshape(8, -1, 32)
    if qtype == "Q4_K":    # |dw| <= 2**-11 (q |scale| + |min|), q <= 15, for normal fp16 values
        s, m = rows.scales.float().numpy(), rows.mins.float().numpy()
        bound = 2.0 ** -11 * (15 * np.abs(s) + np.abs(m)) * (1 + 2.0 ** -10)
    else:
        bound = np.abs(want).reshape(8, -1, 32).max(-1) / 254 * (1 + 2.0 ** -10)   # fp16 scale rounded up
    assert (err.max(-1) <= bound).all(), float((err.max(-1) / bound).max())
    assert err.max() > 0                               # not exact: the test's bound is what holds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [96, 128, 576, 1536])  # 96: odd groups (tail path); 128, 1536: whole quads; 576: quads + a pair
def test_quantized_gemv_matches_its_dequantized_weights(dtype, bits, rows, k):
    g = torch.Generator().manual_seed(bits * 10 + rows)
    w = torch.randn(70, k, generator=g)
    q = quantize(w, bits)
    x = torch.randn(rows, k, generator=g).to(dtype)
    want = reference_matmul(x, q)
    got = torch.ops.fastgen.qgemv(x, q.qweight, q.scales, q.mins, q.kind)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    # int8 activations (VNNI where present): x is rounded to 8 bits per group of 32, so the
    # error is that of the rounding, ~0.5% of the output's norm, never a wrong nibble or scale
    approx = torch.ops.fastgen.qgemv(x, q.qweight, q.scales, q.mins, q.kind, True).float()
    assert (approx - want).norm() / want.norm() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,int8_activations", [(4, False), (4, True), (8, False), (8, True)])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_fused_argmax_is_the_gemvs_outputs_and_their_argmax(dtype, bits, int8_activations, rows):
    """``QuantWeight.matmul_argmax`` (qgemv with greedy decoding's choice taken a block of outputs
    at a time): matmul's outputs bit for bit and torch.argmax of them, over blocks and both
    threads' shares (2,600 outputs), with a tie across the shares; None past qgemv's rows."""
    g = torch.Generator().manual_seed(bits + rows)
    w = torch.randn(2600, 576, generator=g)
    w[2100] = w[300] = w[300] * 3          # the largest output twice, in both threads' shares
    fmt = QuantWeight(quantize(w, bits), None, int8_activations=int8_activations)
    x = torch.randn(rows, 576, generator=g).abs().to(dtype)
    x[:, :] = x[0]                        # every row's largest output is row 300 (and 2100)
    y, idx, best = fmt.matmul_argmax(x)
    assert torch.equal(y, fmt.matmul(x))
    assert torch.equal(idx, y.float().argmax(-1))
    assert torch.equal(best, y.float().max(-1).values)
    many = torch.randn(fmt.decode_plan(dtype)[0] + 1, 576, generator=g).to(dtype)
    assert fmt.matmul_argmax(many) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_take_the_gemv_and_do_not_depend_on_their_batch(dtype):
    """Up to the format's row limit (8 in bf16 where qgemv has its vdpbf16ps kernel, else 6) a
    batch of decode rows goes through qgemv, whose every row is summed alone: each row of the
    batch is bit for bit the row computed alone, so a request's output does not depend on who
    shares its step. Past the limit (qgemm) rows stay within rounding of the same values."""
    g = torch.Generator().manual_seed(5)
    q = quantize(torch.randn(96, 576, generator=g), 4)
    fmt = QuantWeight(q, None)
    limit = fmt.max_qgemv_rows_bf16 if dtype == torch.bfloat16 else fmt.max_qgemv_rows
    assert limit == (8 if dtype == torch.bfloat16 and torch.ops.fastgen.have_bf16_dot() else 6)
    x = torch.randn(limit + 4, 576, generator=g).to(dtype)
    alone = torch.cat([fmt.matmul(x[i:i + 1]) for i in range(limit + 4)])
    assert torch.equal(fmt.matmul(x[:limit]), alone[:limit])
    # qgemm multiplies by the weights rounded to the engine dtype (bf16: 8 bits), qgemv by exact ones
    past = fmt.matmul(x).float()
    assert (past - alone.float()).norm() / alone.float().norm() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_decode_batches_up_to_twelve_rows_take_the_gemv_row_by_row(dtype):
    """With int8 activations 4-bit rows keep qgemv (qrows4_a8) up to 12 rows, since the many-row
    kernels unpack every weight whatever the rows: a decode batch of up to 12 gives each row bit
    for bit as computed alone, and the native stack takes such batches."""
    _skip_without_int8()
    g = torch.Generator().manual_seed(12)
    fmt = QuantWeight(quantize(torch.randn(80, 576, generator=g), 4), None, int8_activations=True)
    assert fmt.decode_plan(dtype) == (12, True)
    x = torch.randn(14, 576, generator=g).to(dtype)
    alone = torch.cat([fmt.matmul(x[i:i + 1]) for i in range(14)])
    for rows in (7, 12):
        assert torch.equal(fmt.matmul(x[:rows]), alone[:rows])
    # 13 rows on: qgemm, multiplying by the weights rounded to x's dtype, unrounded x
    past = fmt.matmul(x).float()
    assert (past - alone.float()).norm() / alone.float().norm() < 2e-2
    eight_bit = QuantWeight(quantize(torch.randn(80, 576, generator=g), 8), None, int8_activations=True)
    assert eight_bit.decode_plan(dtype)[0] == QuantWeight.MAX_QGEMV_ROWS_8BIT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
# blocks of 16/32, panels of 12 (vectors) or 32 (tiles); 700 rows at k = 1,536 take three passes on
# the tiles, the later two reading the panels the first laid out
@pytest.mark.parametrize("rows,n", [(7, 12), (16, 40), (17, 70), (33, 36), (100, 25), (700, 70)])
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_quantized_gemm_matches_its_dequantized_weights(dtype, bits, rows, n, k, amx):
    """qgemm multiplies by the weights rounded to x's dtype (the values a dense copy held),
    with fp32 sums: the reference is that dense product, and the bias is added once. On AMX
    hosts bf16 rows take the tiles (panels of 32 features); both paths are checked there (fp32
    rows take the vectors either way)."""
    g = torch.Generator().manual_seed(bits * 100 + rows + n)
    q = quantize(torch.randn(n, k, generator=g), bits)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    want = x.float() @ q.dequantize().to(dtype).float().T + bias
    got = torch.ops.fastgen.qgemm(x, q.qweight, q.scales, q.mins, q.kind, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2 * want.abs().max().item(), rtol=1e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    no_bias = torch.ops.fastgen.qgemm(x, q.qweight, q.scales, q.mins, q.kind)
    torch.testing.assert_close(no_bias.float(), want - bias, **tol)


@pytest.mark.parametrize("rows,n,k", [(700, 72, 1536), (45, 130, 576)])
def test_quantized_gemm_on_tiles_matches_the_vector_path_with_silu(rows, n, k, amx):
    """The fused gate/up product (silu(gate) * up, never writing [rows, n]) on either path: the
    dequantized reference with the unfused path's roundings; 700 rows at k = 1,536 take three
    passes over the panels on the tiles (amx_rows), 130 features a short last panel of 32."""
    g = torch.Generator().manual_seed(rows + n)
    q = quantize(torch.randn(2 * n, k, generator=g), 4)
    x = torch.randn(rows, k, generator=g).bfloat16()
    both = (x.float() @ q.dequantize().bfloat16().float().T).bfloat16().float()
    gate, up = both[:, :n], both[:, n:]
    want = (torch.nn.functional.silu(gate).bfloat16().float() * up)
    got = torch.ops.fastgen.qgemm(x, q.qweight, q.scales, q.mins, q.kind, None, True)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, atol=3e-2 * want.abs().max().item(), rtol=2e-2)


def test_quantized_gemm_past_the_kept_panels_limit_lays_out_each_pass_itself(amx):
    """A product whose bf16 panels pass 16 MB (8,224 x 1,024: 16.8 MB) is not kept between passes
    on the tiles: 600 rows at k = 1,024 take two passes, each laying its panels out again (a short
    last panel of 32 features included); both paths against the dequantized reference."""
    g = torch.Generator().manual_seed(7)
    q = quantize(torch.randn(8224, 1024, generator=g), 4)
    x = torch.randn(600, 1024, generator=g).bfloat16()
    want = x.float() @ q.dequantize().bfloat16().float().T
    got = torch.ops.fastgen.qgemm(x, q.qweight, q.scales, q.mins, q.kind)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)


def _int8_per_group(x: torch.Tensor) -> torch.Tensor:
    """x rounded as qgemm_a8 rounds it: per (row, group of 32), to the nearest multiple of
    max|x| / 127 (ties to even), in fp32."""
    t, k = x.shape
    g = x.float().view(t, k // 32, 32)
    step = g.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (g * (1 / step)).round().clamp(-127, 127).mul(step).view(t, k)


def _skip_without_int8(bits: int = 4, decode: bool = False) -> None:
    """int8 activations need their kernels for ``bits``-bit rows (known once the kernels are
    loaded, at run time): 4 and 8 bits with AVX512-VNNI, 4 bits with AVX2 (vpmaddubsw); decode
    rows (qgemv, ``decode``) 8 bits with AVX2 too (vpsignb + vpmaddubsw)."""
    kinds = torch.ops.fastgen.a8_gemv_kinds() if decode else torch.ops.fastgen.a8_kinds()
    if bits not in kinds:
        rows = "decode" if decode else "prompt"
        pytest.skip(f"no int8-activation kernel for {bits}-bit {rows} rows on this CPU")


def test_int8_activations_are_taken_by_the_kinds_this_build_has_kernels_for():
    """A weight format asks for int8 activations only where its kind has them; where a kind has
    none, qgemm_a8 refuses it by name rather than computing something else."""
    g = torch.Generator().manual_seed(2)
    kinds, decode_kinds = torch.ops.fastgen.a8_kinds(), torch.ops.fastgen.a8_gemv_kinds()
    assert set(kinds) <= set(decode_kinds) <= {4, 8}
    for bits in (4, 8):
        fmt = QuantWeight(quantize(torch.randn(16, 64, generator=g), bits), None, int8_activations=True)
        assert fmt.act_int8 is (bits in kinds)
        # decode rows (qgemv) may have an int8 kernel where prompt rows have none (8 bits on AVX2)
        assert fmt.decode_plan(torch.float32)[1] is (bits in decode_kinds)
        plain = QuantWeight(fmt.quant, None)
        assert not plain.act_int8 and not plain.decode_plan(torch.float32)[1]
        if bits not in kinds:
            q = fmt.quant
            with pytest.raises(RuntimeError, match="qgemm_a8"):
                torch.ops.fastgen.qgemm_a8(torch.randn(4, 64), q.qweight, q.scales, q.mins, bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,n,k", [(7, 12, 32), (12, 20, 96), (33, 70, 576), (100, 8, 64), (600, 21, 1536)])
def test_int8_activation_gemm_is_its_rounding_of_x_times_the_exact_weights(dtype, bits, rows, n, k):
    """qgemm_a8 rounds x to int8 per (row, group of 32) and multiplies by W's exact values
    (integer dot products, then the group's two scales and W's minimum): the reference is the
    rounded x times the dequantized W, in fp32. Shapes: blocks of 32 rows and a short last one
    (up to 8 rows: the 256-bit kernel; 9-16: one 512-bit vector; 17-31: two), panels of 8 and a
    short last one, row chunks (600 x 1536: more than one)."""
    _skip_without_int8(bits)
    g = torch.Generator().manual_seed(bits * 1000 + rows + n)
    q = QuantWeight(quantize(torch.randn(n, k, generator=g), bits), None).quant
    x = torch.randn(rows, k, generator=g).to(dtype)
    x[3, :32] = 0                              # a group of zeros (its scale must not be 0 / 0)
    q.scales[n // 2, k // 64] = 0              # a W group of equal weights (GGUF writes scale 0)
    bias = torch.randn(n, generator=g)
    want = _int8_per_group(x) @ q.dequantize().T + bias
    got = torch.ops.fastgen.qgemm_a8(x, q.qweight, q.scales, q.mins, q.kind, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    # fp32: sums in another order only; bf16: the output's one rounding to 8 bits
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol
    torch.testing.assert_close(torch.ops.fastgen.qgemm_a8(x, q.qweight, q.scales, q.mins, q.kind).float(),
                               got.float() - bias, atol=tol * 4 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activation_gemm_rows_do_not_depend_on_the_block_kernel(bits):
    """qgemm_a8 takes a 256-bit kernel for blocks of up to 8 rows, one 512-bit vector for 9-16 and
    two for more, and decode batches of up to 32 rows its few-row path in passes of at most 14
    rows split evenly (16 = 8 + 8, 29 = 9 + 10 + 10): each row's lane takes the same operations in
    each, so a row's output is the same bit for bit whether it is multiplied alone, among 12 rows
    or among 40."""
    _skip_without_int8(bits)
    g = torch.Generator().manual_seed(7 + bits)
    q = QuantWeight(quantize(torch.randn(24, 576, generator=g), bits), None).quant
    x = torch.randn(40, 576, generator=g).to(torch.bfloat16)
    # a row of denormals: 1 / dx overflows, every product to int8 saturates (-128) on each path
    x[6] = 1e-38
    x[7, :32] = 0     # an all-zero group
    full = torch.ops.fastgen.qgemm_a8(x, q.qweight, q.scales, q.mins, q.kind, None, True)
    plain = torch.ops.fastgen.qgemm_a8(x, q.qweight, q.scales, q.mins, q.kind)   # no SiLU: row 6 stays nonzero
    assert plain[6].abs().sum() > 0
    assert torch.equal(torch.ops.fastgen.qgemm_a8(x[:8], q.qweight, q.scales, q.mins, q.kind), plain[:8])
    for rows in (1, 5, 8, 12, 14, 15, 16, 20, 28, 29, 32):
        part = torch.ops.fastgen.qgemm_a8(x[:rows], q.qweight, q.scales, q.mins, q.kind, None, True)
        assert torch.equal(part, full[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activation_lane_kernel_gives_the_block_kernels_bits(dtype, bits, monkeypatch):
    """Past the few-row path, AVX-512 hosts multiply prompt rows in the lane kernel (one output
    feature per vector lane, tiles of 8 rows x 32 features) or the block kernels (one row per
    lane), whichever measured faster on the host (``set_a8_lanes``; ``FASTGEN_A8_LANES=0``, read
    at each call, forces the block kernels). Both take each (row, feature)'s
    operations in the same order, so their outputs are the same bit for bit: over tiles of 8 rows
    and a short last one, panels of 32 features and short last ones (fewer than 16, more than
    16, exactly 16), a bias over a short panel, the fused SiLU, one group (k = 32), row counts that
    are multiples of 8 and 32, row chunks (700 x 1536: more than one), zeros and denormals; the
    outputs' bits compared (torch.equal would take -0 for +0)."""
    _skip_without_int8(bits)
    if not torch.ops.fastgen.have_a8_lanes():   # AVX2: the block kernels only, whatever is asked
        was = torch.ops.fastgen.set_a8_lanes(True)
        try:
            assert not torch.ops.fastgen.a8_lanes()
        finally:
            torch.ops.fastgen.set_a8_lanes(was)
        return
    g = torch.Generator().manual_seed(31 + bits)
    for rows, n, k, silu in ((33, 70, 576, False), (45, 24, 96, True), (100, 8, 64, False),
                             (700, 40, 1536, False), (259, 2 * 56, 576, True), (40, 48, 32, False),
                             (64, 56, 64, False)):
        q = QuantWeight(quantize(torch.randn(n, k, generator=g), bits), None).quant
        x = torch.randn(rows, k, generator=g).to(dtype)
        x[5] = 1e-38                # every product saturates on each path
        x[9, :32] = 0               # an all-zero group
        bias = None if silu else torch.randn(n, generator=g)
        outs = []
        was = torch.ops.fastgen.set_a8_lanes(True)
        try:
            for lanes, env in ((True, None), (False, None), (True, "0")):
                if env is None:
                    monkeypatch.delenv("FASTGEN_A8_LANES", raising=False)
                else:
                    monkeypatch.setenv("FASTGEN_A8_LANES", env)
                torch.ops.fastgen.set_a8_lanes(lanes)
                assert torch.ops.fastgen.a8_lanes() == (lanes and env is None)
                outs.append(torch.ops.fastgen.qgemm_a8(x, q.qweight, q.scales, q.mins, q.kind, bias, silu))
        finally:
            torch.ops.fastgen.set_a8_lanes(was)
        assert outs[0].shape == (rows, n // 2 if silu else n)
        bits_of = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(outs[0].view(bits_of), outs[1].view(bits_of)), (rows, n, k, silu)
        assert torch.equal(outs[1].view(bits_of), outs[2].view(bits_of)), (rows, n, k, silu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [576, 1536, 96, 160, 224])   # 4-group quads and a last pair and/or a last group
def test_int8_decode_rows_sum_what_prompt_rows_sum(dtype, bits, k):
    """qgemv with int8 x against 4-bit rows (qrows4_a8) or 8-bit rows (qrows8_a8: the weights
    made unsigned, 128 * sum(x) taken back) rounds x as qgemm_a8 does and sums the same terms:
    decode rows and prompt rows differ by the sums' order only, each a decode's output is the
    same in any batch (one row alone takes two W rows at a time), and the reference is x's
    rounding times the exact weights. On AVX2 hosts 8-bit rows have the decode kernel only
    (qrows8_a8_avx2: |q| . (x with q's sign)), checked against the reference alone."""
    _skip_without_int8(bits, decode=True)
    g = torch.Generator().manual_seed(k + bits)
    q = QuantWeight(quantize(torch.randn(75, k, generator=g), bits), None).quant
    x = torch.randn(7, k, generator=g).to(dtype)
    x[2, 32:64] = 0                            # a group of zeros
    if bits == 8:
        q.qweight.view(torch.int8)[3, :32] = -128   # q = -128: its |q| is the unsigned byte 128
        x[4, :32] = -x[4, :32].abs()                # a group of one sign, so that |x| rounds to 127
    got = torch.ops.fastgen.qgemv(x, q.qweight, q.scales, q.mins, bits, True)
    want = _int8_per_group(x) @ q.dequantize().T
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol
    if bits in torch.ops.fastgen.a8_kinds():
        prompt = torch.ops.fastgen.qgemm_a8(x, q.qweight, q.scales, q.mins, bits)
        assert ((got.float() - prompt.float()).abs().max() / want.abs().max()).item() < tol
    for r in range(7):
        alone = torch.ops.fastgen.qgemv(x[r:r + 1], q.qweight, q.scales, q.mins, bits, True)
        assert torch.equal(alone[0], got[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("rows,inter,k", [(13, 1536, 576), (130, 20, 64), (300, 36, 96)])  # 20, 36: a short last panel pair
def test_the_fused_activation_equals_silu_mul_of_the_product(dtype, int8_activations, rows, inter, k):
    """A gate/up format applies silu(gate) * up as it stores its tiles: bit for bit what silu_mul
    of the stored product gives (the same roundings, the same vector ops in fp32 and bf16), so a
    prompt's rows and a decode's get the same activations."""
    if int8_activations:
        _skip_without_int8()
    g = torch.Generator().manual_seed(rows + inter)
    fmt = QuantWeight(quantize(torch.randn(2 * inter, k, generator=g), 4), None, int8_activations)
    x = torch.randn(rows, k, generator=g).to(dtype)
    fused = fmt.matmul_silu_mul(x)
    want = torch.ops.fastgen.silu_mul(fmt.matmul(x))
    assert fused is not None and fused.shape == (rows, inter) and fused.dtype == dtype
    assert torch.equal(fused, want)
    assert fmt.matmul_silu_mul(x[:1]) is None                  # decode rows: qgemv, then silu_mul
    with_bias = QuantWeight(fmt.quant, torch.zeros(2 * inter))
    assert with_bias.matmul_silu_mul(x) is None


def test_int8_activations_take_prompt_rows_and_bf16_decode_rows():
    """With int8 activations a product of MIN_A8_ROWS rows or more takes qgemm_a8, and bf16
    decode rows take qgemv's int8 kernel (qrows4_a8, faster than the bf16 dot products); without
    the option decode rows stay exact."""
    _skip_without_int8()
    g = torch.Generator().manual_seed(9)
    q = quantize(torch.randn(96, 576, generator=g), 4)
    plain, a8 = QuantWeight(q, None), QuantWeight(q, None, int8_activations=True)
    rows = torch.randn(QuantWeight.MIN_A8_ROWS, 576, generator=g).bfloat16()
    qq = a8.quant
    assert torch.equal(a8.matmul(rows), torch.ops.fastgen.qgemm_a8(rows, qq.qweight, qq.scales, qq.mins, 4))
    assert not torch.equal(a8.matmul(rows), plain.matmul(rows))
    few = rows[:QuantWeight.MIN_A8_ROWS - 1]   # below the threshold: qgemm, as without the option
    assert torch.equal(a8.matmul(few), plain.matmul(few))
    decode = rows[:1]
    assert a8.decode_plan(torch.bfloat16)[1] and not plain.decode_plan(torch.bfloat16)[1]
    assert torch.equal(a8.matmul(decode), torch.ops.fastgen.qgemv(decode, qq.qweight, qq.scales, qq.mins, 4, True))
    assert torch.equal(plain.matmul(decode), torch.ops.fastgen.qgemv(decode, qq.qweight, qq.scales, qq.mins, 4, False))
    assert not torch.equal(a8.matmul(decode), plain.matmul(decode))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_embedding_gathers_exactly_the_dequantized_rows(dtype, bits):
    q = quantize(torch.randn(300, 64, generator=torch.Generator().manual_seed(bits)), bits)
    ids = torch.tensor([0, 7, 299, 7, 150])
    got = QuantEmbedding(q, dtype)(ids)
    assert torch.equal(got, q.dequantize().to(dtype)[ids])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        QuantEmbedding(q, dtype)(torch.tensor([300]))


def test_quantization_error_is_bounded_by_half_a_step():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    for bits, steps in ((8, 254), (4, 15)):
        q = quantize(w, bits)
        err = (q.dequantize() - w).abs().view(8, 2, 32)
        spread = w.view(8, 2, 32).amax(-1) - w.view(8, 2, 32).amin(-1) if bits == 4 else \
            2 * w.view(8, 2, 32).abs().amax(-1)
        # the step is the fp16 scale, rounded up from the exact one (and the minimum down)
        step = q.scales.float().view(8, 2, 1)
        assert (err <= step / 2 + 1e-6).all()
        assert (step <= (spread[..., None] + w.abs().max() * 2 ** -10) / steps * (1 + 2 ** -10)).all()


def test_fused_parts_concatenate():
    a, b = quantize(torch.randn(4, 32), 4), quantize(torch.randn(6, 32), 4)
    both = QuantRows.cat([a, b])
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError):
        QuantRows.cat([a, quantize(torch.randn(2, 32), 8)])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tiny_model_quantized_at_load_matches_transformers_with_the_same_weights(mode, tmp_path):
    """int8/int4 of an HF checkpoint: the reference is transformers with every linear weight
    (and the tied embedding) replaced by its quantized-dequantized value. Decodes take the
    quantized GEMV, chunks the quantized GEMM: both must give the reference's logits."""
    ref = random_checkpoint(_tiny_configs()["llama-tied-llama3-rope"], tmp_path)
    bits = 8 if mode == "int8" else 4
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2:  # every linear weight and the (tied) embedding
                p.copy_(quantize(p, bits).dequantize())
    model = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"), max_positions=256,
                       kernels="native", quantization=mode)
    assert model.layers[0].mlp.down_proj.format.name == "quantized"
    assert model.head.format.name == "quantized"
    cfg = ModelConfig.from_hf(load_hf_config(str(tmp_path)))
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (1, 9, 40)]
    with torch.no_grad():
        wants = [ref(torch.tensor([s])).logits[0] for s in sequences]
    formats = [m.format for m in model.modules() if isinstance(getattr(m, "format", None), QuantWeight)]
    for f in formats:                   # exact with fp32 activations
        f.act_int8 = False
    got = ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=2)   # mostly 1-2 rows
    for logits, want in zip(got, wants):
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    got = ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=16)  # chunks: qgemm
    for logits, want in zip(got, wants):
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    for f in formats:                   # int8 activations: within their rounding
        f.act_int8 = True
    got = ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=2)
    # every batch here has at most 6 rows, so every product of every layer takes int8
    # activations; their ~0.5% per product compounds to 3-5% over the layers of this tiny
    # random model (4.6% measured for int4); a wrong nibble or scale gives ~100%
    for logits, want in zip(got, wants):
        assert (logits - want).norm() / want.norm() < 0.08


def test_default_gguf_keeps_its_quantized_weights(smollm2_path):
    model = load_model(smollm2_path, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
                       kernels="native", quantization="auto")
    formats = {m.format.name for m in model.modules() if hasattr(m, "format") and m.format is not None}
    assert formats == {"quantized"}
    assert model.head.format.quant.kind == 8               # the tied Q8_0 embedding
    assert isinstance(model.embed_tokens, QuantEmbedding)  # gathered from the same rows: no dense copy
    assert model.layers[0].self_attn.qkv_proj.format.quant.kind == 4
    stream = sum(m.stream_bytes for m in model.modules() if hasattr(m, "stream_bytes"))
    assert stream < 0.45 * 2 * 134_515_008                  # well under the bf16 weights a decode reads
    # issue 9's goal: the resident weights within 1.3x of the file; measured 0.98x, with the
    # scales and minima in fp16 as the file has them (1.15x when they were fp32), pinned at 1.05x.
    # Parameters and buffers left (norms, RoPE tables) count too; an empty loaded weight that a
    # format replaced holds nothing.
    import os

    resident = sum(m.resident_bytes for m in model.modules() if hasattr(m, "resident_bytes")) \
        + sum(p.numel() * p.element_size() for p in model.parameters())    # the embedding shares the head's rows
    assert resident < 1.05 * os.path.getsize(smollm2_path), (resident, os.path.getsize(smollm2_path))


def test_a_weight_kept_quantized_is_never_dequantized(smollm2_path, monkeypatch):
    """Loading a GGUF as shipped reads its quantized blocks straight into their rows: the
    ``gguf`` package dequantizes only what stays dense (SmolLM2: its 61 norm vectors)."""
    seen = []
    real = gguf.quants.dequantize

    def recording(data, qtype):
        out = real(data, qtype)
        seen.append(out.shape)
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", recording)
    load_model(smollm2_path, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
               kernels="native", quantization="auto")
    assert len(seen) == 61 and all(len(shape) == 1 for shape in seen), seen[:5]
    seen.clear()
    load_model(smollm2_path, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
               kernels="native", quantization="none")
    assert sum(len(shape) == 2 for shape in seen) == 211          # 210 layer weights, the embedding


def test_a_fused_layer_is_kept_quantized_only_when_all_its_parts_come_in_one_kind():
    """accepts_quantized: a fused QKV whose parts come in different kinds (a 4-bit q and an 8-bit
    v) or with a part missing (an F16 v) is loaded dense, its other layers quantized; a tied
    embedding is held quantized (it is gathered from its rows)."""
    from transformers import LlamaConfig

    from fastgen.model.llama import LlamaForCausalLM
    from fastgen.model.registry import model_config

    hf = LlamaConfig(**TINY, tie_word_embeddings=True)
    model = LlamaForCausalLM(model_config(hf), hf, 64)
    layer = "model.layers.{}.{}.weight"
    kinds = {layer.format(i, p): 4 for i in range(2) for p in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    kinds[layer.format(0, "self_attn.v_proj")] = 8                 # layer 0: mixed kinds
    del kinds[layer.format(1, "mlp.up_proj")]                       # layer 1: an F16 part
    kinds["model.embed_tokens.weight"] = 8
    accepted = model.accepts_quantized(kinds)
    assert layer.format(0, "self_attn.q_proj") not in accepted and layer.format(0, "self_attn.v_proj") not in accepted
    assert layer.format(1, "mlp.gate_proj") not in accepted
    assert {layer.format(1, "self_attn.q_proj"), layer.format(1, "self_attn.v_proj"), layer.format(0, "mlp.up_proj"),
            layer.format(0, "self_attn.o_proj"), "model.embed_tokens.weight"} <= accepted
    assert len(accepted) == len(kinds) - 3 - 1                      # layer 0's QKV, layer 1's gate


_LOAD_MEMORY = """
import os, sys, torch
from fastgen import kernels
from fastgen.model.loader import default_model_path, load_hf_config, load_model, load_tokenizer
assert kernels.load()
path = default_model_path()
load_hf_config(path), load_tokenizer(path)                      # transformers' imports, the tokenizer
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
model = load_model(path, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
                   kernels="native", quantization=sys.argv[1])
# VmHWM: this process's own peak (ru_maxrss would carry the parent's across exec)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print((peak - before) / os.path.getsize(path), (rss() - before) / os.path.getsize(path))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_loading_the_default_gguf_takes_little_more_than_its_file(smollm2_path):
    """Peak and final memory that loading adds, in units of the file's size, in a fresh process:
    the mapped file plus the rows copied out of it, never a dense copy of the weights. Measured
    1.98-2.02x at the peak and 1.2x after, where a dense bf16 copy made it 6.3x and 3.3x (issue
    9: "Loading a GGUF no longer materialises an fp32 copy of every weight")."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LOAD_MEMORY, "auto"], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    peak, after = float(out[-2]), float(out[-1])
    assert peak < 2.6 and after < 1.5, (peak, after)


def test_quality_of_the_default_modes_is_pinned(smollm2_path):
    """Perplexity on the decode path (one token per step: the quantized GEMV) of the GGUF as
    shipped, in the host's default dtype (bf16 where the CPU has bf16 products, fp32 elsewhere:
    on an AVX2 host bf16 is emulated and this test took 5 minutes), with fp32 and with int8 activations, within 2% of the dequantized fp32
    reference (4% with int8 activations); greedy outputs identical for the first tokens on most
    prompts. Measured on these 1,024 tokens: 50.45 for the reference, 50.42 (-0.05%) in bf16;
    with int8 activations (decode rows through qrows4_a8 since 12-02) 50.54 (+0.19%). The earlier
    int8 decode kernels measured 51.11, 51.65 or 51.90 (+1.3 to +2.9%) for three orders of
    summing the same attention: the rounding of each activation to 8 bits turns such last-bit
    differences into different integers, so this mode's perplexity moves by up to +-1.5% with any
    change of summation order, hence its wider bound. A kernel that mis-reads a nibble or a scale
    moves this by far more."""
    import fastgen
    from fastgen.evaluate import agreement, decode_perplexity, greedy_tokens, heldout_tokens, prompt_perplexity

    ref = fastgen.pipeline(dtype="float32", quantization="none", budget_tokens=64)
    ids = heldout_tokens(ref.engine.tokenizer, 1024)      # 256 tokens move by +-3%: too few
    want_ppl = decode_perplexity(ref.engine, ids)
    want = greedy_tokens(ref, 8)
    want_prompt_ppl = prompt_perplexity(ref.engine, ids)
    # and the engine's default (int8 activations) with the KV cache in int8 (kv_cache_dtype="int8"):
    # measured on the AMX host 50.579 (+0.26%) decode path, 50.442 (-0.01%) prompt path (its chunks
    # attend a dequantized copy), bf16's own KV 50.631 / 50.555
    for a8, kv in ((False, "auto"), (True, "auto"), (True, "int8")):
        q = fastgen.pipeline(dtype="auto", quantization="auto", budget_tokens=64, int8_activations=a8,
                             kv_cache_dtype=kv)
        got_ppl = decode_perplexity(q.engine, ids)
        assert abs(got_ppl / want_ppl - 1) < (0.04 if a8 else 0.02), (a8, kv, got_ppl, want_ppl)
        # the prompt path (each window one chunk: qgemm, or qgemm_a8 with int8 activations):
        # measured +0.26% (bf16) and +0.29% (bf16, int8 activations) over the reference's 50.448
        got_prompt_ppl = prompt_perplexity(q.engine, ids)
        assert abs(got_prompt_ppl / want_prompt_ppl - 1) < 0.02, (a8, kv, got_prompt_ppl, want_prompt_ppl)
        same = agreement(greedy_tokens(q, 8), want)
        assert sum(a >= 3 for a in same) >= 6, (a8, kv, same)
