"""Quantized weights: GGUF's Q4_0 / Q4_1 / Q8_0 kept as shipped, and int8 / int4 for HF checkpoints.

All of them are *groups of 32 weights along the input dimension*, each with a scale (and,
for 4-bit, a minimum): Q4_1 is exactly ``w = q * scale + min`` with ``q`` in 0..15, Q4_0 is
the same with ``min = -8 * scale``, Q8_0 is ``w = q * scale`` with ``q`` in -127..127. So
one layout (:class:`QuantRows`) and one kernel (``torch.ops.fastgen.qgemv``) serve the
GGUF files as shipped and the int8 / int4 modes of HF checkpoints alike.

:class:`QuantWeight` is the weight format: a decode step (up to ``MAX_QGEMV_ROWS`` rows)
streams the quantized rows (4.5 to 8.5 bits a weight instead of bf16's 16; products summed
in fp32 from the exact quantized values); more rows (prompt chunks, decode batches) go
through ``qgemm``, which dequantizes a few output features at a time in cache. No dense
copy is held: the model's resident weights are the rows, the scales and minima in fp16 as
GGUF ships them (a Q4_1 file's own size). :class:`QuantEmbedding` does the same for a tied
embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import fast_op

GROUP = 32
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class QuantRows:
    """``rows`` weight rows quantized in groups of 32 along the input dimension ``k``.

    kind 4: ``qweight [rows, k/2]`` uint8, per group the low nibbles of its 16 bytes are
    weights 0..15 and the high nibbles 16..31 (GGUF's order); ``w = q * scale + min``.
    kind 8: ``qweight [rows, k]`` int8 stored as uint8; ``w = q * scale``; ``mins`` is None.
    """

    kind: int
    qweight: torch.Tensor
    scales: torch.Tensor            # [rows, k/32] fp16
    mins: torch.Tensor | None       # [rows, k/32] fp16 (kind 4)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[rows, k]``: the exact values the quantized kernel multiplies by."""
        rows = self.qweight.shape[0]
        if self.kind == 8:
            q = self.qweight.view(torch.int8).float().view(rows, -1, GROUP)
            return (q * self.scales.float()[..., None]).reshape(rows, -1)
        b = self.qweight.view(rows, -1, GROUP // 2)
        q = torch.cat([b & 0xF, b >> 4], dim=-1).float()                # [rows, groups, 32]
        return (q * self.scales.float()[..., None] + self.mins.float()[..., None]).reshape(rows, -1)

    def rows(self, start: int, stop: int) -> "QuantRows":
        """Output rows ``start:stop`` (a fused layer's part, a tensor-parallel rank's share)."""
        return QuantRows(self.kind, self.qweight[start:stop], self.scales[start:stop],
                         None if self.mins is None else self.mins[start:stop])

    def select(self, index: torch.Tensor) -> "QuantRows":
        """The output rows ``index``, in that order (a reordering of a layer's rows)."""
        return QuantRows(self.kind, self.qweight[index], self.scales[index],
                         None if self.mins is None else self.mins[index])

    def columns(self, start: int, stop: int) -> "QuantRows":
        """Input features ``start:stop``, whole groups of 32 only (a row-parallel rank's share)."""
        if start % GROUP or stop % GROUP:
            raise ValueError(f"quantized columns split at {start}:{stop}, not at multiples of {GROUP}")
        per = GROUP // 2 if self.kind == 4 else GROUP          # qweight bytes per group
        g0, g1 = start // GROUP, stop // GROUP
        return QuantRows(self.kind, self.qweight[:, g0 * per:g1 * per].contiguous(),
                         self.scales[:, g0:g1].contiguous(),
                         None if self.mins is None else self.mins[:, g0:g1].contiguous())

    @staticmethod
    def cat(parts: list["QuantRows"]) -> "QuantRows":
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse quantized parts of different kinds {sorted(kinds)}")
        return QuantRows(parts[0].kind, torch.cat([p.qweight for p in parts]).contiguous(),
                         torch.cat([p.scales for p in parts]).contiguous(),
                         None if parts[0].mins is None else torch.cat([p.mins for p in parts]).contiguous())


# GGUF types kept quantized, and the QuantRows kind each becomes (see from_gguf): Q4_0, Q4_1 and
# Q8_0 exactly as shipped, Q5_0 exactly as 8-bit values, Q4_K as 4-bit groups of 32 with its
# 6-bit sub-block scales multiplied out into fp16, and the other K-quants and Q5_1 requantized to
# 8 bits from their values (the only kernel format that holds 5- and 6-bit values, and 2- and
# 3-bit ones with their sub-block scales, without adding more than half an 8-bit step).
GGUF_KINDS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q5_0": 8,
              "Q5_1": 8, "Q2_K": 8, "Q3_K": 8, "Q5_K": 8, "Q6_K": 8}


def gguf_kind(qtype: str) -> int | None:
    """The :class:`QuantRows` kind GGUF type ``qtype`` is kept as (:func:`from_gguf`); None if
    it is dequantized."""
    return GGUF_KINDS.get(qtype)


def _fp16(blk: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block ``blk [..., block bytes]``."""
    return blk[..., at:at + 2].copy().view(np.float16)[..., 0]


def from_gguf(qtype: str, raw: np.ndarray) -> QuantRows:
    """GGUF blocks ``raw [rows, bytes]`` (uint8) of a type of :data:`GGUF_KINDS` as :class:`QuantRows`.

    Exact for Q4_0, Q4_1, Q8_0 and Q5_0 (``dequantize()`` gives gguf's values bit for bit). Q4_K's
    group scale ``d * sc`` and minimum ``-dmin * m`` are rounded to fp16 (each value moves by at
    most ``2**-11`` of ``|q * scale| + |min|``); the other types are requantized to 8 bits per
    group of 32 (at most half a step, ``max|w| / 254``, from gguf's values)."""
    import gguf

    rows = raw.shape[0]
    if qtype == "Q8_0":
        blk = raw.reshape(rows, -1, 34)
        scales = _fp16(blk, 0)
        q = np.ascontiguousarray(blk[..., 2:]).reshape(rows, -1)
        return QuantRows(8, torch.from_numpy(q), torch.from_numpy(scales), None)
    if qtype == "Q5_0":     # w = d * (q - 16), q in 0..31: the int8 value q - 16 with the scale d
        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0).reshape(rows, -1, GROUP)
        d = _fp16(raw.reshape(rows, -1, 22), 0)
        d32 = d.astype(np.float32)
        q = np.rint(w / np.where(d32 == 0, 1, d32)[..., None]).astype(np.int8)   # exact: w = d * q in fp32
        return QuantRows(8, torch.from_numpy(q.reshape(rows, -1).view(np.uint8)), torch.from_numpy(d), None)
    if qtype == "Q4_K":     # per 256: d, dmin, 8 x (6-bit sc, 6-bit m), 128 bytes of nibbles
        blk = raw.reshape(rows, -1, 144)
        n = blk.shape[1]
        sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blk[..., 4:16]).reshape(-1, 12))
        scales = _fp16(blk, 0).astype(np.float32)[..., None] * sc.reshape(rows, n, 8)
        mins = -_fp16(blk, 2).astype(np.float32)[..., None] * m.reshape(rows, n, 8)
        # 4 x 32 bytes: low nibbles are sub-block 2j's 32 values, high nibbles sub-block 2j+1's
        qs = blk[..., 16:].reshape(rows, n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
        v = (qs & 0x0F).reshape(rows, n * 8, GROUP)
        packed = v[..., :GROUP // 2] | (v[..., GROUP // 2:] << 4)            # this layout's order
        return QuantRows(4, torch.from_numpy(np.ascontiguousarray(packed).reshape(rows, -1)),
                         torch.from_numpy(scales.reshape(rows, -1).astype(np.float16)),
                         torch.from_numpy(mins.reshape(rows, -1).astype(np.float16)))
    if qtype in GGUF_KINDS and qtype not in ("Q4_0", "Q4_1"):
        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(rows, -1)
        return quantize(torch.from_numpy(w), 8)
    if qtype == "Q4_1":
        blk = raw.reshape(rows, -1, 20)
        scales, mins = _fp16(blk, 0), _fp16(blk, 2)
        qs = blk[..., 4:]
    elif qtype == "Q4_0":
        blk = raw.reshape(rows, -1, 18)
        scales = _fp16(blk, 0)
        mins = (-8.0 * scales.astype(np.float32)).astype(np.float16)   # exact: a power of two
        qs = blk[..., 2:]
    else:
        raise ValueError(f"GGUF type {qtype} is not kept quantized; kept: {sorted(GGUF_KINDS)}")
    q = np.ascontiguousarray(qs).reshape(rows, -1)
    return QuantRows(4, torch.from_numpy(q), torch.from_numpy(scales), torch.from_numpy(mins))


def _half_at_least(x: torch.Tensor) -> torch.Tensor:
    """The least fp16 value >= each of ``x`` (fp32): a scale rounded to fp16 never shrinks a
    group's range, so no weight is clamped and every error stays within half a step."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize(weight: torch.Tensor, bits: int) -> QuantRows:
    """Quantize ``weight [rows, k]`` (k a multiple of 32) per group of 32: int8 symmetric
    (Q8_0's scheme) or int4 asymmetric (Q4_1's scheme); scales and minima in fp16, as GGUF
    keeps them, and the weights quantized against those fp16 values."""
    w = weight.detach().float().cpu()
    rows, k = w.shape
    g = w.view(rows, k // GROUP, GROUP)
    if bits == 8:
        scales = _half_at_least(g.abs().amax(-1) / 127.0)     # no weight past q = +-127
        s = scales.float()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = (g / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
        return QuantRows(8, q.view(rows, k).view(torch.uint8).contiguous(), scales.contiguous(), None)
    if bits == 4:
        lo = -_half_at_least(-g.amin(-1))                       # fp16 at or below the group's least
        scales = _half_at_least((g.amax(-1) - lo.float()) / 15.0)   # and lo + 15 * scale above its most
        s = scales.float()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = ((g - lo.float()[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
        packed = (q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)).reshape(rows, k // 2).contiguous()
        return QuantRows(4, packed, scales.contiguous(), lo.contiguous())
    raise ValueError(f"bits must be 8 or 4, got {bits}")


class QuantWeight:
    """The weight format of quantized rows: nothing but the rows is held.

    Up to ``MAX_QGEMV_ROWS`` rows (decode steps) go through ``qgemv``, which streams the rows
    once and sums exact products of the quantized values; more rows (prompt chunks, decode
    batches) through ``qgemm``, which dequantizes 12 output features at a time into a buffer
    in cache (``q * scale + min`` rounded to the engine dtype: the values the dense copy of
    earlier versions held) and multiplies it by every row there.

    Measured on the 2-core Zen 5 host (AVX512-BF16), SmolLM2's 120 layer shapes, one thread,
    CPU time on a busy machine: qgemv against qgemm 4.2 / 16.5 ms for 1 row, 15.1 / 16.4 ms
    for 6, 18.4 / 16.4 ms for 8, hence ``MAX_QGEMV_ROWS = 6``; qgemm against oneDNN on a bf16
    copy 16.6 / 11.3 ms for 16 rows, 40 / 34 ms for 64, 137 / 123 ms for 256 (0.90x its rate,
    dequantizing included); in fp32 qgemm takes 0.41-0.47x the time of ``F.linear`` on an
    fp32 copy. In bf16, 4-bit rows multiply through ``vdpbf16ps`` in qgemv where the CPU has
    AVX512-BF16 (each nibble q turned into the exact bf16 value 128 + q by one bit operation,
    the offset taken back with the minimum; 0.82x the time of the earlier table lookup over a
    decode step's 121 products), less than 0.8x the time of its fp32 products;
    ``FASTGEN_QGEMV_BF16=0`` selects those.
    """

    name = "quantized"
    MAX_QGEMV_ROWS = 6
    # bf16 rows where qgemv multiplies them by vdpbf16ps (AVX512-BF16): SmolLM2's 120 4-bit layer
    # weights in model order, two threads, idle, after the bit-trick kernel: qgemv against qgemm
    # 6.8 / 12.8 ms for 6 rows, 8.0 / 12.6 for 8, 12.0 / 12.3 for 10, 17.7 / 13.5 for 16 (fp32
    # rows: 11.1 / 14.7 for 6, 15.3 / 14.9 for 8, hence 6 there)
    MAX_QGEMV_ROWS_BF16 = 8
    # 8-bit rows (SmolLM2's Q8_0 head, 49152 x 576, two threads, idle): qgemv against qgemm
    # 1.63 / 3.92 ms for 6 rows, 4.00 / 5.18 for 8, 5.14 / 3.65 for 12: qgemm's dequantizing
    # costs more per weight for bytes than for nibbles (no table lookup)
    MAX_QGEMV_ROWS_8BIT = 8
    # 4-bit rows with int8 activations (qrows4_a8, VNNI): SmolLM2's 120 layer products, two
    # threads, from memory, on the 2-core Zen 4 host (12-02, bf16 x), qgemv / qgemm / qgemm_a8:
    # 11.5 / 21.8 / 26.8 ms for 6 rows, 15.1 / 25.5 / 27.8 for 8, 21.1 / 25.1 / 28.1 for 12,
    # 27.7 / 24.7 / 27.4 for 16: the many-row kernels unpack every weight whatever the rows, so
    # qgemv keeps the decode batches up to 12 (6 before: 7-12 rows then took qgemm)
    MAX_QGEMV_ROWS_A8 = 12
    # rows from which int8 activations take qgemm_a8 (VNNI, x in int8 per group of 32) rather
    # than qgemm: SmolLM2's layer shapes, two threads, rate against qgemm's 0.88-0.92x at 16
    # rows, 0.71-1.10x at 64, 1.16-1.35x at 256, 1.08-1.18x at 512 (docs/architecture.md)
    MIN_A8_ROWS = 128
    # qgemm_a8 takes its few-row path (one output feature per vector lane, W's groups turned into
    # words in registers) up to this many rows of 4- and 8-bit weights (kFewMaxRows, qgemm_a8.cpp)
    A8_FEW_ROWS = 32
    # no upper row limit for qgemm_a8 (the fixed choice; AMX hosts measure one: fastgen/row_limits.py)
    MAX_A8_ROWS = 1 << 30

    def __init__(self, quant: QuantRows, bias: torch.Tensor | None, int8_activations: bool = False) -> None:
        self.quant = QuantRows(quant.kind, quant.qweight.contiguous(), quant.scales.half().contiguous(),
                               None if quant.mins is None else quant.mins.half().contiguous())
        self.bias = bias
        self._bias_f32 = None if bias is None else bias.float().contiguous()
        self.max_qgemv_rows = self.MAX_QGEMV_ROWS_8BIT if quant.kind == 8 else self.MAX_QGEMV_ROWS
        # direct calls of the ops (fastgen.kernels.direct: ~1 us less a call than torch.ops'
        # overloads; 121 qgemv calls a decode step)
        self._qgemv, self._qgemm = fast_op("qgemv"), fast_op("qgemm")
        self._qgemv_argmax = fast_op("qgemv_argmax")
        self._qgemm_a8 = fast_op("qgemm_a8") if hasattr(torch.ops.fastgen, "qgemm_a8") else None
        # int8 activations (per group of 32, VNNI dot products; EngineOptions turns them on unless
        # float32 is asked for by name), where they pay:
        # - prompt rows (MIN_A8_ROWS or more): qgemm_a8, products 1.1-1.35x qgemm's rate, a
        #   2,048-token prefill 1.03-1.17x faster, prompt perplexity +0.4%;
        # - decode rows: first only where qgemv had no bf16 dot products (fp32 activations, 8-bit
        #   rows, CPUs without AVX512-BF16): there 13% faster decode steps, perplexity +1.3%; in
        #   bf16 against the bf16 dot products their decode steps ran 0.85x as fast then.
        #   4-bit rows take qrows4_a8 (qgemm_a8's sums, two vpdpbusd per 64 weight bytes): on the
        #   Zen 4 host SmolLM2's 120 layer products from memory with fp32 x took 0.78x the time of
        #   the earlier int8 kernel (three fresh pairs); with bf16 x 0.986x the bf16 dot products'
        #   time (60 alternating rounds), too little for int8's error then. Its second version
        #   (12-02: vector tails, the minima summed 16 groups a vector, prefetches into L2) took
        #   0.87x the bf16 dot products' time over those products (37 of 40 rounds) and 0.954x
        #   over whole decode steps (19 of 20 bursts), decode-path perplexity in bf16 +0.19%
        #   (50.424 -> 50.541), so bf16 decode rows take it too.
        # Decode rows then differ from prompt rows by the activations' rounding, so greedy parity
        # with the reference and seeded outputs that do not depend on the batch no longer hold
        # exactly (docs/architecture.md)
        # (the kinds with int8 kernels in this build: 4 and 8 bits with AVX512-VNNI, 4 bits with AVX2)
        self.act_int8 = bool(int8_activations and self._qgemm_a8 is not None
                             and quant.kind in torch.ops.fastgen.a8_kinds())
        # decode rows (qgemv) with int8 activations: act_int8's kinds and, on AVX2 hosts, 8-bit
        # rows too (qrows8_a8_avx2: vpsignb + vpmaddubsw, where qgemm_a8 has no 8-bit path, so
        # their prompt rows stay in the dtype). SmolLM2's Q8_0 head, one row from memory, Zen 3:
        # see docs/architecture.md
        self.decode_a8 = bool(int8_activations and (self.act_int8 or (
            quant.mins is None and quant.kind in torch.ops.fastgen.a8_gemv_kinds())))
        # the fixed row limits; an engine measures its host's (fastgen/row_limits.py)
        self.min_a8_rows = self.MIN_A8_ROWS
        self.max_a8_rows = self.MAX_A8_ROWS   # past it qgemm again
        if self.act_int8 and quant.kind == 4:
            self.max_qgemv_rows = self.MAX_QGEMV_ROWS_A8
        bf16_dot = quant.kind == 4 and torch.ops.fastgen.have_bf16_dot() and not self.act_int8
        self.max_qgemv_rows_bf16 = self.MAX_QGEMV_ROWS_BF16 if bf16_dot else self.max_qgemv_rows

    def decode_plan(self, dtype: torch.dtype) -> tuple[int, bool]:
        """``(rows, act_int8)`` for x of ``dtype``: up to ``rows`` rows take qgemv, with this
        int8-activation flag (what :meth:`matmul` passes it; fastgen/model/stack.py reads it too)."""
        if dtype == torch.bfloat16:
            return self.max_qgemv_rows_bf16, self.decode_a8
        return self.max_qgemv_rows, self.decode_a8

    def stack_rows(self, dtype: torch.dtype) -> int:
        """The most rows the native layer stack (fastgen/model/stack.py) runs this format for: past
        qgemv's limit, qgemm_a8's few-row path (up to ``A8_FEW_ROWS`` rows of 4-bit weights, one
        output feature per vector lane) where the many-row kernel is qgemm_a8."""
        rows = self.decode_plan(dtype)[0]
        if self.act_int8 and self.quant.kind == 4 and self.min_a8_rows <= self.A8_FEW_ROWS:
            rows = max(rows, min(self.A8_FEW_ROWS, self.max_a8_rows))
        return rows

    def _decode_rows(self, x: torch.Tensor) -> bool:
        """Whether x's rows are few enough for qgemv (the row limit of x's dtype)."""
        return x.shape[0] <= self.decode_plan(x.dtype)[0]

    def _many_rows(self, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
        """qgemm_a8 from ``min_a8_rows`` to ``max_a8_rows`` rows with int8 activations, else qgemm."""
        q = self.quant
        gemm = (self._qgemm_a8 if self.act_int8 and self.min_a8_rows <= x.shape[0] <= self.max_a8_rows
                else self._qgemm)
        return gemm(x, q.qweight, q.scales, q.mins, q.kind, bias, silu_mul)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows, a8 = self.decode_plan(x.dtype)
        if x.shape[0] <= rows:
            q = self.quant
            y = self._qgemv(x, q.qweight, q.scales, q.mins, q.kind, a8)
            return y if self.bias is None else y + self.bias
        return self._many_rows(x, self._bias_f32, False)

    def matmul_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(y, argmax of each row of y, its value in fp32)``: :meth:`matmul` of decode rows with
        greedy decoding's choice taken inside the product (``qgemv_argmax``), while each block of
        outputs is in cache; None where qgemv does not run these rows, or a bias follows it."""
        rows, a8 = self.decode_plan(x.dtype)
        if x.shape[0] > rows or self.bias is not None:
            return None
        q = self.quant
        return self._qgemv_argmax(x, q.qweight, q.scales, q.mins, q.kind, a8)

    def matmul_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this fused ``[gate; up]`` product, ``[T, out/2]``, with the activation
        applied to each tile before it is stored (prompt rows: qgemm / qgemm_a8; the ``[T, out]``
        product is never written); None where the kernels do not fuse it (decode rows, a bias).
        Values as the unfused path's in bf16, bit for bit; in fp32 within the last bits of the
        exp's two builds. SmolLM2's gate/up at 512 rows: 2.69 -> 2.29 ms (qgemm), 2.45 -> 1.85 ms
        (qgemm_a8)."""
        if self.bias is not None or self._decode_rows(x):
            return None
        return self._many_rows(x, None, True)

    @property
    def num_bytes(self) -> int:
        return self.quant.num_bytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    @property
    def stream_bytes(self) -> int:
        return self.num_bytes


class QuantEmbedding(torch.nn.Module):
    """An embedding kept as its quantized rows (a tied GGUF embedding, which is also the
    output head's weight): the rows a step gathers are dequantized to ``dtype``, giving the
    values a dense copy would hold, without holding it (56 MB in bf16 for SmolLM2)."""

    def __init__(self, rows: QuantRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows, self.dtype = rows, dtype
        self._qembed = fast_op("qembed")   # looked up once, not every step
        self.num_embeddings, self.embedding_dim = rows.qweight.shape[0], rows.scales.shape[1] * GROUP

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        r = self.rows
        return self._qembed(ids, r.qweight, r.scales, r.mins, r.kind, self.dtype)

    @property
    def num_bytes(self) -> int:
        return self.rows.num_bytes


def reference_matmul(x: torch.Tensor, quant: QuantRows) -> torch.Tensor:
    """fp32 reference of the quantized product (tests)."""
    return F.linear(x.float(), quant.dequantize())
