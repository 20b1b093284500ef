// The argument checks of every op over quantized rows (fastgen.model.quant.QuantRows), shared by
// qgemv (cpu_kernels.cpp), qgemm and qembed (qgemm.cpp), and the fp16 -> fp32 conversion of
// their scales and minima:
//   qw     [n, k/2] uint8 (kind 4: nibbles) or [n, k] (kind 8: int8 bytes), contiguous
//   scales [n, k/32] fp16; mins [n, k/32] fp16, required for kind 4, absent for kind 8
// (fp16 as GGUF ships them: 4 bytes a group instead of fp32's 8, 17% fewer bytes for a
// decode step to stream through Q4_1 rows)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>

struct QuantRowsPtrs {
  const uint16_t* scales;  // fp16 bits
  const uint16_t* mins;    // fp16 bits, nullptr for kind 8
};

// ``op`` names the op in the errors.
inline QuantRowsPtrs check_quant_rows(const char* op, const at::Tensor& qw, const at::Tensor& scales,
                                      const c10::optional<at::Tensor>& mins, int64_t kind, int64_t k) {
  TORCH_CHECK(kind == 4 || kind == 8, op, ": kind must be 4 or 8");
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              op, ": qw must be [n, k/2 or k] uint8, contiguous");
  const int64_t n = qw.size(0);
  TORCH_CHECK(k % 32 == 0 && qw.size(1) == (kind == 4 ? k / 2 : k),
              op, ": k must be a multiple of 32 and match qw's row bytes");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == n * (k / 32),
              op, ": scales must be [n, k/32] fp16");
  QuantRowsPtrs p{reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), nullptr};
  if (mins.has_value() && mins->defined()) {
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->is_contiguous() && mins->numel() == n * (k / 32),
                op, ": mins must be [n, k/32] fp16");
    p.mins = reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>());
  }
  TORCH_CHECK(kind == 8 || p.mins != nullptr, op, ": 4-bit rows need their mins");
  return p;
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

#if defined(__AVX512F__)
// A zeroed vector for an integer accumulator, by the zeroing idiom (vpxord r, r, r), which the
// CPU resolves at register renaming without an execution unit. Given _mm512_setzero_si512() as
// vpdpbusd's accumulator, GCC keeps one zero register and copies it into each accumulator
// (vmovdqa32), a vector op a group that takes a slot from the dot products: qgemm_a8 over
// SmolLM2's 120 layer products at 256 rows took 0.96x the time without the copies, 0.93x at
// 2,048 rows (Zen 4, 21 and 5 alternating rounds). volatile: one idiom per call, never merged.
inline __m512i zeroed_si512() {
  __m512i z;
  asm volatile("vpxord %0, %0, %0" : "=v"(z));
  return z;
}
// the same for an fp32 accumulator (vxorps)
inline __m512 zeroed_ps() {
  __m512 z;
  asm volatile("vxorps %0, %0, %0" : "=v"(z));
  return z;
}
// v held in a register: GCC otherwise folds a vector loaded once and read by several FMAs or
// vpdpbusd into each of them as a memory operand, one load each (four loads of each K or V vector
// in the attention's qk4 / pv4, eight of x's in qgemm_a8's group_a8). Measured on the Zen 4 host,
// the same output bit for bit: the fp32 prompt-chunk attention 0.77x the time at 2,048 queries,
// 0.85x at 256 after 1,792 keys; the 2,048-token prefill's qgemm_a8 0.988x. (The fp32 decode's
// pv_rows, bound by the pool's reads, measured 1.13-1.17x with it: not there.)
inline void in_reg(__m512& v) { asm volatile("" : "+v"(v)); }
inline void in_reg(__m512i& v) { asm volatile("" : "+v"(v)); }
#endif
#if defined(__AVX2__)
// the same on AVX2 hosts (qk4 / pv4 and the packed chunks' products, cpu_kernels.cpp): there GCC
// folded each K or V vector into its four FMAs, 12 loads per 8 FMAs where 2 loads can issue a
// cycle (Zen 3)
inline void in_reg(__m256& v) { asm volatile("" : "+x"(v)); }
inline void in_reg(__m256i& v) { asm volatile("" : "+x"(v)); }
// *p broadcast to eight lanes where the loop reads it: GCC hoists broadcasts that do not change
// across an inner loop out of it, and where they are many (qgemm_a8's AVX2 micro-kernel: 32 of
// W's words per group, invariant across the blocks of 16 rows) spills them all to the stack and
// reloads them (Zen 3: 260 stack accesses of 256 bits in its loops)
inline __m256i broadcast32_here(const uint32_t* p) {
  __m256i r;
  asm volatile("vpbroadcastd %1, %0" : "=x"(r) : "m"(*p));
  return r;
}
#endif

// n fp16 values (bits) -> fp32, exactly
inline void halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src + i)));
  }
#else
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
#endif
}

#if defined(__AVX512F__)
// 16 consecutive values of x (fp32 or bf16) as fp32: what qgemv's group sums and qgemm_a8's
// quantization of x read
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// The fp32 bias [n] of a many-row product (undefined tensor when there is none) and the check of
// its silu_mul form ([gate; up] rows, no bias): the argument handling qgemm and qgemm_a8 share
inline at::Tensor gemm_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t n, bool silu_mul) {
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == n, op, ": bias [n]");
  }
  TORCH_CHECK(!silu_mul || (n % 2 == 0 && !bf.defined()), op, ": silu_mul takes [gate; up] rows, no bias");
  return bf;
}

// The quantized rows a caller will multiply next (fastgen/kernels/csrc/direct.cpp's LayerStack
// knows its products' order): qgemv's threads prefetch the start of their share of them into L2
// while they work on this product's share (set_next_rows, consumed by the next qgemv call).
struct NextRows {
  const uint8_t* qw = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* mins = nullptr;
  int64_t n = 0, row_bytes = 0, groups = 0;
};
namespace fastgen_kernels {
void set_next_rows(const NextRows* next);   // cpu_kernels.cpp; nullptr: none known
}
