// What the many-row products over quantized rows (qgemm.cpp, qgemm_a8.cpp) share: fp32 ->
// bf16 rounding, a 16 x 16 register transpose, and the store of a tile of accumulators held
// with one row of x per vector lane.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fast_math.h"

inline uint16_t to_bf16(float v) {   // round to nearest even, as c10::BFloat16 for finite values
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX512F__)
// 16 fp32 -> 16 bf16, round to nearest even: one vcvtneps2bf16 where AVX512-BF16 exists (it
// reads fp32 denormals as zero, which q * scale never gives), else to_bf16 in integer ops
inline __m256i bf16_vec(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif


#if defined(__AVX512F__)
// v[0..15] (16 x 16 fp32) transposed in registers (always inlined: called apart, GCC kept the
// sixteen vectors in memory)
__attribute__((always_inline)) inline void transpose16(__m512* v) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[4 * i + j]), b = _mm512_castps_pd(t[4 * i + j + 2]);
      v[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      v[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  // v now holds, per 128-bit lane L of register 4i + q, rows 4i..4i+3 of column 4L + q
  for (int i = 0; i < 2; ++i)
    for (int q = 0; q < 4; ++q) {
      t[8 * i + q] = _mm512_shuffle_f32x4(v[8 * i + q], v[8 * i + 4 + q], 0x88);      // lanes 0, 2 | 0, 2
      t[8 * i + 4 + q] = _mm512_shuffle_f32x4(v[8 * i + q], v[8 * i + 4 + q], 0xDD);  // lanes 1, 3 | 1, 3
    }
  for (int q = 0; q < 4; ++q) {
    v[q] = _mm512_shuffle_f32x4(t[q], t[8 + q], 0x88);
    v[8 + q] = _mm512_shuffle_f32x4(t[q], t[8 + q], 0xDD);
    v[4 + q] = _mm512_shuffle_f32x4(t[4 + q], t[12 + q], 0x88);
    v[12 + q] = _mm512_shuffle_f32x4(t[4 + q], t[12 + q], 0xDD);
  }
}
#endif

// acc [NRT][MBT] fp32 (lane = row) -> y rows r0.. (up to m), columns o0 .. o0 + nc - 1, plus
// bias (fp32, may be null), rounded once to T
template <typename T, int NRT, int MBT>
inline void store_tile(const float* acc, int64_t m, int nc, T* y, int64_t n, int64_t r0, int64_t o0,
                       const float* bias) {
  const int rows = static_cast<int>(std::min<int64_t>(MBT, m - r0));
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, at::BFloat16> && NRT <= 8 && MBT % 16 == 0) {
    // bf16 out, at most 8 features (qgemm_a8's panels): each feature's 16 rows rounded first
    // (bias added, bf16_vec: the general path's values bit for bit), then an 8 x 16 transpose of
    // the 16-bit values by three rounds of in-lane unpacks (24 on ymm against the 16 x 16 fp32
    // transpose's 64 on zmm, half of it zeros), a row's 8 features 16 bytes
    const __mmask8 cols8 = static_cast<__mmask8>((1u << nc) - 1);
    for (int h = 0; h * 16 < rows; ++h) {
      __m256i b[8], t[8], u[8];
      for (int c = 0; c < 8; ++c)
        b[c] = c < NRT ? bf16_vec(_mm512_add_ps(_mm512_loadu_ps(acc + c * MBT + 16 * h),
                                                _mm512_set1_ps(bias != nullptr && c < nc ? bias[o0 + c] : 0.f)))
                       : _mm256_setzero_si256();
      // per 128-bit lane (rows 0-7 | 8-15): pairs of features, then quads, then all eight
      for (int c = 0; c < 8; c += 2)
        t[c] = _mm256_unpacklo_epi16(b[c], b[c + 1]), t[c + 1] = _mm256_unpackhi_epi16(b[c], b[c + 1]);
      for (int c = 0; c < 8; c += 4)
        for (int q = 0; q < 2; ++q)
          u[c + 2 * q] = _mm256_unpacklo_epi32(t[c + q], t[c + 2 + q]),
          u[c + 2 * q + 1] = _mm256_unpackhi_epi32(t[c + q], t[c + 2 + q]);
      // u[j] (j < 4) holds rows 2j, 2j + 1 of features 0-3, u[4 + j] of features 4-7
      for (int j = 0; j < 4; ++j) {
        const __m256i lo = _mm256_unpacklo_epi64(u[j], u[4 + j]), hi = _mm256_unpackhi_epi64(u[j], u[4 + j]);
        const __m128i rows_out[4] = {_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi),
                                     _mm256_extracti128_si256(lo, 1), _mm256_extracti128_si256(hi, 1)};
        const int at[4] = {16 * h + 2 * j, 16 * h + 2 * j + 1, 16 * h + 8 + 2 * j, 16 * h + 9 + 2 * j};
        for (int i = 0; i < 4; ++i)
          if (at[i] < rows)
            _mm_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y) + (r0 + at[i]) * n + o0, cols8, rows_out[i]);
      }
    }
    return;
  }
#endif
#if defined(__AVX512F__)
  static_assert(NRT <= 16 && MBT % 16 == 0, "store_tile transposes 16 x 16 at a time");
  const __mmask16 cols = static_cast<__mmask16>((1u << nc) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(cols, bias + o0) : _mm512_setzero_ps();
  for (int h = 0; h * 16 < rows; ++h) {
    __m512 v[16];
    for (int c = 0; c < 16; ++c) v[c] = c < NRT ? _mm512_loadu_ps(acc + c * MBT + 16 * h) : _mm512_setzero_ps();
    transpose16(v);   // v[i]: row 16 h + i, lane c = output feature o0 + c
    for (int i = 0; i < 16 && 16 * h + i < rows; ++i) {
      const __m512 out = _mm512_add_ps(v[i], bv);
      const int64_t at = (r0 + 16 * h + i) * n + o0;
      if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(y + at, cols, out);
      else _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y) + at, cols, bf16_vec(out));
    }
  }
#else
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < nc; ++c) {
      const float v = acc[c * MBT + r] + (bias != nullptr ? bias[o0 + c] : 0.f);
      if constexpr (std::is_same_v<T, float>) y[(r0 + r) * n + o0 + c] = v;
      else reinterpret_cast<uint16_t*>(y)[(r0 + r) * n + o0 + c] = to_bf16(v);
    }
#endif
}

// The MLP's activation on a pair of tiles [NRT][MBT] (lane = row) of the fused gate/up product:
// g = silu(g) * u in place, with the roundings of the unfused path (each product output rounded
// to T, silu rounded to T before the multiply); the result's own rounding is store_tile's.
template <typename T, int NRT, int MBT>
inline void silu_mul_tile(float* g, const float* u) {
#if defined(__AVX512F__)
  auto round = [](__m512 v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_vec(v)), 16));
  };
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int i = 0; i < NRT * MBT; i += 16) {
    const __m512 gv = round(_mm512_loadu_ps(g + i));
    const __m512 s = round(_mm512_div_ps(gv, _mm512_add_ps(one, fast_exp16(_mm512_sub_ps(zero, gv)))));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(s, round(_mm512_loadu_ps(u + i))));
  }
#else
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {   // silu_mul's vector ops (fast_math.h)
    silu_mul_f32_avx2(g, u, g, NRT * MBT);
    return;
  }
#endif
  auto round = [](float v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else {
      const uint32_t b = static_cast<uint32_t>(to_bf16(v)) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    }
  };
  for (int i = 0; i < NRT * MBT; ++i) {
    const float gv = round(g[i]);
    g[i] = round(gv / (1.f + fast_exp(-gv))) * round(u[i]);
  }
#endif
}
