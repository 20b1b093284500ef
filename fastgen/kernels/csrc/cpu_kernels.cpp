// fastgen's native CPU kernels: the small work around the weight products, fused, and
// attention that reads the KV block pool in place.
//
// Built once per host at first use (fastgen/kernels/__init__.py) with -O3 -march=native;
// plain loops written so that the compiler vectorises them (bf16 is widened to fp32 by a
// shift, all arithmetic is fp32). Registered as torch ops in the `fastgen` namespace.
//
// Layouts (see fastgen/cache/pool.py, fastgen/model/attention.py):
//   KV pool per layer  [num_blocks, block_size, num_kv_heads, head_dim]
//   q                  [T, H, D]  (flat ragged batch)
//   block_tables       [S, max_blocks] int32, q_starts [S + 1] int32, start_pos [S] int32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "fast_math.h"
#include "quant_rows.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t u = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// fp32 -> bf16 bits, round to nearest even, as c10::BFloat16 does for finite values; written
// with integer ops so that loops around it vectorise (the c10 constructor's NaN branch
// kept SiLU*up scalar: 900 us against 82 us for 256 x 1536)
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { reinterpret_cast<uint16_t*>(p)[i] = bf16_bits(v); }

// v rounded to T's precision and back (the eager ops round every intermediate to T)
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const uint32_t u = static_cast<uint32_t>(bf16_bits(v)) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
}

// ---------------------------------------------------------------------------------------
// rms_norm(x) * w, optionally after residual += x (then x is replaced by the normed sum).
template <typename T>
void rms_rows(T* x, T* residual, const T* w, int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [=](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * n;
      float ss = 0.f;
      if (residual != nullptr) {
        T* rr = residual + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          // the sum is rounded to the storage dtype, as the eager `x + y` is
          store(rr, i, load(rr, i) + load(xr, i));
          buf[i] = load(rr, i);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) buf[i] = load(xr, i);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(xr, i, buf[i] * inv * load(w, i));
    }
  });
}

// out = rms_norm(x) * w  (x untouched)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type());
  at::Tensor out = x.clone();
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rms_rows<float>(out.data_ptr<float>(), nullptr, w.data_ptr<float>(), x.size(0), x.size(1), eps); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rms_rows<at::BFloat16>(out.data_ptr<at::BFloat16>(), nullptr, w.data_ptr<at::BFloat16>(),
                               x.size(0), x.size(1), eps); }));
  return out;
}

// residual += x; x = rms_norm(residual) * w   (both in place)
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && w.is_contiguous());
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
              x.scalar_type() == w.scalar_type());
  AT_DISPATCH_SWITCH(x.scalar_type(), "add_rms_norm_",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rms_rows<float>(x.data_ptr<float>(), residual.data_ptr<float>(), w.data_ptr<float>(),
                        x.size(0), x.size(1), eps); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rms_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(),
                               w.data_ptr<at::BFloat16>(), x.size(0), x.size(1), eps); }));
}

// ---------------------------------------------------------------------------------------
// silu(gate) * up for gate_up = [T, 2I] (gate first) -> [T, I]
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// the first n <= 16 values of T as fp32 (the rest zero), and 16 fp32 rounded as store() and
// round_to<T> round them (bf16: bf16_bits' integer steps, so denormals and NaNs come out alike)
template <typename T>
inline __m512 load16_as_float(const T* p, __mmask16 n) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(n, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(n, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
inline __m512i bf16_bits16(__m512 v) {   // bf16_bits on 16 lanes, in the low halves of the words
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}
template <typename T>
inline __m512 round16_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
template <typename T>
inline void store16(T* p, __m512 v, __mmask16 n) {
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(p, n, v);
  else _mm256_mask_storeu_epi16(p, n, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
#endif

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  // scalars captured by value: a by-reference capture is reloaded after every store (it
  // might alias), which kept this loop scalar (330 us against 84 us for torch's two ops)
  at::parallel_for(0, rows, 4, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      // 16 lanes at a time, the last ones masked, with the ops of the fused gate/up tiles
      // (silu_mul_tile, gemm_tile.h; bf16 rounded by bf16_bits' integer steps, which keep
      // denormals): decode rows and prompt rows get the same SiLU, in fp32 too (the scalar loop
      // differed from the tiles in fp32's last bit: GCC contracts its ops into other FMAs). It
      // had stayed scalar in bf16: a decode row of SmolLM2 (1,536 values) 3.77 -> 1.82 us a call
      // on the 2-core Zen 4 host, the same bf16 values bit for bit (750k values checked).
      const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 n = inter - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (inter - i)) - 1);
        const __m512 gv = load16_as_float(g + i, n);
        const __m512 sv = round16_to<T>(_mm512_div_ps(gv, _mm512_add_ps(one, fast_exp16(_mm512_sub_ps(zero, gv)))));
        store16(o + i, _mm512_mul_ps(sv, load16_as_float(u + i, n)), n);
      }
#else
#if defined(__AVX2__) && defined(__FMA__)
      // AVX2 hosts, fp32: 8 lanes at a time (fast_math.h), as the fused gate/up tiles do; the
      // loop below had stayed scalar: a decode row of SmolLM2 (1,536 values) 3.63 -> 1.91 us a
      // call on the 2-core Zen 3 host
      if constexpr (std::is_same_v<T, float>) {
        silu_mul_f32_avx2(g, u, o, inter);
        continue;
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = load(g, i);
        // eager rounds silu(gate) to the storage dtype before the product
        const float s = round_to<T>(gv / (1.f + fast_exp(-gv)));
        store(o, i, s * load(u, i));
      }
#endif
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0);
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), gate_up.size(0), inter); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        silu_mul_rows<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                                    gate_up.size(0), inter); }));
  return out;
}

// ---------------------------------------------------------------------------------------
// argmax of each row of fp32 x [n, v] (greedy sampling): torch.argmax's answer, the first index
// of the largest value, or of the first NaN where a row holds one. torch's CPU argmax walks the
// row one value at a time: 30 us for SmolLM2's 49,152 logits, 516 us for 32 rows, against
// amax's 4.9 / 41 us on the 2-core Zen 5 host; this keeps 16 running maxima and their indices.
int64_t argmax_row(const float* x, int64_t v) {
  int64_t i = 0, best = 0;
  float bv = x[0];
#if defined(__AVX512F__)
  if (v >= 64) {
    // four sets of 16 lanes (independent compare chains), merged at the end
    __m512 mv[4];
    __m512i mi[4], cur[4];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi32(64);
    __mmask16 nan = 0;
    for (int s = 0; s < 4; ++s) {
      mv[s] = _mm512_loadu_ps(x + 16 * s);
      mi[s] = cur[s] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * s));
      nan |= _mm512_cmp_ps_mask(mv[s], mv[s], _CMP_UNORD_Q);
    }
    for (i = 64; i + 64 <= v && !nan; i += 64) {
      for (int s = 0; s < 4; ++s) {
        cur[s] = _mm512_add_epi32(cur[s], step);
        const __m512 xv = _mm512_loadu_ps(x + i + 16 * s);
        nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(xv, mv[s], _CMP_GT_OQ);   // strictly: a lane keeps its earliest
        mv[s] = _mm512_mask_mov_ps(mv[s], gt, xv);
        mi[s] = _mm512_mask_mov_epi32(mi[s], gt, cur[s]);
      }
    }
    if (nan) {   // torch: the first NaN wins
      for (int64_t j = 0; j < v; ++j)
        if (std::isnan(x[j])) return j;
    }
    for (int s = 1; s < 4; ++s) {   // per lane: the larger value, the smaller index on a tie
      const __mmask16 take = _mm512_cmp_ps_mask(mv[s], mv[0], _CMP_GT_OQ) |
                             (_mm512_cmp_ps_mask(mv[s], mv[0], _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(mi[s], mi[0]));
      mv[0] = _mm512_mask_mov_ps(mv[0], take, mv[s]);
      mi[0] = _mm512_mask_mov_epi32(mi[0], take, mi[s]);
    }
    bv = _mm512_reduce_max_ps(mv[0]);
    const __mmask16 at = _mm512_cmp_ps_mask(mv[0], _mm512_set1_ps(bv), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(at, mi[0]);   // the smallest index holding the maximum
  }
#elif defined(__AVX2__)
  if (v >= 32) {
    // AVX2 hosts: the same in four sets of 8 lanes (one row of 49,152 logits on Zen 3: 6.8 us,
    // against 78 us for the scalar loop below and 53 us for torch's argmax)
    __m256 mv[4];
    __m256i mi[4], cur[4];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(32);
    __m256 nan = _mm256_setzero_ps();
    for (int s = 0; s < 4; ++s) {
      mv[s] = _mm256_loadu_ps(x + 8 * s);
      mi[s] = cur[s] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * s));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(mv[s], mv[s], _CMP_UNORD_Q));
    }
    for (i = 32; i + 32 <= v && !_mm256_movemask_ps(nan); i += 32) {
      for (int s = 0; s < 4; ++s) {
        cur[s] = _mm256_add_epi32(cur[s], step);
        const __m256 xv = _mm256_loadu_ps(x + i + 8 * s);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(xv, mv[s], _CMP_GT_OQ);   // strictly: a lane keeps its earliest
        mv[s] = _mm256_blendv_ps(mv[s], xv, gt);
        mi[s] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(mi[s]), _mm256_castsi256_ps(cur[s]), gt));
      }
    }
    if (_mm256_movemask_ps(nan)) {   // torch: the first NaN wins
      for (int64_t j = 0; j < v; ++j)
        if (std::isnan(x[j])) return j;
    }
    for (int s = 1; s < 4; ++s) {   // per lane: the larger value, the smaller index on a tie
      const __m256 take = _mm256_or_ps(_mm256_cmp_ps(mv[s], mv[0], _CMP_GT_OQ),
                                       _mm256_and_ps(_mm256_cmp_ps(mv[s], mv[0], _CMP_EQ_OQ),
                                                     _mm256_castsi256_ps(_mm256_cmpgt_epi32(mi[0], mi[s]))));
      mv[0] = _mm256_blendv_ps(mv[0], mv[s], take);
      mi[0] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(mi[0]), _mm256_castsi256_ps(mi[s]), take));
    }
    bv = hmax8(mv[0]);
    // the smallest index holding the maximum: other lanes' indices pushed past any index
    const __m256 at = _mm256_cmp_ps(mv[0], _mm256_set1_ps(bv), _CMP_EQ_OQ);
    __m256i idx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX)),
                                                       _mm256_castsi256_ps(mi[0]), at));
    __m128i m4 = _mm_min_epi32(_mm256_castsi256_si128(idx), _mm256_extracti128_si256(idx, 1));
    m4 = _mm_min_epi32(m4, _mm_shuffle_epi32(m4, 0x4E));
    m4 = _mm_min_epi32(m4, _mm_shuffle_epi32(m4, 0xB1));
    best = _mm_cvtsi128_si32(m4);
  }
#endif
  for (; i < v; ++i) {   // the tail (or a short row): strictly greater, so the earliest stays
    if (std::isnan(x[i])) return i;
    if (x[i] > bv) bv = x[i], best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: x [n, v] fp32, v > 0");
  at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(0), v = xc.size(1);
  at::Tensor out = at::empty({n}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // one row stays on the calling thread (a parallel region costs more than ~3 us of scanning)
  at::parallel_for(0, n, n >= 4 ? 1 : n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * v, v);
  });
  return out;
}

// Greedy decoding's choice fused into a decode product (gemv_argmax, qgemv_argmax): each thread
// runs its share of the output rows a block at a time and takes the block's argmax (argmax_row,
// per row of x) while the outputs it just wrote are still in L1. After the product the head's
// logits were cold: its weight stream (SmolLM2: 113 MB in fp32, 28 MB in Q8_0) had pushed them
// out of every cache, and reading them back for the argmax cost a copy and a scan from memory
// (the engine's _sample: 160-270 us a batch-1 step on the Zen 3 host). The answer is
// torch.argmax's over the stored values (y rounded to its dtype): the first index of the largest
// value, or of the first NaN. A block is a multiple of 16 rows, so every row takes the kernel
// path (blocks of 16, pairs) it takes without the tracking, and gives the same bits.
constexpr int64_t kArgmaxBlock = 1024;

struct RowBest {
  float v = 0.f;
  int64_t i = -1;
  // `w` at index `j`, met after every index already taken
  void take(float w, int64_t j) {
    if (i < 0 || (!std::isnan(v) && (std::isnan(w) || w > v))) v = w, i = j;
  }
};

class ArgmaxTrack {
 public:
  explicit ArgmaxTrack(int64_t m) : m_(m) {}

  // body(b0, b1) writes y's columns [b0, b1) of every row; [n0, n1) is one thread's share
  template <typename T, typename Body>
  void run(int64_t n0, int64_t n1, const T* y, int64_t n, Body&& body) {
    std::vector<RowBest> mine(m_);
    float buf[kArgmaxBlock];
    for (int64_t b0 = n0; b0 < n1; b0 += kArgmaxBlock) {
      const int64_t b1 = std::min(n1, b0 + kArgmaxBlock);
      body(b0, b1);
      for (int64_t r = 0; r < m_; ++r) {
        const float* v = buf;
        if constexpr (std::is_same_v<T, float>) {
          v = y + r * n + b0;
        } else {
          for (int64_t j = b0; j < b1; ++j) buf[j - b0] = load(y, r * n + j);
        }
        const int64_t j = argmax_row(v, b1 - b0);
        mine[r].take(v[j], b0 + j);
      }
    }
    std::lock_guard<std::mutex> guard(mu_);
    shares_.emplace_back(n0, std::move(mine));
  }

  // the shares merged in the order of their rows: index and value per row of x
  void finish(int64_t* idx, float* best) {
    std::sort(shares_.begin(), shares_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (int64_t r = 0; r < m_; ++r) {
      RowBest all;
      for (const auto& share : shares_) all.take(share.second[r].v, share.second[r].i);
      idx[r] = all.i;
      best[r] = all.v;
    }
  }

 private:
  int64_t m_;
  std::mutex mu_;
  std::vector<std::pair<int64_t, std::vector<RowBest>>> shares_;
};

// ---------------------------------------------------------------------------------------
// One draw per row of logits [n, V] (fp32, the logits processors already applied): softmax at
// the row's temperature -> top-k -> top-p -> min-p -> an inverse-CDF draw with the row's uniform
// u: the steps and thresholds of fastgen/sampling.py's torch path (top-k's probabilities
// renormalised; the nucleus the fewest most likely tokens whose mass reaches top_p in fp32, ties
// kept; min-p against the largest probability; the draw the first index whose cumulative mass,
// in double, exceeds u times the total), in a few vectorised passes over the row where the torch
// path ran ~15 ops on [n, V] tensors and widened a top-k until it held the nucleus (SmolLM2's
// 49,152 logits, temperature 1, top_p 0.9: ~1 ms a row on Zen 3). The sums are taken in
// another order than torch's, so a draw can differ from the torch path's only where u lands
// within rounding of a boundary. -1 for a row with nothing to draw (a NaN, an infinite maximum,
// or a mass that is not a positive finite number), as the torch path's NO_TOKEN. top_k 0: off;
// top_p >= 1: off; min_p 0: off.
double sum_f64(const float* p, int64_t n) {
  double acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += p[j];
  return acc;
}

// zero every value below thr (NaN-free values); their sum after
inline float keep_at_least(float* p, int64_t v, float thr) {
  float kept = 0.f;
#pragma omp simd reduction(+ : kept)
  for (int64_t j = 0; j < v; ++j) {
    p[j] = p[j] >= thr ? p[j] : 0.f;
    kept += p[j];
  }
  return kept;
}

// The nucleus's smallest kept value among a[0, n): the largest t with the mass of the values >= t
// at least top_p (in fp32), by a three-way quickselect on mass; where all of a holds less than
// top_p, its smallest value
float nucleus_threshold(float* a, int64_t n, float top_p) {
  int64_t lo = 0, hi = n;
  double above = 0;   // the mass of the values already known to be kept, all greater than a[lo, hi)
  float smallest = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) smallest = std::min(smallest, a[j]);
  while (lo < hi) {
    const float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
    const float pv = std::max(std::min(x, y), std::min(std::max(x, y), z));   // median of three
    // [lo, gt) > pv, [gt, lt) == pv, [lt, hi) < pv
    int64_t gt = lo, i = lo, lt = hi;
    double mgt = 0, meq = 0;
    while (i < lt) {
      if (a[i] > pv) mgt += a[i], std::swap(a[i++], a[gt++]);
      else if (a[i] < pv) std::swap(a[i], a[--lt]);
      else meq += a[i++];
    }
    if (static_cast<float>(above + mgt) >= top_p) hi = gt;
    else if (static_cast<float>(above + mgt + meq) >= top_p) return pv;
    else above += mgt + meq, lo = lt;
  }
  return smallest;
}

int64_t sample_row(const float* logits, int64_t v, float temperature, int64_t top_k, float top_p, float min_p,
                   double u, std::vector<float>& p, std::vector<float>& cand, std::vector<double>& blocks) {
  p.resize(v);
  float* q = p.data();
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < v; ++j) {
    const float x = logits[j] / temperature;
    q[j] = x;
    nan |= x != x;
    m = std::max(m, x);
  }
  if (nan || !std::isfinite(m)) return -1;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < v; ++j) {
    // -inf (a token masked by a grammar or suppressed) is exactly 0, as torch's exp gives, where
    // fast_exp's clamp would give ~1e-38
    const float e = q[j] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(q[j] - m);
    q[j] = e;
    sum += e;
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = 0; j < v; ++j) q[j] *= inv;
  float pmax = inv;   // the largest value's exp(0) = 1, times inv
  if (top_k > 0 && top_k < v) {
    // the k-th largest probability: a min-heap of the k largest (most values fail one compare)
    cand.clear();
    for (int64_t j = 0; j < v; ++j) {
      if (static_cast<int64_t>(cand.size()) < top_k) {
        cand.push_back(q[j]);
        std::push_heap(cand.begin(), cand.end(), std::greater<float>());
      } else if (q[j] > cand.front()) {
        std::pop_heap(cand.begin(), cand.end(), std::greater<float>());
        cand.back() = q[j];
        std::push_heap(cand.begin(), cand.end(), std::greater<float>());
      }
    }
    const float kept = keep_at_least(q, v, cand.front()), rk = 1.f / kept;
#pragma omp simd
    for (int64_t j = 0; j < v; ++j) q[j] *= rk;
    pmax *= rk;
  }
  if (top_p < 1.f) {
    // the nucleus lies among the values >= c once those hold top_p of the mass: c falls from a
    // hundredth of the largest probability until they do (to 0: every value)
    for (float c = pmax * 1e-2f;; c = c > 1e-30f ? c * 1e-3f : 0.f) {
      cand.clear();
      double mass = 0;
      for (int64_t j = 0; j < v; ++j)
        if (q[j] >= c) cand.push_back(q[j]), mass += q[j];
      if (static_cast<float>(mass) >= top_p || c == 0.f) {
        keep_at_least(q, v, nucleus_threshold(cand.data(), static_cast<int64_t>(cand.size()), top_p));
        break;
      }
    }
  }
  if (min_p > 0.f) keep_at_least(q, v, min_p * pmax);
  // the draw: block sums, then the block where the running mass passes u * total, then its values
  constexpr int64_t kBlock = 512;
  const int64_t nb = (v + kBlock - 1) / kBlock;
  blocks.resize(nb);
  double total = 0;
  for (int64_t b = 0; b < nb; ++b) total += (blocks[b] = sum_f64(q + b * kBlock, std::min(kBlock, v - b * kBlock)));
  if (!(std::isfinite(total) && total > 0)) return -1;
  const double target = u * total;
  double acc = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (acc + blocks[b] <= target && b + 1 < nb) {
      acc += blocks[b];
      continue;
    }
    for (int64_t j = b * kBlock; j < std::min(v, (b + 1) * kBlock); ++j) {
      acc += q[j];
      if (acc > target) return j;
    }
    if (b + 1 == nb) break;
  }
  return v - 1;
}

// chosen [n] int64 (the rows' argmax) with rows [s] of it replaced by their draws from logits
// [n, V]; params [s, 4] fp32: temperature, top_k, top_p, min_p; u [s] fp64. A new tensor.
at::Tensor sample_rows(const at::Tensor& chosen, const at::Tensor& logits, const at::Tensor& rows,
                       const at::Tensor& params, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_rows: logits [n, v] fp32, v > 0");
  const int64_t n = logits.size(0), v = logits.size(1), s = rows.numel();
  TORCH_CHECK(chosen.dim() == 1 && chosen.size(0) == n && chosen.scalar_type() == at::kLong, "sample_rows: chosen [n] int64");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "sample_rows: rows [s] int64");
  TORCH_CHECK(params.dim() == 2 && params.size(0) == s && params.size(1) == 4 && params.scalar_type() == at::kFloat,
              "sample_rows: params [s, 4] fp32 (temperature, top_k, top_p, min_p)");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == s && u.scalar_type() == at::kDouble, "sample_rows: u [s] fp64");
  const at::Tensor lc = logits.contiguous(), rc = rows.contiguous(), pc = params.contiguous(), uc = u.contiguous();
  at::Tensor out = chosen.clone();
  const float* lp = lc.data_ptr<float>();
  const int64_t* rp = rc.data_ptr<int64_t>();
  const float* pp = pc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < s; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < n, "sample_rows: row ", rp[i], " out of [0, ", n, ")");
  at::parallel_for(0, s, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p, cand;
    std::vector<double> blocks;
    for (int64_t i = i0; i < i1; ++i) {
      const float* pr = pp + 4 * i;
      op[rp[i]] = sample_row(lp + rp[i] * v, v, pr[0], static_cast<int64_t>(pr[1]), pr[2], pr[3], up[i], p, cand, blocks);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// RoPE (rotate-half convention) of q and k from the fused QKV output, written as
// q [T, H, D] and k [T, KVH, D] (new tensors); rotated k and raw v are stored into the pool
// at `slots` (not where kpool is null: the 8-bit pool rounds them itself, rope_write_kv_i8).
// cos/sin: [max_positions, D] fp32 tables (halves equal), scaling folded in.
template <typename T>
void rope_rows(const T* qkv, const int64_t* pos, const float* cos, const float* sin,
               const int64_t* slots, T* q_out, T* k_out, T* kpool, T* vpool, int64_t tokens,
               int64_t h, int64_t kvh, int64_t d) {
  const int64_t width = (h + 2 * kvh) * d, half = d / 2;
  at::parallel_for(0, tokens, 8, [=](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = qkv + t * width;
      const float* c = cos + pos[t] * d;
      const float* s = sin + pos[t] * d;
      T* kdst = kpool != nullptr ? kpool + slots[t] * kvh * d : nullptr;
      for (int64_t head = 0; head < h + kvh; ++head) {
        const T* x = row + head * d;
        T* dst = head < h ? q_out + (t * h + head) * d : k_out + (t * kvh + head - h) * d;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = load(x, i), b = load(x, i + half);
          // eager: x * cos + swap(x) * signed_sin, each product rounded to T
          const float ac = round_to<T>(a * c[i]);
          const float bs = round_to<T>(b * s[i]);
          const float bc = round_to<T>(b * c[i + half]);
          const float as = round_to<T>(a * s[i + half]);
          store(dst, i, ac - bs);
          store(dst, i + half, bc + as);
        }
        if (head >= h && kdst != nullptr) std::memcpy(kdst + (head - h) * d, dst, d * sizeof(T));
      }
      if (vpool != nullptr) std::memcpy(vpool + slots[t] * kvh * d, row + (h + kvh) * d, kvh * d * sizeof(T));
    }
  });
}

// the checks both rope ops make of the step's tensors
void check_rope_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& slots, int64_t h, int64_t kvh, int64_t d) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (h + 2 * kvh) * d, "qkv must be [T, (H + 2 KVH) * D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(1) == d);
}

std::vector<at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& positions,
                                      const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& slots, at::Tensor& k_pool, at::Tensor& v_pool,
                                      int64_t h, int64_t kvh, int64_t d) {
  check_rope_args(qkv, positions, cos, sin, slots, h, kvh, d);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == qkv.scalar_type());
  at::Tensor x = qkv.contiguous();
  const int64_t tokens = x.size(0);
  at::Tensor q = at::empty({tokens, h, d}, x.options());
  at::Tensor k = at::empty({tokens, kvh, d}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "rope_write_kv",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rope_rows<float>(x.data_ptr<float>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                         sin.data_ptr<float>(), slots.data_ptr<int64_t>(), q.data_ptr<float>(),
                         k.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                         tokens, h, kvh, d); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rope_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), positions.data_ptr<int64_t>(),
                                cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(),
                                q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(),
                                k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
                                tokens, h, kvh, d); }));
  return {q, k};
}

// ---------------------------------------------------------------------------------------
// Paged attention over the block pool, read in place. Query i of sequence s sits at
// position start_pos[s] + (i - q_starts[s]) and attends causally to keys 0..position.
//
// Work items: for a single-query sequence (a decode), (sequence, kv head, key split): every
// query head sharing the kv head is computed while the keys are in L1 (GQA), and long
// contexts are split over the threads (flash-decoding), the partial softmaxes merged at the
// end. For a multi-query chunk, (sequence, kv head, tile of kQueryTile queries). Items run
// under OpenMP's dynamic schedule, since causal tiles differ in cost.
//
// Per key block (block_size keys, contiguous in the pool) an item widens K and V to fp32
// once. With few rows (decodes) it takes one dot product per key; with many rows (chunks)
// it transposes K to [d][block] so that each row's scores are a vectorised product over
// keys (no horizontal sums), then an online softmax and P.V over the block.
struct Partial {
  float m, l;
};

// The prompt chunks' keys and values for the AMX tiles are laid out in chunks of kAmxKeys keys
// (below). Defined on every host: paged_attention_impl addresses the layout whether or not the
// tiles are built (until 12-05's sixth session these sat inside the AMX block, and hosts
// without AMX could not build the kernels at all).
// 128 keys a chunk: 1.15-1.2x the rate of 64 (per-row reductions and the accumulators' tile loads
// and stores spread over twice the keys; 256 queries at 1,792 keys: 502 -> 574 GFLOP/s; 256 keys
// measured level, 12-05)
constexpr int64_t kAmxKeys = 128;

inline int64_t amx_chunk_words(int64_t d) { return kAmxKeys * d; }   // kw + vw, 32-bit words
// a packed chunk's 32-bit words for pool values of T: bf16 pairs as above; fp32 K^T [d][kAmxKeys]
// and V [kAmxKeys][d] as they are (attend_chunk_f32)
template <typename T>
inline int64_t chunk_words(int64_t d) { return std::is_same_v<T, float> ? 2 * kAmxKeys * d : amx_chunk_words(d); }
// a row's probabilities over a chunk, in 32-bit words: fp32 values (F32) or bf16 pairs
template <bool F32>
constexpr int64_t kProbWords = F32 ? kAmxKeys : kAmxKeys / 2;

constexpr int64_t kQueryTile = 32;
constexpr int64_t kManyRows = 8;

struct Item {
  int64_t seq, kv, part, num_parts;  // part: key split (decode) or query tile (chunk)
};

#if defined(__AVX512F__)
// Four rows at a time, so that eight (QK) or sixteen (PV) independent FMA chains hide the
// FMA latency; one row at a time is latency-bound (measured 47 against 80 GFLOP/s for the
// per-key dot products, which at least overlap across keys).
// sc[r][jb .. jb + 16 NK) = q[r][d] . kt[d][jb .. jb + 16 NK) for rows r = 0..3, kt's and sc's
// rows ld apart: 4 NK FMA chains, each K vector held in a register (in_reg)
template <int NK>
inline void qk4_keys(const float* q, int64_t d, const float* kt, int64_t ld, int64_t jb, float* sc) {
  __m512 a[4][NK];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NK; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m512 k[NK];
    for (int c = 0; c < NK; ++c) k[c] = _mm512_loadu_ps(kt + i * ld + jb + 16 * c), in_reg(k[c]);
    for (int r = 0; r < 4; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * d + i]);
      for (int c = 0; c < NK; ++c) a[r][c] = _mm512_fmadd_ps(qv, k[c], a[r][c]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < NK; ++c) _mm512_storeu_ps(sc + r * ld + jb + 16 * c, a[r][c]);
}

// sc[4][bs] = q[4][d] . kt[d][bs]   (bs % 32 == 0)
inline void qk4(const float* q, int64_t d, const float* kt, int64_t bs, float* sc) {
  for (int64_t jb = 0; jb < bs; jb += 32) qk4_keys<2>(q, d, kt, bs, jb, sc);
}

// acc[4][d] += p[4][bs] . vf[n][d]   (d % 64 == 0)
inline void pv4(const float* p, int64_t bs, int64_t n, const float* vf, int64_t d, float* acc) {
  for (int64_t ib = 0; ib < d; ib += 64) {
    __m512 a[4][4];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(acc + r * d + ib + 16 * c);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = vf + j * d + ib;
      __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16), v2 = _mm512_loadu_ps(vj + 32),
             v3 = _mm512_loadu_ps(vj + 48);
      in_reg(v0), in_reg(v1), in_reg(v2), in_reg(v3);
      for (int r = 0; r < 4; ++r) {
        const __m512 pv = _mm512_set1_ps(p[r * bs + j]);
        a[r][0] = _mm512_fmadd_ps(pv, v0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(pv, v1, a[r][1]);
        a[r][2] = _mm512_fmadd_ps(pv, v2, a[r][2]);
        a[r][3] = _mm512_fmadd_ps(pv, v3, a[r][3]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * d + ib + 16 * c, a[r][c]);
  }
}
constexpr bool kHaveBlocked = true;

#if defined(__AVX512BF16__)
// bf16 products (vdpbf16ps: pairs of bf16 multiplied exactly, summed in fp32), half the
// instructions of the fp32 FMAs, for the prompt chunks' packed keys and values
// (attend_chunk_vec): V as pairs of keys, vw[bs/2][d]; P as pairs too.
// acc[4][d] += P[4] . V   (pw: [4][bs/2] pairs of bf16 probabilities; d % 64 == 0)
inline void pv4_bf16(const uint32_t* pw, int64_t bs, int64_t n, const uint32_t* vw, int64_t d, float* acc) {
  const int64_t pairs = (n + 1) / 2, half = bs / 2;
  for (int64_t ib = 0; ib < d; ib += 64) {
    __m512 a[4][4];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(acc + r * d + ib + 16 * c);
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      const uint32_t* vj = vw + j2 * d + ib;
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vj), v1 = (__m512bh)_mm512_loadu_si512(vj + 16),
                     v2 = (__m512bh)_mm512_loadu_si512(vj + 32), v3 = (__m512bh)_mm512_loadu_si512(vj + 48);
      for (int r = 0; r < 4; ++r) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r * half + j2]));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], pv, v0);
        a[r][1] = _mm512_dpbf16_ps(a[r][1], pv, v1);
        a[r][2] = _mm512_dpbf16_ps(a[r][2], pv, v2);
        a[r][3] = _mm512_dpbf16_ps(a[r][3], pv, v3);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * d + ib + 16 * c, a[r][c]);
  }
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 hosts: the same four-row blocks in 8-lane vectors, 16 keys (QK) or 16 values of d (PV) a
// pass: eight FMA chains and eleven of the sixteen registers
// sc[4][0 .. n) = q[4][d] . kt[d][0 .. n)   (n % 16 == 0; kt's and sc's rows ld apart)
inline void qk4_rows(const float* q, int64_t d, const float* kt, int64_t ld, int64_t n, float* sc) {
  for (int64_t jb = 0; jb < n; jb += 16) {
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      __m256 k0 = _mm256_loadu_ps(kt + i * ld + jb), k1 = _mm256_loadu_ps(kt + i * ld + jb + 8);
      in_reg(k0), in_reg(k1);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 qv = _mm256_broadcast_ss(q + r * d + i);
        a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]), a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r)
      _mm256_storeu_ps(sc + r * ld + jb, a[r][0]), _mm256_storeu_ps(sc + r * ld + jb + 8, a[r][1]);
  }
}
// sc[4][bs] = q[4][d] . kt[d][bs]   (bs % 32 == 0)
inline void qk4(const float* q, int64_t d, const float* kt, int64_t bs, float* sc) { qk4_rows(q, d, kt, bs, bs, sc); }

// acc[4][d] += p[4][bs] . vf[n][d]   (d % 64 == 0)
inline void pv4(const float* p, int64_t bs, int64_t n, const float* vf, int64_t d, float* acc) {
  for (int64_t ib = 0; ib < d; ib += 16) {
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r)
      a[r][0] = _mm256_loadu_ps(acc + r * d + ib), a[r][1] = _mm256_loadu_ps(acc + r * d + ib + 8);
    for (int64_t j = 0; j < n; ++j) {
      __m256 v0 = _mm256_loadu_ps(vf + j * d + ib), v1 = _mm256_loadu_ps(vf + j * d + ib + 8);
      in_reg(v0), in_reg(v1);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 pv = _mm256_broadcast_ss(p + r * bs + j);
        a[r][0] = _mm256_fmadd_ps(pv, v0, a[r][0]), a[r][1] = _mm256_fmadd_ps(pv, v1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r)
      _mm256_storeu_ps(acc + r * d + ib, a[r][0]), _mm256_storeu_ps(acc + r * d + ib + 8, a[r][1]);
  }
}
// one row's online softmax over a block of 32 keys it sees whole, in registers: sc[0..32) (scaled
// scores) become the probabilities, the row's accumulator ar[d] and (max, sum) take the
// correction; the values of softmax_update's loops (the same fast_exp steps), without its masks
inline void softmax_block32_avx2(Partial& ml, float* ar, int64_t d, float* sc) {
  __m256 s[4];
  for (int i = 0; i < 4; ++i) s[i] = _mm256_loadu_ps(sc + 8 * i);
  const __m256 m2 = _mm256_max_ps(_mm256_max_ps(s[0], s[1]), _mm256_max_ps(s[2], s[3]));
  const float mx = std::max(ml.m, hmax8(m2));
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 l = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    const __m256 pv = fast_exp8(_mm256_sub_ps(s[i], mv));
    _mm256_storeu_ps(sc + 8 * i, pv);
    l = _mm256_add_ps(l, pv);
  }
  float corr = 1.f;
  if (mx != ml.m) {   // else the correction is exactly 1: skipped
    corr = fast_exp(ml.m - mx);
    const __m256 cv = _mm256_set1_ps(corr);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(ar + i, _mm256_mul_ps(_mm256_loadu_ps(ar + i), cv));
    for (; i < d; ++i) ar[i] *= corr;
  }
  ml = Partial{mx, ml.l * corr + hsum8(l)};
}

// One decode's R query heads (R <= 4; rows of qf [R][d], scaled) against keys [from, visible) of
// one block of an fp32 pool, read in place (key j's row at kb + j * stride, its value's at vb +
// j * stride): an online-softmax step of each row's (max, sum) ml[r] and accumulator acc[r][d].
// For AVX2 hosts, where a decode took attend_item's per-key path (the block widened into a copy,
// then one dot product, one exp and one row update per key and head: ~80 ns a key for SmolLM2's
// 9 heads on two Zen 3 threads; ~31 ns now, keys in cache). Here a key's R partial dot products
// (two FMA chains a row, the key's vectors shared) are reduced together by three vhaddps into its
// R scores, kept as [key][4]; the softmax runs on two keys' four rows a vector (each lane one
// row's); the values are accumulated W vectors of d a pass over the keys, 8-12 FMA chains (16 of
// d a pass, 2-8 chains, left the loop waiting on FMA latency). Prefetches: each key's value row
// and the key row four on into L1 (16 MB of blocks in L3: 17 -> 26 M keys/s for 8 decodes at
// 1,300 keys). The next block's rows were prefetched into L2 as well, key by key; without them
// (the same output bit for bit, Zen 3, 12-07, three runs alternating the two, 8 rounds each) one
// layer's attention took 0.938-0.997x the time for 32 decodes at 4,096 keys (from memory),
// 0.935-0.976x for 8 at 1,300 (16 MB), 0.913-0.938x for one at 1,300 and 0.950-0.960x for one at
// 50, and default-mode decode steps of 8 requests at ~1,300 keys 0.961x (17 of 24 rounds): the
// 16 extra prefetches a key and KV head held the loop up more than they hid.
// sc: 4 * bs floats of scratch. d % 16 == 0.
template <int R>
inline void decode_block_avx2(const float* qf, int64_t d, const float* kb, const float* vb, int64_t stride,
                              int64_t from, int64_t visible, float* sc, Partial* ml, float* acc) {
  static_assert(R >= 1 && R <= 4, "decode_block_avx2: 1 to 4 rows");
  if (visible <= from) return;
  const int64_t row_bytes = d * 4;
  for (int64_t j = from; j < visible; ++j) {
    const float* kj = kb + j * stride;
    {   // this key's value row and the key row four ahead into L1
      const char* kp = reinterpret_cast<const char*>(kj + 4 * stride);
      const char* vp = reinterpret_cast<const char*>(vb + j * stride);
      for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(kp + o, 0, 3), __builtin_prefetch(vp + o, 0, 3);
    }
    __m256 a[4], e[4];   // two FMA chains a row (even and odd vectors of d)
    for (int r = 0; r < 4; ++r) a[r] = e[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
      __m256 k0 = _mm256_loadu_ps(kj + c), k1 = _mm256_loadu_ps(kj + c + 8);
      in_reg(k0), in_reg(k1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        a[r] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(qf + r * d + c), a[r]),
        e[r] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(qf + r * d + c + 8), e[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = _mm256_add_ps(a[r], e[r]);
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(sc + 4 * j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  // the rows' maxima over these keys and before (lane r: row r)
  __m128 m4 = _mm_setr_ps(ml[0].m, R > 1 ? ml[1].m : 0.f, R > 2 ? ml[2].m : 0.f, R > 3 ? ml[3].m : 0.f);
  for (int64_t j = from; j < visible; ++j) m4 = _mm_max_ps(m4, _mm_loadu_ps(sc + 4 * j));
  alignas(16) float mx[4];
  _mm_store_ps(mx, m4);
  const __m256 mv = _mm256_setr_m128(m4, m4);
  __m256 l8 = _mm256_setzero_ps();
  int64_t j = from;
  for (; j + 2 <= visible; j += 2) {
    const __m256 pv = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + 4 * j), mv));
    _mm256_storeu_ps(sc + 4 * j, pv);
    l8 = _mm256_add_ps(l8, pv);
  }
  __m128 l4 = _mm_add_ps(_mm256_castps256_ps128(l8), _mm256_extractf128_ps(l8, 1));
  if (j < visible) {   // an odd last key
    const __m128 pv = _mm256_castps256_ps128(fast_exp8(_mm256_sub_ps(_mm256_castps128_ps256(_mm_loadu_ps(sc + 4 * j)), mv)));
    _mm_storeu_ps(sc + 4 * j, pv);
    l4 = _mm_add_ps(l4, pv);
  }
  alignas(16) float ls[4];
  _mm_store_ps(ls, l4);
  for (int r = 0; r < R; ++r) {
    if (mx[r] != ml[r].m) {   // else the correction is exactly 1: skipped
      const float corr = fast_exp(ml[r].m - mx[r]);
      const __m256 cv = _mm256_set1_ps(corr);
      for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(acc + r * d + i, _mm256_mul_ps(_mm256_loadu_ps(acc + r * d + i), cv));
      ml[r] = Partial{mx[r], ml[r].l * corr + ls[r]};
    } else {
      ml[r].l += ls[r];
    }
  }
  // the values: W vectors of d a pass (4 * W accumulators at most: 8 or 12 chains), each key's
  // vectors read once a pass and multiplied by each row's probability
  constexpr int W = R == 1 ? 8 : R == 4 ? 2 : 4;
  const bool wide = d % (8 * W) == 0;
  auto pass = [&](auto wtag, int64_t ib) {
    constexpr int WV = decltype(wtag)::value;
    __m256 a[R][WV];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int w = 0; w < WV; ++w) a[r][w] = _mm256_loadu_ps(acc + r * d + ib + 8 * w);
    for (int64_t jj = from; jj < visible; ++jj) {
      const float* vj = vb + jj * stride + ib;
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 pv = _mm256_broadcast_ss(sc + 4 * jj + r);
#pragma GCC unroll 8
        for (int w = 0; w < WV; ++w) a[r][w] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8 * w), a[r][w]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int w = 0; w < WV; ++w) _mm256_storeu_ps(acc + r * d + ib + 8 * w, a[r][w]);
  };
  if (wide)
    for (int64_t ib = 0; ib < d; ib += 8 * W) pass(std::integral_constant<int, W>{}, ib);
  else
    for (int64_t ib = 0; ib < d; ib += 16) pass(std::integral_constant<int, 2>{}, ib);
}
constexpr bool kHaveBlocked = true;
constexpr bool kHaveSoftmax32Avx2 = true;
constexpr bool kHaveDecodeAvx2 = true;
#else
inline void qk4(const float*, int64_t, const float*, int64_t, float*) {}
inline void pv4(const float*, int64_t, int64_t, const float*, int64_t, float*) {}
constexpr bool kHaveBlocked = false;
#endif
#if !(!defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__))
inline void softmax_block32_avx2(Partial&, float*, int64_t, float*) {}
constexpr bool kHaveSoftmax32Avx2 = false;
template <int R>
inline void decode_block_avx2(const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t, float*,
                              Partial*, float*) {}
constexpr bool kHaveDecodeAvx2 = false;
#endif

// one row's online-softmax update over a block's scores sc[from..visible): sc becomes the
// probabilities (0 elsewhere, up to bs), the row's accumulated values ar[d] and its (max, sum)
// take the correction
inline void softmax_update(Partial& ml, float* ar, int64_t d, float* sc, int64_t bs, int64_t from,
                           int64_t visible) {
  if (visible <= from) {
    for (int64_t j = 0; j < bs; ++j) sc[j] = 0.f;
    return;
  }
  float mx = ml.m;
#pragma omp simd reduction(max : mx)
  for (int64_t j = from; j < visible; ++j) mx = sc[j] > mx ? sc[j] : mx;
  // an unmoved maximum: the correction is exactly 1 (fast_exp(0) == 1.f), the pass over ar skipped
  const bool moved = mx != ml.m;
  const float corr = moved ? fast_exp(ml.m - mx) : 1.f;
  float l = 0.f;
#pragma omp simd reduction(+ : l)
  for (int64_t j = 0; j < bs; ++j) {
    const float pj = j >= from && j < visible ? fast_exp(sc[j] - mx) : 0.f;
    sc[j] = pj;
    l += pj;
  }
  if (moved) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) ar[i] *= corr;
  }
  ml = Partial{mx, ml.l * corr + l};
}

#if defined(__AVX512F__)
// sixteen vectors -> one: lane j holds the sum of v[j]'s lanes (fast_math.h)
inline __m512 hsum16(const __m512* v) {
  return reduce16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// dot products of one query row with keys k0 .. k0 + cnt - 1 (cnt <= 16) of a block, each key's
// DC values contiguous at kb + j * stride: one vector of partial sums per key (vdpbf16ps on bf16
// pairs, exact products; FMAs in fp32), then hsum16. q: DC values (bf16 bits or fp32).
template <typename T, int64_t DC>
inline __m512 qk16(const T* qrow, const T* kb, int64_t stride, int64_t cnt) {
  __m512 v[16];
  for (int64_t j = 0; j < 16; ++j) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    if (j < cnt) {
      const T* kj = kb + j * stride;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
        // one chain a key (sixteen keys keep sixteen chains in flight): no vector add a key
        a = zeroed_ps();
        for (int64_t c = 0; c < DC; c += 32)
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qrow + c), (__m512bh)_mm512_loadu_si512(kj + c));
        v[j] = a;
        continue;
#endif
      } else {
        for (int64_t c = 0; c < DC; c += 32) {
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qrow + c), _mm512_loadu_ps(kj + c), a);
          b = _mm512_fmadd_ps(_mm512_loadu_ps(qrow + c + 16), _mm512_loadu_ps(kj + c + 16), b);
        }
      }
    }
    v[j] = _mm512_add_ps(a, b);
  }
  return hsum16(v);
}

// acc[r][DC] += sum_j p[r][j] * vf[j][DC] for rows r0, r0 + 1 (two rows: 2 * DC / 16 independent
// FMA chains), keys [from, to)
template <int64_t DC, int R>
inline void pv_rows(const float* p, int64_t bs, const float* vf, int64_t from, int64_t to, float* acc) {
  constexpr int C = static_cast<int>(DC / 16);
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_loadu_ps(acc + r * DC + 16 * c);
  for (int64_t j = from; j < to; ++j) {
    const float* vj = vf + j * DC;
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * bs + j]);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vj + 16 * c), a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * DC + 16 * c, a[r][c]);
}
constexpr bool kHaveDecodeKernel = true;
#if defined(__AVX512BF16__)
// the bf16 PV of decode rows: pairs of keys straight from the pool (two keys' values
// interleaved per 128-bit lane by vpunpck{l,h}wd: no widened copy of V), probabilities as bf16
// pairs pw[r][bs/2] (as the chunk path's pv4_bf16), vdpbf16ps into acc[r][DC] kept in the
// interleaved order: lane 4L + t of the low / high vector of 32 values c holds value
// 32c + 8L + t / 32c + 8L + 4 + t (decode_acc_order puts it back). Key pairs [j2a, j2b);
// a key at or past n reads as 0 (the pool's unused slots may hold anything).
template <int64_t DC, int R>
inline void pv_rows_bf16(const uint32_t* pw, int64_t half, const at::BFloat16* vb, int64_t stride, int64_t j2a,
                         int64_t j2b, int64_t n, float* acc) {
  constexpr int C = static_cast<int>(DC / 32);
  __m512 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      lo[r][c] = _mm512_loadu_ps(acc + r * DC + 32 * c), hi[r][c] = _mm512_loadu_ps(acc + r * DC + 32 * c + 16);
  for (int64_t j2 = j2a; j2 < j2b; ++j2) {
    const at::BFloat16* v0 = vb + 2 * j2 * stride;
    const bool has1 = 2 * j2 + 1 < n;
    __m512i a[C], b[C];
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i y = has1 ? _mm512_loadu_si512(v0 + stride + 32 * c) : _mm512_setzero_si512();
      a[c] = _mm512_unpacklo_epi16(x, y), b[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r * half + j2]));
      for (int c = 0; c < C; ++c) {
        lo[r][c] = _mm512_dpbf16_ps(lo[r][c], pv, (__m512bh)a[c]);
        hi[r][c] = _mm512_dpbf16_ps(hi[r][c], pv, (__m512bh)b[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(acc + r * DC + 32 * c, lo[r][c]), _mm512_storeu_ps(acc + r * DC + 32 * c + 16, hi[r][c]);
}

// pv_rows_bf16's interleaved order -> the values' own, rows x DC in place
template <int64_t DC>
inline void decode_acc_order(float* acc, int64_t rows) {
  const __m512i i1 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i2 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < DC; c += 32) {
      const __m512 lo = _mm512_loadu_ps(acc + r * DC + c), hi = _mm512_loadu_ps(acc + r * DC + c + 16);
      _mm512_storeu_ps(acc + r * DC + c, _mm512_permutex2var_ps(lo, i1, hi));
      _mm512_storeu_ps(acc + r * DC + c + 16, _mm512_permutex2var_ps(lo, i2, hi));
    }
}
#endif
#if defined(__AVX512BF16__)
constexpr bool kDecodeBf16 = true;   // bf16 decodes take qk16's vdpbf16ps
#else
constexpr bool kDecodeBf16 = false;
#endif
#else
constexpr bool kDecodeBf16 = false;
constexpr bool kHaveDecodeKernel = false;
#endif
// FASTGEN_DECODE_KERNEL=0 sends decodes down the general path (A/B measurements); read once
inline bool decode_kernel_enabled() {
  static const bool on = [] { const char* v = std::getenv("FASTGEN_DECODE_KERNEL"); return !(v && v[0] == '0'); }();
  return on;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// probabilities sc[0..n) as (n + 1) / 2 bf16 pairs, round to nearest even (the PV kernels'
// operand: pair j holds keys 2j and 2j + 1; a last odd key pairs with 0)
inline void probs_to_bf16_pairs(const float* sc, int64_t n, uint32_t* dst) {
  int64_t j2 = 0;
  for (; 2 * j2 + 32 <= n; j2 += 16)
    _mm512_storeu_si512(dst + j2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc + 2 * j2 + 16),
                                                               _mm512_loadu_ps(sc + 2 * j2)));
  for (; j2 < (n + 1) / 2; ++j2) {
    const uint32_t lo = bf16_bits(sc[2 * j2]), hi = 2 * j2 + 1 < n ? bf16_bits(sc[2 * j2 + 1]) : 0u;
    dst[j2] = lo | hi << 16;
  }
}

// softmax_update for a block of 32 keys that R rows see whole: raw scores (row r's at sc + r * bs)
// times scale, each row's accumulator (ar + r * d) and (max, sum) corrected, its probabilities
// written as 16 bf16 pairs (pw + r * half). The rows go together so that their reduction and exp
// chains interleave (one row at a time they run back to back, latency-bound); each row takes the
// same operations whatever R is. An unmoved maximum leaves the row's accumulator as it is (the
// correction would be exactly 1: fast_exp(0) == 1.f).
template <int R>
inline void softmax_block32_rows(Partial* ml, float* ar, int64_t d, const float* sc, int64_t bs, float scale,
                                 uint32_t* pw, int64_t half) {
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 s0[R], s1[R], p0[R], p1[R];
  float mx[R];
  for (int r = 0; r < R; ++r) {
    s0[r] = _mm512_mul_ps(_mm512_loadu_ps(sc + r * bs), sv);
    s1[r] = _mm512_mul_ps(_mm512_loadu_ps(sc + r * bs + 16), sv);
  }
  // the running maximum moves only where a score exceeds it; only then is the block's maximum
  // reduced across lanes (the same mx either way: once past a row's first blocks it rarely moves)
  for (int r = 0; r < R; ++r) {
    const __m512 old = _mm512_set1_ps(ml[r].m);
    const bool up = (_mm512_cmp_ps_mask(s0[r], old, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1[r], old, _CMP_GT_OQ)) != 0;
    mx[r] = up ? std::max(ml[r].m, _mm512_reduce_max_ps(_mm512_max_ps(s0[r], s1[r]))) : ml[r].m;
  }
  for (int r = 0; r < R; ++r) {
    const __m512 mv = _mm512_set1_ps(mx[r]);
    p0[r] = fast_exp16_nonpos(_mm512_sub_ps(s0[r], mv));
    p1[r] = fast_exp16_nonpos(_mm512_sub_ps(s1[r], mv));
  }
  for (int r = 0; r < R; ++r) {
    float corr = 1.f;
    if (mx[r] != ml[r].m) {
      corr = fast_exp(ml[r].m - mx[r]);
      const __m512 cv = _mm512_set1_ps(corr);
      float* a = ar + r * d;
      int64_t i = 0;
      for (; i + 16 <= d; i += 16) _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_loadu_ps(a + i), cv));
      for (; i < d; ++i) a[i] *= corr;
    }
    ml[r] = Partial{mx[r], ml[r].l * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0[r], p1[r]))};
    _mm512_storeu_si512(pw + r * half, (__m512i)_mm512_cvtne2ps_pbh(p1[r], p0[r]));
  }
}
#endif

#if defined(__AVX512F__)
// r[i] lane j -> r[j] lane i, 32-bit lanes: in-lane 32- and 64-bit interleaves, then a 4 x 4
// transpose of the 128-bit lanes
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i)
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  // u[4g + c]: 128-bit lane L holds column 4L + c of rows 4g .. 4g + 3
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    r[c] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(2, 0, 2, 0));        // column c
    r[4 + c] = _mm512_shuffle_i32x4(x0, x2, _MM_SHUFFLE(3, 1, 3, 1));    // column 4 + c
    r[8 + c] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(2, 0, 2, 0));    // column 8 + c
    r[12 + c] = _mm512_shuffle_i32x4(x1, x3, _MM_SHUFFLE(3, 1, 3, 1));   // column 12 + c
  }
}

// Keys as the B operand of S = Q . K^T (pairs of d along rows, keys along columns): 16 keys'
// pairs db .. db + 15 transposed into kw[pair][key], pair db + c of key jb + j at
// kw[(db + c) * ld + jb + j]. row_at(j): key jb + j's row of 32-bit pairs; keys from `count` on
// read as zero (past a sequence's last key the pool holds anything). The chunk path's blocks and
// the tiles' packed chunks both take it.
template <typename RowAt>
inline void pack_keys16(RowAt row_at, int64_t count, int64_t db, int64_t jb, int64_t ld, uint32_t* kw) {
  __m512i t[16];
  for (int64_t j = 0; j < 16; ++j) t[j] = j < count ? _mm512_loadu_si512(row_at(j) + db) : _mm512_setzero_si512();
  transpose16x16_epi32(t);
  for (int64_t c = 0; c < 16; ++c) _mm512_storeu_si512(kw + (db + c) * ld + jb, t[c]);
}
#endif

// Two keys' value rows (bf16 bits, d of them; nullptr: a missing key, read as zero) as pairs of
// keys, dst[i] = (v1[i] << 16) | v0[i]: the B operand of O += P . V, one row of it
inline void pair_value_rows(const uint16_t* v0, const uint16_t* v1, int64_t d, uint32_t* dst) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 32 <= d; i += 32) {
    const __m512i a = v0 != nullptr ? _mm512_loadu_si512(v0 + i) : _mm512_setzero_si512();
    const __m512i b = v1 != nullptr ? _mm512_loadu_si512(v1 + i) : _mm512_setzero_si512();
    // 16-bit interleave within 128-bit lanes, then the lanes put back in order
    const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi));
    _mm512_storeu_si512(dst + i + 16, _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi));
  }
#endif
  for (; i < d; ++i)
    dst[i] = (v0 != nullptr ? static_cast<uint32_t>(v0[i]) : 0u) | (v1 != nullptr ? static_cast<uint32_t>(v1[i]) << 16 : 0u);
}

// A decode item's keys: the first visible one (a sliding window's start, else 0) and its key
// split's blocks [b0, b1) of the sequence at position p0
struct DecodeSplit {
  int64_t visible_from, b0, b1;
};
inline DecodeSplit decode_split(const Item& item, int64_t p0, int64_t bs, int64_t window) {
  const int64_t visible_from = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
  const int64_t fb = visible_from / bs, nblk = (p0 + bs) / bs;
  return {visible_from, fb + (nblk - fb) * item.part / item.num_parts, fb + (nblk - fb) * (item.part + 1) / item.num_parts};
}
// a decode item's accumulators cleared: [h][d] values, (max, sum) per head
inline void start_decode_item(int64_t h, int64_t d, std::vector<float>& acc, std::vector<Partial>& ml) {
  acc.assign(h * d, 0.f);
  ml.assign(h, Partial{-std::numeric_limits<float>::infinity(), 0.f});
}

// f(std::integral_constant<int, RN>) for RN = rn (1..4): the row kernels take RN at compile time
template <typename F>
inline void by_rows(int64_t rn, F&& f) {
  switch (rn) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// One decode's key split (item.part of item.num_parts) with all its heads, on AVX2 hosts with an
// fp32 pool (decode_block_avx2 for each KV head's query heads, four rows at a time): each block's
// keys and values are read in place, the KV heads one after another within a block, so that a
// split streams its blocks whole (one KV head per item read a third of each block's lines, with a
// stride). acc [h][d], ml [h]. Prefetches (decode_block_avx2): each key's value row and the key
// row four keys on into L1.
inline void attend_decode_avx2(const Item& item, const float* q, const float* kpool, const float* vpool,
                               const int32_t* q_starts, const int32_t* start_pos, const int32_t* tables,
                               int64_t max_blocks, int64_t h, int64_t kvh, int64_t d, int64_t bs, float scale,
                               int64_t window, std::vector<float>& acc, std::vector<Partial>& ml,
                               std::vector<float>& qf, std::vector<float>& scores) {
  const int64_t group = h / kvh, s = item.seq, p0 = start_pos[s];
  const auto [first, b0, b1] = decode_split(item, p0, bs, window);
  start_decode_item(h, d, acc, ml);
  qf.resize(h * d);
  if (scores.size() < static_cast<size_t>(4 * bs)) scores.resize(4 * bs);
  const float* qs = q + q_starts[s] * h * d;
  for (int64_t i = 0; i < h * d; ++i) qf[i] = qs[i] * scale;
  const int32_t* table = tables + s * max_blocks;
  const int64_t block_floats = bs * kvh * d;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t first_key = b * bs, n = std::min(bs, p0 + 1 - first_key);
    const int64_t from = std::max<int64_t>(0, first - first_key);
    const float* kblk = kpool + static_cast<int64_t>(table[b]) * block_floats;
    const float* vblk = vpool + static_cast<int64_t>(table[b]) * block_floats;
    for (int64_t kv = 0; kv < kvh; ++kv) {
      for (int64_t r0 = 0; r0 < group; r0 += 4) {
        const int64_t rn = std::min<int64_t>(4, group - r0), row = kv * group + r0;
        const float* qr = qf.data() + row * d;
        const float* kb = kblk + kv * d;
        const float* vb = vblk + kv * d;
        float* ar = acc.data() + row * d;
        Partial* mr = ml.data() + row;
        float* sc = scores.data();
        by_rows(rn, [&](auto rows) {
          decode_block_avx2<decltype(rows)::value>(qr, d, kb, vb, kvh * d, from, n, sc, mr, ar);
        });
      }
    }
  }
}

template <typename T, int64_t DC>
void attend_item(const Item& item, const T* q, const T* kpool, const T* vpool, const int32_t* q_starts,
                 const int32_t* start_pos, const int32_t* tables, int64_t max_blocks, int64_t h, int64_t kvh,
                 int64_t d_runtime, int64_t bs, float scale, int64_t window, std::vector<float>& acc,
                 std::vector<Partial>& ml,
                 std::vector<float>& qf, std::vector<float>& kf, std::vector<float>& vf,
                 std::vector<float>& scores) {
  const int64_t d = DC > 0 ? DC : d_runtime;
  const int64_t group = h / kvh, s = item.seq, kv = item.kv;
  const int64_t nq_all = q_starts[s + 1] - q_starts[s], p0 = start_pos[s];
  const bool decode = nq_all == 1;
  // this item's queries [qa, qb) (relative to the sequence) and key blocks [b0, b1). With a
  // sliding window (window > 0) the query at position p sees keys p - window + 1 .. p only,
  // so blocks wholly before the tile's first query's window are skipped
  int64_t qa = 0, qb = nq_all, b0, b1;
  auto first_visible = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; };
  if (decode) {
    const int64_t fb = first_visible(p0) / bs, nblk = (p0 + 1 + bs - 1) / bs;
    b0 = fb + (nblk - fb) * item.part / item.num_parts;
    b1 = fb + (nblk - fb) * (item.part + 1) / item.num_parts;
  } else {
    qa = item.part * kQueryTile;
    qb = std::min(nq_all, qa + kQueryTile);
    b0 = first_visible(p0 + qa) / bs;
    b1 = (p0 + qb - 1) / bs + 1;  // the tile's last query sees keys up to p0 + qb - 1
  }
  const int64_t rows = (qb - qa) * group;  // row r: query qa + r / group, head kv * group + r % group
  const bool many = rows >= kManyRows;
  qf.resize(rows * d);
  acc.assign(rows * d, 0.f);
  ml.assign(rows, Partial{-std::numeric_limits<float>::infinity(), 0.f});
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + ((q_starts[s] + qa + r / group) * h + kv * group + r % group) * d;
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] = load(src, i) * scale;
  }
  // one row's online-softmax update over this block's scores sc[from..visible); sc becomes the
  // probabilities (0 outside, up to bs)
  auto softmax_row = [&](int64_t r, float* sc, int64_t from, int64_t visible) {
    softmax_update(ml[r], acc.data() + r * d, d, sc, bs, from, visible);
  };
  const int32_t* table = tables + s * max_blocks;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t first_key = b * bs, n = std::min(bs, p0 + qb - first_key);
    const T* kb = kpool + (static_cast<int64_t>(table[b]) * bs * kvh + kv) * d;
    const T* vb = vpool + (static_cast<int64_t>(table[b]) * bs * kvh + kv) * d;
    // widen the block once (K transposed to [d][bs] when many rows read it)
    for (int64_t j = 0; j < n; ++j) {
      const T* kj = kb + j * kvh * d;
      const T* vj = vb + j * kvh * d;
      float* vfj = vf.data() + j * d;
      if (many) {
        for (int64_t i = 0; i < d; ++i) kf[i * bs + j] = load(kj, i);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) kf[j * d + i] = load(kj, i);
      }
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) vfj[i] = load(vj, i);
    }
    int64_t r_first = 0;
    if (many && kHaveBlocked && bs % 32 == 0 && d % 64 == 0) {
      // four rows at a time; masked keys get probability 0
      for (; r_first + 4 <= rows; r_first += 4) {
        float* sc4 = scores.data();
        qk4(qf.data() + r_first * d, d, kf.data(), bs, sc4);
        for (int64_t rr = 0; rr < 4; ++rr) {
          const int64_t r = r_first + rr;
          const int64_t pos = p0 + qa + r / group;
          const int64_t from = std::max<int64_t>(0, first_visible(pos) - first_key);
          const int64_t visible = std::min(n, pos - first_key + 1);
          if (kHaveSoftmax32Avx2 && bs == 32 && from == 0 && visible == 32)
            softmax_block32_avx2(ml[r], acc.data() + r * d, d, sc4 + rr * bs);   // a block it sees whole
          else
            softmax_row(r, sc4 + rr * bs, from, visible);
        }
        pv4(sc4, bs, n, vf.data(), d, acc.data() + r_first * d);
      }
    }
    for (int64_t r = r_first; r < rows; ++r) {
      const int64_t pos = p0 + qa + r / group;
      const int64_t visible = std::min(n, pos - first_key + 1);
      const int64_t from = std::max<int64_t>(0, first_visible(pos) - first_key);
      if (visible <= from) continue;
      const float* qr = qf.data() + r * d;
      float* sc = scores.data();
      if (many) {
#pragma omp simd
        for (int64_t j = 0; j < bs; ++j) sc[j] = 0.f;
        for (int64_t i = 0; i < d; ++i) {
          const float qv = qr[i];
          const float* kt = kf.data() + i * bs;
#pragma omp simd
          for (int64_t j = 0; j < bs; ++j) sc[j] += qv * kt[j];
        }
      } else {
        for (int64_t j = from; j < visible; ++j) {
          const float* kj = kf.data() + j * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qr[i] * kj[i];
          sc[j] = dot;
        }
      }
      float mx = ml[r].m;
      for (int64_t j = from; j < visible; ++j) mx = std::max(mx, sc[j]);
      const bool moved = mx != ml[r].m;   // else the correction is exactly 1: skipped
      const float corr = moved ? fast_exp(ml[r].m - mx) : 1.f;
      float l = 0.f;
#pragma omp simd reduction(+ : l)
      for (int64_t j = from; j < visible; ++j) {
        sc[j] = fast_exp(sc[j] - mx);
        l += sc[j];
      }
      float* ar = acc.data() + r * d;
      if (moved) {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ar[i] *= corr;
      }
      for (int64_t j = from; j < visible; ++j) {
        const float pj = sc[j];
        const float* vj = vf.data() + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ar[i] += pj * vj[i];
      }
      ml[r] = Partial{mx, ml[r].l * corr + l};
    }
  }
}

#if defined(__AVX512F__)
// How far ahead a decode prefetches its key blocks (K and V, into L2: L1's few miss buffers
// capped a thread's stream when they went to L1), and how. A block's 384 lines (SmolLM2, bf16)
// were first prefetched in one burst at the block's start. The core then stalled while they
// were issued, so the pool's reads and the arithmetic added up instead of overlapping: 8
// decodes x 1,300 keys over the 30 layers' pools took ~14 ms from memory, ~5 ms with the pools
// in cache, and a plain read of the same bytes ~8 ms. Now the lines go out a few at a time
// between the block's steps (DecodePrefetch below). Measured against the burst, alternating
// rounds in one process on Zen 4, all else equal: one burst of 384, or of 128 per KV head,
// 1.0x; 12 steps a block 0.83-0.87x; 24 steps 0.74-0.75x, one or two blocks ahead. Fewer,
// larger pieces (6 a block) were slower than the burst. Against the kernel before (the burst,
// three blocks ahead), paged_attention over the 30 layers' pools from memory, 11 of 11 rounds
// faster each: 8 decodes x 1,300 keys 0.73-0.77x the time, 32 x 4k 0.70-0.75x, 8 x 300
// 0.81-0.88x, all in the VM's slow memory phases; in a fast one (the old kernel's 32 x 4k at
// 101 against ~165 ms) level, 0.98-1.00x. One decode alone at 120-1,000 keys (its keys in
// cache) was *slower* this way, 1.07-1.23x, and so it stayed with the pieces' calls left in
// place around the old burst. So one decode alone takes the old kernel's code
// (attend_decode_heads<T, DC, false>, the pieces compiled out; chosen in paged_attention_impl):
// level, 0.98-1.07x.
constexpr int64_t kDecodePrefetchBlocks = 1;   // the next block (2 and 3 measured no better)
constexpr int64_t kDecodeBurstBlocks = 3;      // one decode alone: the blocks its bursts reach

// The lines of one key block (K and V) to prefetch into L2, issued a piece at a time by run()
// at each step of the block before it, the rest by finish(). Lines go out in chunks of 8,
// unrolled (no loop exit a chunk to mispredict); piece is whole chunks. A block whose lines are
// not a multiple of 8 has its last chunk run past its end: prefetches there fetch a few lines of
// a neighbour and never fault.
constexpr int64_t kPrefetchChunk = 8 * 64;
struct DecodePrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t off = 0, end = 0, piece = 0;
  inline void run() {
    for (const int64_t stop = std::min(end, off + piece); off < stop; off += kPrefetchChunk) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        __builtin_prefetch(k + off + 64 * i, 0, 1);   // prefetcht2: L2
        __builtin_prefetch(v + off + 64 * i, 0, 1);
      }
    }
  }
  inline void finish() {
    piece = end;
    run();
  }
};

// A decode, all its heads (kv = -1 items): for each key block of the item's split, every KV head
// in turn, so that each block is read once and front to back, the blocks ahead prefetched (blocks
// lie anywhere in the pool, out of the hardware prefetcher's sight). 32 decodes x 4k keys, cold:
// 7.0 ms per KV head without the prefetch, 5.2-5.4 ms with it, per KV head or all heads alike.
// Scores by qk16 straight from the pool's keys; in bf16 the values too (pv_rows_bf16,
// probabilities as bf16 pairs), in fp32 each head's values widened once per block (pv_rows).
// acc [h][d], ml [h]: row r is head r.
#endif   // (the decode kernels' prefetch; the packed prompt chunks below also build on AVX2)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define FASTGEN_HAVE_PACKED_CHUNKS 1
// The packed chunks and their online softmax: used by the AMX tiles (below) and, on hosts with
// AVX512-BF16 but no tiles, by attend_chunk_vec (vdpbf16ps over the same layout)
// chunk c of sequence s, kv head kv (keys k0 .. k0 + kAmxKeys - 1 of num_keys) -> dst
inline void amx_pack_chunk(const at::BFloat16* kpool, const at::BFloat16* vpool, const int32_t* table, int64_t bs,
                           int64_t kvh, int64_t d, int64_t kv, int64_t k0, int64_t num_keys, uint32_t* dst) {
  uint32_t* kw = dst;
  uint32_t* vw = dst + kAmxKeys * d / 2;
  const int64_t d2 = d / 2;
  auto key_at = [&](const at::BFloat16* pool, int64_t key) {
    return pool + ((static_cast<int64_t>(table[key / bs]) * bs + key % bs) * kvh + kv) * d;
  };
  for (int64_t jb = 0; jb < kAmxKeys; jb += 16)
    for (int64_t db = 0; db < d2; db += 16)
      pack_keys16([&](int64_t j) { return reinterpret_cast<const uint32_t*>(key_at(kpool, k0 + jb + j)); },
                  num_keys - (k0 + jb), db, jb, kAmxKeys, kw);
  for (int64_t j2 = 0; j2 < kAmxKeys / 2; ++j2) {
    const int64_t key = k0 + 2 * j2;
    pair_value_rows(key < num_keys ? reinterpret_cast<const uint16_t*>(key_at(vpool, key)) : nullptr,
                    key + 1 < num_keys ? reinterpret_cast<const uint16_t*>(key_at(vpool, key + 1)) : nullptr, d,
                    vw + j2 * d);
  }
}

// One row's online-softmax step over a chunk's raw scores on tiles (sc[0 .. 16 nv)), in log2
// units: t = (score - max) * c2, c2 = scale * log2(e), one fused multiply-subtract, then
// fast_exp2_16. ml.m is the row's running maximum of raw scores (only ml.l is read after
// the item). The maximum moves only where a visible score exceeds it; the accumulator ar[d] is
// corrected when it moved; the probabilities go to bf16 pairs in pr. Masked: the visible keys as lane
// masks mk[] (masked lanes take no part in the maximum and get probability 0); unmasked (a row
// that sees all nv * 16 keys: no masks to build or apply), NV known at compile time where it is
// the whole chunk. Measured (AMX host, SmolLM2's heads, the op alone, 30 calls each way
// alternated, twice): the unmasked rows alone took the attention to 0.85-0.89x of its time
// (same output: per row and chunk the scalar loop that built eight masks cost about what the
// row's vector work did); with the log2 units and a degree-4 exp2 as well, 0.83-0.84x at
// 2,048 prompt queries and 0.86-0.87x at 256 queries after 1,792 keys; that exp2 split by
// floor (fast_exp2_16) instead of by rounding with a clamp, a further 0.95x and 0.96-0.98x.
// Against an fp32 reference: the same largest and mean errors to 1e-7. (The sum kept as a vector
// per row and reduced once per item instead of once per chunk: level, not kept.)
template <bool Masked, int NV, bool F32 = false>
inline void chunk_softmax_row(const float* sc, int nv, const __mmask16* mk, float c2, Partial& ml, float* ar,
                              int64_t d, uint32_t* pr) {
  const int n = NV > 0 ? NV : nv;
  __m512 v[kAmxKeys / 16];
  for (int i = 0; i < n; ++i) v[i] = _mm512_loadu_ps(sc + 16 * i);
  // the lanes' maxima first (masked lanes stay -inf), then one compare against the running
  // maximum, reduced across lanes only where it moved (against eight compares and their mask
  // ORs: 0.95-0.96x the attention's time at 2,048 prompt queries, 0.94-0.95x at 256 after
  // 1,792, same output)
  // (a whole chunk of eight vectors: the maxima and the sum as trees, three steps deep instead of
  // seven; with fast_exp2_16's degree 3, 0.97x the attention's time at 2,048 prompt queries and
  // at 256 after 1,792 keys, one process switching call by call, 20-30 rounds, 12-05 seventh
  // session; outputs within one bf16 rounding)
  constexpr bool kTree = !Masked && NV == 8;
  __m512 m;
  if constexpr (kTree) {
    m = _mm512_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])),
                      _mm512_max_ps(_mm512_max_ps(v[4], v[5]), _mm512_max_ps(v[6], v[7])));
  } else {
    m = Masked ? _mm512_set1_ps(-std::numeric_limits<float>::infinity()) : v[0];
    for (int i = Masked ? 0 : 1; i < n; ++i) m = Masked ? _mm512_mask_max_ps(m, mk[i], m, v[i]) : _mm512_max_ps(m, v[i]);
  }
  float mx = ml.m;
  if (_mm512_cmp_ps_mask(m, _mm512_set1_ps(ml.m), _CMP_GT_OQ)) mx = std::max(mx, _mm512_reduce_max_ps(m));
  const __m512 cv2 = _mm512_set1_ps(c2), mc = _mm512_set1_ps(mx * c2);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < n; ++i) {
    v[i] = F32 ? exp2_16(_mm512_fmsub_ps(v[i], cv2, mc)) : fast_exp2_16(_mm512_fmsub_ps(v[i], cv2, mc));
    if constexpr (Masked) v[i] = _mm512_maskz_mov_ps(mk[i], v[i]);
    if constexpr (!kTree) sum = _mm512_add_ps(sum, v[i]);
  }
  if constexpr (kTree)
    sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_add_ps(v[2], v[3])),
                        _mm512_add_ps(_mm512_add_ps(v[4], v[5]), _mm512_add_ps(v[6], v[7])));
  float corr = 1.f;
  if (mx != ml.m) {
    corr = fast_exp((ml.m - mx) * (c2 * 0.6931471805599453f));
    const __m512 cv = _mm512_set1_ps(corr);
    for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_loadu_ps(ar + i), cv));
  }
  ml = Partial{mx, ml.l * corr + _mm512_reduce_add_ps(sum)};
  if constexpr (F32) {   // fp32 probabilities (attend_chunk_f32; also on hosts without AVX512-BF16)
    for (int i = 0; i < n; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(pr) + 16 * i, v[i]);
  } else {
#if defined(__AVX512BF16__)
    for (int i = 0; i < n; i += 2) _mm512_storeu_si512(pr + 8 * i, (__m512i)_mm512_cvtne2ps_pbh(v[i + 1], v[i]));
#else
    static_assert(F32, "bf16 probabilities need AVX512-BF16 (the tiles and attend_chunk_vec, which have it)");
#endif
  }
}

// One row's online softmax over a packed chunk's scores sc[0 .. kend) (kend a multiple of 16),
// the row seeing the chunk's keys [from, visible) (either may lie outside the chunk): unmasked
// where it sees the chunk whole, lane masks where not, probabilities (0 for keys it does not
// see) as bf16 pairs in pr[kAmxKeys / 2] (F32: as fp32 in pr[kAmxKeys])
template <bool F32 = false>
inline void packed_softmax_row(const float* sc, int64_t from, int64_t visible, int64_t kend, float c2, Partial& ml,
                               float* ar, int64_t d, uint32_t* pr) {
  from = std::max<int64_t>(0, from);
  visible = std::min<int64_t>(kAmxKeys, visible);
  constexpr int NV = kAmxKeys / 16;
  const int nv = static_cast<int>(kend / 16);
  if (visible <= from) {
    std::memset(pr, 0, kProbWords<F32> * sizeof(uint32_t));
    return;
  }
  if (from == 0 && visible >= kend) {
    if (nv == NV) chunk_softmax_row<false, NV, F32>(sc, nv, nullptr, c2, ml, ar, d, pr);
    else chunk_softmax_row<false, 0, F32>(sc, nv, nullptr, c2, ml, ar, d, pr);
    return;
  }
  __mmask16 mk[NV];
  for (int i = 0; i < nv; ++i) {
    const int64_t lo = std::clamp<int64_t>(from - 16 * i, 0, 16), hi = std::clamp<int64_t>(visible - 16 * i, 0, 16);
    mk[i] = hi > lo ? static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1)) : 0;
  }
  chunk_softmax_row<true, 0, F32>(sc, nv, mk, c2, ml, ar, d, pr);
}

#endif   // the AVX-512 packed chunks

#if !defined(FASTGEN_HAVE_PACKED_CHUNKS) && defined(__AVX2__) && defined(__FMA__)
// AVX2 hosts (no AVX-512): one row's online softmax over a packed chunk's raw scores sc[0 .. kend)
// (kend a multiple of 32), the row seeing the chunk's keys [from, visible): fp32 probabilities in
// pr[kAmxKeys] (0 for the keys it does not see), the accumulator ar[d] corrected where the maximum
// moved. The steps of chunk_softmax_row<..., F32 = true> on 8-lane vectors (log2 units, one fused
// multiply-subtract, 2^t to fast_exp's precision), keys outside [from, visible) masked by compares
// against their indices instead of lane masks.
template <bool F32 = true>
inline void packed_softmax_row(const float* sc, int64_t from, int64_t visible, int64_t kend, float c2, Partial& ml,
                               float* ar, int64_t d, uint32_t* pr) {
  static_assert(F32, "AVX2 hosts have the fp32 packed chunks only");
  from = std::max<int64_t>(0, from);
  visible = std::min<int64_t>(kend, visible);
  float* p = reinterpret_cast<float*>(pr);
  if (visible <= from) {
    std::memset(p, 0, kAmxKeys * sizeof(float));
    return;
  }
  const bool whole = from == 0 && visible == kend;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_set1_epi32(static_cast<int>(from) - 1), hi = _mm256_set1_epi32(static_cast<int>(visible));
  auto seen = [&](int64_t j) {   // lanes of keys j .. j + 7 in [from, visible), as a float mask
    const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(j)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, lo), _mm256_cmpgt_epi32(hi, idx)));
  };
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = ninf;
  for (int64_t j = 0; j < kend; j += 8) {
    const __m256 v = _mm256_loadu_ps(sc + j);
    m = _mm256_max_ps(m, whole ? v : _mm256_blendv_ps(ninf, v, seen(j)));
  }
  const float mx = std::max(ml.m, hmax8(m));
  const __m256 cv2 = _mm256_set1_ps(c2), mc = _mm256_set1_ps(mx * c2);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < kend; j += 8) {
    __m256 e = exp2_8(_mm256_fmsub_ps(_mm256_loadu_ps(sc + j), cv2, mc));
    if (!whole) e = _mm256_and_ps(e, seen(j));
    _mm256_storeu_ps(p + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float corr = 1.f;
  if (mx != ml.m) {
    corr = fast_exp((ml.m - mx) * (c2 * 0.6931471805599453f));
    const __m256 cv = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(ar + i, _mm256_mul_ps(_mm256_loadu_ps(ar + i), cv));
  }
  ml = Partial{mx, ml.l * corr + hsum8(sum)};
}
#endif

#if defined(FASTGEN_HAVE_PACKED_CHUNKS) || (defined(__AVX2__) && defined(__FMA__))
// prompt chunks in fp32 on packed chunks (attend_chunk_f32): AVX-512 hosts and AVX2 hosts
#define FASTGEN_HAVE_PACKED_F32 1
// A prompt-chunk item on the packed chunks (attend_chunk_vec, attend_chunk_amx): its queries
// [qa, qb) of sequence s and its rows (query x head sharing kv head kv: row r is query qa + r /
// group, head kv * group + r % group), padded to a multiple of `pad` rows. Its queries go to qb16
// as bf16 [padded][d], acc [padded][d] and ml [padded] are cleared (padding rows zero), scores
// holds at least `pad` rows of a chunk's scores and pw [padded][kAmxKeys / 2] pairs of zeros
// (rows past `rows` keep probability 0). c0 .. c1 - 1: the chunks a row of it sees.
struct PackedItem {
  int64_t group, s, kv, p0, qa, qb, rows, padded, c0, c1, window;
  float c2;   // a raw score's log2 units: scale * log2(e)
  // chunk k0's keys up to the last any row sees, in whole steps of 32 (on the diagonal the keys
  // past the item's last query are skipped by the products and the softmax alike: 0.97x the time
  // at 2,048 prompt queries, 0.98x at 256 after 1,792 keys on tiles, same output)
  int64_t kend(int64_t k0) const { return std::min<int64_t>(kAmxKeys, (p0 + qb - k0 + 31) / 32 * 32); }
  // row r's online softmax over chunk k0's scores sc[0 .. kend) (packed_softmax_row); F32: fp32
  // probabilities, kAmxKeys words a row (attend_chunk_f32), else bf16 pairs (a compile-time choice:
  // the bf16 pairs' conversion does not build without AVX512-BF16, where the fp32 path runs)
  template <bool F32 = false>
  void softmax_row(int64_t r, const float* sc, int64_t k0, int64_t kend, int64_t d, std::vector<Partial>& ml,
                   std::vector<float>& acc, std::vector<uint32_t>& pw) const {
    const int64_t pos = p0 + qa + r / group;
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    packed_softmax_row<F32>(sc, first - k0, pos - k0 + 1, kend, c2, ml[r], acc.data() + r * d, d,
                            pw.data() + r * kProbWords<F32>);
  }
};
// (qbuf: bf16 q as bf16 [padded][d] for the bf16 items, fp32 q as fp32 for attend_chunk_f32, whose
// probabilities' rows take kAmxKeys words)
template <typename T, typename QBuf>
inline PackedItem start_packed_item(const Item& item, const T* q, const int32_t* q_starts,
                                    const int32_t* start_pos, int64_t h, int64_t kvh, int64_t d, float scale,
                                    int64_t window, int64_t pad, std::vector<float>& acc, std::vector<Partial>& ml,
                                    QBuf& qbuf, std::vector<float>& scores, std::vector<uint32_t>& pw) {
  PackedItem it{};
  it.group = h / kvh, it.s = item.seq, it.kv = item.kv, it.p0 = start_pos[it.s];
  it.qa = item.part * kQueryTile, it.qb = std::min<int64_t>(q_starts[it.s + 1] - q_starts[it.s], it.qa + kQueryTile);
  it.rows = (it.qb - it.qa) * it.group, it.padded = (it.rows + pad - 1) / pad * pad;
  qbuf.assign(it.padded * d, 0);
  for (int64_t r = 0; r < it.rows; ++r)
    std::memcpy(qbuf.data() + r * d,
                q + ((q_starts[it.s] + it.qa + r / it.group) * h + it.kv * it.group + r % it.group) * d,
                d * sizeof(T));
  acc.assign(it.padded * d, 0.f);
  ml.assign(it.padded, Partial{-std::numeric_limits<float>::infinity(), 0.f});
  if (scores.size() < static_cast<size_t>(pad * kAmxKeys)) scores.resize(pad * kAmxKeys);
  pw.assign(it.padded * kProbWords<std::is_same_v<T, float>>, 0u);
  const int64_t first = window > 0 ? std::max<int64_t>(0, it.p0 + it.qa - window + 1) : 0;
  it.c0 = first / kAmxKeys, it.c1 = (it.p0 + it.qb - 1) / kAmxKeys + 1;
  it.c2 = scale * 1.4426950408889634f;
  it.window = window;
  return it;
}

#if defined(__AVX512BF16__) && defined(FASTGEN_HAVE_PACKED_CHUNKS)
#define FASTGEN_HAVE_CHUNK_VEC 1
// Prompt chunks on hosts with AVX512-BF16 but no AMX tiles: the tiles' item (attend_chunk_amx)
// with vdpbf16ps in their place, over the same packed chunks (laid out once per sequence and kv
// head, not once per query tile and pool block as attend_item lays out its blocks) and the same
// softmax (log2 units, fast_exp2_16, once per 128 keys instead of once per 32).
// S = Q . K^T for R rows (bf16 pairs qw[R][d2n]) against a chunk's keys 0 .. kend - 1 (kend a
// multiple of 32; kw [d2n][kAmxKeys]) -> sc [R][kAmxKeys]: 2R independent vdpbf16ps chains
template <int R>
inline void qk_chunk_rows(const uint32_t* qw, int64_t d2n, const uint32_t* kw, int64_t kend, float* sc) {
  for (int64_t jb = 0; jb < kend; jb += 32) {
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = _mm512_setzero_ps(), a[r][1] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < d2n; ++d2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kw + d2 * kAmxKeys + jb);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kw + d2 * kAmxKeys + jb + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[r * d2n + d2]));
        a[r][0] = _mm512_dpbf16_ps(a[r][0], qv, k0), a[r][1] = _mm512_dpbf16_ps(a[r][1], qv, k1);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(sc + r * kAmxKeys + jb, a[r][0]), _mm512_storeu_ps(sc + r * kAmxKeys + jb + 16, a[r][1]);
  }
}

// one chunk item's attention (d % 64 == 0; set up by start_packed_item with pad 8): acc [rows8][d]
// and ml[rows8] as attend_item leaves them. packed: the (sequence, kv head)'s chunks. Per chunk, eight rows at a time: their scores,
// their softmax, then O += P . V four rows at a time (pv4_bf16), the chunk's K and V in L1/L2
inline void attend_chunk_vec(const PackedItem& it, int64_t d, const uint32_t* packed, std::vector<float>& acc,
                             std::vector<Partial>& ml, const std::vector<uint16_t>& qb16, std::vector<float>& scores,
                             std::vector<uint32_t>& pw) {
  const int64_t d2n = d / 2, half = kAmxKeys / 2, words = amx_chunk_words(d);
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(qb16.data());
  float* const sb = scores.data();
  for (int64_t c = it.c0; c < it.c1; ++c) {
    const int64_t k0 = c * kAmxKeys, kend = it.kend(k0);
    const uint32_t* kw = packed + c * words;
    const uint32_t* vw = kw + kAmxKeys * d / 2;
    for (int64_t rb = 0; rb < it.padded; rb += 8) {
      qk_chunk_rows<8>(qw + rb * d2n, d2n, kw, kend, sb);
      for (int64_t r = rb; r < std::min(rb + 8, it.rows); ++r)
        it.softmax_row(r, sb + (r - rb) * kAmxKeys, k0, kend, d, ml, acc, pw);
      pv4_bf16(pw.data() + rb * half, kAmxKeys, kend, vw, d, acc.data() + rb * d);
      pv4_bf16(pw.data() + (rb + 4) * half, kAmxKeys, kend, vw, d, acc.data() + (rb + 4) * d);
    }
  }
}
#endif

// Prompt chunks in fp32 (the engine's dtype on hosts without AVX512-BF16): the packed item with
// fp32 FMAs. A chunk of kAmxKeys keys is laid out once per (sequence, kv head) as K^T
// [d][kAmxKeys] (16 x 16 transposes) and V [kAmxKeys][d] (rows copied), keys past the sequence's
// last as zeros; per chunk, four rows at a time, their scores (qk_chunk_f32), their softmax
// (packed_softmax_row in log2 units, fp32 probabilities) and O += P . V (pv4). The per-block path
// (attend_item) it replaces transposed every 32-key block for every query tile with scalar stores
// and took the softmax per row and block through fast_exp's scalar-shaped loops.
inline void pack_chunk_f32(const float* kpool, const float* vpool, const int32_t* table, int64_t bs, int64_t kvh,
                           int64_t d, int64_t kv, int64_t k0, int64_t num_keys, uint32_t* dst) {
  uint32_t* kt = dst;
  float* vr = reinterpret_cast<float*>(dst + kAmxKeys * d);
  auto key_at = [&](const float* pool, int64_t key) {
    return pool + ((static_cast<int64_t>(table[key / bs]) * bs + key % bs) * kvh + kv) * d;
  };
#if defined(FASTGEN_HAVE_PACKED_CHUNKS)
  for (int64_t jb = 0; jb < kAmxKeys; jb += 16)
    for (int64_t db = 0; db < d; db += 16)
      pack_keys16([&](int64_t j) { return reinterpret_cast<const uint32_t*>(key_at(kpool, k0 + jb + j)); },
                  num_keys - (k0 + jb), db, jb, kAmxKeys, kt);
#else
  // AVX2: 8 x 8 transposes (keys past the last read as zero)
  float* ktf = reinterpret_cast<float*>(kt);
  for (int64_t jb = 0; jb < kAmxKeys; jb += 8) {
    const float* rows[8];
    for (int64_t j = 0; j < 8; ++j) rows[j] = k0 + jb + j < num_keys ? key_at(kpool, k0 + jb + j) : nullptr;
    for (int64_t db = 0; db < d; db += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = rows[j] != nullptr ? _mm256_loadu_ps(rows[j] + db) : _mm256_setzero_ps();
      transpose8x8_epi32(reinterpret_cast<__m256i*>(r));
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(ktf + (db + c) * kAmxKeys + jb, r[c]);
    }
  }
#endif
  for (int64_t j = 0; j < kAmxKeys; ++j) {
    if (k0 + j < num_keys)
      std::memcpy(vr + j * d, key_at(vpool, k0 + j), d * sizeof(float));
    else
      std::memset(vr + j * d, 0, d * sizeof(float));
  }
}

// the scores of four rows against a chunk's keys 0 .. kend - 1 (kend a multiple of 32): 64 keys a
// pass (qk4_keys, 16 chains), then a last 32; on AVX2 16 keys a pass (qk4_rows, 8 chains)
inline void qk_chunk_f32(const float* q, int64_t d, const float* kt, int64_t kend, float* sc) {
#if defined(FASTGEN_HAVE_PACKED_CHUNKS)
  int64_t jb = 0;
  for (; jb + 64 <= kend; jb += 64) qk4_keys<4>(q, d, kt, kAmxKeys, jb, sc);
  if (jb < kend) qk4_keys<2>(q, d, kt, kAmxKeys, jb, sc);
#else
  qk4_rows(q, d, kt, kAmxKeys, kend, sc);
#endif
}

// one chunk item's attention in fp32 (d % 64 == 0; set up by start_packed_item with pad 4): acc
// [rows4][d] and ml[rows4] as attend_item leaves them. packed: the (sequence, kv head)'s chunks
inline void attend_chunk_f32(const PackedItem& it, int64_t d, const uint32_t* packed, std::vector<float>& acc,
                             std::vector<Partial>& ml, const std::vector<float>& qf, std::vector<float>& scores,
                             std::vector<uint32_t>& pw) {
  const int64_t words = chunk_words<float>(d);
  float* const sb = scores.data();
  for (int64_t c = it.c0; c < it.c1; ++c) {
    const int64_t k0 = c * kAmxKeys, kend = it.kend(k0);
    const float* kt = reinterpret_cast<const float*>(packed + c * words);
    const float* vr = kt + kAmxKeys * d;
    for (int64_t rb = 0; rb < it.padded; rb += 4) {
      qk_chunk_f32(qf.data() + rb * d, d, kt, kend, sb);
      for (int64_t r = rb; r < std::min(rb + 4, it.rows); ++r)
        it.softmax_row<true>(r, sb + (r - rb) * kAmxKeys, k0, kend, d, ml, acc, pw);
      pv4(reinterpret_cast<const float*>(pw.data()) + rb * kAmxKeys, kAmxKeys, kend, vr, d, acc.data() + rb * d);
    }
  }
}

#endif   // FASTGEN_HAVE_PACKED_F32

#if defined(__AVX512F__)   // the AMX chunks and the decode kernels (attend_decode_heads)
#if defined(FASTGEN_HAVE_AMX)
// ---------------------------------------------------------------------------------------
// Prompt chunks on AMX tiles (bf16; amx.h). The keys and values a chunk's queries see are laid
// out once per (sequence, kv head), before the items run, in chunks of kAmxKeys keys: K as pairs
// along d, kw[d/2][kAmxKeys] (the B operand of S = Q . K^T: 16 pairs of d x 16 keys a tile), V as
// pairs of keys, vw[kAmxKeys/2][d] (the B operand of O += P . V); keys past the sequence's last
// read as zero (the pool's unused slots may hold anything). Every query tile of the sequence
// reads them (before, each tile widened or packed every block it saw itself).
// An item (sequence, kv head, tile of kQueryTile queries) holds its rows (query x head sharing the
// kv head) as bf16, padded to a multiple of 32; per chunk of keys the tiles give its scores
// [rows][kAmxKeys] (2 x 16 rows by 2 x 16 keys at a time), the vector units the online softmax
// (chunk_softmax_row: the vector path's steps but in log2 units with fast_exp2_16,
// probabilities rounded to bf16 pairs, an unmoved maximum leaving the row as it is), and the
// tiles O += P . V into the fp32 accumulators, loaded and stored by tile around it (2 x 16 rows
// by 2 x 16 values of d).

// one chunk item's attention on tiles (configured by the caller; set up by start_packed_item with
// pad 32): acc [rows32][d] and ml[rows32] as attend_item leaves them. packed: the (sequence, kv
// head)'s chunks.
inline void attend_chunk_amx(const PackedItem& it, int64_t d, const uint32_t* packed, std::vector<float>& acc,
                             std::vector<Partial>& ml, const std::vector<uint16_t>& qb16, std::vector<float>& scores,
                             std::vector<uint32_t>& pw) {
  const int64_t rows = it.rows, r32 = it.padded, half = kAmxKeys / 2, words = amx_chunk_words(d);
  float* const sb = scores.data();   // the scores of one block of 32 rows at a time
  for (int64_t c = it.c0; c < it.c1; ++c) {
    const int64_t k0 = c * kAmxKeys, kend = it.kend(k0);
    const uint32_t* kw = packed + c * words;
    const uint32_t* vw = kw + kAmxKeys * d / 2;
    // S = Q . K^T for rows rb .. rb + 31 into the 32-row scratch sb [32][kAmxKeys]
    auto qk_block = [&](int64_t rb) {
      if (d == 64) {
        // head dim 64: the 32 rows' queries stay in tiles 4-7 (rows x halves of d) for the whole
        // chunk; per 16 keys two tiles of K^T and two of sums (rows 0-15, 16-31): half the tile
        // loads of the 2 x 2 steps below. Measured (AMX host, SmolLM2's heads, the two loops
        // alternated call by call, same output): 0.93x the attention's time at 2,048 prompt
        // queries and at 256 queries after 1,792 keys
        const uint16_t* q0 = qb16.data() + rb * d;
        _tile_loadd(4, q0, d * 2);
        _tile_loadd(5, q0 + 32, d * 2);
        _tile_loadd(6, q0 + 16 * d, d * 2);
        _tile_loadd(7, q0 + 16 * d + 32, d * 2);
        for (int64_t kb = 0; kb < kend; kb += 16) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(2, kw + kb, kAmxKeys * 4);
          _tile_loadd(3, kw + 16 * kAmxKeys + kb, kAmxKeys * 4);
          _tile_dpbf16ps(0, 4, 2);
          _tile_dpbf16ps(1, 6, 2);
          _tile_dpbf16ps(0, 5, 3);
          _tile_dpbf16ps(1, 7, 3);
          _tile_stored(0, sb + kb, kAmxKeys * 4);
          _tile_stored(1, sb + 16 * kAmxKeys + kb, kAmxKeys * 4);
        }
      } else {
        for (int64_t kb = 0; kb < kend; kb += 32) {
          amx_zero_2x2();
          for (int64_t ks = 0; ks < d; ks += 32) {
            const uint32_t* b = kw + (ks / 2) * kAmxKeys + kb;
            amx_step_2x2(qb16.data() + rb * d + ks, qb16.data() + (rb + 16) * d + ks, d * 2, b, b + 16, kAmxKeys * 4);
          }
          amx_store_2x2(sb + kb, sb + 16 + kb, sb + 16 * kAmxKeys + kb, sb + 16 * kAmxKeys + 16 + kb, kAmxKeys * 4);
        }
      }
    };
    // per block of 32 rows: their scores on the tiles, then their softmax, the scores in one
    // 32-row scratch (16 KB, kept in L1) instead of the item's whole [rows][kAmxKeys] (48 KB
    // for SmolLM2's 96 rows, which pushed the packed chunk and the probabilities out of L1).
    // Measured (AMX host, SmolLM2's heads, the op alone, 30 calls each way alternated, twice,
    // same output): 0.97-0.98x the attention's time at 2,048 prompt queries, 0.95-0.99x at 256
    // after 1,792 keys. (The P . V of each block right after its softmax as well: 1.03-1.05x,
    // not kept.)
    for (int64_t rb = 0; rb < r32; rb += 32) {
      qk_block(rb);
      for (int64_t r = rb; r < std::min(rb + 32, rows); ++r) it.softmax_row(r, sb + (r - rb) * kAmxKeys, k0, kend, d, ml, acc, pw);
    }
    // O += P . V
    for (int64_t rb = 0; rb < r32; rb += 32)
      for (int64_t db = 0; db < d; db += 32) {
        float* a0 = acc.data() + rb * d + db;
        float* a1 = a0 + 16 * d;
        amx_load_2x2(a0, a0 + 16, a1, a1 + 16, d * 4);
        for (int64_t ks = 0; ks < kend / 2; ks += 16)
          amx_step_2x2(pw.data() + rb * half + ks, pw.data() + (rb + 16) * half + ks, half * 4, vw + ks * d + db,
                        vw + ks * d + db + 16, d * 4);
        amx_store_2x2(a0, a0 + 16, a1, a1 + 16, d * 4);
      }
  }
}
#endif

template <typename T, int64_t DC, bool Spread>
void attend_decode_heads(const Item& item, const T* q, const T* kpool, const T* vpool, const int32_t* q_starts,
                         const int32_t* start_pos, const int32_t* tables, int64_t max_blocks, int64_t h,
                         int64_t kvh, int64_t bs, float scale, int64_t window, std::vector<float>& acc,
                         std::vector<Partial>& ml, std::vector<float>& qf, std::vector<float>& scores,
                         std::vector<float>& vf, std::vector<uint32_t>& pw) {
  constexpr int64_t d = DC;
  constexpr bool bf16 = std::is_same_v<T, at::BFloat16>;
  const int64_t group = h / kvh, s = item.seq, p0 = start_pos[s];
  const auto [visible_from, b0, b1] = decode_split(item, p0, bs, window);
  start_decode_item(h, d, acc, ml);
  if (static_cast<int64_t>(scores.size()) < h * bs + 16) scores.resize(h * bs + 16);
  const int64_t half = (bs + 1) / 2;
  if (static_cast<int64_t>(pw.size()) < h * half) pw.resize(h * half);
  if (static_cast<int64_t>(vf.size()) < bs * d) vf.resize(bs * d);
  const T* qs = q + static_cast<int64_t>(q_starts[s]) * h * d;   // head r's query at qs + r * d
  if constexpr (!bf16) {                                           // fp32: pre-scaled
    qf.resize(h * d);
    for (int64_t i = 0; i < h * d; ++i) qf[i] = load(qs, i) * scale;
  }
  const __m512 sv = _mm512_set1_ps(bf16 ? scale : 1.f);
  const int32_t* table = tables + s * max_blocks;
  const int64_t row = kvh * d;                                     // between one key's rows
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t first_key = b * bs, n = std::min(bs, p0 + 1 - first_key);
    const int64_t from = std::max<int64_t>(0, visible_from - first_key);
    if (n <= from) continue;
    const int64_t block_bytes = bs * row * static_cast<int64_t>(sizeof(T));
    if constexpr (!Spread) {
      // blocks b + 1 .. b + kDecodeBurstBlocks in one burst at the split's first block, the
      // farthest at each later one (the kernel before DecodePrefetch)
      for (int64_t a = b == b0 ? 1 : kDecodeBurstBlocks; a <= kDecodeBurstBlocks && b + a < b1; ++a) {
        const char* kn = reinterpret_cast<const char*>(kpool + static_cast<int64_t>(table[b + a]) * bs * row);
        const char* vn = reinterpret_cast<const char*>(vpool + static_cast<int64_t>(table[b + a]) * bs * row);
        for (int64_t off = 0; off < block_bytes; off += 64) {
          __builtin_prefetch(kn + off, 0, 1);   // prefetcht2: L2
          __builtin_prefetch(vn + off, 0, 1);
        }
      }
    }
    // a block of 32 keys seen whole (all but the last and a window's edge), bf16: each KV head's
    // group of rows takes the register softmax together (softmax_block32_rows, as the chunk
    // path's whole blocks), probabilities straight to bf16 pairs; outputs bit for bit as the
    // one-row update's. SmolLM2's heads (3 KV heads, groups of 3), with the PV's group below,
    // old against new in four fresh pairs of processes: one decode at 2k keys 0.83x the time,
    // 32 at 4k 0.88x (cold: more of it is the pool's reads)
    const bool whole = bf16 && kDecodeBf16 && bs == 32 && from == 0 && n == 32 && group <= 4;
    // the next block, K and V, into L2 while this one computes, a piece at each of this block's
    // steps (per KV head: its start, each row's two score halves, the softmax; fewer where the
    // block is not whole), the rest at the block's end; at the split's first block in one burst
    DecodePrefetch ahead;
    if (Spread && b + kDecodePrefetchBlocks < b1) {
      const int64_t nb = table[b + kDecodePrefetchBlocks];
      const int64_t steps = whole ? kvh * (2 + 2 * group) : kvh * (1 + group);
      const int64_t chunks = (block_bytes + kPrefetchChunk - 1) / kPrefetchChunk;
      ahead = DecodePrefetch{reinterpret_cast<const char*>(kpool + nb * bs * row),
                             reinterpret_cast<const char*>(vpool + nb * bs * row), 0, block_bytes,
                             (chunks + steps - 1) / steps * kPrefetchChunk};
      if (b == b0) ahead.finish();
    }
    for (int64_t kv = 0; kv < kvh; ++kv) {
      if constexpr (Spread) ahead.run();
      const T* kb = kpool + (static_cast<int64_t>(table[b]) * bs * kvh + kv) * d;
      const T* vb = vpool + (static_cast<int64_t>(table[b]) * bs * kvh + kv) * d;
      if constexpr (!bf16 || !kDecodeBf16) {
        for (int64_t j = 0; j < n; ++j) {
          const T* vj = vb + j * row;
          float* vfj = vf.data() + j * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) vfj[i] = load(vj, i);
        }
      }
      const int64_t r0 = kv * group;
      for (int64_t r = r0; r < r0 + group; ++r) {
        if constexpr (Spread) ahead.run();
        const T* qrow = bf16 ? qs + r * d : reinterpret_cast<const T*>(qf.data() + r * d);
        float* sc = scores.data() + r * bs;
        if (whole) {   // raw scores: the softmax scales them
          _mm512_storeu_ps(sc, qk16<T, DC>(qrow, kb, row, 16));
          if constexpr (Spread) ahead.run();
          _mm512_storeu_ps(sc + 16, qk16<T, DC>(qrow, kb + 16 * row, row, 16));
          continue;
        }
        for (int64_t j0 = 0; j0 < n; j0 += 16)
          _mm512_storeu_ps(sc + j0, _mm512_mul_ps(qk16<T, DC>(qrow, kb + j0 * row, row, std::min<int64_t>(16, n - j0)), sv));
        softmax_update(ml[r], acc.data() + r * d, d, sc, bs, from, n);
      }
      int64_t r = r0;
      if constexpr (bf16 && kDecodeBf16) {
#if defined(__AVX512BF16__)
        if (whole) {
          Partial* mlr = ml.data() + r0;
          float* ar = acc.data() + r0 * d;
          const float* scr = scores.data() + r0 * bs;
          uint32_t* pwr = pw.data() + r0 * half;
          switch (group) {
            case 1: softmax_block32_rows<1>(mlr, ar, d, scr, bs, scale, pwr, half); break;
            case 2: softmax_block32_rows<2>(mlr, ar, d, scr, bs, scale, pwr, half); break;
            case 3: softmax_block32_rows<3>(mlr, ar, d, scr, bs, scale, pwr, half); break;
            default: softmax_block32_rows<4>(mlr, ar, d, scr, bs, scale, pwr, half); break;
          }
          if constexpr (Spread) ahead.run();
        }
        for (int64_t rr = r0; !whole && rr < r0 + group; ++rr)   // probabilities -> bf16 pairs (0 past n)
          probs_to_bf16_pairs(scores.data() + rr * bs, bs, pw.data() + rr * half);
        const int64_t j2a = from / 2, j2b = (n + 1) / 2;
        const at::BFloat16* vbb = reinterpret_cast<const at::BFloat16*>(vb);
        // the group's rows share each key pair's loads and interleaves (3 rows at once against
        // 2 + 1, four fresh pairs of processes: 8 decodes x 1,216 keys 0.89x the time, 32 x 4k 0.965x)
        const int64_t end = r0 + group;
        for (; r + 4 <= end; r += 4)
          pv_rows_bf16<DC, 4>(pw.data() + r * half, half, vbb, row, j2a, j2b, n, acc.data() + r * d);
        if (end - r == 3) {
          pv_rows_bf16<DC, 3>(pw.data() + r * half, half, vbb, row, j2a, j2b, n, acc.data() + r * d);
          r += 3;
        }
        for (; r + 2 <= end; r += 2)
          pv_rows_bf16<DC, 2>(pw.data() + r * half, half, vbb, row, j2a, j2b, n, acc.data() + r * d);
        if (r < end) pv_rows_bf16<DC, 1>(pw.data() + r * half, half, vbb, row, j2a, j2b, n, acc.data() + r * d);
#endif
      } else {
        for (; r + 2 <= r0 + group; r += 2)
          pv_rows<DC, 2>(scores.data() + r * bs, bs, vf.data(), from, n, acc.data() + r * d);
        if (r < r0 + group) pv_rows<DC, 1>(scores.data() + r * bs, bs, vf.data(), from, n, acc.data() + r * d);
      }
    }
    if constexpr (Spread) ahead.finish();
  }
#if defined(__AVX512BF16__)
  if constexpr (bf16 && kDecodeBf16) decode_acc_order<DC>(acc.data(), h);
#endif
}
#endif

// Whether this build has attend_decode_heads for T and head dim DC (FASTGEN_DECODE_KERNEL=0
// can still turn it off at run time): AVX-512, a head dim that is a multiple of 64 known at
// compile time, and for bf16 the vdpbf16ps scores.
template <typename T, int64_t DC>
constexpr bool decode_heads_built() {
  return kHaveDecodeKernel && DC > 0 && DC % 64 == 0 && (!std::is_same_v<T, at::BFloat16> || kDecodeBf16);
}

// DC: the head dim as a compile-time constant (64, 128: loops fully unrolled, no remainder
// handling; measured 1.6x faster at 64) or 0 for any other head dim.
// ---------------------------------------------------------------------------------------
// The 8-bit KV cache (kv_cache_dtype="int8"): each (token, KV head) row of K and V is stored as
// int8 values q with one fp32 scale s (x ~ q * s, s = max|x| / 127, rounded to nearest), so a
// decode reads a little over half the bytes of a bf16 pool. Layouts, per block of bs tokens:
// K [kvh][d/4][bs][4] (four values of a key contiguous, keys next to each other, so that one
// vpdpbusd takes four values of sixteen keys and its sums are the keys' scores, no horizontal
// sums), V [kvh][bs/4][d][4] (a value of four keys contiguous, so that one vpdpbusd takes four
// keys' probabilities against sixteen values), scales [kvh][bs].
// Decodes read it in place (attend_decode_i8); fp32 prompt chunks that attend_chunk_f32 takes are
// packed from it (pack_chunk_f32_i8); other prompt chunks, whose attention is bound by arithmetic
// rather than by the pool's reads, take the bf16 / fp32 kernels on a copy of their blocks
// dequantized once per call (paged_attention_i8).
struct KvI8 {
  const int8_t* k;
  const int8_t* v;
  const float* ks;          // [blocks, kvh, bs]
  const float* vs;
  const int32_t* tables;    // the pool's own block tables [num_seqs, max_blocks]
  bool decodes;             // decodes read it in place (attend_decode_i8)
  bool chunks;              // fp32 prompt chunks packed from it (pack_chunk_f32_i8; chunk_packs_f32)
};
// byte of value e of token `off` of block `blk`, KV head kv, in the K layout
inline int64_t k_i8_at(int64_t blk, int64_t kv, int64_t off, int64_t e, int64_t kvh, int64_t d, int64_t bs) {
  return ((blk * kvh + kv) * (d / 4) + e / 4) * bs * 4 + off * 4 + e % 4;
}
// byte of value e of token `off` of block `blk`, KV head kv, in the V layout
inline int64_t v_i8_at(int64_t blk, int64_t kv, int64_t off, int64_t e, int64_t kvh, int64_t d, int64_t bs) {
  return ((blk * kvh + kv) * (bs / 4) + off / 4) * d * 4 + e * 4 + off % 4;
}

#if defined(FASTGEN_HAVE_PACKED_F32)
// pack_chunk_f32's layout (K^T [d][kAmxKeys], V [kAmxKeys][d], fp32) straight from an 8-bit pool:
// the blocks of such chunks had been dequantized into a copy first (paged_attention_i8) that the
// packing then read again. x = q * s in fp32 as dequant_kv_block computes it, so the packed chunk
// is the same bit for bit. Eight keys at a time (bs % 8 == 0: they lie in one block); keys from
// num_keys on read as zero. The K layout holds four values of eight keys in 32 bytes and the V
// layout a value of four keys in 4: a 4 x 4 byte transpose within each 128-bit lane, then one
// dword of each lane, widens either to eight fp32 values of K^T's row or V's.
constexpr bool kHavePackedF32 = true;
// the lanes of the 8 keys 8g .. 8g + 7 below n (all ones), as a mask for the 32-bit loads (also
// i8_keys32's on AVX2)
inline __m256i keys_below8(int64_t g, int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - 8 * g)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline void pack_chunk_f32_i8(const KvI8& kv8, const int32_t* table, int64_t bs, int64_t kvh, int64_t d, int64_t kv,
                              int64_t k0, int64_t num_keys, uint32_t* dst) {
  float* kt = reinterpret_cast<float*>(dst);
  float* vr = kt + kAmxKeys * d;
  const __m256i t4 = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                      0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  auto widen = [](__m256i x, int c) {   // dword c of each lane: eight bytes as fp32
    const __m256i idx = _mm256_setr_epi32(c, c + 4, c, c + 4, c, c + 4, c, c + 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x, idx))));
  };
  for (int64_t jb = 0; jb < kAmxKeys; jb += 8) {
    const int64_t key = k0 + jb, n = std::min<int64_t>(8, num_keys - key);
    if (n <= 0) {
      for (int64_t e = 0; e < d; ++e) _mm256_storeu_ps(kt + e * kAmxKeys + jb, _mm256_setzero_ps());
      std::memset(vr + jb * d, 0, 8 * d * sizeof(float));
      continue;
    }
    const int64_t blk = table[key / bs], off = key % bs;
    const float* ksc = kv8.ks + (blk * kvh + kv) * bs + off;
    const float* vsc = kv8.vs + (blk * kvh + kv) * bs + off;
    // only the n keys' scales read; lanes past the last key zeroed after the product (0 times a
    // negative byte would be -0)
    const __m256i below = keys_below8(0, n);
    const __m256 ks = _mm256_maskload_ps(ksc, below), live = _mm256_castsi256_ps(below);
    const int8_t* kb = kv8.k + k_i8_at(blk, kv, off, 0, kvh, d, bs);
    for (int64_t w = 0; w < d / 4; ++w) {
      const __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + w * bs * 4)), t4);
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_ps(kt + (4 * w + c) * kAmxKeys + jb, _mm256_and_ps(_mm256_mul_ps(widen(x, c), ks), live));
    }
    for (int64_t g = 0; g < 8; g += 4) {   // four keys a step of the V layout
      const int8_t* vb = kv8.v + v_i8_at(blk, kv, off + g, 0, kvh, d, bs);
      for (int64_t e = 0; e < d; e += 8) {
        const __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + e * 4)), t4);
        for (int c = 0; c < 4; ++c) {
          float* row = vr + (jb + g + c) * d + e;
          if (g + c < n) _mm256_storeu_ps(row, _mm256_mul_ps(widen(x, c), _mm256_set1_ps(vsc[g + c])));
          else _mm256_storeu_ps(row, _mm256_setzero_ps());
        }
      }
    }
  }
}
#else
constexpr bool kHavePackedF32 = false;
#endif
// whether paged_attention_impl packs a sequence's chunk of nq queries for attend_chunk_f32 (fp32)
inline bool chunk_packs_f32(int64_t nq, int64_t group, int64_t d) {
  return kHavePackedF32 && nq > 1 && d % 64 == 0 && nq * group >= kManyRows;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

// Up to 32 keys of one KV head (keys [from, n) of them take part, n <= 32) against its R query
// rows: scores, online softmax, and P.V in registers. kb: the first key's word 0 in the K layout
// (word w of the keys bs * 4 bytes further each); vb: their first four keys in the V layout; ksc,
// vsc: their scales. Only the n keys are read.
template <int64_t DC, int R>
inline void i8_keys32(const int8_t* kb, int64_t bs, const int8_t* vb, const float* ksc, const float* vsc,
                      const int32_t* qi, const float* qsc, const float* qcorr, int64_t from, int64_t n, Partial* ml,
                      float* acc) {
  constexpr int64_t W = DC / 4;
  constexpr int C = static_cast<int>(DC / 16);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint32_t have = static_cast<uint32_t>(n >= 32 ? 0xFFFFFFFFull : (1ull << n) - 1);
  const __mmask16 h0 = static_cast<__mmask16>(have & 0xFFFF), h1 = static_cast<__mmask16>(have >> 16);
  __m512i dot[R][2];
  for (int r = 0; r < R; ++r) dot[r][0] = _mm512_setzero_si512(), dot[r][1] = _mm512_setzero_si512();
  for (int64_t w = 0; w < W; ++w) {   // values 4w .. 4w + 3 of the keys (a key's four bytes a lane)
    const __m512i k0 = _mm512_xor_si512(_mm512_maskz_loadu_epi32(h0, kb + w * bs * 4), flip);
    const __m512i k1 = _mm512_xor_si512(_mm512_maskz_loadu_epi32(h1, kb + w * bs * 4 + 64), flip);
    for (int r = 0; r < R; ++r) {
      const __m512i qv = _mm512_set1_epi32(qi[r * W + w]);
      dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], k0, qv);
      dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], k1, qv);
    }
  }
  const uint32_t live = (have >> from) << from;
  const __mmask16 m0 = static_cast<__mmask16>(live & 0xFFFF), m1 = static_cast<__mmask16>(live >> 16);
  const __m512 ks0 = _mm512_maskz_loadu_ps(h0, ksc), ks1 = _mm512_maskz_loadu_ps(h1, ksc + 16);
  const __m512 vs0 = _mm512_maskz_loadu_ps(h0, vsc), vs1 = _mm512_maskz_loadu_ps(h1, vsc + 16);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) uint32_t pw[R][8];
  float pmax[R];
  for (int r = 0; r < R; ++r) {
    // |dot| <= 255 * 127 * DC: exact in fp32
    const __m512 f = _mm512_set1_ps(qsc[r]), c = _mm512_set1_ps(qcorr[r]);
    const __m512 s0 = _mm512_mask_mov_ps(ninf, m0, _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(dot[r][0]), c), f), ks0));
    const __m512 s1 = _mm512_mask_mov_ps(ninf, m1, _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(dot[r][1]), c), f), ks1));
    const float mx = std::max(ml[r].m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
    const __m512 mv = _mm512_set1_ps(mx);
    const __m512 p0 = _mm512_maskz_mov_ps(m0, fast_exp16_nonpos(_mm512_sub_ps(s0, mv)));
    const __m512 p1 = _mm512_maskz_mov_ps(m1, fast_exp16_nonpos(_mm512_sub_ps(s1, mv)));
    float corr = 1.f;
    if (mx != ml[r].m) {   // an unmoved maximum leaves the accumulator as it is
      corr = fast_exp(ml[r].m - mx);
      const __m512 cv = _mm512_set1_ps(corr);
      for (int cc = 0; cc < C; ++cc) _mm512_storeu_ps(acc + r * DC + 16 * cc, _mm512_mul_ps(_mm512_loadu_ps(acc + r * DC + 16 * cc), cv));
    }
    ml[r] = Partial{mx, ml[r].l * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1))};
    // the probabilities times the value rows' scales, to 8 bits against their largest
    const __m512 q0 = _mm512_mul_ps(p0, vs0), q1 = _mm512_mul_ps(p1, vs1);
    pmax[r] = _mm512_reduce_max_ps(_mm512_max_ps(q0, q1));
    const __m512 k = _mm512_set1_ps(pmax[r] > 0.f ? 255.f / pmax[r] : 0.f);
    _mm_store_si128(reinterpret_cast<__m128i*>(pw[r]), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(q0, k))));
    _mm_store_si128(reinterpret_cast<__m128i*>(pw[r] + 4), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(q1, k))));
  }
  // P.V in passes of CH vectors of the head dim, so that the passes' int32 sums and the values
  // they load stay in registers (R x CH <= 16): one pass for head dims 64 (and 128 at up to two
  // rows), several for 256 (Gemma 3). Each sum is exact, so the passes give the same output.
  constexpr int CH = (R * C <= 16) ? C : (16 / R >= 8 ? 8 : 16 / R >= 4 ? 4 : 16 / R >= 2 ? 2 : 1);
  static_assert(C % CH == 0, "the head dim's vectors split into whole passes");
  for (int c0 = 0; c0 < C; c0 += CH) {
    __m512i ai[R][CH];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CH; ++c) ai[r][c] = _mm512_setzero_si512();
    for (int64_t j4 = from / 4; j4 < (n + 3) / 4; ++j4) {   // four keys' probabilities against 16 values of them
      __m512i vv[CH];
      for (int c = 0; c < CH; ++c) vv[c] = _mm512_loadu_si512(vb + j4 * DC * 4 + 64 * (c0 + c));
      for (int r = 0; r < R; ++r) {
        const __m512i pv = _mm512_set1_epi32(static_cast<int>(pw[r][j4]));
        for (int c = 0; c < CH; ++c) ai[r][c] = _mm512_dpbusd_epi32(ai[r][c], pv, vv[c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 f = _mm512_set1_ps(pmax[r] / 255.f);
      for (int c = 0; c < CH; ++c) {
        float* a = acc + r * DC + 16 * (c0 + c);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][c]), f, _mm512_loadu_ps(a)));
      }
    }
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 hosts (no VNNI): decodes read the 8-bit pool in place too, where they had dequantized their
// blocks into an fp32 copy and read that (8 decodes at 1,300 keys in SmolLM2's forward took 1.7-2.6x
// the time of an fp32 pool's). The scores are the VNNI kernel's: each head's query rounded to int8,
// the exact integer dot product of the two (vpmaddubsw on |k| and the query's bytes signed as k's,
// no pair over 2 * 127 * 127, then vpmaddwd) times both scales. The values are widened to fp32 and
// multiplied by the probabilities times their rows' scales in fp32 (vpmaddubsw's 16-bit pairs
// cannot hold 8-bit probabilities times 8-bit values), so this kernel rounds less than the VNNI one.

// i8_keys32 on AVX2: up to 32 keys of one KV head (keys [from, n) take part, n <= 32) against its
// R query rows (qi: their int8 words, qsc: their scales times the softmax's; qcorr, the VNNI
// kernel's correction of its unsigned keys, is not needed). Only the n keys' words and scales are
// read; the values of whole groups of four keys.
template <int64_t DC, int R>
inline void i8_keys32(const int8_t* kb, int64_t bs, const int8_t* vb, const float* ksc, const float* vsc,
                      const int32_t* qi, const float* qsc, const float*, int64_t from, int64_t n, Partial* ml,
                      float* acc) {
  constexpr int64_t W = DC / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t groups = (n + 7) / 8;
  __m256 sc[R][4];
  __m256i below[4];   // keys below n of each group of 8 (what is read)
  __m256 live[4];     // keys [from, n) (what takes part)
  for (int64_t g = 0; g < 4; ++g) {
    below[g] = keys_below8(g, n);
    live[g] = _mm256_castsi256_ps(_mm256_andnot_si256(keys_below8(g, from), below[g]));
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 2) {   // two groups of 8 keys a pass over the words
    const __m256i m0 = below[g0], m1 = below[g0 + 1];
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t w = 0; w < W; ++w) {   // values 4w .. 4w + 3 of the keys (a key's four bytes a lane)
      const int* kw = reinterpret_cast<const int*>(kb + w * bs * 4 + g0 * 32);
      const __m256i k0 = _mm256_maskload_epi32(kw, m0), k1 = _mm256_maskload_epi32(kw + 8, m1);
      const __m256i a0 = _mm256_abs_epi8(k0), a1 = _mm256_abs_epi8(k1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i qv = _mm256_set1_epi32(qi[r * W + w]);
        dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(qv, k0)), ones));
        dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(qv, k1)), ones));
      }
    }
    for (int64_t gg = 0; gg < 2 && g0 + gg < 4; ++gg) {
      const __m256 ks = _mm256_maskload_ps(ksc + 8 * (g0 + gg), below[g0 + gg]);
      for (int r = 0; r < R; ++r)   // |dot| <= 127 * 127 * DC: exact in fp32
        sc[r][g0 + gg] = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][gg]),
                                                                            _mm256_set1_ps(qsc[r])), ks), live[g0 + gg]);
    }
  }
  for (int64_t g = groups + groups % 2; g < 4; ++g)
    for (int r = 0; r < R; ++r) sc[r][g] = ninf;
  // the online softmax of each row; the probabilities times the value rows' scales into pv[r][32]
  alignas(32) float pv[R][32];
  __m256 vs[4];
  for (int64_t g = 0; g < 4; ++g) vs[g] = _mm256_maskload_ps(vsc + 8 * g, below[g]);
  for (int r = 0; r < R; ++r) {
    const float mx = std::max(ml[r].m, hmax8(_mm256_max_ps(_mm256_max_ps(sc[r][0], sc[r][1]),
                                                           _mm256_max_ps(sc[r][2], sc[r][3]))));
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 l = _mm256_setzero_ps();
    for (int64_t g = 0; g < 4; ++g) {
      // dead keys: exp(0), then zero
      const __m256 x = _mm256_sub_ps(_mm256_blendv_ps(mv, sc[r][g], live[g]), mv);
      const __m256 p = _mm256_and_ps(fast_exp8(x), live[g]);
      l = _mm256_add_ps(l, p);
      _mm256_store_ps(pv[r] + 8 * g, _mm256_mul_ps(p, vs[g]));
    }
    float corr = 1.f;
    if (mx != ml[r].m) {   // an unmoved maximum leaves the accumulator as it is
      corr = fast_exp(ml[r].m - mx);
      const __m256 cv = _mm256_set1_ps(corr);
      for (int64_t i = 0; i < DC; i += 8) _mm256_storeu_ps(acc + r * DC + i, _mm256_mul_ps(_mm256_loadu_ps(acc + r * DC + i), cv));
    }
    ml[r] = Partial{mx, ml[r].l * corr + hsum8(l)};
  }
  // P.V: a group of four keys holds, for each value e, the four keys' bytes in a word; 8 bytes
  // widened to fp32 are values e, e + 1 of the four keys, multiplied by the four probabilities
  // (lanes: key), and the key lanes summed once a pass (TP such vectors a row a pass: 2 TP values)
  constexpr int TP = R <= 3 ? 4 : 2;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t j4a = from / 4, j4b = (n + 3) / 4;
  for (int64_t e0 = 0; e0 < DC; e0 += 2 * TP) {
    __m256 a[R][TP];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TP; ++t) a[r][t] = _mm256_setzero_ps();
    for (int64_t j4 = j4a; j4 < j4b; ++j4) {
      const int8_t* v = vb + j4 * DC * 4 + e0 * 4;
      __m256 vf[TP];
      for (int t = 0; t < TP; ++t)
        vf[t] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * t))));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 p4 = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(pv[r] + 4 * j4));
        for (int t = 0; t < TP; ++t) a[r][t] = _mm256_fmadd_ps(p4, vf[t], a[r][t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* o = acc + r * DC + e0;
      if constexpr (TP == 4) {   // [e0 e2 e4 e6 | e1 e3 e5 e7] -> in order
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_permutevar8x32_ps(h, order)));
      } else {   // [e0 e2 e0 e2 | e1 e3 e1 e3] -> e0 .. e3
        const __m256 h01 = _mm256_hadd_ps(a[r][0], a[r][1]);
        const __m256 h = _mm256_permutevar8x32_ps(_mm256_hadd_ps(h01, h01), order);
        _mm_storeu_ps(o, _mm_add_ps(_mm_loadu_ps(o), _mm256_castps256_ps128(h)));
      }
    }
  }
}

#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kHaveDecodeI8 = true;
template <int64_t DC>
constexpr bool decode_i8_built() { return DC > 0 && DC % 64 == 0; }

// One decode item (a key split of one sequence, all heads) over the 8-bit pool. Each head's
// query is rounded to int8 with its own scale, as the keys are; a score is the exact integer dot
// product of the two (VNNI: vpdpbusd on the keys taken as unsigned q + 128, with 128 * sum(query)
// taken back; AVX2: vpmaddubsw and vpmaddwd) times both scales. With VNNI the probabilities
// times each value row's scale are rounded to 8 bits against their largest in the piece and
// multiply the int8 values by vpdpbusd too; on AVX2 the values are widened to fp32 (i8_keys32 of
// each). acc [h][DC] and ml [h] as attend_decode_heads leaves them.
template <typename T, int64_t DC>
void attend_decode_i8(const Item& item, const T* q, const KvI8& kv8, const int32_t* q_starts,
                      const int32_t* start_pos, int64_t max_blocks, int64_t h, int64_t kvh, int64_t bs,
                      float scale, int64_t window, bool prefetch, std::vector<float>& acc,
                      std::vector<Partial>& ml) {
  constexpr int64_t d = DC, W = DC / 4;   // W: 32-bit words of a query
  const int64_t group = h / kvh, s = item.seq, p0 = start_pos[s];
  const auto [visible_from, b0, b1] = decode_split(item, p0, bs, window);
  start_decode_item(h, d, acc, ml);
  // the queries in int8 (qi [h][W] words), per head its scale times the softmax's and 128 * sum
  static thread_local std::vector<int32_t> qi;
  static thread_local std::vector<float> qsc, qcorr;
  qi.resize(h * W), qsc.resize(h), qcorr.resize(h);
  const T* qrow0 = q + static_cast<int64_t>(q_starts[s]) * h * d;
  for (int64_t r = 0; r < h; ++r) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(load(qrow0 + r * d, i)));
    const float sq = amax > 0.f ? amax / 127.f : 1.f;
    int32_t sum = 0;
    int8_t* qb = reinterpret_cast<int8_t*>(qi.data() + r * W);
    for (int64_t i = 0; i < d; ++i) {
      qb[i] = static_cast<int8_t>(std::clamp(std::nearbyint(load(qrow0 + r * d, i) / sq), -127.f, 127.f));
      sum += qb[i];
    }
    qsc[r] = sq * scale;
    qcorr[r] = 128.f * static_cast<float>(sum);
  }
  const int32_t* table = kv8.tables + s * max_blocks;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t first_key = b * bs, n = std::min(bs, p0 + 1 - first_key);
    const int64_t from = std::max<int64_t>(0, visible_from - first_key);
    if (n <= from) continue;
    const int64_t blk = table[b];
    if (b + 1 < b1) {   // the next block's scales (kvh * bs floats each, apart from the values): else a
      // miss per KV head in the middle of the block's work (8 decodes x 1,300 keys in SmolLM2's
      // forward: the attention 270 -> 240 us a layer)
      const char* kn = reinterpret_cast<const char*>(kv8.ks + static_cast<int64_t>(table[b + 1]) * kvh * bs);
      const char* vn = reinterpret_cast<const char*>(kv8.vs + static_cast<int64_t>(table[b + 1]) * kvh * bs);
      for (int64_t off = 0; off < kvh * bs * 4; off += 64) __builtin_prefetch(kn + off, 0, 3), __builtin_prefetch(vn + off, 0, 3);
    }
    for (int64_t kv = 0; kv < kvh; ++kv) {
      // several decodes: the next block's K and V of this KV head into L2 while this one computes (the
      // whole next block at the block's start instead: 1.06x the time of 8 decodes' forward at
      // 1,300 keys, 32 at 1,000); one decode alone, its keys in cache: none
      if (prefetch && b + 1 < b1) {
        const char* kn = reinterpret_cast<const char*>(kv8.k + (static_cast<int64_t>(table[b + 1]) * kvh + kv) * bs * d);
        const char* vn = reinterpret_cast<const char*>(kv8.v + (static_cast<int64_t>(table[b + 1]) * kvh + kv) * bs * d);
        for (int64_t off = 0; off < bs * d; off += 64) __builtin_prefetch(kn + off, 0, 1), __builtin_prefetch(vn + off, 0, 1);
      }
      const int8_t* kb = kv8.k + (blk * kvh + kv) * W * bs * 4;
      const int8_t* vb = kv8.v + (blk * kvh + kv) * bs * d;
      const float* ksc = kv8.ks + (blk * kvh + kv) * bs;
      const float* vsc = kv8.vs + (blk * kvh + kv) * bs;
      // the block in pieces of 32 keys, the group's rows four at a time (SmolLM2: one piece, 3 rows)
      for (int64_t j0 = 0; j0 < n; j0 += 32) {
        const int64_t pf = std::max<int64_t>(0, from - j0), pn = std::min<int64_t>(32, n - j0);
        if (pn <= pf) continue;
        for (int64_t rb = kv * group; rb < (kv + 1) * group; rb += 4) {
          auto piece = [&](auto rows) {
            i8_keys32<DC, decltype(rows)::value>(kb + j0 * 4, bs, vb + j0 * d, ksc + j0, vsc + j0, qi.data() + rb * W,
                                                 qsc.data() + rb, qcorr.data() + rb, pf, pn, ml.data() + rb,
                                                 acc.data() + rb * d);
          };
          switch (std::min<int64_t>(4, (kv + 1) * group - rb)) {
            case 1: piece(std::integral_constant<int, 1>{}); break;
            case 2: piece(std::integral_constant<int, 2>{}); break;
            case 3: piece(std::integral_constant<int, 3>{}); break;
            default: piece(std::integral_constant<int, 4>{}); break;
          }
        }
      }
    }
  }
}
#else
constexpr bool kHaveDecodeI8 = false;
template <int64_t DC>
constexpr bool decode_i8_built() { return false; }
template <typename T, int64_t DC>
void attend_decode_i8(const Item&, const T*, const KvI8&, const int32_t*, const int32_t*, int64_t, int64_t, int64_t,
                      int64_t, float, int64_t, bool, std::vector<float>&, std::vector<Partial>&) {}
#endif

template <typename T, int64_t DC>
void paged_attention_impl(const T* q, const T* kpool, const T* vpool, const int32_t* q_starts,
                          const int32_t* start_pos, const int32_t* tables, int64_t max_blocks,
                          int64_t num_seqs, int64_t h, int64_t kvh, int64_t d_runtime, int64_t bs,
                          float scale, int64_t window, int64_t num_threads, T* out,
                          const KvI8* i8 = nullptr) {
  const int64_t d = DC > 0 ? DC : d_runtime;
  const int64_t group = h / kvh;
  // decode key splits: enough items to keep every thread busy when decodes are few
  // a decode reads its last `window` keys only (window > 0), so it is split by those
  auto num_keys = [&](int64_t s) { return window > 0 ? std::min<int64_t>(window, start_pos[s] + 1) : start_pos[s] + 1; };
  int64_t decode_keys = 0, num_decodes = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    if (q_starts[s + 1] - q_starts[s] == 1) decode_keys += num_keys(s), ++num_decodes;
  const int64_t target_items = 4 * num_threads;
  // decodes as one item per key split with all their heads (attend_decode_heads) where that
  // kernel builds; else one per KV head (attend_item)
  bool heads = false;
  if constexpr (decode_heads_built<T, DC>()) heads = decode_kernel_enabled();
  if constexpr (kHaveDecodeAvx2 && std::is_same_v<T, float>) heads = d % 16 == 0;
  if constexpr (decode_i8_built<DC>()) {
    if (i8 != nullptr && i8->decodes) heads = true;   // the caller asks for it only where this kernel is built
  }
  const int64_t decode_kv_items = heads ? 1 : kvh;
  std::vector<Item> items;
  std::vector<int64_t> first_item(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t nq = q_starts[s + 1] - q_starts[s];
    first_item[s] = static_cast<int64_t>(items.size());
    int64_t parts;
    if (nq == 1) {
      const int64_t nblk = (num_keys(s) + bs - 1) / bs;
      int64_t want = 1;
      if (num_decodes * decode_kv_items < target_items)
        want = std::max<int64_t>(1, (target_items * num_keys(s)) / (decode_keys * decode_kv_items));
      parts = std::min<int64_t>(want, std::max<int64_t>(1, nblk / 2));
      // a whole number of splits a thread where they are fewer than items to go round (one
      // decode at 200 keys: 3 splits over 2 threads left one thread idle a third of the time)
      if (num_decodes * decode_kv_items * parts <= target_items && parts > num_threads) parts -= parts % num_threads;
      if (heads) {
        for (int64_t part = 0; part < parts; ++part) items.push_back(Item{s, -1, part, parts});
        continue;
      }
    } else {
      parts = (nq + kQueryTile - 1) / kQueryTile;
    }
    for (int64_t kv = 0; kv < kvh; ++kv)
      for (int64_t part = 0; part < parts; ++part) items.push_back(Item{s, kv, part, parts});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  // partial results of split decodes: item -> offset (rows: h for an all-heads item, else group)
  std::vector<int64_t> part_off(num_items + 1, 0);
  for (int64_t it = 0; it < num_items; ++it)
    part_off[it + 1] = part_off[it] + (items[it].num_parts > 1 && q_starts[items[it].seq + 1] -
                                       q_starts[items[it].seq] == 1 ? (items[it].kv < 0 ? h : group) : 0);
  std::vector<float> part_acc(part_off[num_items] * d);
  std::vector<Partial> part_ml(part_off[num_items]);

  // below ~1k key-head pairs waking the other thread costs more than it saves; above, two
  // threads win. Measured on the 2-core Zen 5 host, one decode (9 heads, 3 KV heads, head dim
  // 64, bf16), one thread against two: 13.0 / 9.2 us at 128 keys, 40.8 / 23.2 at 512, 160 / 85
  // at 2,048 (the threshold was 64k pairs before: every single decode under ~7k keys ran on one
  // thread)
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    work += (start_pos[s] + q_starts[s + 1] - q_starts[s]) * (q_starts[s + 1] - q_starts[s]) * h;
  // prompt chunks on AMX tiles (bf16): their keys and values laid out once per (sequence, kv
  // head), in chunks of kAmxKeys keys, before the items run (pack_tasks: (sequence, kv, chunk));
  // sequence s's kv head kv's chunk c at packed + chunk_at(s, kv, c). With a sliding window, the
  // chunks before the first query's window are left out (no query of the step reads them)
  // (hosts with AVX512-BF16 but no tiles: the same packed chunks, attend_chunk_vec)
  bool use_amx = false, use_packed = false;
  std::vector<int64_t> pack_off, seq_chunks;   // sized where the chunks are packed (not for decode-only steps)
  std::vector<std::array<int64_t, 3>> pack_tasks;
  static thread_local std::vector<uint32_t> packed_store;
#if defined(FASTGEN_HAVE_PACKED_F32)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(FASTGEN_HAVE_PACKED_CHUNKS)   // (AVX2 hosts: bf16 chunks stay with attend_item)
    const bool chunks = num_decodes < num_seqs && d % 32 == 0 && d <= 256;
#if defined(FASTGEN_HAVE_AMX)
    use_amx = chunks && amx_usable();
#endif
    use_packed = use_amx;
#if defined(FASTGEN_HAVE_CHUNK_VEC)
    use_packed = use_packed || (chunks && d % 64 == 0);
#endif
#endif
  } else {   // fp32 chunks (attend_chunk_f32)
    use_packed = num_decodes < num_seqs && d % 64 == 0;
  }
  if (use_packed) pack_off.assign(num_seqs + 1, 0), seq_chunks.assign(num_seqs, 0);
  for (int64_t s = 0; use_packed && s < num_seqs; ++s) {
    const int64_t nq = q_starts[s + 1] - q_starts[s];
    // on the vector path a chunk of fewer rows than kManyRows (query x head) stays with
    // attend_item's per-key products: laying out all its keys would cost more than its products
    const bool packs = std::is_same_v<T, float> ? chunk_packs_f32(nq, group, d)
                                                : nq > 1 && (use_amx || nq * group >= kManyRows);
    seq_chunks[s] = packs ? (start_pos[s] + nq + kAmxKeys - 1) / kAmxKeys : 0;
    pack_off[s + 1] = pack_off[s] + seq_chunks[s] * kvh * chunk_words<T>(d);
    const int64_t first = window > 0 ? std::max<int64_t>(0, start_pos[s] - window + 1) / kAmxKeys : 0;
    for (int64_t kv = 0; kv < kvh; ++kv)
      for (int64_t c = first; c < seq_chunks[s]; ++c) pack_tasks.push_back({s, kv, c});
  }
  if (use_packed && packed_store.size() < static_cast<size_t>(pack_off[num_seqs])) packed_store.resize(pack_off[num_seqs]);
#endif
  uint32_t* packed = packed_store.data();
  auto chunk_at = [&](int64_t s, int64_t kv, int64_t c) {
    return pack_off[s] + (kv * seq_chunks[s] + c) * chunk_words<T>(d);
  };
  const int64_t num_pack = static_cast<int64_t>(pack_tasks.size());
#pragma omp parallel num_threads(num_threads) if (num_items > 1 && work > (1 << 10))
  {
    // this thread's buffers, kept between calls and only grown (a fresh set per call, zeroed, cost
    // ~1 us of a one-decode call at 130 keys: 0.93x the time kept, 0.97x at 1,000 keys, tcmalloc
    // preloaded, calls alternated, same output); what a call leaves in them is only what the
    // blocks of one call already leave each other (every kernel writes what it then reads)
    static thread_local std::vector<float> qf, acc, scores, kf, vf;
    static thread_local std::vector<uint32_t> pw;
    static thread_local std::vector<Partial> ml;
    static thread_local std::vector<uint16_t> qb16;
    auto grow = [](auto& v, size_t n) { if (v.size() < n) v.resize(n); };
    grow(scores, std::max<int64_t>(4, kManyRows) * bs + 16);
    grow(kf, bs * d);
    grow(vf, bs * d);
    bool tiles = false;   // this thread configured the tiles (released at the end)
#if defined(FASTGEN_HAVE_PACKED_F32)
    if (num_pack > 0) {   // (bf16 pairs for the tiles and vdpbf16ps, fp32 K^T and V for the FMAs)
#pragma omp for schedule(static)
      for (int64_t t = 0; t < num_pack; ++t) {
        const auto [s, kv, c] = pack_tasks[t];
        const int64_t num_keys = start_pos[s] + q_starts[s + 1] - q_starts[s];
        if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(FASTGEN_HAVE_PACKED_CHUNKS)
          amx_pack_chunk(kpool, vpool, tables + s * max_blocks, bs, kvh, d, kv, c * kAmxKeys, num_keys,
                         packed + chunk_at(s, kv, c));
#endif
        } else if (i8 != nullptr && i8->chunks)
          pack_chunk_f32_i8(*i8, i8->tables + s * max_blocks, bs, kvh, d, kv, c * kAmxKeys, num_keys,
                            packed + chunk_at(s, kv, c));
        else
          pack_chunk_f32(kpool, vpool, tables + s * max_blocks, bs, kvh, d, kv, c * kAmxKeys, num_keys,
                         packed + chunk_at(s, kv, c));
      }
    }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; ++it) {
      const Item& item = items[it];
      const int64_t s = item.seq;
      const bool decode = q_starts[s + 1] - q_starts[s] == 1;
      const int64_t qa = decode ? 0 : item.part * kQueryTile;
      const int64_t qb = decode ? 1 : std::min<int64_t>(q_starts[s + 1] - q_starts[s], qa + kQueryTile);
      const bool all_heads = item.kv < 0;
      const int64_t rows = all_heads ? h : (qb - qa) * group;
      if (all_heads && i8 != nullptr && i8->decodes) {   // the 8-bit pool in place (VNNI or AVX2)
        if constexpr (decode_i8_built<DC>())
          // several decodes stream their blocks from memory: the next one prefetched; one alone, its
          // keys in cache: without
          attend_decode_i8<T, DC>(item, q, *i8, q_starts, start_pos, max_blocks, h, kvh, bs, scale, window,
                                  num_decodes > 1, acc, ml);
      } else
#if defined(__AVX512F__)
      if (all_heads) {
        if constexpr (decode_heads_built<T, DC>()) {
          // several decodes: their pools stream from memory, so the spread prefetches; one alone
          // (a short context in cache, or one long split into few parts) keeps the bursts
          if (num_decodes > 1)
            attend_decode_heads<T, DC, true>(item, q, kpool, vpool, q_starts, start_pos, tables, max_blocks, h, kvh,
                                             bs, scale, window, acc, ml, qf, scores, vf, pw);
          else
            attend_decode_heads<T, DC, false>(item, q, kpool, vpool, q_starts, start_pos, tables, max_blocks, h, kvh,
                                              bs, scale, window, acc, ml, qf, scores, vf, pw);
        }
      } else
#endif
      if (kHaveDecodeAvx2 && all_heads) {
        if constexpr (kHaveDecodeAvx2 && std::is_same_v<T, float>)
          attend_decode_avx2(item, q, kpool, vpool, q_starts, start_pos, tables, max_blocks, h, kvh, d, bs, scale,
                             window, acc, ml, qf, scores);
      } else
#if defined(FASTGEN_HAVE_PACKED_F32)
      if (use_packed && !decode && seq_chunks[s] > 0) {   // bf16: tiles (32-row blocks) or vectors (8); fp32: vectors (4)
        if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(FASTGEN_HAVE_PACKED_CHUNKS)
          const PackedItem pi = start_packed_item(item, q, q_starts, start_pos, h, kvh, d, scale, window,
                                                  use_amx ? 32 : 8, acc, ml, qb16, scores, pw);
          const uint32_t* chunks = packed + chunk_at(s, item.kv, 0);
#if defined(FASTGEN_HAVE_AMX)
          if (use_amx) {
            if (!tiles) amx_configure(), tiles = true;
            attend_chunk_amx(pi, d, chunks, acc, ml, qb16, scores, pw);
          }
#endif
#if defined(FASTGEN_HAVE_CHUNK_VEC)
          if (!use_amx) attend_chunk_vec(pi, d, chunks, acc, ml, qb16, scores, pw);
#endif
#endif
        } else if constexpr (std::is_same_v<T, float>) {
          const PackedItem pi = start_packed_item(item, q, q_starts, start_pos, h, kvh, d, scale, window, 4, acc, ml,
                                                  qf, scores, pw);
          attend_chunk_f32(pi, d, packed + chunk_at(s, item.kv, 0), acc, ml, qf, scores, pw);
        }
      } else
#endif
      {
        attend_item<T, DC>(item, q, kpool, vpool, q_starts, start_pos, tables, max_blocks, h, kvh, d, bs, scale,
                           window, acc, ml, qf, kf, vf, scores);
      }
      if (decode && item.num_parts > 1) {
        std::memcpy(part_acc.data() + part_off[it] * d, acc.data(), rows * d * sizeof(float));
        std::copy(ml.begin(), ml.begin() + rows, part_ml.begin() + part_off[it]);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = out + (all_heads ? q_starts[s] * h + r : (q_starts[s] + qa + r / group) * h + item.kv * group + r % group) * d;
        const float inv = ml[r].l > 0.f ? 1.f / ml[r].l : 0.f;
        for (int64_t i = 0; i < d; ++i) store(dst, i, acc[r * d + i] * inv);
      }
    }
#if defined(FASTGEN_HAVE_AMX)
    if (tiles) amx_release();
#endif
  }
  if (part_off[num_items] == 0) return;
  // merge the key splits of long decodes
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (q_starts[s + 1] - q_starts[s] != 1 || items[first_item[s]].num_parts == 1) continue;
    const int64_t parts = items[first_item[s]].num_parts;
    const bool all_heads = items[first_item[s]].kv < 0;
    // split sp's row of head kv * group + r
    auto part_row = [&](int64_t kv, int64_t sp, int64_t r) {
      return all_heads ? part_off[first_item[s] + sp] + kv * group + r : part_off[first_item[s] + kv * parts + sp] + r;
    };
    for (int64_t kv = 0; kv < kvh; ++kv) {
      for (int64_t r = 0; r < group; ++r) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < parts; ++sp) mx = std::max(mx, part_ml[part_row(kv, sp, r)].m);
        float l = 0.f;
        float o[DC > 0 ? DC : 256] = {};
        std::vector<float> big(DC > 0 || d <= 256 ? 0 : d, 0.f);
        float* ov = DC > 0 || d <= 256 ? o : big.data();
        for (int64_t sp = 0; sp < parts; ++sp) {
          const int64_t off = part_row(kv, sp, r);
          if (part_ml[off].l == 0.f) continue;
          const float c = fast_exp(part_ml[off].m - mx);
          l += part_ml[off].l * c;
          const float* a = part_acc.data() + off * d;
          for (int64_t i = 0; i < d; ++i) ov[i] += a[i] * c;
        }
        T* dst = out + (q_starts[s] * h + kv * group + r) * d;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t i = 0; i < d; ++i) store(dst, i, ov[i] * inv);
      }
    }
  }
}

template <typename T>
void paged_attention_dispatch(const T* q, const T* kpool, const T* vpool, const int32_t* q_starts,
                              const int32_t* start_pos, const int32_t* tables, int64_t max_blocks,
                              int64_t num_seqs, int64_t h, int64_t kvh, int64_t d, int64_t bs, float scale,
                              int64_t window, int64_t threads, T* out, const KvI8* i8 = nullptr) {
  if (d == 64)
    paged_attention_impl<T, 64>(q, kpool, vpool, q_starts, start_pos, tables, max_blocks, num_seqs, h, kvh, d,
                                bs, scale, window, threads, out, i8);
  else if (d == 128)
    paged_attention_impl<T, 128>(q, kpool, vpool, q_starts, start_pos, tables, max_blocks, num_seqs, h, kvh, d,
                                 bs, scale, window, threads, out, i8);
  else if (d == 256)   // Gemma 3
    paged_attention_impl<T, 256>(q, kpool, vpool, q_starts, start_pos, tables, max_blocks, num_seqs, h, kvh, d,
                                 bs, scale, window, threads, out, i8);
  else
    paged_attention_impl<T, 0>(q, kpool, vpool, q_starts, start_pos, tables, max_blocks, num_seqs, h, kvh, d,
                               bs, scale, window, threads, out, i8);
}

// the checks both paged attention ops make of the step's tensors (k_pool: [blocks, bs, kvh, d])
void check_paged_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& q_starts,
                      const at::Tensor& start_pos, const at::Tensor& block_tables, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be [T, H, D] contiguous");
  TORCH_CHECK(q_starts.scalar_type() == at::kInt && start_pos.scalar_type() == at::kInt &&
              block_tables.scalar_type() == at::kInt && block_tables.is_contiguous());
  const int64_t num_seqs = start_pos.size(0);
  TORCH_CHECK(q_starts.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs);
  TORCH_CHECK(k_pool.size(3) == q.size(2) && q.size(1) % k_pool.size(2) == 0);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& q_starts, const at::Tensor& start_pos,
                           const at::Tensor& block_tables, double scale, int64_t window) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous());
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type());
  check_paged_args(q, k_pool, q_starts, start_pos, block_tables, window);
  const int64_t num_seqs = start_pos.size(0);
  const int64_t h = q.size(1), d = q.size(2), bs = k_pool.size(1), kvh = k_pool.size(2);
  at::Tensor out = at::empty_like(q);
  const int64_t threads = at::get_num_threads();
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_attention",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        paged_attention_dispatch<float>(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                                        q_starts.data_ptr<int32_t>(), start_pos.data_ptr<int32_t>(),
                                        block_tables.data_ptr<int32_t>(), block_tables.size(1), num_seqs, h,
                                        kvh, d, bs, static_cast<float>(scale), window, threads, out.data_ptr<float>()); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        paged_attention_dispatch<at::BFloat16>(
            q.data_ptr<at::BFloat16>(), k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
            q_starts.data_ptr<int32_t>(), start_pos.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
            block_tables.size(1), num_seqs, h, kvh, d, bs, static_cast<float>(scale), window, threads,
            out.data_ptr<at::BFloat16>()); }));
  return out;
}

// ---------------------------------------------------------------------------------------
// The 8-bit KV cache's ops (KvI8 above). A row of d values x -> int8 q and scale s: s = max|x| / 127,
// q = round(x / s) to nearest even (0 and s = 0 for a row of zeros): KVPool.write's arithmetic,
// so either path stores the same bytes.
template <typename T>
inline void quantize_kv_row(const T* x, int64_t d, int8_t* q, float* s) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (d % 16 == 0) {   // the same arithmetic, 16 values at a time (vdivps and vcvtps2dq round as the scalar code)
    const __m512 sign = _mm512_set1_ps(-0.f);
    __m512 mx = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, load16_as_float(x + c, 0xFFFF)));
    const float sc = _mm512_reduce_max_ps(mx) / 127.f;
    *s = sc;
    const __m512 sv = _mm512_set1_ps(sc);
    for (int64_t c = 0; c < d; c += 16) {
      const __m512i v = sc > 0.f ? _mm512_cvtps_epi32(_mm512_div_ps(load16_as_float(x + c, 0xFFFF), sv))
                                 : _mm512_setzero_si512();
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c), _mm512_cvtsepi32_epi8(v));
    }
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(load(x, i)));
  const float sc = amax / 127.f;
  *s = sc;
  for (int64_t i = 0; i < d; ++i)
    q[i] = sc > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(load(x, i) / sc), -127.f, 127.f)) : 0;
}

void check_kv_i8(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k_scales,
                 const at::Tensor& v_scales) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
              k_pool.scalar_type() == at::kChar && v_pool.scalar_type() == at::kChar &&
              v_pool.sizes() == k_pool.sizes(), "an 8-bit KV pool must be two contiguous int8 [blocks, bs, kvh, d]");
  TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat &&
              k_scales.is_contiguous() && v_scales.is_contiguous() && k_scales.dim() == 3 &&
              k_scales.size(0) == k_pool.size(0) && k_scales.size(1) == k_pool.size(2) &&
              k_scales.size(2) == k_pool.size(1) && v_scales.sizes() == k_scales.sizes(),
              "an 8-bit KV pool's scales must be contiguous fp32 [blocks, kvh, bs]");
}

std::vector<at::Tensor> rope_write_kv_i8(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                         const at::Tensor& sin, const at::Tensor& slots, at::Tensor& k_pool,
                                         at::Tensor& v_pool, at::Tensor& k_scales, at::Tensor& v_scales, int64_t h,
                                         int64_t kvh, int64_t d) {
  check_kv_i8(k_pool, v_pool, k_scales, v_scales);
  TORCH_CHECK(k_pool.size(2) == kvh && k_pool.size(3) == d && d % 4 == 0 && d <= 1024 && k_pool.size(1) % 4 == 0,
              "the KV pool's heads or head dim differ from the layer's");
  check_rope_args(qkv, positions, cos, sin, slots, h, kvh, d);
  at::Tensor x = qkv.contiguous();
  const int64_t tokens = x.size(0), width = (h + 2 * kvh) * d;
  at::Tensor q = at::empty({tokens, h, d}, x.options());
  at::Tensor k = at::empty({tokens, kvh, d}, x.options());
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t bs = k_pool.size(1);
  int8_t* kp = k_pool.data_ptr<int8_t>();
  int8_t* vp = v_pool.data_ptr<int8_t>();
  float* ksp = k_scales.data_ptr<float>();
  float* vsp = v_scales.data_ptr<float>();
  auto write = [&](auto tag) {   // q and k rotated, then the rotated k and the raw v rounded into the pool's layouts
    using T = decltype(tag);
    rope_rows<T>(x.data_ptr<T>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), sl,
                 q.data_ptr<T>(), k.data_ptr<T>(), nullptr, nullptr, tokens, h, kvh, d);
    const T* kx = k.data_ptr<T>();
    const T* vx = x.data_ptr<T>() + (h + kvh) * d;
    at::parallel_for(0, tokens * kvh, 64, [&](int64_t a, int64_t b) {
      alignas(64) int8_t kq[1024];
      for (int64_t i = a; i < b; ++i) {
        const int64_t blk = sl[i / kvh] / bs, off = sl[i / kvh] % bs, kv = i % kvh;
        quantize_kv_row(kx + i * d, d, kq, ksp + (blk * kvh + kv) * bs + off);
        for (int64_t e = 0; e < d; e += 4) std::memcpy(kp + k_i8_at(blk, kv, off, e, kvh, d, bs), kq + e, 4);
        quantize_kv_row(vx + (i / kvh) * width + kv * d, d, kq, vsp + (blk * kvh + kv) * bs + off);
        int8_t* vdst = vp + v_i8_at(blk, kv, off, 0, kvh, d, bs);
        for (int64_t e = 0; e < d; ++e) vdst[4 * e] = kq[e];
      }
    });
  };
  AT_DISPATCH_SWITCH(qkv.scalar_type(), "rope_write_kv_i8",
      AT_DISPATCH_CASE(at::kFloat, [&] { write(float{}); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { write(at::BFloat16{}); }));
  return {q, k};
}

// KV head kv of block blk of an 8-bit pool, dequantized into block `to` of a pool of T
// ([bs][kvh][d], the other kernels' layout): x = q * s rounded to T
template <typename T>
void dequant_kv_block(const int8_t* kp, const int8_t* vp, const float* ksp, const float* vsp, int64_t blk,
                      int64_t kv, int64_t kvh, int64_t d, int64_t bs, T* kd, T* vd, int64_t to) {
  const float* ks = ksp + (blk * kvh + kv) * bs;
  const float* vs = vsp + (blk * kvh + kv) * bs;
  auto dst = [&](T* base, int64_t off) { return base + ((to * bs + off) * kvh + kv) * d; };
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
  if (d % 64 == 0 && bs % 16 == 0) {
    auto put16 = [&](T* out, __m128i bytes, float sc) {   // 16 int8 values times sc -> T
      store16<T>(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(sc)), 0xFFFF);
    };
    // K [d/4][bs][4]: per 64 values and 16 keys, a 16 x 16 transpose of 32-bit words gives each key's 64 bytes
    const int8_t* kb = kp + (blk * kvh + kv) * (d / 4) * bs * 4;
    for (int64_t j0 = 0; j0 < bs; j0 += 16)
      for (int64_t w0 = 0; w0 < d / 4; w0 += 16) {
        __m512i r[16];
        for (int64_t w = 0; w < 16; ++w) r[w] = _mm512_loadu_si512(kb + ((w0 + w) * bs + j0) * 4);
        transpose16x16_epi32(r);   // r[j]: values 4 w0 .. 4 w0 + 63 of key j0 + j
        for (int64_t j = 0; j < 16; ++j) {
          T* out = dst(kd, j0 + j) + 4 * w0;
          put16(out, _mm512_castsi512_si128(r[j]), ks[j0 + j]);
          put16(out + 16, _mm512_extracti32x4_epi32(r[j], 1), ks[j0 + j]);
          put16(out + 32, _mm512_extracti32x4_epi32(r[j], 2), ks[j0 + j]);
          put16(out + 48, _mm512_extracti32x4_epi32(r[j], 3), ks[j0 + j]);
        }
      }
    // V [bs/4][d][4]: per 4 keys and 16 values one byte permutation gives each key's 16 values
    const int8_t* vb = vp + (blk * kvh + kv) * bs * d;
    alignas(64) uint8_t idx[64];
    for (int k = 0; k < 4; ++k)
      for (int e = 0; e < 16; ++e) idx[k * 16 + e] = static_cast<uint8_t>(e * 4 + k);
    const __m512i perm = _mm512_load_si512(idx);
    for (int64_t j4 = 0; j4 < bs / 4; ++j4)
      for (int64_t e0 = 0; e0 < d; e0 += 16) {
        const __m512i x = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(vb + (j4 * d + e0) * 4));
        put16(dst(vd, 4 * j4) + e0, _mm512_castsi512_si128(x), vs[4 * j4]);
        put16(dst(vd, 4 * j4 + 1) + e0, _mm512_extracti32x4_epi32(x, 1), vs[4 * j4 + 1]);
        put16(dst(vd, 4 * j4 + 2) + e0, _mm512_extracti32x4_epi32(x, 2), vs[4 * j4 + 2]);
        put16(dst(vd, 4 * j4 + 3) + e0, _mm512_extracti32x4_epi32(x, 3), vs[4 * j4 + 3]);
      }
    return;
  }
#endif
  for (int64_t off = 0; off < bs; ++off) {
    T* ko = dst(kd, off);
    T* vo = dst(vd, off);
    for (int64_t e = 0; e < d; ++e) {
      store(ko, e, static_cast<float>(kp[k_i8_at(blk, kv, off, e, kvh, d, bs)]) * ks[off]);
      store(vo, e, static_cast<float>(vp[v_i8_at(blk, kv, off, e, kvh, d, bs)]) * vs[off]);
    }
  }
}

// paged_attention over an 8-bit pool: decodes in place (attend_decode_i8, where it is built for
// this head dim); the blocks of prompt chunks (and of decodes where it is not) dequantized once
// into a pool of q's dtype, which the other kernels read as they read the engine's own
at::Tensor paged_attention_i8(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& q_starts,
                              const at::Tensor& start_pos, const at::Tensor& block_tables, double scale,
                              int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be fp32 or bf16");
  check_kv_i8(k_pool, v_pool, k_scales, v_scales);
  check_paged_args(q, k_pool, q_starts, start_pos, block_tables, window);
  const int64_t num_seqs = start_pos.size(0);
  const int64_t h = q.size(1), d = q.size(2), bs = k_pool.size(1), kvh = k_pool.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* qs = q_starts.data_ptr<int32_t>();
  const int32_t* sp = start_pos.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const bool in_place = kHaveDecodeI8 && (d == 64 || d == 128 || d == 256) && decode_kernel_enabled();
  // fp32 prompt chunks packed straight from the pool (pack_chunk_f32_i8): one chunk of 256 queries
  // at 1,792 keys, one layer, 1.044x the fp32 pool's time through the copy (128 at 1,100: 1.084x;
  // 64 at 300: 1.141x; the Zen 3 host, AVX2)
  const bool chunks_in_place = kHavePackedF32 && q.scalar_type() == at::kFloat && bs % 8 == 0;
  // the blocks to dequantize: (sequence, block) -> a slot of the copy, in the remapped tables
  std::vector<int32_t> remapped(num_seqs * max_blocks, 0);
  int32_t* rt = remapped.data();
  std::vector<int32_t> src;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t nq = qs[s + 1] - qs[s];
    if ((nq == 1 && in_place) || (chunks_in_place && chunk_packs_f32(nq, h / kvh, d))) continue;
    const int64_t nb = std::min<int64_t>(max_blocks, (sp[s] + nq + bs - 1) / bs);
    for (int64_t b = 0; b < nb; ++b) {
      rt[s * max_blocks + b] = static_cast<int32_t>(src.size());
      src.push_back(tables[s * max_blocks + b]);
    }
  }
  // the copy (none in a step of decodes only: the kernels then read no pool of q's dtype)
  const int64_t copies = static_cast<int64_t>(src.size());
  at::Tensor kc, vc;
  if (copies > 0) kc = at::empty({copies, bs, kvh, d}, q.options()), vc = at::empty({copies, bs, kvh, d}, q.options());
  at::Tensor out = at::empty_like(q);
  const int8_t* kp = k_pool.data_ptr<int8_t>();
  const int8_t* vp = v_pool.data_ptr<int8_t>();
  const float* ksp = k_scales.data_ptr<float>();
  const float* vsp = v_scales.data_ptr<float>();
  const KvI8 info{kp, vp, ksp, vsp, tables, in_place, chunks_in_place};
  const int64_t threads = at::get_num_threads();
  auto attend = [&](auto tag) {   // the copy's blocks, then the kernels over the copy and the pool
    using T = decltype(tag);
    T* kd = copies > 0 ? kc.data_ptr<T>() : nullptr;
    T* vd = copies > 0 ? vc.data_ptr<T>() : nullptr;
    if (copies > 0)
      at::parallel_for(0, copies * kvh, 8, [&](int64_t a, int64_t b) {
        for (int64_t i = a; i < b; ++i)
          dequant_kv_block<T>(kp, vp, ksp, vsp, src[i / kvh], i % kvh, kvh, d, bs, kd, vd, i / kvh);
      });
    paged_attention_dispatch<T>(q.data_ptr<T>(), kd, vd, qs, sp, rt, max_blocks, num_seqs, h, kvh, d, bs,
                                static_cast<float>(scale), window, threads, out.data_ptr<T>(),
                                in_place || chunks_in_place ? &info : nullptr);
  };
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_attention_i8",
      AT_DISPATCH_CASE(at::kFloat, [&] { attend(float{}); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { attend(at::BFloat16{}); }));
  return out;
}

// ---------------------------------------------------------------------------------------
// y = x @ W.T (+ b) for a few rows of x: the decode-step product, which only has to stream
// W once at the memory's rate. x [m, k], W [n, k] row-major, fp32 accumulation; four
// output features at a time so that four independent FMA chains hide the FMA latency.
constexpr int64_t kPrefetchBytes = 4096;  // ahead of the stream: rows are contiguous

// Dot product of one x row with one W row, read front to back (the hardware prefetcher
// follows one stream; four interleaved short rows measured 15 GB/s per core against 32),
// with four accumulators to hide the FMA latency and a software prefetch 4 KiB ahead
// (per-layer weights are too short for the hardware prefetcher to ramp up: 32 -> 46 GB/s),
// into L2 (prefetcht1), as qgemv's decode rows: SmolLM2's 121 dense products in model order from
// memory took 0.92-0.94x the time (fp32) and 0.87-0.88x (bf16) of prefetcht0's, 88-96% of a
// plain read of the same bytes (Zen 4, two 20-round A/Bs each; 8 KiB ahead, or two rows at a
// time with every line of the thread's stream prefetched once, measured no better).
//
// dotv is its vector part, for k a multiple of the vector step (kGemvStep<T>; kGemvVector<T>:
// whether this build has the loop for T, bf16 needing AVX512-BF16), its four sums added but not
// reduced: dot1 reduces it for one row, gemv_impl sixteen rows' vectors at once (reduce16),
// storing their sixteen outputs together, where every row used to end with a horizontal sum of
// its own, for bf16 weights. SmolLM2's 120 layer products from memory, one process alternating
// the two (20-30 rounds each, Zen 4, 2 threads, 12-06), bf16: one row of x 0.927-0.979x the time
// (faster in 27-28 of 30; 0.72 -> 0.78 of a plain read of the same bytes in the same rounds), 2 /
// 4 / 8 rows 0.956x / 0.846x / 0.968x (19-20 of 20). fp32 rows keep dot1: one row 0.962x in a
// first A/B, 0.999-1.004x in three later ones, 2-8 rows 1.10-1.22x. Sixteen rows' sums are added
// in another order than dot1's (an output's last bit may differ between the two paths; each
// output takes one of them, whatever the rows of x).
#if defined(__AVX512F__)
template <typename T>
constexpr int64_t kGemvStep = std::is_same_v<T, float> ? 16 : 32;
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool kGemvVector = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
#else
template <typename T>
constexpr bool kGemvVector = std::is_same_v<T, float>;
#endif

template <typename T>
inline __m512 dotv(const float* xr, const T* xraw, const T* wr, int64_t k) {
  __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps(), v2 = _mm512_setzero_ps(), v3 = _mm512_setzero_ps();
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    for (; i + 128 <= k; i += 128) {
      const char* ahead = reinterpret_cast<const char*>(wr + i) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      _mm_prefetch(ahead + 128, _MM_HINT_T1);
      _mm_prefetch(ahead + 192, _MM_HINT_T1);
      v0 = _mm512_dpbf16_ps(v0, (__m512bh)_mm512_loadu_si512(xraw + i), (__m512bh)_mm512_loadu_si512(wr + i));
      v1 = _mm512_dpbf16_ps(v1, (__m512bh)_mm512_loadu_si512(xraw + i + 32), (__m512bh)_mm512_loadu_si512(wr + i + 32));
      v2 = _mm512_dpbf16_ps(v2, (__m512bh)_mm512_loadu_si512(xraw + i + 64), (__m512bh)_mm512_loadu_si512(wr + i + 64));
      v3 = _mm512_dpbf16_ps(v3, (__m512bh)_mm512_loadu_si512(xraw + i + 96), (__m512bh)_mm512_loadu_si512(wr + i + 96));
    }
    for (; i + 32 <= k; i += 32)
      v0 = _mm512_dpbf16_ps(v0, (__m512bh)_mm512_loadu_si512(xraw + i), (__m512bh)_mm512_loadu_si512(wr + i));
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 64 <= k; i += 64) {
      const char* ahead = reinterpret_cast<const char*>(wr + i) + kPrefetchBytes;
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      _mm_prefetch(ahead + 128, _MM_HINT_T1);
      _mm_prefetch(ahead + 192, _MM_HINT_T1);
      v0 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + i), _mm512_loadu_ps(wr + i), v0);
      v1 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(wr + i + 16), v1);
      v2 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + i + 32), _mm512_loadu_ps(wr + i + 32), v2);
      v3 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + i + 48), _mm512_loadu_ps(wr + i + 48), v3);
    }
    for (; i + 16 <= k; i += 16) v0 = _mm512_fmadd_ps(_mm512_loadu_ps(xr + i), _mm512_loadu_ps(wr + i), v0);
  }
  return _mm512_add_ps(_mm512_add_ps(v0, v1), _mm512_add_ps(v2, v3));
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 hosts (e.g. Zen 3): 8-lane vectors. Before this loop, AVX2 builds ran dot1's simd loop
// over every k.
//
// fp32: four FMA chains, a prefetch into L1 (prefetcht0) 512 bytes ahead. On the 2-core Zen 3
// host, SmolLM2's dense decode steps (quantization="none"), one process alternating variants
// 8-10 rounds (12-07): 0.95x the old loop's time (9 of 10 faster; 0.89x in an earlier pair);
// 4 KiB ahead into L2 as on AVX-512 was 1.06x the old loop; 512 bytes 0.965x of no prefetch and
// 0.974x of 1 KiB.
//
// bf16 (no bf16 dot product here): 16 weights a load, widened to fp32 by interleaving a zero
// word below each (vpunpcklwd / vpunpckhwd: one instruction per 8 values, where a zero-extension
// and a shift took two), which yields them in the order 0-3, 8-11 | 4-7, 12-15 of each 16, so x
// comes permuted to match (permute16, once a call); eight FMA chains, a prefetch into L1 1 KiB
// ahead. The widening costs enough that with four chains a thread computed little faster than
// its share of the memory streams (Zen 3, one thread, a 300-row weight in L2: 36.3-41.7 ns a
// row in two runs; now 32.2). SmolLM2's 121 dense products from memory, one process alternating
// (12-07, Zen 3, 16 rounds): 0.941x the time of the zero-extension loop with four chains (15 of
// 16 faster); its dense bf16 decode steps 0.957x (12 rounds). Prefetch distances for the new loop: 2 KiB
// 1.07x of 1 KiB (1 of 12 faster), 1.5 KiB 1.026x, 768 bytes 1.000x, 512 bytes 1.026x, none 1.13x.
constexpr int64_t kAvx2Bf16Ahead = 1024;   // bytes

inline __m256 dotv_f32(const float* xr, const float* wr, int64_t k) {
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps(), v2 = _mm256_setzero_ps(), v3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {   // 64 values: 4 lines
    const char* ahead = reinterpret_cast<const char*>(wr + i) + 512;
    for (int64_t l = 0; l < 4; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    for (int64_t j = i; j < i + 64; j += 32) {
      v0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j), _mm256_loadu_ps(wr + j), v0);
      v1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j + 8), _mm256_loadu_ps(wr + j + 8), v1);
      v2 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j + 16), _mm256_loadu_ps(wr + j + 16), v2);
      v3 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j + 24), _mm256_loadu_ps(wr + j + 24), v3);
    }
  }
  for (; i + 8 <= k; i += 8) v0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(wr + i), v0);
  return _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
}

// k a multiple of 16, xr permuted by permute16
inline __m256 dotv_bf16(const float* xr, const at::BFloat16* wr, int64_t k) {
  __m256 v[8];
  for (auto& a : v) a = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  auto wv = [](const at::BFloat16* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); };
  auto lo = [&](__m256i a) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a)); };
  auto hi = [&](__m256i a) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a)); };
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {   // 64 values: 2 lines
    const char* ahead = reinterpret_cast<const char*>(wr + i) + kAvx2Bf16Ahead;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    for (int q = 0; q < 4; ++q) {
      const __m256i a = wv(wr + i + 16 * q);
      v[2 * q] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 16 * q), lo(a), v[2 * q]);
      v[2 * q + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 16 * q + 8), hi(a), v[2 * q + 1]);
    }
  }
  for (; i + 16 <= k; i += 16) {
    const __m256i a = wv(wr + i);
    v[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), lo(a), v[0]);
    v[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i + 8), hi(a), v[1]);
  }
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])),
                       _mm256_add_ps(_mm256_add_ps(v[4], v[5]), _mm256_add_ps(v[6], v[7])));
}

// values a step of the AVX2 loop for T (dot1 leaves the rest, k % kAvx2Step, to its scalar loop)
template <typename T>
constexpr int64_t kAvx2Step = std::is_same_v<T, float> ? 8 : 16;

template <typename T>
inline __m256 dotv(const float* xr, const T*, const T* wr, int64_t k) {
  if constexpr (std::is_same_v<T, float>)
    return dotv_f32(xr, wr, k);
  else
    return dotv_bf16(xr, wr, k);
}

// x's values in the order dotv_bf16 meets the weights: in each whole 16, values 4-7 and 8-11
// swap places; the rest (k % 16) stays as it is, for dot1's scalar loop
inline void permute16(float* x, int64_t k) {
  for (int64_t b = 0; b + 16 <= k; b += 16)
    for (int j = 4; j < 8; ++j) std::swap(x[b + j], x[b + j + 4]);
}
#endif

template <typename T>
inline float dot1(const float* xr, const T* xraw, const T* wr, int64_t k) {
  int64_t i = 0;
  float tail = 0.f;
#if defined(__AVX512F__)
  if constexpr (kGemvVector<T>) {
    i = k - k % kGemvStep<T>;
    tail = _mm512_reduce_add_ps(dotv<T>(xr, xraw, wr, i));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  i = k - k % kAvx2Step<T>;
  tail = hsum8(dotv<T>(xr, xraw, wr, i));
#endif
  // the rest (k not a multiple of the vector steps), entered only where there is one: GCC sums
  // the simd loop's 16 lanes one after another even when it runs no iteration, a chain of 16
  // dependent adds a row (Zen 4, one thread, a cached 1,536 x 576 bf16 weight: 29.1 -> 20.2 ns a
  // row; SmolLM2's bf16 head from memory 1,941 -> 1,484 us, fp32 3,206 -> 2,360 us)
  float a = 0.f;
  if (i < k) {
#pragma omp simd reduction(+ : a)
    for (int64_t j = i; j < k; ++j) a += xr[j] * load(wr, j);
  }
  return tail + a;
}

template <typename T>
void gemv_impl(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t n, int64_t k,
               ArgmaxTrack* track = nullptr) {
#if defined(__AVX512F__)
  // bf16 only: fp32 rows are twice the bytes, and there the blocks measured level at one row
  // and slower at 2-8 (each block's 16 rows read again for every row of x: 1.10-1.22x)
  const bool blocks = std::is_same_v<T, at::BFloat16> && kGemvVector<T> && k % kGemvStep<T> == 0;
#else
  const bool blocks = false;
#endif
  // x in fp32, for the fp32 loops and the scalar rest; where the blocks apply every row of x is
  // read as bf16 by vdpbf16ps (k has no rest), so none is made
  std::vector<float> xf(blocks ? 0 : m * k);
  for (int64_t i = 0; i < static_cast<int64_t>(xf.size()); ++i) xf[i] = load(x, i);
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, at::BFloat16>)
    for (int64_t r = 0; r < m; ++r) permute16(xf.data() + r * k, k);   // dotv_bf16's order
#endif
  auto xrow = [&](int64_t r) -> const float* { return blocks ? nullptr : xf.data() + r * k; };
  auto body = [&](int64_t n0, int64_t n1) {
    int64_t o = n0;
#if defined(__AVX512F__)
    if (blocks) {
      for (; o + 16 <= n1; o += 16)
        for (int64_t r = 0; r < m; ++r) {
          __m512 v[16];
          for (int i = 0; i < 16; ++i) v[i] = dotv<T>(xrow(r), x + r * k, w + (o + i) * k, k);
          __m512 sum = reduce16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
          alignas(64) float t[16];
          _mm512_store_ps(t, sum);
          for (int i = 0; i < 16; ++i) store(y, r * n + o + i, t[i] + (bias != nullptr ? load(bias, o + i) : 0.f));
        }
    }
#endif
    for (; o < n1; ++o) {
      const T* wr = w + o * k;
      const float b = bias != nullptr ? load(bias, o) : 0.f;
      for (int64_t r = 0; r < m; ++r) store(y, r * n + o, dot1<T>(xrow(r), x + r * k, wr, k) + b);
    }
  };
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    if (track != nullptr)
      track->run(n0, n1, y, n, body);
    else
      body(n0, n1);
  });
}

at::Tensor gemv_tracked(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        ArgmaxTrack* track) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [m, k], w [n, k]");
  TORCH_CHECK(w.is_contiguous() && x.scalar_type() == w.scalar_type());
  at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = w.size(0), k = w.size(1);
  at::Tensor y = at::empty({m, n}, xc.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == w.scalar_type());
  }
  AT_DISPATCH_SWITCH(w.scalar_type(), "gemv",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        gemv_impl<float>(xc.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                         y.data_ptr<float>(), m, n, k, track); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        gemv_impl<at::BFloat16>(xc.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                                b.defined() ? b.data_ptr<at::BFloat16>() : nullptr,
                                y.data_ptr<at::BFloat16>(), m, n, k, track); }));
  return y;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return gemv_tracked(x, w, bias, nullptr);
}

// (y, argmax of each row of y, its value in fp32): `product(track)` (gemv_tracked, qgemv_tracked)
// of x's rows with greedy decoding's choice fused in (ArgmaxTrack)
template <typename Product>
std::tuple<at::Tensor, at::Tensor, at::Tensor> with_argmax(const at::Tensor& x, Product&& product) {
  ArgmaxTrack track(x.size(0));
  at::Tensor y = product(&track);
  at::Tensor idx = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  at::Tensor best = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  track.finish(idx.data_ptr<int64_t>(), best.data_ptr<float>());
  return {y, idx, best};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gemv_argmax(const at::Tensor& x, const at::Tensor& w,
                                                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(0) > 0, "gemv_argmax: x [m, k], w [n, k], n > 0");
  return with_argmax(x, [&](ArgmaxTrack* track) { return gemv_tracked(x, w, bias, track); });
}

// ---------------------------------------------------------------------------------------
// y = x @ W.T for W quantized in groups of 32 along k, as GGUF ships it, for a few rows of
// x (decode steps): W is streamed once in its 4.5 / 8.5 bits per weight instead of bf16's 16.
//   kind 4: nibbles [n, k/2] uint8, per group of 32 the low nibbles of its 16 bytes are
//           weights 0..15 and the high nibbles 16..31 (GGUF's Q4_0/Q4_1 order);
//           w = q * scale + min   (Q4_0: min = -8 * scale)
//   kind 8: int8 [n, k]; w = q * scale   (Q8_0)
// scales, mins: [n, k/32] fp32. Sums in fp32; y rounded once to x's dtype.
#if defined(__AVX512F__)
// RN x rows against one quantized W row; RN is a compile-time count so the accumulators
// stay in registers (a runtime count spilled them: 2.85 -> 5.7 ms for SmolLM2's layers)
template <int RN>
inline void qrow(const uint8_t* wr, const float* sc, const float* xf, int64_t k, int64_t groups, int kind,
                 float* totals) {
  __m512 acc[RN], acc2[RN];
  for (int r = 0; r < RN; ++r) acc[r] = _mm512_setzero_ps(), acc2[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo, hi;
    if (kind == 4) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16)));
      lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low4));
      hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    } else {
      const __m128i* src = reinterpret_cast<const __m128i*>(wr + g * 32);
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));
    }
    const __m512 scale = _mm512_set1_ps(sc[g]);
    for (int r = 0; r < RN; ++r) {
      const float* xg = xf + r * k + g * 32;
      const __m512 part = _mm512_fmadd_ps(_mm512_loadu_ps(xg), lo, _mm512_mul_ps(_mm512_loadu_ps(xg + 16), hi));
      if (g & 1)
        acc2[r] = _mm512_fmadd_ps(part, scale, acc2[r]);
      else
        acc[r] = _mm512_fmadd_ps(part, scale, acc[r]);
    }
  }
  for (int r = 0; r < RN; ++r) totals[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r]));
}
#endif

inline void qrow_generic(const uint8_t* wr, const float* sc, const float* xf, int64_t k, int64_t groups, int kind,
                         int64_t rn, float* totals) {
  for (int64_t g = 0; g < groups; ++g) {
    float wv[32];
    for (int64_t i = 0; i < 16; ++i) {
      if (kind == 4) {
        wv[i] = static_cast<float>(wr[g * 16 + i] & 0xF) * sc[g];
        wv[i + 16] = static_cast<float>(wr[g * 16 + i] >> 4) * sc[g];
      } else {
        wv[i] = static_cast<float>(static_cast<int8_t>(wr[g * 32 + i])) * sc[g];
        wv[i + 16] = static_cast<float>(static_cast<int8_t>(wr[g * 32 + 16 + i])) * sc[g];
      }
    }
    for (int64_t r = 0; r < rn; ++r) {
      const float* xg = xf + r * k + g * 32;
      float part = 0.f;
      for (int64_t i = 0; i < 32; ++i) part += xg[i] * wv[i];
      totals[r] += part;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// x rows quantized to int8 per group of 32 (llama.cpp's Q8_0 activations), laid out to
// match the weight bytes of a pair of groups (see qrow_vnni); dx: [groups] scales; dsum (may be
// null): [groups] dx * sum(xq), the rounded x's group sums (qrows8_a8 takes them).
inline void quantize_x_pairs(const float* xr, int64_t k, int kind, int8_t* xq, float* dx, float* dsum = nullptr) {
  const int64_t groups = k / 32;
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.f;
    for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xr[g * 32 + i]));
    const float d = amax > 0.f ? amax / 127.f : 1.f;
    dx[g] = d;
    const float inv = 1.f / d;
    const int64_t p = g / 2, odd = g % 2;
    int32_t sum = 0;
    for (int64_t i = 0; i < 32; ++i) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(xr[g * 32 + i] * inv));
      sum += v;
      int64_t pos;
      if (g + 1 == groups && groups % 2 == 1)
        pos = p * 64 + i;                                          // tail group: plain order
      else if (kind == 4)
        pos = p * 64 + (i < 16 ? 0 : 32) + odd * 16 + (i % 16);   // [g0 lo, g1 lo, g0 hi, g1 hi]
      else
        pos = p * 64 + odd * 32 + i;                               // [g0, g1]
      xq[pos] = v;
    }
    if (dsum != nullptr) dsum[g] = d * static_cast<float>(sum);
  }
}

// RN rows of int8 x against one quantized W row with VNNI (vpdpbusd: u8 x s8 -> int32), a
// pair of groups per instruction; per-group scales applied in fp32. Measured on the Zen 5
// host, SmolLM2's layers as Q4_1, one row: see QuantWeight. kind 8 makes x unsigned by
// +128 and subtracts 128 * sum(w).
template <int RN>
inline void qrow_vnni(const uint8_t* wr, const float* sc, const int8_t* const* xq, const float* const* dx,
                      int64_t groups, int kind, float* totals) {
  const int64_t pairs = groups / 2;
  __m512 acc[RN];
  for (int r = 0; r < RN; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i idx = kind == 4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(static_cast<char>(0x80)),
                ones = _mm512_set1_epi8(1);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i w, wsum128 = _mm512_setzero_si512();
    if (kind == 4) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + p * 32));
      const __m512i bb = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
      w = _mm512_and_si512(bb, low4);                            // [g0 lo, g1 lo, g0 hi, g1 hi]
    } else {
      w = _mm512_loadu_si512(wr + p * 64);
      wsum128 = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w), 7);
    }
    const __m512 swv = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sc + 2 * p))));
    for (int r = 0; r < RN; ++r) {
      __m512i xv = _mm512_loadu_si512(xq[r] + p * 64);
      __m512i dot;
      if (kind == 4) {
        dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);       // u4 weights x s8 x
      } else {
        xv = _mm512_xor_si512(xv, bias);                                   // s8 -> u8 (+128)
        dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, w), wsum128);
      }
      const __m512 dxv = _mm512_castps128_ps512(
          _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx[r] + 2 * p))));
      const __m512 scale = _mm512_permutexvar_ps(idx, _mm512_mul_ps(swv, dxv));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  }
  for (int r = 0; r < RN; ++r) totals[r] = _mm512_reduce_add_ps(acc[r]);
  if (groups % 2 == 1) {  // the tail group, in plain order
    const int64_t g = groups - 1;
    for (int r = 0; r < RN; ++r) {
      const int8_t* xg = xq[r] + pairs * 64;
      int32_t sum = 0;
      if (kind == 4) {
        for (int64_t i = 0; i < 16; ++i)
          sum += static_cast<int32_t>(wr[g * 16 + i] & 0xF) * xg[i] +
                 static_cast<int32_t>(wr[g * 16 + i] >> 4) * xg[i + 16];
      } else {
        const int8_t* ws = reinterpret_cast<const int8_t*>(wr) + g * 32;
        for (int64_t i = 0; i < 32; ++i) sum += static_cast<int32_t>(ws[i]) * static_cast<int32_t>(xg[i]);
      }
      totals[r] += static_cast<float>(sum) * sc[g] * dx[r][g];
    }
  }
}
constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// x laid out for qrows4_bf16 (vdpbf16ps multiplies pairs of bf16; each 16-bit lane of the
// weights holds nibbles that belong to different positions of x, so x is permuted to match).
// A last pair of groups (32 bytes of weights widened to 16-bit lanes, low nibbles then high
// ones): [g0 0..15, g1 0..15, g0 16..31, g1 16..31].
inline void bf16_x_pairs(const at::BFloat16* xr, int64_t k, uint16_t* xp) {
  const int64_t pairs = k / 64;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xr);
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t i = 0; i < 16; ++i) {
      xp[p * 64 + i] = xs[p * 64 + i];               // g0 weights 0..15 (low nibbles)
      xp[p * 64 + 16 + i] = xs[p * 64 + 32 + i];     // g1 weights 0..15
      xp[p * 64 + 32 + i] = xs[p * 64 + 16 + i];     // g0 weights 16..31 (high nibbles)
      xp[p * 64 + 48 + i] = xs[p * 64 + 48 + i];     // g1 weights 16..31
    }
}

// Four groups (64 bytes of weights, unpacked within 16-bit lanes: word j holds bytes 2j and
// 2j+1, whose four nibbles are weights (g, 2i), (g, 2i+16), (g, 2i+1), (g, 2i+17) of group
// g = j / 8, i = j % 8): per four groups, [A, B, C, D] of 32 each, A[j] = x(g, 2i) etc.
inline void bf16_x_quads(const at::BFloat16* xr, int64_t k, uint16_t* xp) {
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xr);
  for (int64_t q = 0; q < k / 128; ++q)
    for (int64_t j = 0; j < 32; ++j) {
      const int64_t g = 4 * q + j / 8, i = j % 8, base = g * 32;
      xp[q * 128 + j] = xs[base + 2 * i];
      xp[q * 128 + 32 + j] = xs[base + 2 * i + 16];
      xp[q * 128 + 64 + j] = xs[base + 2 * i + 1];
      xp[q * 128 + 96 + j] = xs[base + 2 * i + 17];
    }
}
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// FASTGEN_QGEMV_BF16=0 turns the bf16 dot path off (A/B measurements); read once
inline bool qgemv_bf16_enabled() {
  static const bool on = [] { const char* v = std::getenv("FASTGEN_QGEMV_BF16"); return !(v && v[0] == '0'); }();
  return on;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 x against 4-bit W rows with vdpbf16ps, min terms included: WN consecutive W rows
// (row_bytes apart, their scales and minima `groups` apart) against RN rows of x, totals
// [WN][RN]. A nibble q becomes the bf16 value 128 + q by one bit operation (0x4300 | q:
// exponent 2^7, q in the mantissa's low bits; exact, as bf16 holds every integer up to 256),
// which replaced a table lookup per 32 weights (vpermw, the bottleneck: ~60 -> ~40 cycles a row
// of 576). The 128 * sum(x) that the offset adds per group is taken back with the minimum: the
// row's groups contribute scale * dot(128 + q, x) + (min - 128 * scale) * sum(x). The groups go
// in quads (bf16_x_quads' layout) and a last pair (bf16_x_pairs') into one set of accumulators
// per (W row, x row), reduced once; the min terms as masked FMAs with x's group sums xs. sc, mn:
// the rows' fp16 scales and minima, widened in registers (a round trip through a buffer cost
// more than the products: store-to-load forwarding fails from 512-bit and masked stores to
// narrower loads). groups even. Each (W row, x row) takes the same operations in the same order
// whatever WN and RN are, so a decode's output does not depend on its batch, bit for bit (a
// test holds it). A single decode takes WN = 2, RN = 1: x's loads shared by two W rows and none
// of the many-row loop's per-row set-up (SmolLM2's 3072 x 576 gate/up product from memory 38 ->
// 25 us, 29 -> 45 GB/s, near the 50 GB/s the host reads at; the 121 GEMVs of a decode step 3.09
// -> 2.71 ms; one W row at a time 25.8 us, four 25.2).
template <int WN, int RN>
__attribute__((always_inline)) inline void qrows4_bf16(const uint8_t* wr, int64_t row_bytes, const uint16_t* sc, const uint16_t* mn,
                        const uint16_t* const* xp, const float* const* xs, int64_t groups, float* totals) {
  __m512 acc[WN][RN], accm[WN][RN];
  for (int w = 0; w < WN; ++w)
    for (int r = 0; r < RN; ++r) acc[w][r] = _mm512_setzero_ps(), accm[w][r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi16(0x0F), c128 = _mm512_set1_epi16(0x4300);
  // (b & m4) | c128 in one vpternlog: imm 0xEA = (A & B) | C
  auto bf = [&](__m512i b) { return (__m512bh)_mm512_ternarylogic_epi32(b, m4, c128, 0xEA); };
  const __m512i idx4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const int64_t quads = groups / 4;
  for (int64_t q = 0; q < quads; ++q) {
    for (int w = 0; w < WN; ++w) {
      const __m512i b = _mm512_loadu_si512(wr + w * row_bytes + q * 64);
      const __m512bh wa = bf(b), wb = bf(_mm512_srli_epi16(b, 4)), wc = bf(_mm512_srli_epi16(b, 8)),
                     wd = bf(_mm512_srli_epi16(b, 12));
      const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + w * groups + 4 * q)));
      const __m128 m4v = _mm_fnmadd_ps(_mm_set1_ps(128.f), s4,
          _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + w * groups + 4 * q))));
      const __m512 scale = _mm512_permutexvar_ps(idx4, _mm512_castps128_ps512(s4));
      const __m512 minv = _mm512_zextps128_ps512(m4v);
      for (int r = 0; r < RN; ++r) {
        const uint16_t* xv = xp[r] + q * 128;
        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), wa, (__m512bh)_mm512_loadu_si512(xv));
        __m512 e = _mm512_dpbf16_ps(_mm512_setzero_ps(), wb, (__m512bh)_mm512_loadu_si512(xv + 32));
        d = _mm512_dpbf16_ps(d, wc, (__m512bh)_mm512_loadu_si512(xv + 64));
        e = _mm512_dpbf16_ps(e, wd, (__m512bh)_mm512_loadu_si512(xv + 96));
        acc[w][r] = _mm512_fmadd_ps(_mm512_add_ps(d, e), scale, acc[w][r]);
        accm[w][r] = _mm512_fmadd_ps(minv, _mm512_maskz_loadu_ps(0xF, xs[r] + 4 * q), accm[w][r]);
      }
    }
  }
  if (groups % 4) {  // the last pair of groups: one byte per 16-bit lane
    const int64_t g0 = quads * 4;
    const __m512i idx2 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int w = 0; w < WN; ++w) {
      const __m512i b = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + w * row_bytes + quads * 64)));
      const __m512bh wlo = bf(b), whi = bf(_mm512_srli_epi16(b, 4));
      uint32_t sbits, mbits;   // two fp16 each
      std::memcpy(&sbits, sc + w * groups + g0, 4);
      std::memcpy(&mbits, mn + w * groups + g0, 4);
      const __m128 s2 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(sbits)));   // lanes 2, 3 zero
      const __m128 m2 = _mm_fnmadd_ps(_mm_set1_ps(128.f), s2, _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(mbits))));
      const __m512 scale = _mm512_permutexvar_ps(idx2, _mm512_castps128_ps512(s2));
      const __m512 minv = _mm512_zextps128_ps512(m2);
      for (int r = 0; r < RN; ++r) {
        const uint16_t* xv = xp[r] + quads * 128;
        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), wlo, (__m512bh)_mm512_loadu_si512(xv));
        d = _mm512_dpbf16_ps(d, whi, (__m512bh)_mm512_loadu_si512(xv + 32));
        acc[w][r] = _mm512_fmadd_ps(d, scale, acc[w][r]);
        accm[w][r] = _mm512_fmadd_ps(minv, _mm512_maskz_loadu_ps(0x3, xs[r] + g0), accm[w][r]);   // lanes 2.. 0
      }
    }
  }
  for (int w = 0; w < WN; ++w)
    for (int r = 0; r < RN; ++r) totals[w * RN + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[w][r], accm[w][r]));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
// int8 x for qrows4_a8: each group of 32 quantized as qgemm_a8 does (dx = max|x| / 127, round to
// nearest even of x / dx; dsum = dx * sum(xq)), laid out to meet the weight bytes as they load:
// per four groups 128 bytes, [weights 0..15 of each of the 4 groups | weights 16..31 of each]
// (a byte of the 64 weight bytes holds weight i and 16 + i of group i / 16 in its two nibbles);
// then a last pair of groups the same way in 64 bytes, then a last single group in 32.
inline void quantize_x_quads(const float* xr, int64_t k, int8_t* xq, float* dx, float* dsum) {
  const int64_t groups = k / 32, quads = groups / 4, pair = (groups % 4) / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m512 a = _mm512_loadu_ps(xr + g * 32), b = _mm512_loadu_ps(xr + g * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
    const float d = amax > 0.f ? amax / 127.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / d);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    dx[g] = d;
    dsum[g] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    int64_t lo, hi;   // where weights 0..15 and 16..31 of group g go
    if (g < quads * 4) {
      lo = (g / 4) * 128 + (g % 4) * 16, hi = lo + 64;
    } else if (pair && g < quads * 4 + 2) {
      lo = quads * 128 + (g - quads * 4) * 16, hi = lo + 32;
    } else {
      lo = quads * 128 + pair * 64, hi = lo + 16;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + lo), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + hi), _mm512_cvtsepi32_epi8(qb));
  }
}

// The sum of v's 16 lanes in one fixed order (halves, then quarters, then pairs), the same
// whichever kernel shape produced v: a decode's total does not depend on its batch.
inline float sum16(__m512 v) {
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 z = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  z = _mm_add_ps(z, _mm_movehl_ps(z, z));
  return _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps(z, z, 1)));
}

// The int8 row kernels' per-group terms and totals: for each (W row w, x row r), sum_g f h[g] dsum[g]
// (h: fp16 a group, W rows `groups` apart; f = 1, or -128 where Neg128) 16 groups a vector, added
// to acc[w][r] and reduced once in sum16's fixed order into totals [WN][RN]. qrows4_a8 adds its
// minima' terms so, qrows8_a8 takes back the 128 * sum(xq) of its unsigned weights.
template <int WN, int RN, bool Neg128>
__attribute__((always_inline)) inline void add_group_terms(const uint16_t* h, const float* const* dsum, int64_t groups,
                                                           __m512 (&acc)[WN][RN], float* totals) {
#pragma GCC unroll 4
  for (int w = 0; w < WN; ++w) {
    __m512 accm[RN];
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) accm[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const __mmask16 mask = groups - g0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g0)) - 1);
      __m512 hv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, h + w * groups + g0));
      if constexpr (Neg128) hv = _mm512_mul_ps(_mm512_set1_ps(-128.f), hv);
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) accm[r] = _mm512_fmadd_ps(hv, _mm512_maskz_loadu_ps(mask, dsum[r] + g0), accm[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) totals[w * RN + r] = sum16(_mm512_add_ps(acc[w][r], accm[r]));
  }
}

// int8 x (quantize_x_quads) against 4-bit W rows with vpdpbusd: WN consecutive W rows (row_bytes
// apart, their fp16 scales and minima `groups` apart) against RN rows of x, totals [WN][RN] of
//   sum_g  s[g] dx[g] * dot(q, xq)  +  m[g] * dsum[g],
// qgemm_a8's sum for prompt rows, dot(q, xq) exact in int32. Per 64 weight bytes (four groups):
// the nibbles masked into two vectors of unsigned bytes, two vpdpbusd (4 lanes a group), one
// conversion and one FMA by the lanes' s * dx; against qrows4_bf16's four vdpbf16ps and four
// nibble-to-bf16 operations. Each (W row, x row) takes the same operations in the same order
// whatever WN and RN are: a decode's output does not depend on its batch.
template <int WN, int RN>
__attribute__((always_inline)) inline void qrows4_a8(const uint8_t* wr, int64_t row_bytes, const uint16_t* sc,
                                                     const uint16_t* mn, const int8_t* const* xq,
                                                     const float* const* dx, const float* const* dsum,
                                                     int64_t groups, float* totals) {
  // Per quad of groups and W row: the nibbles masked into two vectors of unsigned bytes, two
  // vpdpbusd against x's two vectors (loaded once for all WN rows), one conversion, one FMA by
  // the lanes' s * dx. The minima's terms, m . dsum, are summed after the quads 16 groups at a
  // time, and a last pair or single group of the row in 256- or 128-bit lanes, into the same
  // accumulator, reduced once (sum16): no scalar work a row but its store.
  __m512 acc[WN][RN];
#pragma GCC unroll 4
  for (int w = 0; w < WN; ++w)
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) acc[w][r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i idx4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const int64_t quads = groups / 4, pair = (groups % 4) / 2, single = groups % 2;
  for (int64_t q = 0; q < quads; ++q) {
    __m512i xa[RN], xb[RN];
    __m128 dx4[RN];
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) {
      xa[r] = _mm512_loadu_si512(xq[r] + q * 128), xb[r] = _mm512_loadu_si512(xq[r] + q * 128 + 64);
      dx4[r] = _mm_loadu_ps(dx[r] + 4 * q);
    }
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m512i b = _mm512_loadu_si512(wr + w * row_bytes + q * 64);
      const __m512i lo = _mm512_and_si512(b, m4), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
      const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + w * groups + 4 * q)));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xa[r]), hi, xb[r]);
        const __m512 scale = _mm512_permutexvar_ps(idx4, _mm512_castps128_ps512(_mm_mul_ps(s4, dx4[r])));
        acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[w][r]);
      }
    }
  }
  int64_t g = quads * 4, at = quads * 128;
  if (pair) {   // two groups: 32 weight bytes, 8 lanes (4 a group)
    const __m256i m4h = _mm256_set1_epi8(0x0F);
    const __m256i idx2 = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + w * row_bytes + quads * 64));
      const __m256i lo = _mm256_and_si256(b, m4h), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4h);
      uint32_t sbits;   // two fp16
      std::memcpy(&sbits, sc + w * groups + g, 4);
      const __m128 s2 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(sbits)));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo,
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + at)));
        d = _mm256_dpbusd_epi32(d, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + at + 32)));
        const __m128 sd = _mm_mul_ps(s2, _mm_maskz_loadu_ps(0x3, dx[r] + g));
        const __m256 scale = _mm256_permutexvar_ps(idx2, _mm256_castps128_ps256(sd));
        acc[w][r] = _mm512_add_ps(acc[w][r], _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(d), scale)));
      }
    }
    g += 2, at += 64;
  }
  if (single) {  // one group: 16 weight bytes, 4 lanes
    const __m128i m4x = _mm_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + w * row_bytes + g * 16));
      const __m128i lo = _mm_and_si128(b, m4x), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4x);
      const float s1 = half_to_float(sc[w * groups + g]);
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        __m128i d = _mm_dpbusd_epi32(_mm_setzero_si128(), lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[r] + at)));
        d = _mm_dpbusd_epi32(d, hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[r] + at + 16)));
        const __m128 t = _mm_mul_ps(_mm_cvtepi32_ps(d), _mm_set1_ps(s1 * dx[r][g]));
        acc[w][r] = _mm512_add_ps(acc[w][r], _mm512_zextps128_ps512(t));
      }
    }
  }
  // the minima: sum_g m[g] * dsum[g]
  add_group_terms<WN, RN, false>(mn, dsum, groups, acc, totals);
}

// int8 x (quantize_x_pairs: 8-bit rows keep x in plain order) against 8-bit W rows (q, one fp16
// scale a group, no minima) with vpdpbusd, as qrows4_a8 does 4-bit rows: WN consecutive W rows
// against RN rows of x, totals [WN][RN] of sum_g s[g] dx[g] * dot(q, xq). The weights are made
// unsigned by one XOR (q + 128) against x's signed bytes, and the 128 * sum(xq) this adds is taken
// back once per row through dsum (dx * sum(xq) a group), 16 groups a vector. Per quad of groups
// (128 weight bytes) and (W row, x row): two vpdpbusd, two conversions and two FMAs by the lanes'
// s * dx, against qrow_vnni's per pair (64 bytes) the weights' own sums (a vpdpbusd and a shift),
// x's XOR, a subtraction, a product and a permute besides. Each (W row, x row) takes the same
// operations in the same order whatever WN and RN are: a decode's output does not depend on its batch.
template <int WN, int RN>
__attribute__((always_inline)) inline void qrows8_a8(const uint8_t* wr, int64_t row_bytes, const uint16_t* sc,
                                                     const int8_t* const* xq, const float* const* dx,
                                                     const float* const* dsum, int64_t groups, float* totals) {
  __m512 acc[WN][RN];
#pragma GCC unroll 4
  for (int w = 0; w < WN; ++w)
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) acc[w][r] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // a pair of groups' lanes: 0-7 the first group's 32 bytes, 8-15 the second's
  const __m512i lo2 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi2 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  const int64_t quads = groups / 4, pair = (groups % 4) / 2, single = groups % 2;
  for (int64_t q = 0; q < quads; ++q) {
    __m128 dx4[RN];
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) dx4[r] = _mm_loadu_ps(dx[r] + 4 * q);
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const uint8_t* b = wr + w * row_bytes + q * 128;
      const __m512i b0 = _mm512_xor_si512(_mm512_loadu_si512(b), flip), b1 = _mm512_xor_si512(_mm512_loadu_si512(b + 64), flip);
      const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + w * groups + 4 * q)));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b0, _mm512_loadu_si512(xq[r] + q * 128));
        const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b1, _mm512_loadu_si512(xq[r] + q * 128 + 64));
        const __m512 sd = _mm512_castps128_ps512(_mm_mul_ps(s4, dx4[r]));
        acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(lo2, sd), acc[w][r]);
        acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_permutexvar_ps(hi2, sd), acc[w][r]);
      }
    }
  }
  int64_t g = quads * 4;
  if (pair) {   // two groups: 64 weight bytes
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m512i b0 = _mm512_xor_si512(_mm512_loadu_si512(wr + w * row_bytes + g * 32), flip);
      uint32_t sbits;   // two fp16
      std::memcpy(&sbits, sc + w * groups + g, 4);
      const __m128 s2 = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(sbits)));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b0, _mm512_loadu_si512(xq[r] + g * 32));
        const __m512 sd = _mm512_castps128_ps512(_mm_mul_ps(s2, _mm_maskz_loadu_ps(0x3, dx[r] + g)));
        acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_permutexvar_ps(lo2, sd), acc[w][r]);
      }
    }
    g += 2;
  }
  if (single) {   // one group: 32 weight bytes, 8 lanes
    const __m256i flip8 = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m256i b0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + w * row_bytes + g * 32)), flip8);
      const float s1 = half_to_float(sc[w * groups + g]);
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        const __m256i d0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), b0,
                                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + g * 32)));
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(s1 * dx[r][g]));
        acc[w][r] = _mm512_add_ps(acc[w][r], _mm512_zextps256_ps512(t));
      }
    }
  }
  // the XOR's 128 * sum(xq) taken back: sum_g -128 s[g] * dsum[g]
  add_group_terms<WN, RN, true>(sc, dsum, groups, acc, totals);
}

constexpr bool kHaveA8Quads = true;
#else
constexpr bool kHaveA8Quads = false;
#endif

// AVX2 hosts without AVX-512 (e.g. Zen 3): no vpdpbusd, so u8 x s8 products go through
// vpmaddubsw (pairs of products summed into 16-bit lanes; a nibble times |x| <= 127, two of
// them and two such sums fit: 4 * 15 * 127 = 7,620) and vpmaddwd by ones (into 32-bit lanes).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// int8 x for qrows4_a8_avx2, each group of 32 rounded as qgemm_a8 rounds it (dx = max|x| / 127,
// round to nearest even of x * (1 / dx); dsum = dx * sum(xq)), laid out to meet a pair of
// groups' 32 weight bytes as they load: per pair 64 bytes, [weights 0..15 of g, of g + 1 |
// weights 16..31 of g, of g + 1]; a last single group as [0..15 | 16..31].
// plain: the bytes in k order instead (a group's 32 at g * 32; qrows8_a8_avx2's 8-bit rows)
template <bool Plain = false>
inline void quantize_x_pairs_avx2(const float* xr, int64_t k, int8_t* xq, float* dx, float* dsum) {
  const int64_t groups = k / 32, pairs = groups / 2;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xr + g * 32 + 8 * i);
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
    dx[g] = d;
    dsum[g] = d * static_cast<float>(_mm_cvtsi128_si32(u));
    // bytes in x's order: the packs interleave 4-value pieces of q[0..3]; one permute undoes it
    const __m256i b = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    int64_t lo, hi;   // where weights 0..15 and 16..31 of group g go
    if (Plain)
      lo = g * 32, hi = lo + 16;
    else if (g < 2 * pairs)
      lo = (g / 2) * 64 + (g % 2) * 16, hi = lo + 32;
    else
      lo = pairs * 64, hi = lo + 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + lo), _mm256_castsi256_si128(b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + hi), _mm256_extracti128_si256(b, 1));
  }
}

// int8 x (quantize_x_pairs_avx2) against 4-bit W rows: WN consecutive W rows (row_bytes apart,
// their fp16 scales and minima `groups` apart) against RN rows of x, totals [WN][RN] of
//   sum_g  s[g] dx[g] * dot(q, xq)  +  m[g] * dsum[g]
// (qgemm_a8's sum; dot(q, xq) exact in int32). Per pair of groups (32 weight bytes): the nibbles
// masked into two vectors, two vpmaddubsw, one 16-bit add, one vpmaddwd (4 lanes a group), one
// conversion and one FMA by the lanes' s * dx. Each (W row, x row) takes the same operations in
// the same order whatever WN and RN are: a decode's output does not depend on its batch.
template <int WN, int RN>
__attribute__((always_inline)) inline void qrows4_a8_avx2(const uint8_t* wr, int64_t row_bytes, const uint16_t* sc,
                                                          const uint16_t* mn, const int8_t* const* xq,
                                                          const float* const* dx, const float* const* dsum,
                                                          int64_t groups, float* totals) {
  __m256 acc[WN][RN];
#pragma GCC unroll 4
  for (int w = 0; w < WN; ++w)
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) acc[w][r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i idx2 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const int64_t pairs = groups / 2;
  // pair p's products, as fp32: 4 lanes a group
  auto pair_dot = [&](const __m256i b, const __m256i xa, const __m256i xb) {
    const __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    return _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)), ones));
  };
  // eight groups (four pairs) at a time: their s[g] * dx[g] made in one multiply from 8 fp16
  // scales and 8 of x's and put in the order [even groups | odd groups] by one vpermps, so that
  // a pair's two (lanes 0..3: its first group, 4..7: its second) are spread by one in-lane
  // vpermilps with an immediate (one fp16 pair widened, spread and multiplied a pair before)
  const __m256i even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  int64_t p = 0;
  for (; 2 * p + 8 <= groups; p += 4) {
    __m256 sd[WN][RN];
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + w * groups + 2 * p)));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r)
        sd[w][r] = _mm256_permutevar8x32_ps(_mm256_mul_ps(s8, _mm256_loadu_ps(dx[r] + 2 * p)), even_odd);
    }
    auto step = [&](auto j) {
      constexpr int J = decltype(j)::value;
      __m256i xa[RN], xb[RN];
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        xa[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + (p + J) * 64));
        xb[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + (p + J) * 64 + 32));
      }
#pragma GCC unroll 4
      for (int w = 0; w < WN; ++w) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + w * row_bytes + (p + J) * 32));
#pragma GCC unroll 4
        for (int r = 0; r < RN; ++r)
          acc[w][r] = _mm256_fmadd_ps(pair_dot(b, xa[r], xb[r]), _mm256_permute_ps(sd[w][r], J * 0x55), acc[w][r]);
      }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
  }
  for (; p < pairs; ++p) {   // the last pairs (fewer than four), a pair's scales at a time
    __m256 dx2[RN];
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r)
      dx2[r] = _mm256_permutevar8x32_ps(
          _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx[r] + 2 * p)))), idx2);
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + w * row_bytes + p * 32));
      uint32_t sbits;   // two fp16
      std::memcpy(&sbits, sc + w * groups + 2 * p, 4);
      const __m256 s2 = _mm256_permutevar8x32_ps(
          _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(sbits)))), idx2);
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + p * 64));
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + p * 64 + 32));
        acc[w][r] = _mm256_fmadd_ps(pair_dot(b, xa, xb), _mm256_mul_ps(s2, dx2[r]), acc[w][r]);
      }
    }
  }
  if (groups % 2) {   // a last single group: 16 weight bytes, 4 lanes
    const int64_t g = groups - 1, at = pairs * 64;
    const __m128i m4x = _mm_set1_epi8(0x0F), ones4 = _mm_set1_epi16(1);
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + w * row_bytes + g * 16));
      const __m128i lo = _mm_and_si128(b, m4x), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4x);
      const float s1 = half_to_float(sc[w * groups + g]);
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        const __m128i t = _mm_add_epi16(
            _mm_maddubs_epi16(lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[r] + at))),
            _mm_maddubs_epi16(hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[r] + at + 16))));
        const __m128 d = _mm_mul_ps(_mm_cvtepi32_ps(_mm_madd_epi16(t, ones4)), _mm_set1_ps(dx[r][g]));
        acc[w][r] = _mm256_fmadd_ps(_mm256_insertf128_ps(_mm256_setzero_ps(), d, 0), _mm256_set1_ps(s1), acc[w][r]);
      }
    }
  }
  // the minima: sum_g m[g] * dsum[g], 8 groups a vector, the rest one at a time
#pragma GCC unroll 4
  for (int w = 0; w < WN; ++w) {
    __m256 accm[RN];
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) accm[r] = _mm256_setzero_ps();
    int64_t g0 = 0;
    for (; g0 + 8 <= groups; g0 += 8) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + w * groups + g0)));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) accm[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(dsum[r] + g0), accm[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) {
      float tail = 0.f;
      for (int64_t g = g0; g < groups; ++g) tail += half_to_float(mn[w * groups + g]) * dsum[r][g];
      totals[w * RN + r] = hsum8(_mm256_add_ps(acc[w][r], accm[r])) + tail;
    }
  }
}

// fp32 x against one quantized W row (kind 4 or 8), RN rows: the fp32 path of AVX2 hosts
// (AVX-512 hosts take qrow)
template <int RN>
inline void qrow_avx2(const uint8_t* wr, const float* sc, const float* xf, int64_t k, int64_t groups, int kind,
                      float* totals) {
  __m256 acc[RN], acc2[RN];
  for (int r = 0; r < RN; ++r) acc[r] = _mm256_setzero_ps(), acc2[r] = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 wv[4];
    if (kind == 4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16));
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      wv[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      wv[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      wv[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      wv[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
      for (int i = 0; i < 4; ++i)
        wv[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + g * 32 + 8 * i))));
    }
    const __m256 scale = _mm256_set1_ps(sc[g]);
    for (int r = 0; r < RN; ++r) {
      const float* xg = xf + r * k + g * 32;
      __m256 part = _mm256_mul_ps(_mm256_loadu_ps(xg), wv[0]);
      part = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), wv[1], part);
      part = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), wv[2], part);
      part = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), wv[3], part);
      if (g & 1)
        acc2[r] = _mm256_fmadd_ps(part, scale, acc2[r]);
      else
        acc[r] = _mm256_fmadd_ps(part, scale, acc[r]);
    }
  }
  for (int r = 0; r < RN; ++r) totals[r] = hsum8(_mm256_add_ps(acc[r], acc2[r]));
}

// int8 x (quantize_x_pairs_avx2<true>: k order) against 8-bit W rows without minima (Q8_0;
// w = s[g] * q, q signed): WN consecutive W rows (row_bytes apart, their fp16 scales `groups`
// apart) against RN rows of x, totals [WN][RN] of sum_g s[g] dx[g] * dot(q, xq). vpmaddubsw takes
// unsigned bytes on one side, so each group's products are |q| times xq with q's sign moved onto
// xq (vpsignb); |q| <= 128 and |xq| <= 127, so a pair's sum (<= 32,512) fits its 16-bit lane and
// q = -128 is exact (its |q| is the unsigned byte 128). Per group of 32: vpabsb, vpsignb,
// vpmaddubsw, vpmaddwd by ones, a conversion and an FMA by s * dx (eight groups' products made
// in one multiply, spread by vpermps); even and odd groups in two accumulators. The fp32 path it
// replaces (qrow_avx2) took a widening load, a conversion and an FMA per 8 weights. Each (W row,
// x row) takes the same operations in the same order whatever WN and RN are.
template <int WN, int RN>
__attribute__((always_inline)) inline void qrows8_a8_avx2(const uint8_t* wr, int64_t row_bytes, const uint16_t* sc,
                                                          const int8_t* const* xq, const float* const* dx,
                                                          int64_t groups, float* totals) {
  __m256 acc[WN][RN][2];
#pragma GCC unroll 4
  for (int w = 0; w < WN; ++w)
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) acc[w][r][0] = acc[w][r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  // group g's products: |q| . (xq with q's sign), summed into 8 int32 lanes, as fp32
  auto dot = [&](const __m256i wv, const __m256i xv) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)), ones));
  };
  int64_t g0 = 0;
  for (; g0 + 8 <= groups; g0 += 8) {
    __m256 sd[WN][RN];   // s[g] * dx[g] of these 8 groups
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + w * groups + g0)));
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) sd[w][r] = _mm256_mul_ps(s8, _mm256_loadu_ps(dx[r] + g0));
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const int64_t g = g0 + j;
      const __m256i idx = _mm256_set1_epi32(j);
      __m256i xv[RN];
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + g * 32));
#pragma GCC unroll 4
      for (int w = 0; w < WN; ++w) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + w * row_bytes + g * 32));
#pragma GCC unroll 4
        for (int r = 0; r < RN; ++r)
          acc[w][r][j & 1] = _mm256_fmadd_ps(dot(wv, xv[r]), _mm256_permutevar8x32_ps(sd[w][r], idx), acc[w][r][j & 1]);
      }
    }
  }
  for (; g0 < groups; ++g0) {   // the last groups (fewer than 8), one scale at a time
#pragma GCC unroll 4
    for (int w = 0; w < WN; ++w) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + w * row_bytes + g0 * 32));
      const float s1 = half_to_float(sc[w * groups + g0]);
#pragma GCC unroll 4
      for (int r = 0; r < RN; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + g0 * 32));
        acc[w][r][g0 & 1] = _mm256_fmadd_ps(dot(wv, xv), _mm256_set1_ps(s1 * dx[r][g0]), acc[w][r][g0 & 1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int w = 0; w < WN; ++w)
#pragma GCC unroll 4
    for (int r = 0; r < RN; ++r) totals[w * RN + r] = hsum8(_mm256_add_ps(acc[w][r][0], acc[w][r][1]));
}
constexpr bool kHaveA8Avx2 = true;
#else
constexpr bool kHaveA8Avx2 = false;
#endif

// sum of each group of 32 values of x[groups * 32]
template <typename T>
inline void group_sums(const T* x, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
#if defined(__AVX512F__)
    out[g] = _mm512_reduce_add_ps(_mm512_add_ps(load16(x + g * 32), load16(x + g * 32 + 16)));
#else
    float t = 0.f;
    for (int64_t i = 0; i < 32; ++i) t += load(x, g * 32 + i);
    out[g] = t;
#endif
  }
}

// One decode row against a long product (8 MiB of rows or more: SmolLM2's 28 MiB Q8_0 head, where
// its layer products are 0.2-0.9 MiB), AVX2 builds: the rows' L2 prefetch 12 KiB ahead instead of
// kPrefetchBytes, each thread's share being one long stream. Zen 3, random rows of SmolLM2's
// default-mode shapes, one process switching round by round (30-40 rounds a run): the head 0.867 /
// 0.875x the time at 12 KiB (28 and 25 of 30 faster), 0.896-0.926x at 8 KiB, 0.891x at 16 KiB,
// 0.902x at 24 KiB; the layer products, below the threshold, untouched; a head of Gemma 3's shape
// (262,144 x 640, 178 MB) 0.868x (16 of 16). Whole default-mode decode steps 0.966 / 0.981 /
// 0.986x (22, 21 and 18 of 30 rounds faster), Gemma 3's 0.957x (17 of 20). The dense fp32 GEMV's head
// with an L2 prefetch 12 KiB ahead besides its L1 one: decode steps 1.037x (twice), not taken.
// AVX-512 hosts (Zen 4) had measured 8-16 KiB over every product slower (docs/architecture.md)
// and keep kPrefetchBytes until measured for long products.
constexpr int64_t kLongRows = 8 << 20;   // bytes of a product's rows
#if !defined(__AVX512F__)
constexpr int64_t kLongRowsAhead = 12 << 10;
#else
constexpr int64_t kLongRowsAhead = kPrefetchBytes;
#endif

std::atomic<const NextRows*> g_next_rows{nullptr};

// The start of this thread's share of `next` (at::parallel_for's split over `threads` threads,
// grain 64, as qgemv_impl's): the first 4 KiB of its rows, and their scales and minima, into
// L2. The kernels' own prefetches run kPrefetchBytes ahead within a share, so without this
// every share of every product began with demand misses (SmolLM2's decode step: 120 products,
// 360 short streams a step).
inline void prefetch_share(const NextRows* next, int64_t tid, int64_t threads) {
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads, (next->n + 63) / 64));
  if (tid >= tasks) return;
  const int64_t chunk = (next->n + tasks - 1) / tasks, r0 = tid * chunk;
  const int64_t rows = std::min(chunk, next->n - r0);
  if (rows <= 0) return;
  const char* w = reinterpret_cast<const char*>(next->qw + r0 * next->row_bytes);
  const int64_t wb = std::min<int64_t>(kPrefetchBytes, rows * next->row_bytes);
  for (int64_t off = 0; off < wb; off += 64) __builtin_prefetch(w + off, 0, 2);   // prefetcht1: into L2
  const int64_t sb = std::min<int64_t>(kPrefetchBytes / 4, rows * next->groups * 2);
  for (const uint16_t* a : {next->scales, next->mins}) {
    if (a == nullptr) continue;
    const char* p = reinterpret_cast<const char*>(a + r0 * next->groups);
    for (int64_t off = 0; off < sb; off += 64) __builtin_prefetch(p + off, 0, 2);
  }
}

template <typename T>
void qgemv_impl(const T* x, const uint8_t* qw, const uint16_t* scales_h, const uint16_t* mins_h, T* y, int64_t m,
                int64_t n, int64_t k, int kind, bool act_int8, ArgmaxTrack* track = nullptr) {
  const int64_t groups = k / 32;
  const int64_t row_bytes = kind == 4 ? k / 2 : k;
  const bool vnni = act_int8 && kHaveVnni;
  // bf16 x, 4-bit weights, whole pairs of groups: the bf16 dot products (qrows4_bf16)
  const bool bf16_dot = kHaveBf16Dot && std::is_same<T, at::BFloat16>::value && kind == 4 && !vnni &&
                        groups % 2 == 0 && qgemv_bf16_enabled();
  // int8 x against 4-bit rows: the quads kernel (qrows4_a8), qgemm_a8's sums; 8-bit rows: qrow_vnni
  const bool a8_quads = vnni && kind == 4 && kHaveA8Quads;
  // AVX2 hosts: int8 x against 4-bit rows through vpmaddubsw (qrows4_a8_avx2), against 8-bit
  // rows without minima through vpsignb and vpmaddubsw (qrows8_a8_avx2)
  const bool a8_avx2 = act_int8 && kHaveA8Avx2 && kind == 4;
  const bool a8_avx2_eight = act_int8 && kHaveA8Avx2 && kind == 8 && mins_h == nullptr;
  // int8 x against 8-bit rows without minima: qrows8_a8 (qrow_vnni for rows with minima)
  const bool a8_eight = vnni && kind == 8 && kHaveA8Quads && mins_h == nullptr;
  // the kernels that sum the rounded x (dsum) and widen their fp16 scales in registers
  const bool a8_rows = a8_quads || a8_avx2 || a8_eight || a8_avx2_eight;
  // x in fp32 for the other row kernels (the bf16 dot products read x itself); every kernel but
  // the int8 row kernels (which sum the rounded x, dsum) takes x's group sums (for the minima)
  std::vector<float> xf(bf16_dot ? 0 : m * k), xsum(a8_rows ? 0 : m * groups, 0.f);
  for (int64_t i = 0; i < static_cast<int64_t>(xf.size()); ++i) xf[i] = load(x, i);
  // x's group sums (the minima's factor), 32 values at a time in two vectors (a chain of 32
  // scalar adds a group before: a 2-row product at k = 576 2.42-2.49 -> 2.23-2.30 us a call, at
  // k = 1,536 3.04-3.12 -> 2.53-2.58 us; ~30 us of a SmolLM2 decode step)
  for (int64_t r = 0; !a8_rows && r < m; ++r) group_sums(x + r * k, groups, xsum.data() + r * groups);
  std::vector<uint16_t> xp(bf16_dot ? m * k : 0);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    for (int64_t r = 0; bf16_dot && r < m; ++r) {
      const int64_t head = (k / 128) * 128;   // whole quads of groups; a last pair after them
      bf16_x_quads(x + r * k, head, xp.data() + r * k);
      if (head < k) bf16_x_pairs(x + r * k + head, k - head, xp.data() + r * k + head);
    }
  }
#endif
  std::vector<int8_t> xq(vnni || a8_avx2 || a8_avx2_eight ? m * (k + 64) : 0);
  std::vector<float> dx(vnni || a8_avx2 || a8_avx2_eight ? m * groups : 0), dsum(a8_rows ? m * groups : 0);
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (int64_t r = 0; a8_avx2 && r < m; ++r)
    quantize_x_pairs_avx2(xf.data() + r * k, k, xq.data() + r * (k + 64), dx.data() + r * groups,
                          dsum.data() + r * groups);
  for (int64_t r = 0; a8_avx2_eight && r < m; ++r)
    quantize_x_pairs_avx2<true>(xf.data() + r * k, k, xq.data() + r * (k + 64), dx.data() + r * groups,
                                dsum.data() + r * groups);
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  for (int64_t r = 0; a8_quads && r < m; ++r)
    quantize_x_quads(xf.data() + r * k, k, xq.data() + r * (k + 64), dx.data() + r * groups,
                     dsum.data() + r * groups);
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  for (int64_t r = 0; vnni && !a8_quads && r < m; ++r)
    quantize_x_pairs(xf.data() + r * k, k, kind, xq.data() + r * (k + 64), dx.data() + r * groups,
                     a8_eight ? dsum.data() + r * groups : nullptr);
#endif
  const NextRows* next = g_next_rows.exchange(nullptr, std::memory_order_relaxed);
  static const bool next_on = [] { const char* v = std::getenv("FASTGEN_NEXT_ROWS_PREFETCH"); return !(v && v[0] == '0'); }();
  const bool pf_next = next != nullptr && next_on;
  const int64_t threads = pf_next ? at::get_num_threads() : 1;
  auto body = [=, &xf, &xsum, &xq, &dx, &dsum, &xp](int64_t n0, int64_t n1) {
    // this row's scales and minima in fp32 (16 per instruction from their fp16), for the row
    // kernels that take them so (the bf16 dot products and the int8 quads widen them in registers)
    const bool fp16_rows = bf16_dot || a8_rows;
    std::vector<float> row_scales(fp16_rows ? 0 : 2 * groups);
    float* sc = row_scales.data();
    float* mn = mins_h != nullptr && !fp16_rows ? sc + groups : nullptr;
    int64_t o = n0;
    // the int8 row kernels' loop: one decode takes two W rows at a time (x's loads shared by them),
    // else each W row meets x's rows four at a time. kernel(wn, rn, W rows, their first index,
    // x's rows, their scales, their sums, totals [wn][rn]); every (W row, x row) takes the same
    // operations either way
    //
    // The rows' fp16 scales (and minima) are streams of their own, 2 bytes a group a row each:
    // every line of them is prefetched into L2 as far ahead in their stream as the rows' bytes
    // are in theirs. Left to the hardware prefetcher (Zen 4, one process switching round by
    // round, the same outputs): SmolLM2's Q8_0 head from memory took 1.05-1.07x the time (30
    // rounds, twice); default-mode generations of 128 tokens 1.03-1.07x in the VM's slower phases
    // (three runs, one line a call 128 rows ahead; this faster in 18-21 of 24-30 rounds) and
    // 1.00-1.03x in faster ones (this form); batches of 8 level (0.994x, 1.016x)
    auto prefetch_scales = [&](int64_t row, int64_t rows) {
      const char* sp = reinterpret_cast<const char*>(scales_h + row * groups) + kPrefetchBytes;
      const char* mp = mins_h != nullptr ? reinterpret_cast<const char*>(mins_h + row * groups) + kPrefetchBytes : nullptr;
      for (int64_t off = 0; off < rows * groups * 2; off += 64) {
        __builtin_prefetch(sp + off, 0, 2);
        if (mp != nullptr) __builtin_prefetch(mp + off, 0, 2);
      }
    };
    auto a8_loop = [&](auto kernel) {
      const int8_t* xqs[4];
      const float *dxs[4], *dss[4];
      if (m == 1) {
        constexpr int WN = 2;
        xqs[0] = xq.data(), dxs[0] = dx.data(), dss[0] = dsum.data();
        const int64_t ahead = n * row_bytes >= kLongRows ? kLongRowsAhead : kPrefetchBytes;
        for (; o + WN <= n1; o += WN) {
          const uint8_t* wr = qw + o * row_bytes;
          for (int64_t off = 0; off < WN * row_bytes; off += 64) {
            __builtin_prefetch(wr + ahead + off, 0, 2);
#if !defined(__AVX512F__)
            // AVX2 hosts: the rows 1 KiB on into L1 as well. Zen 3, one row from memory,
            // alternating in one process (30 rounds, three runs): SmolLM2's Q8_0 head 0.88-0.90x
            // the time, its 120 layer products level (0.94-1.02x), batch-1 steps 0.979x (11 of
            // 16 faster). (On the Zen 4 host a prefetch of the next pair of rows into L1 had
            // cost 1.05-1.16x the time: left to AVX2 builds)
            __builtin_prefetch(wr + 1024 + off, 0, 3);
#endif
          }
          prefetch_scales(o, WN);
          float totals[WN];
          kernel(std::integral_constant<int, WN>{}, std::integral_constant<int, 1>{}, wr, o, xqs, dxs, dss, totals);
          for (int w = 0; w < WN; ++w) store(y, o + w, totals[w]);
        }
      }
      for (; o < n1; ++o) {
        const uint8_t* wr = qw + o * row_bytes;
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(wr + kPrefetchBytes + off);
        prefetch_scales(o, 1);
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
          const int64_t rn = std::min<int64_t>(4, m - r0);
          float totals[4];
          for (int64_t r = 0; r < rn; ++r)
            xqs[r] = xq.data() + (r0 + r) * (k + 64), dxs[r] = dx.data() + (r0 + r) * groups,
            dss[r] = dsum.data() + (r0 + r) * groups;
          by_rows(rn, [&](auto rows) { kernel(std::integral_constant<int, 1>{}, rows, wr, o, xqs, dxs, dss, totals); });
          for (int64_t r = 0; r < rn; ++r) store(y, (r0 + r) * n + o, totals[r]);
        }
      }
    };
    (void)a8_loop;
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if (a8_quads) {   // int8 x against 4-bit rows
      a8_loop([&](auto wn, auto rn, const uint8_t* wr, int64_t w0, const int8_t* const* xqs, const float* const* dxs,
                  const float* const* dss, float* totals) {
        qrows4_a8<decltype(wn)::value, decltype(rn)::value>(wr, row_bytes, scales_h + w0 * groups, mins_h + w0 * groups,
                                                            xqs, dxs, dss, groups, totals);
      });
      return;
    }
    if (a8_eight) {   // int8 x against 8-bit rows
      a8_loop([&](auto wn, auto rn, const uint8_t* wr, int64_t w0, const int8_t* const* xqs, const float* const* dxs,
                  const float* const* dss, float* totals) {
        qrows8_a8<decltype(wn)::value, decltype(rn)::value>(wr, row_bytes, scales_h + w0 * groups, xqs, dxs, dss,
                                                            groups, totals);
      });
      return;
    }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (a8_avx2) {   // int8 x against 4-bit rows, AVX2
      a8_loop([&](auto wn, auto rn, const uint8_t* wr, int64_t w0, const int8_t* const* xqs, const float* const* dxs,
                  const float* const* dss, float* totals) {
        qrows4_a8_avx2<decltype(wn)::value, decltype(rn)::value>(wr, row_bytes, scales_h + w0 * groups,
                                                                 mins_h + w0 * groups, xqs, dxs, dss, groups, totals);
      });
      return;
    }
    if (a8_avx2_eight) {   // int8 x against 8-bit rows, AVX2
      a8_loop([&](auto wn, auto rn, const uint8_t* wr, int64_t w0, const int8_t* const* xqs, const float* const* dxs,
                  const float* const*, float* totals) {
        qrows8_a8_avx2<decltype(wn)::value, decltype(rn)::value>(wr, row_bytes, scales_h + w0 * groups, xqs, dxs,
                                                                 groups, totals);
      });
      return;
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (bf16_dot && m == 1) {   // one decode: two W rows at a time (qrows4_bf16<2, 1>)
      constexpr int WN = 2;
      for (; o + WN <= n1; o += WN) {
        const uint8_t* wr = qw + o * row_bytes;
        for (int64_t off = 0; off < WN * row_bytes; off += 64) __builtin_prefetch(wr + kPrefetchBytes + off, 0, 2);
        float totals[WN];
        const uint16_t* x1 = xp.data();
        const float* xs1 = xsum.data();
        qrows4_bf16<WN, 1>(wr, row_bytes, scales_h + o * groups, mins_h + o * groups, &x1, &xs1, groups, totals);
        for (int w = 0; w < WN; ++w) store(y, o + w, totals[w]);
      }
    }
#endif
    for (; o < n1; ++o) {
      const uint8_t* wr = qw + o * row_bytes;
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(wr + kPrefetchBytes + off);
      __builtin_prefetch(scales_h + (o + 8) * groups);
      if (mins_h != nullptr) __builtin_prefetch(mins_h + (o + 8) * groups);
      if (!bf16_dot) {   // the other row kernels take fp32 scales and minima
        halves_to_floats(scales_h + o * groups, sc, groups);
        if (mn != nullptr) halves_to_floats(mins_h + o * groups, mn, groups);
      }
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t rn = std::min<int64_t>(4, m - r0);
        float totals[4] = {};
        bool with_mins = false;   // the kernel summed the min terms already
        const float* xr = bf16_dot ? nullptr : xf.data() + r0 * k;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (bf16_dot) {
          const uint16_t* xps[4];
          const float* xss[4];
          for (int64_t r = 0; r < rn; ++r) xps[r] = xp.data() + (r0 + r) * k, xss[r] = xsum.data() + (r0 + r) * groups;
          by_rows(rn, [&](auto rows) {
            qrows4_bf16<1, decltype(rows)::value>(wr, row_bytes, scales_h + o * groups, mins_h + o * groups, xps,
                                                  xss, groups, totals);
          });
          with_mins = true;
        } else
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
        if (vnni) {
          const int8_t* xqs[4];
          const float* dxs[4];
          for (int64_t r = 0; r < rn; ++r)
            xqs[r] = xq.data() + (r0 + r) * (k + 64), dxs[r] = dx.data() + (r0 + r) * groups;
          switch (rn) {
            case 1: qrow_vnni<1>(wr, sc, xqs, dxs, groups, kind, totals); break;
            case 2: qrow_vnni<2>(wr, sc, xqs, dxs, groups, kind, totals); break;
            case 3: qrow_vnni<3>(wr, sc, xqs, dxs, groups, kind, totals); break;
            default: qrow_vnni<4>(wr, sc, xqs, dxs, groups, kind, totals); break;
          }
        } else
#endif
#if defined(__AVX512F__)
        switch (rn) {
          case 1: qrow<1>(wr, sc, xr, k, groups, kind, totals); break;
          case 2: qrow<2>(wr, sc, xr, k, groups, kind, totals); break;
          case 3: qrow<3>(wr, sc, xr, k, groups, kind, totals); break;
          default: qrow<4>(wr, sc, xr, k, groups, kind, totals); break;
        }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        switch (rn) {
          case 1: qrow_avx2<1>(wr, sc, xr, k, groups, kind, totals); break;
          case 2: qrow_avx2<2>(wr, sc, xr, k, groups, kind, totals); break;
          case 3: qrow_avx2<3>(wr, sc, xr, k, groups, kind, totals); break;
          default: qrow_avx2<4>(wr, sc, xr, k, groups, kind, totals); break;
        }
#else
        qrow_generic(wr, sc, xr, k, groups, kind, rn, totals);
#endif
        for (int64_t r = 0; r < rn; ++r) {
          float total = totals[r];
          if (mn != nullptr && !with_mins) {
            const float* xs = xsum.data() + (r0 + r) * groups;
            float mt = 0.f;
#pragma omp simd reduction(+ : mt)
            for (int64_t gg = 0; gg < groups; ++gg) mt += mn[gg] * xs[gg];
            total += mt;
          }
          store(y, (r0 + r) * n + o, total);
        }
      }
    }
  };
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    if (pf_next) prefetch_share(next, at::get_thread_num(), threads);
    if (track != nullptr)
      track->run(n0, n1, y, n, body);
    else
      body(n0, n1);
  });
}

at::Tensor qgemv_tracked(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& mins, int64_t kind, bool act_int8, ArgmaxTrack* track) {
  TORCH_CHECK(x.dim() == 2 && qw.dim() == 2, "qgemv: x [m, k], qw [n, k/2 or k]");
  const int64_t m = x.size(0), k = x.size(1), n = qw.size(0);
  const QuantRowsPtrs qp = check_quant_rows("qgemv", qw, scales, mins, kind, k);
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, xc.options());
  AT_DISPATCH_SWITCH(xc.scalar_type(), "qgemv",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        qgemv_impl<float>(xc.data_ptr<float>(), qw.data_ptr<uint8_t>(), qp.scales, qp.mins,
                          y.data_ptr<float>(), m, n, k, static_cast<int>(kind), act_int8, track); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        qgemv_impl<at::BFloat16>(xc.data_ptr<at::BFloat16>(), qw.data_ptr<uint8_t>(), qp.scales,
                                 qp.mins, y.data_ptr<at::BFloat16>(), m, n, k, static_cast<int>(kind), act_int8,
                                 track); }));
  return y;
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& mins, int64_t kind, bool act_int8) {
  return qgemv_tracked(x, qw, scales, mins, kind, act_int8, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qgemv_argmax(const at::Tensor& x, const at::Tensor& qw,
                                                            const at::Tensor& scales,
                                                            const c10::optional<at::Tensor>& mins, int64_t kind,
                                                            bool act_int8) {
  TORCH_CHECK(x.dim() == 2 && qw.dim() == 2 && qw.size(0) > 0, "qgemv_argmax: x [m, k], qw [n, bytes], n > 0");
  return with_argmax(x, [&](ArgmaxTrack* track) { return qgemv_tracked(x, qw, scales, mins, kind, act_int8, track); });
}

}  // namespace

TORCH_LIBRARY(fastgen, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("sample_rows(Tensor chosen, Tensor logits, Tensor rows, Tensor params, Tensor u) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, int h, int kvh, int d) -> Tensor[]");
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("qgemv(Tensor x, Tensor qw, Tensor scales, Tensor? mins, int kind, bool act_int8=False) -> Tensor");
  m.def("gemv_argmax(Tensor x, Tensor w, Tensor? bias) -> (Tensor, Tensor, Tensor)");
  m.def("qgemv_argmax(Tensor x, Tensor qw, Tensor scales, Tensor? mins, int kind, bool act_int8=False) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("have_vnni() -> bool");
  m.def("a8_kinds() -> int[]");
  m.def("a8_gemv_kinds() -> int[]");
  m.def("have_bf16_dot() -> bool");
  m.def("have_amx() -> bool");
  m.def("set_amx(bool on) -> bool");
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor q_starts, Tensor start_pos, "
        "Tensor block_tables, float scale, int window=0) -> Tensor");
  m.def("rope_write_kv_i8(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) k_scales, Tensor(d!) v_scales, int h, int kvh, int d) "
        "-> Tensor[]");
  m.def("paged_attention_i8(Tensor q, Tensor k_pool, Tensor v_pool, Tensor k_scales, Tensor v_scales, "
        "Tensor q_starts, Tensor start_pos, Tensor block_tables, float scale, int window=0) -> Tensor");
}

bool have_vnni() { return kHaveVnni; }
// the weight kinds (4, 8 bits) with int8-activation kernels in this build (qgemv's int8 rows and
// qgemm_a8): both with AVX512-VNNI, 4-bit rows with AVX2's vpmaddubsw, none otherwise
std::vector<int64_t> a8_kinds() {
  if (kHaveVnni) return {4, 8};
  if (kHaveA8Avx2) return {4};
  return {};
}
// the weight kinds whose decode rows (qgemv) have int8-activation kernels: a8_kinds and, on AVX2
// hosts, 8-bit rows without minima (qrows8_a8_avx2; their many-row products stay in the dtype)
std::vector<int64_t> a8_gemv_kinds() {
  if (kHaveVnni || kHaveA8Avx2) return {4, 8};
  return {};
}
// bf16 x takes qgemv's vdpbf16ps kernel (AVX512-BF16, FASTGEN_QGEMV_BF16 not 0)
bool have_bf16_dot() { return kHaveBf16Dot && qgemv_bf16_enabled(); }
// whether bf16 prompt products (qgemm) and prompt-chunk attention run on AMX tiles now (amx.h)
bool have_amx() { return amx_usable(); }
// turns the AMX paths on or off for this process (on: where available); returns the prior state
bool set_amx(bool on) {
  const bool was = amx_usable();
  amx_switch().store(on);
  return was;
}

TORCH_LIBRARY_IMPL(fastgen, CompositeExplicitAutograd, m) {
  m.impl("have_vnni", &have_vnni);
  m.impl("a8_kinds", &a8_kinds);
  m.impl("a8_gemv_kinds", &a8_gemv_kinds);
  m.impl("have_bf16_dot", &have_bf16_dot);
  m.impl("have_amx", &have_amx);
  m.impl("set_amx", &set_amx);
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("rope_write_kv_i8", &rope_write_kv_i8);
  m.impl("paged_attention_i8", &paged_attention_i8);
  m.impl("gemv", &gemv);
  m.impl("qgemv", &qgemv);
  m.impl("gemv_argmax", &gemv_argmax);
  m.impl("qgemv_argmax", &qgemv_argmax);
}

namespace fastgen_kernels {
void set_next_rows(const NextRows* next) { g_next_rows.store(next, std::memory_order_relaxed); }
}  // namespace fastgen_kernels
