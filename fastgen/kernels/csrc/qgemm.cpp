// y = x @ W.T for W quantized in groups of 32 along k (fastgen.model.quant.QuantRows: GGUF's
// Q4_0 / Q4_1 / Q8_0 as shipped, fastgen's int8 / int4), for MANY rows of x: prompt chunks
// and decode batches. (qgemv in cpu_kernels.cpp streams W once for one or two rows.)
//
// W is never held dequantized. Each task takes a panel of NR = 12 output features,
// dequantizes it into a buffer of its own that stays in cache (12 x K values, each feature's
// contiguous: 14 KB in bf16 for K = 576) and multiplies it by every block of 32 rows of x,
// which was repacked once so that each step loads the block's values of one k (fp32) or one
// pair of k (bf16) as two vectors; the panel's weights are broadcast one at a time against
// them, 24 accumulators in registers (lane = row; transposed in registers when stored):
//   bf16 x (AVX512-BF16): vdpbf16ps (products of bf16 pairs, fp32 sums);
//   fp32 x (AVX512F):     FMA.
// The panel holds exactly the values the dense copy of earlier versions held (q * scale +
// min in fp32, rounded to bf16 for bf16 x), so prompt rows compute what they did, without the
// copy: for SmolLM2 as shipped, 540 MB less (its plain and oneDNN-packed bf16 copies), a
// resident model of 1.13x the file. Sums in fp32; y rounded once to x's dtype.
// Measured (Zen 5, one thread, SmolLM2's layer shapes): 12 features x 32 rows beat 8 x 48,
// 6 x 64 and 16 x 16 at 16-512 rows; 0.87-0.9x the rate of oneDNN on a packed bf16 copy for
// 64-512 rows, dequantizing included (fastgen.model.quant.QuantWeight).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "gemm_tile.h"
#include "quant_rows.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <memory>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#ifndef QGEMM_NR
#define QGEMM_NR 12
#endif
#ifndef QGEMM_HM
#define QGEMM_HM 2
#endif
constexpr int NR = QGEMM_NR;        // output features per panel (weights broadcast one at a time)
constexpr int HM = QGEMM_HM;        // vectors of 16 rows per block of x
constexpr int MB = 16 * HM;         // rows per block of x

// q * scale + min as two roundings, as QuantRows.dequantize() and gguf's dequantizer compute
// it (a fused multiply-add would differ in the last bit now and then)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// weight rows o0 .. o0 + nc - 1, dequantized (q * scale + min in fp32, then T's precision),
// into w [NR][k] of T (rows nc.. zero): each output feature's weights contiguous along k
template <typename T>
inline void dequant_rows(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, int kind, int64_t k,
                         int64_t o0, int nc, T* w) {
  const int64_t groups = k / 32, row_bytes = kind == 4 ? k / 2 : k;
  for (int c = 0; c < nc; ++c) {
    const uint8_t* wr = qw + (o0 + c) * row_bytes;
    const uint16_t* sc = scales + (o0 + c) * groups;
    const uint16_t* mn = mins != nullptr ? mins + (o0 + c) * groups : nullptr;
    T* out = w + static_cast<int64_t>(c) * k;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = half_to_float(sc[g]), m = mn != nullptr ? half_to_float(mn[g]) : 0.f;
      T* o = out + g * 32;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (kind == 4) {
        // the group's 16 possible values q * scale + min (q = 0..15) computed once, then each
        // nibble looks its value up (vpermps / vpermw): half the work of converting 32
        // nibbles; the same two roundings, so the same values
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                         _mm512_set1_ps(s)), _mm512_set1_ps(m));
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16));
        if constexpr (std::is_same_v<T, float>) {
          const __m512i b = _mm512_cvtepu8_epi32(bytes);
          _mm512_storeu_ps(o, _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), table));
          _mm512_storeu_ps(o + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table));
        } else {
          const __m512i words = _mm512_castsi256_si512(bf16_vec(table));
          const __m256i b = _mm256_cvtepu8_epi16(bytes);
          const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(0xF))),
                                                 _mm256_srli_epi16(b, 4), 1);
          _mm512_storeu_si512(o, _mm512_permutexvar_epi16(idx, words));
        }
        continue;
      }
      // 8-bit weights: 32 as two vectors of 16 (a scalar loop ran at ~2 cycles a weight)
      __m512 lo, hi;
      if (kind == 4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16)));
        lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
        hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      } else {
        const __m128i* src = reinterpret_cast<const __m128i*>(wr + g * 32);
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
      }
      const __m512 sv = _mm512_set1_ps(s), mv = _mm512_set1_ps(m);
      lo = _mm512_add_ps(_mm512_mul_ps(lo, sv), mv);
      hi = _mm512_add_ps(_mm512_mul_ps(hi, sv), mv);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(o, lo);
        _mm512_storeu_ps(o + 16, hi);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bf16_vec(lo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), bf16_vec(hi));
      }
#else
      float v[32];
      for (int i = 0; i < 16; ++i) {
        if (kind == 4) {
          v[i] = static_cast<float>(wr[g * 16 + i] & 0xF) * s + m;
          v[i + 16] = static_cast<float>(wr[g * 16 + i] >> 4) * s + m;
        } else {
          v[i] = static_cast<float>(static_cast<int8_t>(wr[g * 32 + i])) * s;
          v[i + 16] = static_cast<float>(static_cast<int8_t>(wr[g * 32 + 16 + i])) * s;
        }
      }
      for (int i = 0; i < 32; ++i) {
        if constexpr (std::is_same_v<T, float>) o[i] = v[i];
        else reinterpret_cast<uint16_t*>(o)[i] = to_bf16(v[i]);
      }
#endif
    }
  }
}

#pragma GCC pop_options

// a panel of `panel` output features (NR for the vector path, 32 for the tiles): nc dequantized,
// the rest zero
template <typename T>
inline void dequant_panel(const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, int kind, int64_t k,
                          int64_t o0, int nc, T* w, int panel = NR) {
  dequant_rows<T>(qw, scales, mins, kind, k, o0, nc, w);
  if (nc < panel) std::memset(static_cast<void*>(w + static_cast<int64_t>(nc) * k), 0, sizeof(T) * (panel - nc) * k);
}

// rows r0 .. r0 + MB - 1 of x [m, k] (rows past m zero) into a [k/2][MB] pairs of bf16 (bf16)
// or [k][MB] fp32: each micro-kernel step loads its rows' values as two vectors. Both are a
// transpose of 32-bit words (a bf16 pair or one fp32), done 16 x 16 in registers: the scalar
// loop's strided stores took 0.68 ms for 512 rows x 2048 (a quarter of Gemma 3's down
// projection, whose products then ran at 0.55x oneDNN's rate).
template <typename T>
inline void pack_x(const T* x, int64_t m, int64_t k, int64_t r0, T* a) {
  const int64_t words = std::is_same_v<T, float> ? k : k / 2;   // 32-bit words per row
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(x);
  uint32_t* as = reinterpret_cast<uint32_t*>(a);
#if defined(__AVX512F__)
  if (words % 16 == 0) {
    for (int h = 0; h < MB / 16; ++h) {
      const int64_t rows = std::clamp<int64_t>(m - r0 - 16 * h, 0, 16);
      for (int64_t j = 0; j < words; j += 16) {
        __m512 v[16];
        for (int r = 0; r < 16; ++r)
          v[r] = r < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(xs + (r0 + 16 * h + r) * words + j))
                          : _mm512_setzero_ps();
        transpose16(v);   // v[i]: word j + i of the 16 rows
        for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(as + (j + i) * MB + 16 * h), v[i]);
      }
    }
    return;
  }
#endif
  for (int r = 0; r < MB; ++r) {
    if (r0 + r < m)
      for (int64_t j = 0; j < words; ++j) as[j * MB + r] = xs[(r0 + r) * words + j];
    else
      for (int64_t j = 0; j < words; ++j) as[j * MB + r] = 0u;
  }
}

#if defined(__AVX512F__)
// What one micro-kernel step multiplies: FMA over one k of fp32 values, or vdpbf16ps over a
// pair of k of bf16 values (held as 32-bit words). x's block is [steps][MB], the panel
// [NR][steps], so a step loads its rows' values as vectors and broadcasts each weight.
struct Fp32Step {
  using Word = float;
  using Vec = __m512;
  static Vec load(const Word* p) { return _mm512_load_ps(p); }
  static Vec broadcast(Word w) { return _mm512_set1_ps(w); }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
};
#if defined(__AVX512BF16__)
struct Bf16PairStep {
  using Word = uint32_t;
  using Vec = __m512bh;
  static Vec load(const Word* p) { return (__m512bh)_mm512_load_si512(p); }
  static Vec broadcast(Word w) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(w)); }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// one block of MB rows x one panel: H vectors of 16 rows (fewer than HM only in the last
// block), NR output features, H * NR accumulators in registers; out [NR][MB] fp32
template <int H, typename S>
inline void micro(const typename S::Word* a, const typename S::Word* w, int64_t steps, float* out) {
  // named arrays, not acc[NR][H]: with H = 1 GCC kept that one in memory (a store per FMA)
  __m512 acc0[NR], acc1[NR], acc2[NR], acc3[NR];
  for (int c = 0; c < NR; ++c)
    acc0[c] = _mm512_setzero_ps(), acc1[c] = acc0[c], acc2[c] = acc0[c], acc3[c] = acc0[c];
  for (int64_t j = 0; j < steps; ++j) {
    const auto x0 = S::load(a + j * MB);
    const auto x1 = H > 1 ? S::load(a + j * MB + 16) : x0;
    const auto x2 = H > 2 ? S::load(a + j * MB + 32) : x0;
    const auto x3 = H > 3 ? S::load(a + j * MB + 48) : x0;
    for (int c = 0; c < NR; ++c) {
      const auto wv = S::broadcast(w[c * steps + j]);
      acc0[c] = S::madd(acc0[c], x0, wv);
      if (H > 1) acc1[c] = S::madd(acc1[c], x1, wv);
      if (H > 2) acc2[c] = S::madd(acc2[c], x2, wv);
      if (H > 3) acc3[c] = S::madd(acc3[c], x3, wv);
    }
  }
  for (int c = 0; c < NR; ++c) {
    _mm512_storeu_ps(out + c * MB, acc0[c]);
    if (H > 1) _mm512_storeu_ps(out + c * MB + 16, acc1[c]);
    if (H > 2) _mm512_storeu_ps(out + c * MB + 32, acc2[c]);
    if (H > 3) _mm512_storeu_ps(out + c * MB + 48, acc3[c]);
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 hosts: fp32 FMA on 8-lane vectors, the block in passes of 6 features x 16 rows (12
// accumulators, two x vectors and a broadcast: 15 of the 16 registers); h: the block's vectors of
// 16 rows that hold x (1 or 2). Before it these hosts took micro_generic at ~3 GFLOP/s.
inline void micro_avx2(const float* a, const float* w, int64_t k, int h, float* out) {
  static_assert(NR % 6 == 0 && MB % 16 == 0, "passes of 6 features x 16 rows");
  for (int f0 = 0; f0 < NR; f0 += 6) {
    for (int v0 = 0; v0 < 16 * h && v0 < MB; v0 += 16) {
      __m256 acc[6][2];
#pragma GCC unroll 6
      for (int c = 0; c < 6; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
      const float* wf = w + static_cast<int64_t>(f0) * k;
      for (int64_t j = 0; j < k; ++j) {
        const __m256 x0 = _mm256_load_ps(a + j * MB + v0), x1 = _mm256_load_ps(a + j * MB + v0 + 8);
#pragma GCC unroll 6
        for (int c = 0; c < 6; ++c) {
          const __m256 wv = _mm256_broadcast_ss(wf + c * k + j);
          acc[c][0] = _mm256_fmadd_ps(x0, wv, acc[c][0]);
          acc[c][1] = _mm256_fmadd_ps(x1, wv, acc[c][1]);
        }
      }
#pragma GCC unroll 6
      for (int c = 0; c < 6; ++c) {
        _mm256_storeu_ps(out + (f0 + c) * MB + v0, acc[c][0]);
        _mm256_storeu_ps(out + (f0 + c) * MB + v0 + 8, acc[c][1]);
      }
    }
  }
}
#endif

// f(std::integral_constant<int, H>) for H = h in 1..HM (the micro-kernels take H at compile time)
template <typename F>
inline void by_h(int h, F&& f) {
  if (h <= 1 || HM == 1) f(std::integral_constant<int, 1>{});
  else if (h == 2 || HM == 2) f(std::integral_constant<int, (HM >= 2 ? 2 : 1)>{});
  else if (h == 3 || HM == 3) f(std::integral_constant<int, (HM >= 3 ? 3 : 1)>{});
  else f(std::integral_constant<int, (HM >= 4 ? 4 : 1)>{});
}

// plain loops (no AVX512; bf16 without AVX512-BF16): correct, not fast
template <typename T>
inline void micro_generic(const T* a, const T* w, int64_t k, float* out) {
  for (int c = 0; c < NR; ++c)
    for (int r = 0; r < MB; ++r) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        // a is [k][MB] (fp32) or [k/2][MB] pairs (bf16)
        const T av = std::is_same_v<T, float> ? a[j * MB + r] : a[(j / 2) * MB * 2 + r * 2 + (j % 2)];
        s += static_cast<float>(av) * static_cast<float>(w[c * k + j]);
      }
      out[c * MB + r] = s;
    }
}

#if defined(FASTGEN_HAVE_AMX)
// ---------------------------------------------------------------------------------------
// bf16 rows on AMX tiles (tdpbf16ps: products of bf16 pairs summed in fp32, 16 x 16 x 32 a tile
// op). A task takes a panel of 32 output features, dequantizes it (dequant_rows: the values the
// other paths multiply) and lays it out as the B operand, pairs of k per feature, wv[k/2][32];
// then every block of 32 rows of x, read in place as the A operand (16 rows x 32 k a tile; the
// last few rows from a zero-padded copy), takes four tiles of sums (2 x 16 rows by 2 x 16
// features), stored row by row. Rows are taken amx_rows() at a time, so that that much of x
// stays in L2 while every panel passes over it (each panel is laid out once per call: see
// qgemm_amx). Measured (AMX host, SmolLM2's 120 layer products, each product's old and new
// kernels alternated): items taken by whichever thread is free and panels kept between passes
// took 1/1.13 of the time of a fixed split of the panels per pass at 2,048 rows, 1/1.06 at 512,
// 1/1.02 at 256; passes over 0.5 or 1.5 MB of x instead of 1 MB: level; 3 MB: 1.12x the time.
// (Computing y^T = W . x^T instead, with W's dequantized rows as A and no layout to make, took
// 1.15-1.3x the time from 128 rows: its sums need a transpose per block to be stored.)
constexpr int64_t kAmxPanel = 32;

// rows per pass over the panels: ~1 MB of x, 256 to 2,048 rows (SmolLM2: 896 rows at k = 576)
inline int64_t amx_rows(int64_t k) { return std::clamp<int64_t>((1 << 20) / (2 * k) / 32 * 32, 256, 2048); }

// w [32][k] bf16 (features' rows) -> wv [k/2][32] 32-bit words (pair i of feature c at i * 32 + c)
inline void amx_b_layout(const at::BFloat16* w, int64_t k, uint32_t* wv) {
  const uint32_t* ws = reinterpret_cast<const uint32_t*>(w);
  const int64_t words = k / 2;   // a multiple of 16: k is a multiple of 32
  for (int fb = 0; fb < 2; ++fb)
    for (int64_t j = 0; j < words; j += 16) {
      __m512 v[16];
      for (int c = 0; c < 16; ++c) v[c] = _mm512_castsi512_ps(_mm512_loadu_si512(ws + (16 * fb + c) * words + j));
      transpose16(v);   // v[i]: word j + i of features 16 fb .. 16 fb + 15
      for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(wv + (j + i) * kAmxPanel + 16 * fb), v[i]);
    }
}

// c [32][32] fp32 (rows by features) = 32 rows of x (bf16, ldx bytes apart) . the panel wv; tiles
// configured. The rows of x are loaded with the non-temporal hint (tileloaddt1): they pass once
// per panel while the panel (36 KB at k = 576) is read again for every block, and plain loads of
// the rows pushed it out of L1. Measured on the AMX host: a C loop of this step over 896 rows
// ran at 1.03-1.19x the time of the same tile products with no loads at all, against
// 1.51-1.65x with plain loads; SmolLM2's 120 layer products, each product's two kernels
// alternated, 1/1.12 of the time at 256-2,048 rows, 1/1.05 at 64. (The same hint on either
// operand of the prompt attention's tiles made it 1.03-1.13x slower.)
inline void amx_block(const at::BFloat16* x, int64_t ldx, const uint32_t* wv, int64_t k, float* c) {
  amx_zero_2x2();
  const char* x0 = reinterpret_cast<const char*>(x);
  const char* x1 = x0 + 16 * ldx;
  for (int64_t kk = 0; kk < k; kk += 32) {
    const uint32_t* b = wv + (kk / 2) * kAmxPanel;
    amx_step_2x2<true>(x0 + kk * 2, x1 + kk * 2, ldx, b, b + 16, kAmxPanel * 4);
  }
  amx_store_2x2(c, c + 16, c + 16 * kAmxPanel, c + 16 * kAmxPanel + 16, kAmxPanel * 4);
}

void qgemm_amx(const at::BFloat16* x, const uint8_t* qw, const uint16_t* scales, const uint16_t* mins,
               const float* bias, at::BFloat16* y, int64_t m, int64_t n, int64_t k, int kind, bool silu) {
  const int64_t out_n = silu ? n / 2 : n;
  const int64_t panels = (out_n + kAmxPanel - 1) / kAmxPanel;
  // the last block's rows past m read as zeros: a padded copy of that block, made once
  const int64_t full = m / 32 * 32;
  static thread_local std::vector<at::BFloat16> tail_store;
  if (full < m) {
    tail_store.assign(32 * k, at::BFloat16(0.f));
    std::memcpy(static_cast<void*>(tail_store.data()), x + full * k, 2 * (m - full) * k);
  }
  const at::BFloat16* tail = tail_store.data();
  // The work is (pass, panel) items in pass-major order, taken one at a time by whichever thread
  // is free (a thread slowed down by the host takes fewer: a fixed split left the faster thread
  // waiting), in one parallel region for every pass. With more than one pass each panel is laid
  // out once, by the thread that takes it in the first pass, into a buffer the later passes read
  // (ready[] says when; the item that fills it never waits, so nothing waits forever). That buffer
  // holds the product's weights in bf16 (3.5 MB for SmolLM2's gate/up) and stays with the calling
  // thread for its later calls; past 16 MB (a larger model's product) every item lays out its own.
  const int64_t pass = amx_rows(k), passes = (m + pass - 1) / pass, items = passes * panels;
  const int64_t panel_words = k / 2 * kAmxPanel, per_panel = silu ? 2 : 1;
  const bool keep = passes > 1 && panels * per_panel * panel_words * 4 <= (int64_t{16} << 20);
  static thread_local std::vector<uint32_t> kept_store;
  std::unique_ptr<std::atomic<uint8_t>[]> ready;
  if (keep) {
    const size_t need = static_cast<size_t>(panels * per_panel * panel_words) + 16;
    if (kept_store.size() < need) kept_store.resize(need);
    ready.reset(new std::atomic<uint8_t>[panels]);
    for (int64_t i = 0; i < panels; ++i) ready[i].store(0, std::memory_order_relaxed);
  }
  uint32_t* kept = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(kept_store.data()) + 63) & ~uintptr_t(63));
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    static thread_local std::vector<uint8_t> store;
    const size_t w_bytes = kAmxPanel * k * 2, need = 4 * w_bytes + 2 * 32 * 32 * 4 + 64 * 7;
    if (store.size() < need) store.resize(need);
    uint8_t* at_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
    auto carve = [&](size_t bytes) { uint8_t* p = at_; at_ += (bytes + 63) / 64 * 64; return p; };
    auto* w = reinterpret_cast<at::BFloat16*>(carve(w_bytes));
    auto* wu = reinterpret_cast<at::BFloat16*>(carve(w_bytes));
    auto* wv_own = reinterpret_cast<uint32_t*>(carve(w_bytes));
    auto* wvu_own = reinterpret_cast<uint32_t*>(carve(w_bytes));
    auto* acc = reinterpret_cast<float*>(carve(32 * 32 * 4));
    auto* accu = reinterpret_cast<float*>(carve(32 * 32 * 4));
    amx_configure();
    for (int64_t it = next.fetch_add(1, std::memory_order_relaxed); it < items;
         it = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t pi = it % panels, r_sb = it / panels * pass, r_end = std::min(m, r_sb + pass);
      const int64_t o0 = pi * kAmxPanel;
      const int nc = static_cast<int>(std::min<int64_t>(kAmxPanel, out_n - o0));
      uint32_t* wv = keep ? kept + pi * per_panel * panel_words : wv_own;
      uint32_t* wvu = keep ? wv + panel_words : wvu_own;
      if (!keep || r_sb == 0) {
        dequant_panel<at::BFloat16>(qw, scales, mins, kind, k, o0, nc, w, kAmxPanel);
        amx_b_layout(w, k, wv);
        if (silu) {
          dequant_panel<at::BFloat16>(qw, scales, mins, kind, k, out_n + o0, nc, wu, kAmxPanel);
          amx_b_layout(wu, k, wvu);
        }
        if (keep) ready[pi].store(1, std::memory_order_release);
      } else {
        while (ready[pi].load(std::memory_order_acquire) == 0) _mm_pause();
      }
      const __mmask16 lo = static_cast<__mmask16>(nc >= 16 ? 0xFFFF : (1u << nc) - 1);
      const __mmask16 hi = static_cast<__mmask16>(nc >= 32 ? 0xFFFF : nc <= 16 ? 0 : (1u << (nc - 16)) - 1);
      const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(lo, bias + o0) : _mm512_setzero_ps();
      const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(hi, bias + o0 + 16) : _mm512_setzero_ps();
      for (int64_t r0 = r_sb; r0 < r_end; r0 += 32) {
        const int64_t rows = std::min<int64_t>(32, m - r0);
        const at::BFloat16* a = r0 < full ? x + r0 * k : tail;
        amx_block(a, k * 2, wv, k, acc);
        if (silu) {
          amx_block(a, k * 2, wvu, k, accu);
          silu_mul_tile<at::BFloat16, 32, 32>(acc, accu);
        }
        for (int64_t r = 0; r < rows; ++r) {
          uint16_t* yr = reinterpret_cast<uint16_t*>(y) + (r0 + r) * out_n + o0;
          _mm256_mask_storeu_epi16(yr, lo, bf16_vec(_mm512_add_ps(_mm512_load_ps(acc + r * 32), b0)));
          if (hi) _mm256_mask_storeu_epi16(yr + 16, hi, bf16_vec(_mm512_add_ps(_mm512_load_ps(acc + r * 32 + 16), b1)));
        }
      }
    }
    amx_release();
  });
}
#endif

// silu: W is a fused gate/up product [gate; up] (n = 2I) and y = silu(gate) * up [m, I]: a task
// takes gate panel o0 and up panel I + o0 together and applies the activation to the pair of
// tiles before storing (the [m, 2I] product is never written: for SmolLM2's 500-row chunks the
// separate silu_mul read and wrote 4.5 MB per layer, 6.8% of a serving step)
template <typename T>
void qgemm_impl(const T* x, const uint8_t* qw, const uint16_t* scales, const uint16_t* mins, const float* bias, T* y,
                int64_t m, int64_t n, int64_t k, int kind, bool silu) {
#if defined(FASTGEN_HAVE_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (amx_usable() && k % 32 == 0) return qgemm_amx(x, qw, scales, mins, bias, y, m, n, k, kind, silu);
  }
#endif
  const int64_t out_n = silu ? n / 2 : n;
  const int64_t blocks = (m + MB - 1) / MB, panels = (out_n + NR - 1) / NR;
  // x repacked once (64-byte aligned: the micro-kernels' vector loads), into a buffer this
  // thread keeps and only grows: a fresh one per call (megabytes, hence fresh pages from the
  // system) took about 0.5 ms of page faults and zeroing for 512 rows x 2048
  static thread_local std::vector<uint8_t> xa_store;
  const size_t need = static_cast<size_t>(blocks) * MB * k * sizeof(T) + 64;
  if (xa_store.size() < need) xa_store.resize(need);
  T* xa = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(xa_store.data()) + 63) & ~uintptr_t(63));
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) pack_x<T>(x, m, k, b * MB, xa + b * MB * k);
  });
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<T> w(static_cast<size_t>(NR) * k), wu(silu ? static_cast<size_t>(NR) * k : 0);
    alignas(64) float acc[NR * MB], accu[NR * MB];
    auto multiply = [&](const T* a, const T* panel, int h, float* out) {
      if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        const auto* aw = reinterpret_cast<const uint32_t*>(a);
        const auto* ww = reinterpret_cast<const uint32_t*>(panel);
        by_h(h, [&](auto hh) { micro<decltype(hh)::value, Bf16PairStep>(aw, ww, k / 2, out); });
#else
        micro_generic<T>(a, panel, k, out);
#endif
      } else {
#if defined(__AVX512F__)
        by_h(h, [&](auto hh) { micro<decltype(hh)::value, Fp32Step>(a, panel, k, out); });
#elif defined(__AVX2__) && defined(__FMA__)
        micro_avx2(a, panel, k, h, out);
        for (int c = 0; h * 16 < MB && c < NR; ++c)   // rows the pass skipped: zero, as the others' padding
          std::memset(out + c * MB + 16 * h, 0, sizeof(float) * (MB - 16 * h));
#else
        micro_generic<T>(a, panel, k, out);
#endif
      }
    };
    for (int64_t pi = p0; pi < p1; ++pi) {
      const int64_t o0 = pi * NR;
      const int nc = static_cast<int>(std::min<int64_t>(NR, out_n - o0));
      dequant_panel<T>(qw, scales, mins, kind, k, o0, nc, w.data());
      if (silu) dequant_panel<T>(qw, scales, mins, kind, k, out_n + o0, nc, wu.data());
      for (int64_t b = 0; b < blocks; ++b) {
        const T* a = xa + b * MB * k;
        // vectors of 16 rows this block needs (fewer than HM only in the last block)
        const int h = static_cast<int>(std::min<int64_t>(HM, (m - b * MB + 15) / 16));
        multiply(a, w.data(), h, acc);
        if (silu) {
          multiply(a, wu.data(), h, accu);
          silu_mul_tile<T, NR, MB>(acc, accu);
        }
        store_tile<T, NR, MB>(acc, m, nc, y, out_n, b * MB, o0, bias);
      }
    }
  });
}

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& mins, int64_t kind, const c10::optional<at::Tensor>& bias,
                 bool silu_mul) {
  TORCH_CHECK(x.dim() == 2 && qw.dim() == 2, "qgemm: x [m, k], qw [n, k/2 or k]");
  const int64_t m = x.size(0), k = x.size(1), n = qw.size(0);
  const QuantRowsPtrs qp = check_quant_rows("qgemm", qw, scales, mins, kind, k);
  const at::Tensor bf = gemm_bias("qgemm", bias, n, silu_mul);
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, silu_mul ? n / 2 : n}, xc.options());
  if (m == 0) return y;
  AT_DISPATCH_SWITCH(xc.scalar_type(), "qgemm",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        qgemm_impl<float>(xc.data_ptr<float>(), qw.data_ptr<uint8_t>(), qp.scales, qp.mins, bp,
                          y.data_ptr<float>(), m, n, k, static_cast<int>(kind), silu_mul); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        qgemm_impl<at::BFloat16>(xc.data_ptr<at::BFloat16>(), qw.data_ptr<uint8_t>(), qp.scales,
                                 qp.mins, bp, y.data_ptr<at::BFloat16>(), m, n, k, static_cast<int>(kind),
                                 silu_mul); }));
  return y;
}

// rows ids of a quantized embedding [vocab, k], dequantized into [len(ids), k] of dtype's type:
// the values the dense embedding held (q * scale + min, rounded to dtype), without holding it
at::Tensor qembed(const at::Tensor& ids, const at::Tensor& qw, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& mins, int64_t kind, at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && qw.dim() == 2, "qembed: ids [t], qw [vocab, k/2 or k]");
  const int64_t vocab = qw.size(0), k = qw.size(1) * (kind == 4 ? 2 : 1), t = ids.size(0);
  const QuantRowsPtrs qp = check_quant_rows("qembed", qw, scales, mins, kind, k);
  at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < vocab, "qembed: token id ", ip[i], " outside the vocabulary of ", vocab);
  at::Tensor out = at::empty({t, k}, qw.options().dtype(dtype));
  AT_DISPATCH_SWITCH(dtype, "qembed",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        for (int64_t i = 0; i < t; ++i)
          dequant_rows<float>(qw.data_ptr<uint8_t>(), qp.scales, qp.mins, static_cast<int>(kind), k,
                              ip[i], 1, out.data_ptr<float>() + i * k); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        for (int64_t i = 0; i < t; ++i)
          dequant_rows<at::BFloat16>(qw.data_ptr<uint8_t>(), qp.scales, qp.mins, static_cast<int>(kind),
                                     k, ip[i], 1, out.data_ptr<at::BFloat16>() + i * k); }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def("qgemm(Tensor x, Tensor qw, Tensor scales, Tensor? mins, int kind, Tensor? bias=None, "
        "bool silu_mul=False) -> Tensor");
  m.def("qembed(Tensor ids, Tensor qw, Tensor scales, Tensor? mins, int kind, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) {
  m.impl("qgemm", &qgemm);
  m.impl("qembed", &qembed);
}
