// exp(x) as fastgen's kernels compute it, scalar and on 16 lanes with the same steps (so a
// vectorised loop and an explicit vector give the same values): the attention softmax
// (cpu_kernels.cpp) and SiLU, alone (cpu_kernels.cpp) or fused after the gate/up product
// (qgemm.cpp, qgemm_a8.cpp); 2^t for the prompt-chunk softmax on tiles (fast_exp2_16).
// Also reduce16, sixteen horizontal reductions at once.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x), vectorisable (the softmax, SiLU; a scalar expf per element cost ~35 ms of a
// 256-token step): 2^(x log2 e) split into an integer power
// (built in the exponent bits) and 2^f, |f| <= 1/2, by its degree-6 Taylor polynomial
// (relative error ~1e-7). Inputs below -87 give ~1e-38 (exp(-inf) -> ~0).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t + 0.5f);
  const float f = t - fi;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX512F__)
// 2^t on 16 lanes to fast_exp's precision (relative error ~1e-7: its degree-6 polynomial in f =
// t - round(t), 2^round(t) by vscalefps), for fp32 probabilities (the fp32 prompt-chunk softmax,
// cpu_kernels.cpp), where fast_exp2_16's 7.5e-5 would show in fp32 outputs
inline __m512 exp2_16(__m512 t) {
  const __m512 fi = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, fi);
}

// fast_exp's steps on 16 lanes from the clamp on (x in [-87, 88]): 2^(x log2 e) by exp2_16, the
// same operations as fast_exp's; p * 2^fi by vscalefps, exact there as the exponent bits
// fast_exp builds are
inline __m512 fast_exp16_clamped(__m512 x) { return exp2_16(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f))); }

// fast_exp on 16 lanes (the same steps; NaN goes to exp(-87), as max_ps returns the clamp)
inline __m512 fast_exp16(__m512 x) {
  return fast_exp16_clamped(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f)));
}

// fast_exp16 for x <= 0 (or NaN), the softmax's case: the clamp at 88 cannot bind, so one op fewer
inline __m512 fast_exp16_nonpos(__m512 x) { return fast_exp16_clamped(_mm512_max_ps(x, _mm512_set1_ps(-87.f))); }
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 2^t on 16 lanes for finite t, for probabilities rounded to bf16 next (the prompt-chunk softmax
// on tiles, cpu_kernels.cpp): vscalefps applies 2^floor(t) itself, and 2^f for f = t - floor(t)
// (one vreduceps) comes from a degree-3 polynomial fitted on [0, 1) for relative error (at most
// 7.5e-5 in fp32, 50x under bf16's 3.9e-3; p(1) = 2 p(0) to fp32's precision, so no step where
// floor(t) moves). 5 operations a vector against fast_exp16_nonpos's 11 (NaN stays NaN). In the
// chunk softmax against a round-to-nearest split with a clamp (8 operations): 0.95x the
// attention's time at 2,048 prompt queries, 0.96-0.98x at 256 after 1,792 (with degree 4, the
// polynomial until 12-05's seventh session: degree 3 is part of a further 0.97x, see
// chunk_softmax_row).
inline __m512 fast_exp2_16(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, 0x09);   // round down, precision exception suppressed
  __m512 p = _mm512_set1_ps(0.07802402973175049f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.22606706619262695f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6958339810371399f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999251365661621f));
  return _mm512_scalef_ps(p, t);
}
#endif

#if defined(__AVX2__)
// 8 x 8 32-bit words: word j of r[i] -> word i of r[j] (in-lane interleaves, then 128-bit
// halves); qgemm_a8's AVX2 and VNNI layouts, and the AVX2 prompt chunks' keys (cpu_kernels.cpp)
inline void transpose8x8_epi32(__m256i* r) {
  __m256i t[8], v[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    v[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]), v[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]), v[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_permute2x128_si256(v[i], v[i + 4], 0x20), r[i + 4] = _mm256_permute2x128_si256(v[i], v[i + 4], 0x31);
}

// the sum and the maximum of a vector's eight lanes (halves, then pairs, then the last two)
inline float hsum8(__m256 v) {
  __m128 z = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  z = _mm_add_ps(z, _mm_movehl_ps(z, z));
  return _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps(z, z, 1)));
}
inline float hmax8(__m256 v) {
  __m128 z = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  z = _mm_max_ps(z, _mm_movehl_ps(z, z));
  return _mm_cvtss_f32(_mm_max_ss(z, _mm_shuffle_ps(z, z, 1)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 2^t on 8 lanes to fast_exp's precision (its degree-6 polynomial in f = t - round(t)); t >= -126 (lower t
// are clamped there, 2^-126 ~ 1e-38: what fast_exp gives below -87); the AVX2 prompt
// chunks' softmax (cpu_kernels.cpp) and fast_exp8
inline __m256 exp2_8(__m256 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  const __m256 fi = _mm256_floor_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// fast_exp on 8 lanes (the same steps; AVX2 hosts): x clamped, times log2 e, then exp2_8 (whose
// clamp at -126 cannot bind after fast_exp's at -87)
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  return exp2_8(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)));
}

// fp32 silu(g) * u on n values (AVX2 hosts), 8 lanes at a time and the last n % 8 through one
// padded vector, so that every value takes the same vector ops wherever it falls: SiLU alone
// (silu_mul, cpu_kernels.cpp) and after the fused gate/up tiles (silu_mul_tile, gemm_tile.h) give
// the same values. (Their scalar loops had: the scalar fast_exp's steps contract into other FMAs)
inline void silu_mul_f32_avx2(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  auto eight = [&](__m256 gv, __m256 uv) {
    return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, fast_exp8(_mm256_xor_ps(gv, sign)))), uv);
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, eight(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  if (i < n) {
    alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
    std::memcpy(gt, g + i, (n - i) * sizeof(float));
    std::memcpy(ut, u + i, (n - i) * sizeof(float));
    _mm256_store_ps(ot, eight(_mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::memcpy(out + i, ot, (n - i) * sizeof(float));
  }
}
#endif

#if defined(__AVX512F__)
// sixteen vectors -> one: lane j holds op over v[j]'s lanes (a tree of unpacks and lane shuffles:
// 45 instructions for 16 horizontal reductions instead of ~130 one at a time). op takes two
// __m512 (an integer op casts). The sums of decode scores (cpu_kernels.cpp, hsum16) and
// qgemm_a8's per-row maxima and sums of x take it.
template <typename Op>
inline __m512 reduce16(const __m512* v, Op op) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = op(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif
