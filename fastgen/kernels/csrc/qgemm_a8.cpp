// y = x @ W.T for W quantized in groups of 32 along k (fastgen.model.quant.QuantRows) and MANY
// rows of x quantized to int8 per (row, group of 32) on the fly: llama.cpp's scheme on CPUs
// (Q8_0 activations against 4-bit weights), integer products through AVX512-VNNI's vpdpbusd
// (64 multiply-adds of u8 x s8 per instruction, twice vdpbf16ps' 32).
//
// Per (row r, group g): x ~ dx[r, g] * xq (xq int8, round to nearest of x / dx, dx = max|x| / 127);
// W's row c: w = s[c, g] * u + m[c, g] with u unsigned (kind 4: the nibble q, m the group's
// minimum; kind 8: q + 128, m = -128 s). So
//   y[r, c] = sum_g  s[c, g] dx[r, g] * dot(u, xq)  +  m[c, g] * dx[r, g] * sum(xq)
// with dot(u, xq) exact in int32 (8 vpdpbusd a group). Only x is rounded (W's values are the ones
// it ships with): SmolLM2's prompt perplexity 50.58 -> 50.77 (+0.4%), against +3.6% for one
// scale per row of x and per-channel int8 W, and +5.4% for one scale per row of x alone
// (docs/architecture.md).
//
// Three paths by rows, each (row, feature) taking the same operations in the same order, so a
// row's output does not depend on the path:
// - up to 32 rows (decode batches; AVX-512): the few-row path, one output feature per lane, W's
//   groups turned into words in registers, x's bytes broadcast (qgemm_a8_few);
// - more rows on AVX-512 hosts: the lane kernel, one output feature per lane too, W's panels of
//   32 features unpacked once per chunk of rows, tiles of 8 rows (qgemm_a8_lanes);
// - the block kernels (AVX2 hosts; AVX-512 hosts where they measured faster: set_a8_lanes),
//   lane = row as in qgemm.cpp: a block of MB8 rows of x held as [k/4][MB8] 32-bit words (4 consecutive int8 of
//   one row), with dx and dx * sum(xq) as [groups][MB8]; a panel of NR8 output features as
//   [NR8][k/4] words of 4 unsigned bytes, broadcast one at a time. Per group the int32 sums of
//   each (feature, vector of 16 rows) are scaled into fp32 accumulators.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gemm_tile.h"
#include "quant_rows.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHaveA8 = true;
#define FASTGEN_A8_VNNI 1
#elif !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 hosts (no AVX-512): vpmaddubsw + vpmaddwd in place of vpdpbusd, 4-bit rows only (a
// byte weight q + 128 times |x| <= 127, paired, overflows vpmaddubsw's 16-bit sums)
constexpr bool kHaveA8 = true;
#define FASTGEN_A8_AVX2 1
#include <immintrin.h>
#else
constexpr bool kHaveA8 = false;
#endif

#ifndef QGEMM_A8_NR
#define QGEMM_A8_NR 8
#endif
#ifndef QGEMM_A8_HM
#define QGEMM_A8_HM 2
#endif
constexpr int NR8 = QGEMM_A8_NR;   // output features per panel
constexpr int HM8 = QGEMM_A8_HM;   // vectors of 16 rows per block
constexpr int MB8 = 16 * HM8;      // rows per block of x

// a buffer this thread keeps and only grows, at least n values from a 64-byte boundary on
template <typename V>
inline V* grown_aligned(std::vector<V>& store, size_t n) {
  if (store.size() < n + 64 / sizeof(V)) store.resize(n + 64 / sizeof(V));
  return reinterpret_cast<V*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
}

#if defined(FASTGEN_A8_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// rows r0 .. r0 + MB8 - 1 of x [m, k] (rows past m zero): xq words [k/4][MB8], dx and
// dx * sum(xq) [groups][MB8]; the rounding of the AVX-512 build (and of qgemv's int8 rows)
template <typename T>
void quantize_block(const T* x, int64_t m, int64_t k, int64_t r0, int32_t* xa, float* dx, float* dsum) {
  const int64_t groups = k / 32, words = k / 4;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = 0; r < MB8; ++r) {
    if (r0 + r >= m) {
      for (int64_t j = 0; j < words; ++j) xa[j * MB8 + r] = 0;
      for (int64_t g = 0; g < groups; ++g) dx[g * MB8 + r] = 0.f, dsum[g * MB8 + r] = 0.f;
      continue;
    }
    const T* xr = x + (r0 + r) * k;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(xr + g * 32 + 8 * i);
      const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 z = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      z = _mm_max_ps(z, _mm_movehl_ps(z, z));
      const float amax = _mm_cvtss_f32(_mm_max_ss(z, _mm_shuffle_ps(z, z, 1)));
      const float d = amax > 0.f ? amax / 127.f : 1.f;
      const __m256 inv = _mm256_set1_ps(1.f / d);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
      u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
      alignas(32) int32_t w[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(w), _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order));
      for (int j = 0; j < 8; ++j) xa[(g * 8 + j) * MB8 + r] = w[j];
      dx[g * MB8 + r] = d;
      dsum[g * MB8 + r] = d * static_cast<float>(_mm_cvtsi128_si32(u));
    }
  }
}

// one block x one panel, as the AVX-512 micro_a8 (out [NR8][MB8] fp32 in L1), in passes of 4
// features x 16 rows (8 accumulators of 16-bit sums, 2 x vectors, a broadcast: 11 of AVX2's 16
// registers). Per group each 16-bit lane sums 16 products of a nibble and |xq| <= 127: at most
// 30,480, inside vpmaddubsw's and vpaddw's range; then one vpmaddwd by ones into 32 bits.
// rows: the block's rows that hold x (16 or MB8)
inline void micro_a8_avx2(const int32_t* xa, const float* dx, const float* dsum, const uint32_t* u, const float* s,
                          const float* mn, int64_t groups, int rows, float* out) {
  static_assert(NR8 % 4 == 0 && MB8 % 16 == 0, "passes of 4 features x 16 rows");
  for (int c = 0; c < NR8 * MB8; c += 8) _mm256_store_ps(out + c, _mm256_setzero_ps());
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* xg = xa + g * 8 * MB8;
    const uint32_t* ug = u + g * 8 * NR8;
    for (int f0 = 0; f0 < NR8; f0 += 4) {
      for (int v0 = 0; v0 < rows; v0 += 16) {
        __m256i a[4][2];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) a[c][0] = a[c][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          __m256i x0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xg + j * MB8 + v0));
          __m256i x1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xg + j * MB8 + v0 + 8));
          in_reg(x0), in_reg(x1);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            const __m256i wb = broadcast32_here(ug + j * NR8 + f0 + c);
            a[c][0] = _mm256_add_epi16(a[c][0], _mm256_maddubs_epi16(wb, x0));
            a[c][1] = _mm256_add_epi16(a[c][1], _mm256_maddubs_epi16(wb, x1));
            in_reg(a[c][0]), in_reg(a[c][1]);   // (else GCC sums a group's 64 products as a tree, spilling them)
          }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256 d = _mm256_load_ps(dx + g * MB8 + v0 + 8 * h), e = _mm256_load_ps(dsum + g * MB8 + v0 + 8 * h);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            const __m256 sv = _mm256_set1_ps(s[g * NR8 + f0 + c]), mv = _mm256_set1_ps(mn[g * NR8 + f0 + c]);
            float* o = out + (f0 + c) * MB8 + v0 + 8 * h;
            const __m256 i32 = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[c][h], ones));
            _mm256_store_ps(o, _mm256_fmadd_ps(e, mv, _mm256_fmadd_ps(i32, _mm256_mul_ps(d, sv), _mm256_load_ps(o))));
          }
        }
      }
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// rows r0 .. r0 + MB8 - 1 of x [m, k] (rows past m zero): xq words [k/4][MB8], dx and
// dx * sum(xq) [groups][MB8]. Sixteen rows of a group at a time: their maxima and sums reduced
// together (reduce16, fast_math.h; one row at a time they ran 16 shuffle chains back to back),
// each row's eight words kept in a register and turned into eight vectors of sixteen rows by two
// 8 x 8 transposes (eight gathers from a buffer before: ~35% of the quantizer's samples on Zen 4).
// The same values as one row at a time (the scalar loop before this): the same division, the
// same round-to-nearest-even, the same saturation to int8, the same int32 sums (for finite x; a
// NaN in a group may leave a different one of its lanes' maxima than before).
// Per group and row r (its index in x, `live` false past m: zeros), the overload's two steps:
// max_abs(r, live, g) the row's |x| folded into a vector whose largest lane is the group's
// largest |x|; quantize(r, live, g, iv, sum) its 32 values times iv rounded and saturated to
// int8, as eight 4-byte words in k order (a 256-bit vector), and their int32 sum spread over the
// lanes of *sum.
// lanes: the layout of the lane kernels (qgemm_a8_lanes) instead, xa as int8 [tiles of 8 rows][groups][8][32]
// (a row's group as its 32 bytes in k order), dx and dsum [tiles][groups][8]
template <typename MaxAbs, typename Quantize>
inline void quantize_groups(int64_t m, int64_t k, int64_t r0, int32_t* xa, float* dx, float* dsum, MaxAbs max_abs,
                            Quantize quantize, bool lanes = false) {
  const int64_t groups = k / 32;
  alignas(64) float inv[16];
  for (int v0 = 0; v0 < MB8; v0 += 16) {
    const int live = static_cast<int>(std::clamp<int64_t>(m - (r0 + v0), 0, 16));
    const __mmask16 live_mask = static_cast<__mmask16>((1u << live) - 1);
    for (int64_t g = 0; g < groups; ++g) {
      int32_t* xg = xa + g * 8 * MB8 + v0;
      // the lane kernels' layout: tiles of 8 rows, a tile's groups one after another, a group's
      // 8 rows of 32 bytes each (k order), dx and dsum [tile][group][8]. store_lanes(words, d, e):
      // the 16 rows' words and their dx, dsum (the first 8 rows tile (r0 + v0) / 8's, the next the
      // following tile's); only called in that layout (for the block one xa, dx and dsum start at
      // the block, so the tile offsets would point past it)
      auto store_lanes = [&](const __m256i* words, __m512 d, __m512 e) {
        for (int h = 0; h < 2; ++h) {
          const int64_t at = ((r0 + v0) / 8 + h) * groups + g;
          for (int r = 0; r < 8; ++r)
            _mm256_store_si256(reinterpret_cast<__m256i*>(reinterpret_cast<int8_t*>(xa) + at * 256 + 32 * r), words[8 * h + r]);
          const __m512i dh = _mm512_castps_si512(d), eh = _mm512_castps_si512(e);
          _mm256_store_ps(dx + at * 8, _mm256_castsi256_ps(h ? _mm512_extracti64x4_epi64(dh, 1) : _mm512_castsi512_si256(dh)));
          _mm256_store_ps(dsum + at * 8, _mm256_castsi256_ps(h ? _mm512_extracti64x4_epi64(eh, 1) : _mm512_castsi512_si256(eh)));
        }
      };
      if (lanes && live == 0) {
        __m256i zeros[16];
        for (auto& z : zeros) z = _mm256_setzero_si256();
        store_lanes(zeros, _mm512_setzero_ps(), _mm512_setzero_ps());
        continue;
      }
      if (!lanes && live == 0) {
        for (int j = 0; j < 8; ++j) _mm512_store_si512(xg + j * MB8, _mm512_setzero_si512());
        _mm512_store_ps(dx + g * MB8 + v0, _mm512_setzero_ps());
        _mm512_store_ps(dsum + g * MB8 + v0, _mm512_setzero_ps());
        continue;
      }
      __m512 v[16];
      for (int r = 0; r < 16; ++r) v[r] = max_abs(r0 + v0 + r, r < live, g);
      const __m512 amax = reduce16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
      const __m512 d = _mm512_mask_div_ps(_mm512_set1_ps(1.f), _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                          amax, _mm512_set1_ps(127.f));
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), d));
      __m256i w[16];
      for (int r = 0; r < 16; ++r) {
        __m512i sum_r;
        // round to nearest even (the default rounding mode), as nearbyint in qgemv's int8 path
        w[r] = quantize(r0 + v0 + r, r < live, g, _mm512_set1_ps(inv[r]), &sum_r);
        v[r] = _mm512_castsi512_ps(sum_r);
      }
      const __m512i sum = _mm512_castps_si512(reduce16(v, [](__m512 a, __m512 b) {
        return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
      }));
      if (lanes) {
        store_lanes(w, _mm512_maskz_mov_ps(live_mask, d),
                    _mm512_maskz_mov_ps(live_mask, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum))));
        continue;
      }
      transpose8x8_epi32(w);
      transpose8x8_epi32(w + 8);
      for (int j = 0; j < 8; ++j)
        _mm512_store_si512(xg + j * MB8, _mm512_inserti64x4(_mm512_castsi256_si512(w[j]), w[8 + j], 1));
      _mm512_store_ps(dx + g * MB8 + v0, _mm512_maskz_mov_ps(live_mask, d));
      _mm512_store_ps(dsum + g * MB8 + v0, _mm512_maskz_mov_ps(live_mask, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum))));
    }
  }
}

// fp32 x: two vectors a row and group
inline void quantize_block(const float* x, int64_t m, int64_t k, int64_t r0, int32_t* xa, float* dx, float* dsum,
                           bool lanes = false) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  auto half = [&](int64_t r, bool live, int64_t g, int h) {
    return live ? _mm512_loadu_ps(x + r * k + g * 32 + 16 * h) : _mm512_setzero_ps();
  };
  quantize_groups(m, k, r0, xa, dx, dsum,
      [&](int64_t r, bool live, int64_t g) {
        return _mm512_max_ps(_mm512_andnot_ps(sign, half(r, live, g, 0)), _mm512_andnot_ps(sign, half(r, live, g, 1)));
      },
      [&](int64_t r, bool live, int64_t g, __m512 iv, __m512i* sum) {
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(half(r, live, g, 0), iv));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(half(r, live, g, 1), iv));
        *sum = _mm512_add_epi32(qa, qb);
        return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(qa)), _mm512_cvtsepi32_epi8(qb), 1);
      }, lanes);
}

// bf16 x: a row's group is one 64-byte vector of 32 values, never widened in element order. |x|
// as 16-bit integers (bf16 bits without the sign: their order is the values' order), the larger
// of each pair's two halves in the low half of its 32-bit lane, then reduced as fp32 of those
// bits shifted up (the same maximum); the even values are the lanes' low halves shifted up, the
// odd ones their high halves masked, each rounded to int32, saturated to int16 by one pack (even
// and odd values four at a time in each 128-bit lane), saturated to bytes (vpmovswb) and put
// back in k order by one byte shuffle: int32 -> int8 saturation as before (cvtsepi32_epi8), for
// every int32 (a NaN or out-of-range product's 0x80000000 included). On Zen 4 with the
// transposes above, 2,048 rows x 576 of bf16: 0.6 against 1.05 cycles a value (the widening
// loads (vpmovzxwd) and two narrowings a row cost most of it)
inline void quantize_block(const at::BFloat16* x, int64_t m, int64_t k, int64_t r0, int32_t* xa, float* dx,
                           float* dsum, bool lanes = false) {
  const __m512i abs16 = _mm512_set1_epi16(0x7FFF), lo16 = _mm512_set1_epi32(0xFFFF);
  const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // per 8 bytes after the pack and narrowing: x0 x2 x4 x6 x1 x3 x5 x7 -> x0 .. x7
  const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  auto row = [&](int64_t r, bool live, int64_t g) {
    return live ? _mm512_loadu_si512(x + r * k + g * 32) : _mm512_setzero_si512();
  };
  quantize_groups(m, k, r0, xa, dx, dsum,
      [&](int64_t r, bool live, int64_t g) {
        const __m512i a = _mm512_and_si512(row(r, live, g), abs16);
        const __m512i top = _mm512_and_si512(_mm512_max_epu16(a, _mm512_srli_epi32(a, 16)), lo16);
        return _mm512_castsi512_ps(_mm512_slli_epi32(top, 16));
      },
      [&](int64_t r, bool live, int64_t g, __m512 iv, __m512i* sum) {
        const __m512i raw = row(r, live, g);
        const __m512i qe = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), iv));
        const __m512i qo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(raw, hi16)), iv));
        *sum = _mm512_add_epi32(qe, qo);
        return _mm256_shuffle_epi8(_mm512_cvtsepi16_epi8(_mm512_packs_epi32(qe, qo)), order);
      }, lanes);
}
#endif

#if defined(FASTGEN_A8_VNNI) || defined(FASTGEN_A8_AVX2)
// 8 fp16 values (n <= 8 of them, the rest 0) as fp32
inline __m256 halves8(const uint16_t* p, int64_t n) {
  if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), p));
#else
  alignas(16) uint16_t b[8] = {};
  std::memcpy(b, p, sizeof(uint16_t) * n);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
#endif
}

#if defined(FASTGEN_A8_VNNI)
// 16 bytes at each of a, b, c, e as the four 128-bit lanes of a vector
inline __m512i lanes4(const uint8_t* a, const uint8_t* b, const uint8_t* c, const uint8_t* e) {
  const __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  const __m512i v1 = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  const __m512i v2 = _mm512_inserti32x4(v1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), 2);
  return _mm512_inserti32x4(v2, _mm_loadu_si128(reinterpret_cast<const __m128i*>(e)), 3);
}

// unpack_panel for a whole panel (NR8 = 8 features) of 4-bit rows with minima, on 512-bit
// vectors: the same u, s and m. Per group, features 0..3 and 4..7 each in one vector (a feature's
// 16 bytes a lane); their low nibbles are words 0..3 of each feature, the high ones words 4..7,
// and one two-source dword permute makes two steps' [j][c] rows. The fp16 scales and minima of
// 8 groups go through a two-source 16-bit permute to [g][c] before the conversion. Against the
// 256-bit path (8 x 8 transposes; still taken by 8-bit rows and a short last panel), same output
// bit for bit; the model's 256-token chunk at 1,792 keys 0.991x the time in two runs of 24
// alternating rounds (15 of 24 faster each), prefill of 2,048 tokens 0.990x (7 of 8), Zen 4
// (perf had ~7% of qgemm_a8's samples at 256 rows in the unpacking, its loads from memory)
inline void unpack_panel4_full(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, int64_t k, int64_t o0,
                               uint32_t* u, float* s, float* mn) {
  const int64_t groups = k / 32, row_bytes = k / 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // the permutes' indices, built once: output dword p = 8 j + c (j = 0, 1) takes feature c's
  // word j, lane c of the first source (c < 4) or lane c - 4 of the second (j = 2, 3: + 2);
  // output 16-bit p = 8 g + c (g = 0..3) takes feature c's half g (g = 4..7: + 4)
  static const struct Indices {
    alignas(64) int32_t words[16];
    alignas(64) int16_t halves[32];
  } idx = [] {
    Indices t{};
    for (int p = 0; p < 16; ++p) t.words[p] = (p % 8 < 4 ? 0 : 16) + (p % 4) * 4 + p / 8;
    for (int p = 0; p < 32; ++p) t.halves[p] = static_cast<int16_t>((p % 8 < 4 ? 0 : 32) + (p % 4) * 8 + p / 8);
    return t;
  }();
  const __m512i x01 = _mm512_load_si512(idx.words), x23 = _mm512_add_epi32(x01, _mm512_set1_epi32(2));
  const uint8_t* r = qw + o0 * row_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = r + g * 16;
    const __m512i a = lanes4(q, q + row_bytes, q + 2 * row_bytes, q + 3 * row_bytes);
    const __m512i b = lanes4(q + 4 * row_bytes, q + 5 * row_bytes, q + 6 * row_bytes, q + 7 * row_bytes);
    const __m512i alo = _mm512_and_si512(a, low4), ahi = _mm512_and_si512(_mm512_srli_epi16(a, 4), low4);
    const __m512i blo = _mm512_and_si512(b, low4), bhi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    uint32_t* ug = u + g * 64;
    _mm512_storeu_si512(ug, _mm512_permutex2var_epi32(alo, x01, blo));
    _mm512_storeu_si512(ug + 16, _mm512_permutex2var_epi32(alo, x23, blo));
    _mm512_storeu_si512(ug + 32, _mm512_permutex2var_epi32(ahi, x01, bhi));
    _mm512_storeu_si512(ug + 48, _mm512_permutex2var_epi32(ahi, x23, bhi));
  }
  const __m512i y03 = _mm512_load_si512(idx.halves), y47 = _mm512_add_epi16(y03, _mm512_set1_epi16(4));
  int64_t g0 = 0;
  for (; g0 + 8 <= groups; g0 += 8) {
    for (int which = 0; which < 2; ++which) {
      const uint8_t* base = reinterpret_cast<const uint8_t*>((which ? mins : scales) + o0 * groups + g0);
      const int64_t st = groups * 2;
      const __m512i a = lanes4(base, base + st, base + 2 * st, base + 3 * st);
      const __m512i b = lanes4(base + 4 * st, base + 5 * st, base + 6 * st, base + 7 * st);
      const __m512i lo = _mm512_permutex2var_epi16(a, y03, b), hi = _mm512_permutex2var_epi16(a, y47, b);
      float* dst = (which ? mn : s) + g0 * NR8;
      _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm512_castsi512_si256(lo)));
      _mm512_storeu_ps(dst + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1)));
      _mm512_storeu_ps(dst + 32, _mm512_cvtph_ps(_mm512_castsi512_si256(hi)));
      _mm512_storeu_ps(dst + 48, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1)));
    }
  }
  for (; g0 < groups; ++g0)   // the last groups (k not a multiple of 256)
    for (int c = 0; c < NR8; ++c) {
      s[g0 * NR8 + c] = _cvtsh_ss(scales[(o0 + c) * groups + g0]);
      mn[g0 * NR8 + c] = _cvtsh_ss(mins[(o0 + c) * groups + g0]);
    }
}
#endif

// output features o0 .. o0 + nc - 1 (the rest zero), interleaved so that one pointer reaches a
// step's NR8 values: u as [k/4][NR8] words of 4 unsigned bytes in k order, s and m as
// [groups][NR8] fp32. Per group the NR8 = 8 features' 8 words each are an 8 x 8 transpose in
// registers. A word at a time through a buffer before, it took ~6 ms of the 120 layer products'
// 17.6 ms at 16 rows (every panel unpacked for one block of rows), ~2 ms after (in cache, Zen 4)
void unpack_panel(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, int kind, int64_t k,
                  int64_t o0, int nc, uint32_t* u, float* s, float* mn) {
  static_assert(NR8 == 8, "unpack_panel transposes 8 features at a time");
  const int64_t groups = k / 32, row_bytes = kind == 4 ? k / 2 : k;
#if defined(FASTGEN_A8_VNNI)
  if (kind == 4 && nc == NR8 && mins != nullptr) {   // a whole panel of 4-bit rows: 512-bit vectors
    unpack_panel4_full(qw, scales, mins, k, o0, u, s, mn);
    return;
  }
#endif
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < groups; ++g) {
    __m256i r[8];
    for (int c = 0; c < NR8; ++c) {
      if (c >= nc) {
        r[c] = _mm256_setzero_si256();
      } else if (kind == 4) {   // GGUF order: low nibbles are weights 0..15, words 0..3
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qw + (o0 + c) * row_bytes + g * 16));
        r[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
      } else {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + (o0 + c) * row_bytes + g * 32));
        r[c] = _mm256_xor_si256(b, flip);   // q + 128
      }
    }
    transpose8x8_epi32(r);
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + (g * 8 + j) * NR8), r[j]);
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t len = std::min<int64_t>(8, groups - g0);
    __m256i sv[8], mv[8];
    for (int c = 0; c < NR8; ++c) {
      if (c >= nc) {
        sv[c] = mv[c] = _mm256_setzero_si256();
        continue;
      }
      const __m256 sc = halves8(scales + (o0 + c) * groups + g0, len);
      sv[c] = _mm256_castps_si256(sc);
      mv[c] = _mm256_castps_si256(kind == 4 ? halves8(mins + (o0 + c) * groups + g0, len)
                                            : _mm256_mul_ps(_mm256_set1_ps(-128.f), sc));
    }
    transpose8x8_epi32(sv);
    transpose8x8_epi32(mv);
    for (int64_t g = 0; g < len; ++g) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + (g0 + g) * NR8), sv[g]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mn + (g0 + g) * NR8), mv[g]);
    }
  }
}

// one block x one panel: H vectors of 16 rows, NR8 features; out [NR8][MB8] fp32. Only the int32
// sums live in registers (NR8 * H of them); each group's scaled sums are added to out, which
// stays in L1 (with the fp32 sums in registers too GCC spilled and copied registers in the
// inner loop: 0.5x vpdpbusd's rate). Per 8 vpdpbusd a group costs a conversion, a multiply and
// two FMAs (scale, minimum): with vpdpbusd on the FMA pipes that caps the loop near 8 / 11 of
// vpdpbusd's rate, where it runs (perf: ~75%). Group 0 stores into out without reading it
// (no zeroing pass: 2-3% of the product's time at 256-2,048 rows). x's vectors and the rows'
// scales (d, e) are held in registers (in_reg, quant_rows.h: GCC had folded them into every
// vpdpbusd, multiply and FMA that reads them; one process switching call by call: SmolLM2's four
// layer products at 2,048 rows 0.980x the time, the 2,048-token prefill 0.988x).
#if defined(FASTGEN_A8_VNNI)
template <int H, bool First>
inline void group_a8(const int32_t* xg, const float* dxg, const float* dsumg, const uint32_t* ug, const float* sg,
                     const float* mg, float* out) {
  __m512i acc[H][NR8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {   // step 0 starts the sums from zero (zeroed_si512)
    __m512i xv[H];
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) xv[h] = _mm512_load_si512(xg + j * MB8 + 16 * h), in_reg(xv[h]);
#pragma GCC unroll 16
    for (int c = 0; c < NR8; ++c) {
      const __m512i wb = _mm512_set1_epi32(static_cast<int>(ug[j * NR8 + c]));
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) acc[h][c] = _mm512_dpbusd_epi32(j == 0 ? zeroed_si512() : acc[h][c], wb, xv[h]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) {
    __m512 d = _mm512_load_ps(dxg + 16 * h), e = _mm512_load_ps(dsumg + 16 * h);
    in_reg(d), in_reg(e);
#pragma GCC unroll 16
    for (int c = 0; c < NR8; ++c) {
      float* o = out + c * MB8 + 16 * h;
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][c]), _mm512_mul_ps(d, _mm512_set1_ps(sg[c])),
                                       First ? _mm512_setzero_ps() : _mm512_load_ps(o));
      _mm512_store_ps(o, _mm512_fmadd_ps(e, _mm512_set1_ps(mg[c]), t));
    }
  }
}

template <int H>
inline void micro_a8(const int32_t* xa, const float* dx, const float* dsum, const uint32_t* u, const float* s,
                     const float* mn, int64_t groups, float* out) {
  group_a8<H, true>(xa, dx, dsum, u, s, mn, out);
  for (int64_t g = 1; g < groups; ++g)
    group_a8<H, false>(xa + g * 8 * MB8, dx + g * MB8, dsum + g * MB8, u + g * 8 * NR8, s + g * NR8, mn + g * NR8, out);
}

#if defined(__AVX512VL__)
#define FASTGEN_A8_8ROWS 1
// micro_a8 for a block's first 8 rows only (a decode batch of up to 8, or a last block's rest):
// the same operations in 256-bit vectors (AVX512-VL), lanes 0..7 of each row vector; out's rows
// 8.. are left as zeros. A 512-bit op costs a Zen 4 core two 256-bit ones, so this is half of
// micro_a8<1>'s work for the rows it has.
inline void micro_a8_8rows(const int32_t* xa, const float* dx, const float* dsum, const uint32_t* u, const float* s,
                           const float* mn, int64_t groups, float* out) {
  for (int c = 0; c < NR8 * MB8; c += 16) _mm512_store_ps(out + c, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* xg = xa + g * 8 * MB8;
    const uint32_t* ug = u + g * 8 * NR8;
    __m256i i0[NR8];
#pragma GCC unroll 16
    for (int c = 0; c < NR8; ++c) {
      __m256i z;
      asm volatile("vpxord %0, %0, %0" : "=v"(z));   // the zeroing idiom, as zeroed_si512()
      i0[c] = _mm256_dpbusd_epi32(z, _mm256_set1_epi32(static_cast<int>(ug[c])),
                                  _mm256_load_si256(reinterpret_cast<const __m256i*>(xg)));
    }
#pragma GCC unroll 8
    for (int j = 1; j < 8; ++j) {
      const __m256i x0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(xg + j * MB8));
#pragma GCC unroll 16
      for (int c = 0; c < NR8; ++c)
        i0[c] = _mm256_dpbusd_epi32(i0[c], _mm256_set1_epi32(static_cast<int>(ug[j * NR8 + c])), x0);
    }
    const __m256 d0 = _mm256_load_ps(dx + g * MB8), e0 = _mm256_load_ps(dsum + g * MB8);
#pragma GCC unroll 16
    for (int c = 0; c < NR8; ++c) {
      const __m256 sv = _mm256_set1_ps(s[g * NR8 + c]), mv = _mm256_set1_ps(mn[g * NR8 + c]);
      float* o = out + c * MB8;
      _mm256_store_ps(o, _mm256_fmadd_ps(e0, mv, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[c]), _mm256_mul_ps(d0, sv),
                                                                 _mm256_load_ps(o))));
    }
  }
}
#endif
#endif

// output features f0 .. f1 - 1 of W (their weight rows, row_bytes each, and their fp16 scales and
// minima, `groups` a row; mins may be null) into L2: the kernels read them a group of 16 or 8
// features at a time, which the hardware prefetcher does not follow
inline void prefetch_features(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, int64_t row_bytes,
                              int64_t groups, int64_t f0, int64_t f1) {
  const char* wp = reinterpret_cast<const char*>(qw + f0 * row_bytes);
  for (int64_t off = 0; off < (f1 - f0) * row_bytes; off += 64) __builtin_prefetch(wp + off, 0, 1);
  for (const uint16_t* a : {scales, mins}) {
    if (a == nullptr) continue;
    const char* p = reinterpret_cast<const char*>(a + f0 * groups);
    for (int64_t off = 0; off < (f1 - f0) * groups * 2; off += 64) __builtin_prefetch(p + off, 0, 1);
  }
}

#if defined(FASTGEN_A8_VNNI) && defined(__AVX512VL__)
#define FASTGEN_A8_FEW 1
// A few rows (decode batches): one output feature per vector lane instead of one row. The blocks
// above unpack every panel of W into a buffer of words through 8 x 8 transposes and read it back
// as broadcasts, whatever the rows: at 4-8 rows that was ~60% of the product (perf, Zen 4:
// SmolLM2's 120 layer products took ~9.4 ms at 4 rows and at 8). Here sixteen features' 16-byte
// groups are loaded into four registers and turned in registers into the group's four words of
// nibbles per feature (vpermt2d, vshufi64x2), masked into eight vectors of unsigned bytes, and
// each row's x is broadcast 4 bytes at a time from memory. Every (row, feature) takes the block
// kernels' operations in their order (exact int32 group sums, then per group a conversion, the
// FMA by dx * s, the FMA by dsum * m; the tile's silu and bias), so a row's output is the same
// bit for bit on either path.
#ifndef FEW_ROWS
#define FEW_ROWS 14
#endif
// at most this many rows a pass, the rows split evenly between the passes (16 = 8 + 8, 28 = 14 +
// 14): the W words are built once a group for all of a pass's rows (two passes of six took 1.15x
// the time of one of twelve), but a pass of 15 or 16 rows keeps more int32 chains and sums than
// the 32 vector registers hold, and the spilled chains doubled its time (Zen 4, SmolLM2's 120
// layer products from memory, passes of 16 against passes of at most 14 in one process, the same
// output bit for bit: 16 rows 13.0 against 8.3 ms, 32 rows 24.4 against 15.8)
constexpr int kFewRows = FEW_ROWS;
#ifndef FEW_MAX
#define FEW_MAX 32
#endif
// at most this many rows take this path, in passes of at most kFewRows (17-28 rows in two, 29-32 in
// three; when passes were of 16, 17-32 rows in two: against the block
// kernels 0.67x the time at 20 rows, 0.79x at 24, 0.94x at 32)
constexpr int kFewMaxRows = FEW_MAX;
#ifndef FEW_AHEAD
#define FEW_AHEAD 2
#endif
constexpr int64_t kFewAhead = FEW_AHEAD;

// f(std::integral_constant<int, n>) for n in 1 .. N
template <int N, typename F>
inline void by_count(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return by_count<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// rows 0 .. m - 1 of x [m, k] rounded per group of 32 as quantize_block rounds them (the same
// division, rounding and int32 sums): xq [groups][m][32] int8, dx and dsum [groups][m]: a group's
// rows side by side, so that few_rows_panel reaches every row's bytes from one pointer by constant
// offsets (rows k bytes apart took a register a row and spilled address arithmetic: 0.87-0.97x the
// time at 2-32 rows this way).
// Not quantize_block itself: its layout pads a block to 32 rows and puts a row's words 128 bytes
// apart, so x no longer sat in L1 (k = 1,536: 48 KB against 12 KB at 8 rows); reading it measured
// 1.08-1.14x the time at 4-8 rows, 1.3x at one
template <typename T>
void quantize_rows_few(const T* x, int64_t m, int64_t k, int8_t* xq, float* dx, float* dsum) {
  const int64_t groups = k / 32;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 a = load16(x + r * k + g * 32), b = load16(x + r * k + g * 32 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
      const float d = amax > 0.f ? amax / 127.f : 1.f;
      const __m512 iv = _mm512_set1_ps(1.f / d);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, iv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + (g * m + r) * 32),
                          _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(qa)),
                                                  _mm512_cvtsepi32_epi8(qb), 1));
      dx[g * m + r] = d;
      dsum[g * m + r] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
}

// fp16 values [16 features][groups] (feature rows `groups` apart) -> fp32 [groups][16]
inline void features_by_group(const uint16_t* const* rows, int64_t groups, float* out, int64_t ld = 16) {
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t len = std::min<int64_t>(16, groups - g0);
    const __mmask16 mask = static_cast<__mmask16>((1u << len) - 1);
    __m512 v[16];
    for (int c = 0; c < 16; ++c) v[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, rows[c] + g0));
    transpose16(v);   // v[i]: group g0 + i, lane c = feature c
    // a constant trip count: with the variable one GCC spilled v and copied it out by rep movsq
    // (a tenth of the few-row path's time at 8 rows)
#pragma GCC unroll 16
    for (int64_t i = 0; i < 16; ++i)
      if (i < len) _mm512_storeu_ps(out + (g0 + i) * ld, v[i]);
  }
}

// dword `half * 4 + j` (j = 0..3) of sixteen features' group g (16 or 32 bytes a feature, the
// group's bytes at rows[c] + g * gbytes): four registers of four features' 16 bytes each, then
// lanes 0..7 from the first pair and 8..15 from the second (vpermt2d, vshufi64x2)
__attribute__((always_inline)) inline void group_words(const uint8_t* const* rows, int64_t at, __m512i* words) {
  const __m512i idx01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i idx23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  __m512i z[4];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q] + at)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + 1] + at)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + 2] + at)), 2);
    z[q] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + 3] + at)), 3);
  }
  const __m512i t01 = _mm512_permutex2var_epi32(z[0], idx01, z[1]), t23 = _mm512_permutex2var_epi32(z[0], idx23, z[1]);
  const __m512i u01 = _mm512_permutex2var_epi32(z[2], idx01, z[3]), u23 = _mm512_permutex2var_epi32(z[2], idx23, z[3]);
  words[0] = _mm512_shuffle_i64x2(t01, u01, 0x44), words[1] = _mm512_shuffle_i64x2(t01, u01, 0xEE);
  words[2] = _mm512_shuffle_i64x2(t23, u23, 0x44), words[3] = _mm512_shuffle_i64x2(t23, u23, 0xEE);
}

// the weight rows, fp16 scales and minima (null without) of sixteen features from f0; those past
// the first nc repeat feature f0 + nc - 1 (nc may be 0 or less: all of them do), their lanes never
// stored. The few-row path's panels and the lane kernel's halves of a panel
inline void feature_rows(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, int64_t row_bytes,
                         int64_t groups, int64_t f0, int nc, const uint8_t** wr, const uint16_t** sr,
                         const uint16_t** mr) {
  for (int c = 0; c < 16; ++c) {
    const int64_t f = f0 + std::min(c, nc - 1);
    wr[c] = qw + f * row_bytes, sr[c] = scales + f * groups, mr[c] = mins != nullptr ? mins + f * groups : nullptr;
  }
}

// group g of sixteen features (rows[c]: feature c's weight bytes; KIND 4: Q4 nibbles, 16 bytes a
// group, byte i holding weight i (low nibble) and 16 + i (high); KIND 8: int8, 32 bytes a group,
// taken as q + 128) as u[j]: weights 4j .. 4j + 3 of each feature, unsigned bytes, a feature a lane
template <int KIND>
__attribute__((always_inline)) inline void feature_words(const uint8_t* const* rows, int64_t g, __m512i* u) {
  if constexpr (KIND == 4) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i words[4];
    group_words(rows, g * 16, words);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      u[j] = _mm512_and_si512(words[j], m4), u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(words[j], 4), m4);
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    group_words(rows, g * 32, u);
    group_words(rows, g * 32 + 16, u + 4);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(u[j], flip);
  }
}

// the sixteen features' scales and minima as fp32 s, mn [groups][ld] (8-bit rows: q + 128 against
// x, so the minimum is -128 s, the block kernels' product)
inline void feature_scales(const uint16_t* const* sr, const uint16_t* const* mr, int kind, int64_t groups, float* s,
                           float* mn, int64_t ld) {
  features_by_group(sr, groups, s, ld);
  if (kind == 4) {
    features_by_group(mr, groups, mn, ld);
    return;
  }
  for (int64_t g = 0; g < groups; ++g)
    _mm512_storeu_ps(mn + g * ld, _mm512_mul_ps(_mm512_set1_ps(-128.f), _mm512_loadu_ps(s + g * ld)));
}

// one panel of sixteen features (rows[c]: feature c's weight bytes; KIND 4: Q4 nibbles, 16 bytes a
// group; KIND 8: int8, 32 bytes a group, taken as q + 128) against R rows of x: acc[r] lane c = the
// block kernels' fp32 sum for (row r, feature c). xq, dx, dsum: the pass's first row in
// quantize_rows_few's layout (m rows a group)
template <int KIND, int R>
__attribute__((always_inline)) inline void few_rows_panel(const uint8_t* const* rows, int64_t groups,
                                                          const float* sv, const float* mv, const int8_t* xq,
                                                          const float* dx, const float* dsum, int64_t m,
                                                          const char* const* ahead, __m512* acc) {
  constexpr int64_t kGroupBytes = KIND == 4 ? 16 : 32;
  // the sums in registers, stored once at the end (through acc, an __m512 pointer that may alias
  // the float arrays, each group's sums were stored and reloaded: 0.95-0.98x the time at 8-32 rows)
  __m512 sum[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (ahead[0] != nullptr) {   // a later panel's group g: 16 features' bytes, and its scales and minima
#pragma GCC unroll 8
      for (int l = 0; l < kGroupBytes / 4; ++l) __builtin_prefetch(ahead[0] + g * 16 * kGroupBytes + 64 * l, 0, 2);
      if (g % 2 == 0) {
        __builtin_prefetch(ahead[1] + g * 32, 0, 2);
        if (ahead[2] != nullptr) __builtin_prefetch(ahead[2] + g * 32, 0, 2);
      }
    }
    // u[j]: weights 4j .. 4j + 3 of the group, per feature, as unsigned bytes
    __m512i u[8];
    feature_words<KIND>(rows, g, u);
    const __m512 s = _mm512_loadu_ps(sv + g * 16), mn = _mm512_loadu_ps(mv + g * 16);
    // the rows' eight-deep vpdpbusd chains interleaved, one step of every row at a time: one row
    // after another, each chain's latency (~5 cycles a step) bound the loop (perf, AMX host: 8 rows
    // took the time of 4). Integer sums, so the same output bit for bit; SmolLM2's layer shapes at
    // 2-32 rows 0.81-0.96x the time, a forward of 8 decodes at 1,300 keys 0.94-0.955x.
    //
    // dp: i32 += w . (row r's four bytes at `at`, broadcast), the bytes as vpdpbusd's embedded
    // broadcast ({1to16}: one fused load and product, where GCC emitted a vpbroadcastd and a
    // vpdpbusd for _mm512_set1_epi32 of them: 64 more uops a group at 8 rows; 0.83-0.96x the time
    // at 2-32 rows this way, the same sums)
    auto dp = [&](__m512i& i32, __m512i w, int r, int at) {
      asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(i32) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(xq + (g * m + r) * 32 + at)));
    };
    __m512i i32[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) i32[r] = zeroed_si512(), dp(i32[r], u[0], r, 0);
#pragma GCC unroll 8
    for (int j = 1; j < 8; ++j)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) dp(i32[r], u[j], r, 4 * j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32[r]), _mm512_mul_ps(_mm512_set1_ps(dx[g * m + r]), s),
                                       sum[r]);
      sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(dsum[g * m + r]), mn, t);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = sum[r];
}

template <typename T>
void qgemm_a8_few(const T* x, const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, const float* bias,
                  T* y, int64_t m, int64_t n, int64_t k, int kind, bool silu) {
  const int64_t out_n = silu ? n / 2 : n, groups = k / 32, row_bytes = kind == 4 ? k / 2 : k;
  const int64_t panels = (out_n + 15) / 16;
  const int64_t npass = (m + kFewRows - 1) / kFewRows;   // passes of even size, at most kFewRows rows
  static thread_local std::vector<int8_t> xq_store;
  static thread_local std::vector<float> d_store;
  if (xq_store.size() < static_cast<size_t>(m * k)) xq_store.resize(m * k);
  if (d_store.size() < static_cast<size_t>(2 * m * groups)) d_store.resize(2 * m * groups);
  int8_t* xq = xq_store.data();
  float* dx = d_store.data();
  float* dsum = dx + m * groups;
  quantize_rows_few<T>(x, m, k, xq, dx, dsum);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> sm(4 * 16 * groups);   // scales, minima [groups][16]; the up half's after them
    for (int64_t pi = p0; pi < p1; ++pi) {
      const int64_t o0 = pi * 16;
      const int nc = static_cast<int>(std::min<int64_t>(16, out_n - o0));
      // the first panels of this task in one burst; then each panel's groups prefetch panel
      // pi + kFewAhead's groups as they go (a burst of a whole panel's lines at each panel's
      // start stalled the core: from memory 2.7x the time in cache at one row)
      if (pi == p0)
        for (int64_t a = 0; a < kFewAhead && pi + a < p1; ++a)
          for (int64_t half = 0; half < (silu ? 2 : 1); ++half) {
            const int64_t f0 = (pi + a) * 16 + half * out_n;
            prefetch_features(qw, scales, mins, row_bytes, groups, f0, std::min<int64_t>(f0 + 16, half * out_n + out_n));
          }
      const char* ahead[2][3] = {{nullptr, nullptr, nullptr}, {nullptr, nullptr, nullptr}};
      if (pi + kFewAhead < p1 && (pi + kFewAhead + 1) * 16 <= out_n)   // whole panels only
        for (int64_t half = 0; half < (silu ? 2 : 1); ++half) {
          const int64_t f0 = (pi + kFewAhead) * 16 + half * out_n;
          ahead[half][0] = reinterpret_cast<const char*>(qw + f0 * row_bytes);
          ahead[half][1] = reinterpret_cast<const char*>(scales + f0 * groups);
          ahead[half][2] = mins != nullptr ? reinterpret_cast<const char*>(mins + f0 * groups) : nullptr;
        }
      const uint8_t* wr[2][16];
      const uint16_t *sr[16], *mr[16];
      for (int64_t half = 0; half < (silu ? 2 : 1); ++half) {
        feature_rows(qw, scales, mins, row_bytes, groups, half * out_n + o0, nc, wr[half], sr, mr);
        float* sv = sm.data() + half * 32 * groups;
        feature_scales(sr, mr, kind, groups, sv, sv + 16 * groups, 16);
      }
      const __mmask16 cols = static_cast<__mmask16>((1u << nc) - 1);
      const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(cols, bias + o0) : _mm512_setzero_ps();
      for (int64_t ip = 0; ip < npass; ++ip) {
        const int64_t r0 = m * ip / npass;
        const int rn = static_cast<int>(m * (ip + 1) / npass - r0);
        __m512 acc[kFewRows], accu[kFewRows];
        static const char* const none[3] = {nullptr, nullptr, nullptr};
        auto panel = [&](auto kind_c, auto rows, int half, __m512* out) {
          few_rows_panel<decltype(kind_c)::value, decltype(rows)::value>(
              wr[half], groups, sm.data() + half * 32 * groups, sm.data() + half * 32 * groups + 16 * groups,
              xq + r0 * 32, dx + r0, dsum + r0, m, r0 == 0 ? ahead[half] : none, out);
        };
        auto run = [&](auto rows) {
          if (kind == 4) {
            panel(std::integral_constant<int, 4>{}, rows, 0, acc);
            if (silu) panel(std::integral_constant<int, 4>{}, rows, 1, accu);
          } else {
            panel(std::integral_constant<int, 8>{}, rows, 0, acc);
            if (silu) panel(std::integral_constant<int, 8>{}, rows, 1, accu);
          }
        };
        by_count<kFewRows>(rn, run);
        for (int r = 0; r < rn; ++r) {
          __m512 v = acc[r];
          if (silu) {   // silu_mul_tile's roundings, a vector at a time
            alignas(64) float gt[16], ut[16];
            _mm512_store_ps(gt, v);
            _mm512_store_ps(ut, accu[r]);
            silu_mul_tile<T, 1, 16>(gt, ut);
            v = _mm512_load_ps(gt);
          }
          const __m512 out = _mm512_add_ps(v, bv);
          const int64_t at = (r0 + r) * out_n + o0;
          if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(y + at, cols, out);
          else _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y) + at, cols, bf16_vec(out));
        }
      }
    }
  });
}

// Many rows with one output feature per vector lane (the few-row path's orientation) and x's
// four bytes as vpdpbusd's embedded broadcast, in tiles of 8 rows x 32 features (sixteen int32
// sums, two W vectors a step). The block kernels above hold a row per lane and broadcast W's
// words, one vpbroadcastd per feature and step: on Zen 4 those broadcasts take slots from the
// dot products (a loop of only the products and their operands: 2.6 against 3.3-3.4 G vpdpbusd a
// second with the roles turned; with the group's scaling 2.0 against 2.6-2.7). W's panels are
// unpacked once per chunk of rows into [group][step][32 features] words, their scales and
// minima into [group][32] fp32; x is quantized as for the block kernels (the same division,
// rounding and int32 sums), each row's group its 32 bytes, the rows of a group side by side.
// Every (row, feature) takes the very operations of the other paths in their order (exact int32
// group sums, then per group a conversion, the FMA by dx * s, the FMA by dsum * m; the silu and
// bias of the tile), so the output is the same bit for bit.
constexpr int kLaneRows = 8;   // rows a tile (16 int32 sums in registers; 10-12 rows spilled)
constexpr int kLaneFeatures = 32;

// features f0 .. f0 + nc - 1 of W (those past nc repeat the last one: their lanes are not
// stored) -> u [groups][8][32] words of unsigned bytes, s and mn [groups][32] fp32
void unpack_lanes(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, int kind, int64_t k, int64_t f0,
                  int nc, uint32_t* u, float* s, float* mn) {
  const int64_t groups = k / 32, row_bytes = kind == 4 ? k / 2 : k;
  for (int half = 0; half < 2; ++half) {   // sixteen features each
    const uint8_t* rows[16];
    const uint16_t *sr[16], *mr[16];
    feature_rows(qw, scales, mins, row_bytes, groups, f0 + 16 * half, nc - 16 * half, rows, sr, mr);
    for (int64_t g = 0; g < groups; ++g) {
      __m512i w[8];
      if (kind == 4) feature_words<4>(rows, g, w);
      else feature_words<8>(rows, g, w);
      for (int j = 0; j < 8; ++j) _mm512_store_si512(u + (g * 8 + j) * kLaneFeatures + 16 * half, w[j]);
    }
    feature_scales(sr, mr, kind, groups, s + 16 * half, mn + 16 * half, kLaneFeatures);
  }
}

// rows r0 .. r0 + R - 1, r0 a multiple of 8 (x in quantize_groups. lane layout: xq [tiles][groups][8][32], dx and dsum
// [tiles][groups][8]) x one unpacked panel -> out [R][32] fp32 sums
template <int R>
__attribute__((always_inline)) inline void lanes_tile(const uint32_t* u, const float* s, const float* mn,
                                                      const int8_t* xq, const float* dx, const float* dsum,
                                                      int64_t r0, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* xg = xq + ((r0 / kLaneRows) * groups + g) * 256;
    const float* dg = dx + ((r0 / kLaneRows) * groups + g) * 8;
    const float* eg = dsum + ((r0 / kLaneRows) * groups + g) * 8;
    const uint32_t* ug = u + g * 8 * kLaneFeatures;
    // x's bytes through _mm512_set1_epi32 and the sums as intrinsics' values (GCC broadcasts each
    // once for the two W vectors): with each sum an asm operand bound to i32[r][h] ("+v", the
    // bytes as the embedded {1to16}), the Zen 5 build (-march=znver5) kept i32 in memory and
    // stored every sum to the stack after each vpdpbusd, 128 stores of 64 bytes a group, and the
    // kernel ran at half the block kernels' rate (the Zen 4 build had not). The same integer sums.
    auto bx = [&](int r, int j) {   // row r's four bytes of step j, in every lane
      int32_t v;
      std::memcpy(&v, xg + r * 32 + 4 * j, 4);
      return _mm512_set1_epi32(v);
    };
    __m512i i32[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) i32[r][0] = _mm512_setzero_si512(), i32[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i w0 = _mm512_load_si512(ug + j * kLaneFeatures), w1 = _mm512_load_si512(ug + j * kLaneFeatures + 16);
      in_reg(w0), in_reg(w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i b = bx(r, j);
        i32[r][0] = _mm512_dpbusd_epi32(i32[r][0], w0, b), i32[r][1] = _mm512_dpbusd_epi32(i32[r][1], w1, b);
      }
    }
    const __m512 s0 = _mm512_load_ps(s + g * kLaneFeatures), s1 = _mm512_load_ps(s + g * kLaneFeatures + 16);
    const __m512 m0 = _mm512_load_ps(mn + g * kLaneFeatures), m1 = _mm512_load_ps(mn + g * kLaneFeatures + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dg[r]), e = _mm512_set1_ps(eg[r]);
      float* o = out + r * kLaneFeatures;
      const __m512 t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32[r][0]), _mm512_mul_ps(d, s0),
                                        g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(o));
      const __m512 t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32[r][1]), _mm512_mul_ps(d, s1),
                                        g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(o + 16));
      _mm512_store_ps(o, _mm512_fmadd_ps(e, m0, t0));
      _mm512_store_ps(o + 16, _mm512_fmadd_ps(e, m1, t1));
    }
  }
}

template <typename T>
void qgemm_a8_lanes(const T* x, const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, const float* bias,
                    T* y, int64_t m, int64_t n, int64_t k, int kind, bool silu) {
  const int64_t out_n = silu ? n / 2 : n, groups = k / 32, row_bytes = kind == 4 ? k / 2 : k;
  const int64_t ld = (m + MB8 - 1) / MB8 * MB8, blocks = ld / MB8;
  static thread_local std::vector<int8_t> xq_store;
  static thread_local std::vector<float> d_store;
  int8_t* xq = grown_aligned(xq_store, ld * k);
  float* dx = grown_aligned(d_store, 2 * ld * groups);
  float* dsum = dx + ld * groups;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) quantize_block(x, m, k, b * MB8, reinterpret_cast<int32_t*>(xq), dx, dsum, true);
  });
  const int64_t panels = (out_n + kLaneFeatures - 1) / kLaneFeatures;
  // rows in chunks whose quantized x stays in L2 while every panel passes over it (as the block
  // kernels': each chunk unpacks every panel again)
  // (640 KB against 2 MB and whole: level on Zen 4, 0.98-0.99x, x now read tile by tile in order)
  const int64_t chunk = std::max<int64_t>(kLaneRows, (640 * 1024) / (k + 8 * groups) / kLaneRows * kLaneRows);
  for (int64_t c0 = 0; c0 < m; c0 += chunk) {
    const int64_t c1 = std::min(m, c0 + chunk);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      // the unpacked panel (and its up half)
      const int64_t words = groups * 8 * kLaneFeatures, floats = 2 * groups * kLaneFeatures;
      std::vector<uint32_t> ubuf;
      std::vector<float> fbuf;
      uint32_t* u = grown_aligned(ubuf, (silu ? 2 : 1) * words);
      float* sm = grown_aligned(fbuf, (silu ? 2 : 1) * floats);
      alignas(64) float acc[kLaneRows * kLaneFeatures], accu[kLaneRows * kLaneFeatures];
      for (int64_t pi = p0; pi < p1; ++pi) {
        const int64_t o0 = pi * kLaneFeatures;
        const int nc = static_cast<int>(std::min<int64_t>(kLaneFeatures, out_n - o0));
        if (pi + 1 < p1)   // the next panel's rows into L2 (unpacking reads 16 rows a group at a time)
          for (int64_t half = 0; half < (silu ? 2 : 1); ++half) {
            const int64_t f0 = (pi + 1) * kLaneFeatures + half * out_n;
            prefetch_features(qw, scales, mins, row_bytes, groups, f0,
                              std::min<int64_t>(f0 + kLaneFeatures, half * out_n + out_n));
          }
        for (int64_t half = 0; half < (silu ? 2 : 1); ++half)
          unpack_lanes(qw, scales, mins, kind, k, half * out_n + o0, nc, u + half * words, sm + half * floats,
                       sm + half * floats + groups * kLaneFeatures);
        const __mmask16 cols0 = static_cast<__mmask16>(nc >= 16 ? 0xFFFF : (1u << nc) - 1);
        const __mmask16 cols1 = static_cast<__mmask16>(nc <= 16 ? 0 : nc >= 32 ? 0xFFFF : (1u << (nc - 16)) - 1);
        const __m512 b0v = bias != nullptr ? _mm512_maskz_loadu_ps(cols0, bias + o0) : _mm512_setzero_ps();
        const __m512 b1v = bias != nullptr && cols1 ? _mm512_maskz_loadu_ps(cols1, bias + o0 + 16) : _mm512_setzero_ps();
        for (int64_t r0 = c0; r0 < c1; r0 += kLaneRows) {
          const int rn = static_cast<int>(std::min<int64_t>(kLaneRows, c1 - r0));
          by_count<kLaneRows>(rn, [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            lanes_tile<R>(u, sm, sm + groups * kLaneFeatures, xq, dx, dsum, r0, groups, acc);
            if (silu)
              lanes_tile<R>(u + words, sm + floats, sm + floats + groups * kLaneFeatures, xq, dx, dsum, r0, groups,
                            accu);
          });
          for (int r = 0; r < rn; ++r) {
            if (silu) silu_mul_tile<T, 1, kLaneFeatures>(acc + r * kLaneFeatures, accu + r * kLaneFeatures);
            const int64_t at = (r0 + r) * out_n + o0;
            const __m512 v0 = _mm512_add_ps(_mm512_load_ps(acc + r * kLaneFeatures), b0v);
            const __m512 v1 = _mm512_add_ps(_mm512_load_ps(acc + r * kLaneFeatures + 16), b1v);
            if constexpr (std::is_same_v<T, float>) {
              _mm512_mask_storeu_ps(y + at, cols0, v0);
              if (cols1) _mm512_mask_storeu_ps(y + at + 16, cols1, v1);
            } else {
              _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y) + at, cols0, bf16_vec(v0));
              if (cols1) _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(y) + at + 16, cols1, bf16_vec(v1));
            }
          }
        }
      }
    });
  }
}
#endif

// Which kernel takes qgemm_a8's rows past the few-row path on AVX-512 hosts: the lane kernel
// (on) or the block kernels. Their outputs are the same bit for bit, their speed is the host's:
// on the Zen 4 host the lane kernel took 0.926x the block kernels' time over a 2,048-token prefill,
// on the Zen 5 host 0.97-1.03x (and twice their time while that build kept its sums in memory:
// lanes_tile), so the engine measures both once per host and model (fastgen/row_limits.py) and
// sets this. FASTGEN_A8_LANES=0 sends the rows to the block kernels whatever it holds (A/B
// measurements; read at each call).
std::atomic<bool>& a8_lanes_switch() {
  static std::atomic<bool> on{true};
  return on;
}

bool a8_lanes_on() {
  const char* v = std::getenv("FASTGEN_A8_LANES");
  if (v && v[0] == '0') return false;
  return a8_lanes_switch().load(std::memory_order_relaxed);
}

template <typename T>
void qgemm_a8_impl(const T* x, const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, const float* bias,
                   T* y, int64_t m, int64_t n, int64_t k, int kind, bool silu) {
  // silu: [gate; up] rows, y = silu(gate) * up [m, n / 2], panels in pairs (as qgemm's)
#if defined(FASTGEN_A8_FEW)
  static const bool few_on = [] { const char* v = std::getenv("FASTGEN_A8_FEW"); return !(v && v[0] == '0'); }();
  if (m <= kFewMaxRows && few_on) {
    qgemm_a8_few<T>(x, qw, scales, mins, bias, y, m, n, k, kind, silu);
    return;
  }
  // the lane kernel or the block kernels below, as measured for this host (a8_lanes_on)
  if (a8_lanes_on()) {
    qgemm_a8_lanes<T>(x, qw, scales, mins, bias, y, m, n, k, kind, silu);
    return;
  }
#endif
  const int64_t out_n = silu ? n / 2 : n;
  const int64_t groups = k / 32, blocks = (m + MB8 - 1) / MB8, panels = (out_n + NR8 - 1) / NR8;
  const int64_t row_bytes8 = kind == 4 ? k / 2 : k;
  constexpr int64_t kPanelsAhead = 2;
  const int64_t block_words = (k / 4) * MB8, block_groups = groups * MB8;
  // x quantized once, into buffers this thread keeps and only grows (as qgemm's repacked x)
  static thread_local std::vector<int32_t> xa_store;
  static thread_local std::vector<float> dx_store;
  int32_t* xa = grown_aligned(xa_store, blocks * block_words);
  float* dx = grown_aligned(dx_store, 2 * blocks * block_groups);
  float* dsum = dx + blocks * block_groups;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_block(x, m, k, b * MB8, xa + b * block_words, dx + b * block_groups, dsum + b * block_groups);
  });
  // rows in chunks whose quantized x stays in L2 while every panel passes over it (all 2,048 rows
  // of a prompt at once: 1.1x qgemm's rate, against 1.2-1.35x at 256 rows); each chunk unpacks
  // every panel again, so as large as L2 allows: 640 KB against 256 KB, SmolLM2's four layer
  // products at 384 rows 0.90x the time, at 512 rows 0.94x (Zen 5, 1 MB L2 a core)
  const int64_t chunk_blocks = std::max<int64_t>(1, (640 * 1024) / (block_words * 4 + block_groups * 8));
  for (int64_t c0 = 0; c0 < blocks; c0 += chunk_blocks) {
    const int64_t c1 = std::min(blocks, c0 + chunk_blocks);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<uint32_t> u(static_cast<size_t>(NR8) * k / 4), uu(silu ? static_cast<size_t>(NR8) * k / 4 : 0);
      std::vector<float> sm(static_cast<size_t>(2 * NR8) * groups), smu(silu ? 2 * NR8 * groups : 0);
      alignas(64) float acc[NR8 * MB8], accu[NR8 * MB8];
      auto multiply = [&](int64_t b, const uint32_t* panel, const float* psm, float* out) {
        const int64_t at = b * block_groups;
#if defined(FASTGEN_A8_AVX2)
        micro_a8_avx2(xa + b * block_words, dx + at, dsum + at, panel, psm, psm + NR8 * groups, groups,
                      m - b * MB8 > 16 ? MB8 : 16, out);
#else
        if (HM8 > 1 && m - b * MB8 > 16)
          micro_a8<HM8>(xa + b * block_words, dx + at, dsum + at, panel, psm, psm + NR8 * groups, groups, out);
#if defined(FASTGEN_A8_8ROWS)
        else if (m - b * MB8 <= 8)
          micro_a8_8rows(xa + b * block_words, dx + at, dsum + at, panel, psm, psm + NR8 * groups, groups, out);
#endif
        else
          micro_a8<1>(xa + b * block_words, dx + at, dsum + at, panel, psm, psm + NR8 * groups, groups, out);
#endif
      };
      for (int64_t pi = p0; pi < p1; ++pi) {
        const int64_t o0 = pi * NR8;
        const int nc = static_cast<int>(std::min<int64_t>(NR8, out_n - o0));
        // panels pi + 1 .. pi + kPanelsAhead (at this task's first panel all of them, after it the
        // farthest only) into L2: the unpacking reads its 8 rows a group at a time, which the
        // hardware prefetcher does not follow (vectorised unpacking alone from memory: 1.17x the
        // time at 16 rows; with this 0.79-0.86x at 16 rows, 0.84-0.91x at 32-64, level at 256)
        for (int64_t a = pi == p0 ? 1 : kPanelsAhead; a <= kPanelsAhead && pi + a < p1; ++a)
          for (int64_t half = 0; half < (silu ? 2 : 1); ++half) {
            const int64_t f0 = (pi + a) * NR8 + half * out_n;
            prefetch_features(qw, scales, mins, row_bytes8, groups, f0, std::min<int64_t>(f0 + NR8, half * out_n + out_n));
          }
        unpack_panel(qw, scales, mins, kind, k, o0, nc, u.data(), sm.data(), sm.data() + NR8 * groups);
        if (silu) unpack_panel(qw, scales, mins, kind, k, out_n + o0, nc, uu.data(), smu.data(), smu.data() + NR8 * groups);
        for (int64_t b = c0; b < c1; ++b) {
          multiply(b, u.data(), sm.data(), acc);
          if (silu) {
            multiply(b, uu.data(), smu.data(), accu);
            silu_mul_tile<T, NR8, MB8>(acc, accu);
          }
          store_tile<T, NR8, MB8>(acc, m, nc, y, out_n, b * MB8, o0, bias);
        }
      }
    });
  }
}
#endif

at::Tensor qgemm_a8(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& mins, int64_t kind, const c10::optional<at::Tensor>& bias,
                    bool silu_mul) {
  TORCH_CHECK(kHaveA8, "qgemm_a8 needs AVX512-VNNI or AVX2 (torch.ops.fastgen.a8_kinds())");
  TORCH_CHECK(x.dim() == 2 && qw.dim() == 2, "qgemm_a8: x [m, k], qw [n, k/2 or k]");
  const int64_t m = x.size(0), k = x.size(1), n = qw.size(0);
  const QuantRowsPtrs qp = check_quant_rows("qgemm_a8", qw, scales, mins, kind, k);
  const at::Tensor bf = gemm_bias("qgemm_a8", bias, n, silu_mul);
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, silu_mul ? n / 2 : n}, xc.options());
  if (m == 0) return y;
  if (k == 0) {   // an empty sum: the bias (silu_mul takes none: silu(0) * 0)
    y.copy_(bf.defined() ? bf.unsqueeze(0).expand({m, n}) : at::zeros({m, silu_mul ? n / 2 : n}, xc.options()));
    return y;
  }
#if defined(FASTGEN_A8_AVX2)
  TORCH_CHECK(kind == 4, "qgemm_a8 on an AVX2 host takes 4-bit rows only (torch.ops.fastgen.a8_kinds())");
#endif
#if defined(FASTGEN_A8_VNNI) || defined(FASTGEN_A8_AVX2)
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  AT_DISPATCH_SWITCH(xc.scalar_type(), "qgemm_a8",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        qgemm_a8_impl<float>(xc.data_ptr<float>(), qw.data_ptr<uint8_t>(), qp.scales, qp.mins, bp,
                             y.data_ptr<float>(), m, n, k, static_cast<int>(kind), silu_mul); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        qgemm_a8_impl<at::BFloat16>(xc.data_ptr<at::BFloat16>(), qw.data_ptr<uint8_t>(), qp.scales, qp.mins, bp,
                                    y.data_ptr<at::BFloat16>(), m, n, k, static_cast<int>(kind), silu_mul); }));
#endif
  return y;
}

// whether this build has the lane kernel (AVX-512 VNNI hosts), which set_a8_lanes chooses
bool have_a8_lanes() {
#if defined(FASTGEN_A8_FEW)
  return true;
#else
  return false;
#endif
}

// the lane kernel (on) or the block kernels for qgemm_a8's many rows in this process, where the
// build has both; returns the prior choice
bool set_a8_lanes(bool on) { return a8_lanes_switch().exchange(on); }

// whether qgemm_a8's many rows take the lane kernel now (FASTGEN_A8_LANES=0 included)
bool a8_lanes() { return have_a8_lanes() && a8_lanes_on(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def("qgemm_a8(Tensor x, Tensor qw, Tensor scales, Tensor? mins, int kind, Tensor? bias=None, "
        "bool silu_mul=False) -> Tensor");
  m.def("have_a8_lanes() -> bool");
  m.def("set_a8_lanes(bool on) -> bool");
  m.def("a8_lanes() -> bool");
}

TORCH_LIBRARY_IMPL(fastgen, CompositeExplicitAutograd, m) {
  m.impl("have_a8_lanes", &have_a8_lanes);
  m.impl("set_a8_lanes", &set_a8_lanes);
  m.impl("a8_lanes", &a8_lanes);
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) {
  m.impl("qgemm_a8", &qgemm_a8);
}
