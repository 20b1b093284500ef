// AMX tiles (Intel Sapphire Rapids and later: AMX-TILE, AMX-BF16), shared by the kernels that use
// them (qgemm.cpp: bf16 products of many rows; cpu_kernels.cpp: prompt-chunk attention).
//
// One tile shape serves every use here: 16 rows of 64 bytes (16 fp32 sums, 32 bf16 values, or
// 16 pairs of bf16 in the "VNNI" layout of a B operand), so a kernel loads the configuration
// once, uses tiles 0..7 as it likes and releases them when done (torch's own brgemm callers
// configure the tiles again after a release, so the two never see each other's state).
//
// The Linux kernel hands a process the tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM); amx_usable() asks once. FASTGEN_AMX=0 turns the tiles off at start,
// torch.ops.fastgen.set_amx(False) at run time (A/B measurements and tests: the other paths of
// the same ops then run).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#define FASTGEN_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// whether the build has AMX and the OS granted this process the tile state (asked once)
inline bool amx_available() {
#if defined(FASTGEN_HAVE_AMX)
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// the run-time switch (starts on unless FASTGEN_AMX=0)
inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("FASTGEN_AMX");
    return !(v && v[0] == '0');
  }()};
  return on;
}

inline bool amx_usable() { return amx_switch().load(std::memory_order_relaxed) && amx_available(); }

#if defined(FASTGEN_HAVE_AMX)
struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0..7 as 16 rows x 64 bytes; for the calling thread, until amx_release()
inline void amx_configure() {
  AmxTileConfig c{};
  c.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

inline void amx_release() { _tile_release(); }

// The step every tile kernel here takes: tiles 0-3 += (A rows at a0 / a1) x (B columns at b0 /
// b1), sums 0: a0.b0, 1: a0.b1, 2: a1.b0, 3: a1.b1 (A in tiles 4-5, B in 6-7; bf16 pairs).
// StreamA: the A rows loaded by tileloaddt1 (the non-temporal hint), for A rows that stream past
// once while the B operand is used again (qgemm's rows of x against a panel)
template <bool StreamA = false>
inline void amx_step_2x2(const void* a0, const void* a1, int64_t lda, const void* b0, const void* b1, int64_t ldb) {
  if constexpr (StreamA) {
    _tile_stream_loadd(4, a0, lda);
    _tile_stream_loadd(5, a1, lda);
  } else {
    _tile_loadd(4, a0, lda);
    _tile_loadd(5, a1, lda);
  }
  _tile_loadd(6, b0, ldb);
  _tile_loadd(7, b1, ldb);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// tiles 0-3 from / to four blocks of 16 x 16 fp32, ldc bytes between rows
inline void amx_load_2x2(const float* c0, const float* c1, const float* c2, const float* c3, int64_t ldc) {
  _tile_loadd(0, c0, ldc);
  _tile_loadd(1, c1, ldc);
  _tile_loadd(2, c2, ldc);
  _tile_loadd(3, c3, ldc);
}

inline void amx_store_2x2(float* c0, float* c1, float* c2, float* c3, int64_t ldc) {
  _tile_stored(0, c0, ldc);
  _tile_stored(1, c1, ldc);
  _tile_stored(2, c2, ldc);
  _tile_stored(3, c3, ldc);
}

inline void amx_zero_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
#endif
