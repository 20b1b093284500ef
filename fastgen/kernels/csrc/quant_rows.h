// The argument checks of every op over quantized rows (fastgen.model.quant.QuantRows), shared by
// qgemv (cpu_kernels.cpp), qgemm and qembed (qgemm.cpp):
//   qw     [n, k/2] uint8 (kind 4: nibbles) or [n, k] (kind 8: int8 bytes), contiguous
//   scales [n, k/32] fp32; mins [n, k/32] fp32, required for kind 4, absent for kind 8
#pragma once

#include <ATen/ATen.h>

// Returns the mins' data (nullptr for kind 8). ``op`` names the op in the errors.
inline const float* check_quant_rows(const char* op, const at::Tensor& qw, const at::Tensor& scales,
                                     const c10::optional<at::Tensor>& mins, int64_t kind, int64_t k) {
  TORCH_CHECK(kind == 4 || kind == 8, op, ": kind must be 4 or 8");
  TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              op, ": qw must be [n, k/2 or k] uint8, contiguous");
  const int64_t n = qw.size(0);
  TORCH_CHECK(k % 32 == 0 && qw.size(1) == (kind == 4 ? k / 2 : k),
              op, ": k must be a multiple of 32 and match qw's row bytes");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n * (k / 32),
              op, ": scales must be [n, k/32] fp32");
  const float* mp = nullptr;
  if (mins.has_value() && mins->defined()) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->numel() == n * (k / 32),
                op, ": mins must be [n, k/32] fp32");
    mp = mins->data_ptr<float>();
  }
  TORCH_CHECK(kind == 8 || mp != nullptr, op, ": 4-bit rows need their mins");
  return mp;
}
