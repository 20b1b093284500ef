// Direct calls of the fastgen ops from Python: the extension's module (``fastgen.kernels.direct()``)
// holds one function per hot op, which takes the same arguments as ``torch.ops.fastgen.<op>`` and
// calls the op through the dispatcher's typed handle. The dispatcher still picks the kernel (a
// tensor on another device is refused by name, autograd and inference mode behave as through
// torch.ops); what is skipped is torch.ops' Python-side work, its schema parsing and boxing of
// every argument. Measured on the 2-core Zen 5 host, an op that only allocates its output:
// 1.72 us a call through ``torch.ops.<ns>.<op>.default``, 0.73 us through its typed handle from
// pybind11. A batch-1 decode step of SmolLM2 makes ~270 such calls.
// Not <torch/extension.h>, which brings all of torch's C++ API: ATen, the dispatcher and torch's
// pybind11 casters are all this file uses (its compile 28 -> 17 s on the 2-core Zen 4 host, the
// longest of the four, so a first start builds the kernels ~10 s sooner)
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include "quant_rows.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using T = at::Tensor;
using OptT = c10::optional<at::Tensor>;

using AddRmsNorm = void(T&, T&, const T&, double);
using SiluMul = T(const T&);
using RopeWriteKv = std::vector<T>(const T&, const T&, const T&, const T&, const T&, T&, T&, int64_t, int64_t,
                                   int64_t);
using PagedAttention = T(const T&, const T&, const T&, const T&, const T&, const T&, double, int64_t);
using RopeWriteKvI8 = std::vector<T>(const T&, const T&, const T&, const T&, const T&, T&, T&, T&, T&, int64_t,
                                     int64_t, int64_t);
using PagedAttentionI8 = T(const T&, const T&, const T&, const T&, const T&, const T&, const T&, const T&, double,
                           int64_t);
using Gemv = T(const T&, const T&, const OptT&);
using Qgemv = T(const T&, const T&, const T&, const OptT&, int64_t, bool);
using Qgemm = T(const T&, const T&, const T&, const OptT&, int64_t, const OptT&, bool);

// The decode-row product of one weight format, as fastgen/model/layers.py (GemvDenseWeight) and
// fastgen/model/quant.py (QuantWeight) compute it for the rows a LayerStack takes: kind 0 is the
// dense GEMV (weight, bias), kind 4 / 8 the quantized rows through qgemv (then `+ bias`, as
// QuantWeight adds it), `act_int8` the activations' int8 flag QuantWeight passes for the model's dtype.
struct Product {
  int64_t kind = 0;
  T weight;
  OptT scales, mins, bias;
  bool act_int8 = false;
  NextRows rows;   // kind 4 / 8: what qgemv prefetches the start of while the product before runs
  // quantized rows: up to qgemv_rows rows take qgemv; more take qgemm_a8 from a8_rows on, qgemm
  // below it, with the bias in fp32 (QuantWeight.matmul's choice, so the closures' result bit for bit)
  int64_t qgemv_rows = std::numeric_limits<int64_t>::max(), a8_rows = std::numeric_limits<int64_t>::max();
  OptT bias_f32;
};

struct StackLayer {
  Product qkv, o, gate_up, down;
  T post_norm, next_norm, cos, sin;   // cos, sin: the layer's RoPE table
  double post_eps = 0, next_eps = 0, scale = 1;
  int64_t layer = 0, heads = 0, kv_heads = 0, head_dim = 0, window = 0;
};

// A Llama-family decoder stack run for few rows (decode steps) without Python between its ops:
// the same ops, in the same order and with the same arguments as the layers' closures
// (fastgen/model/llama.py, DecoderLayer.bind), called through their typed dispatcher handles, so
// the result is the closures' bit for bit; only the ~10 Python calls a layer make are gone, and
// the GIL is released while it runs. fastgen/model/stack.py decides when a model can use it.
class LayerStack {
 public:
  LayerStack()
      : add_rms_norm_(handle<AddRmsNorm>("fastgen::add_rms_norm_")),
        silu_mul_(handle<SiluMul>("fastgen::silu_mul")),
        rope_write_kv_(handle<RopeWriteKv>("fastgen::rope_write_kv")),
        paged_attention_(handle<PagedAttention>("fastgen::paged_attention")),
        rope_write_kv_i8_(handle<RopeWriteKvI8>("fastgen::rope_write_kv_i8")),
        paged_attention_i8_(handle<PagedAttentionI8>("fastgen::paged_attention_i8")),
        gemv_(handle<Gemv>("fastgen::gemv")),
        qgemv_(handle<Qgemv>("fastgen::qgemv")),
        qgemm_(handle<Qgemm>("fastgen::qgemm")),
        qgemm_a8_(handle<Qgemm>("fastgen::qgemm_a8")) {}

  void add_layer(StackLayer l) {
    max_layer_ = std::max(max_layer_, l.layer);
    layers_.push_back(std::move(l));
  }

  // x: the first layer's input norm of `residual` ([T, hidden]); updates `residual` in place and
  // returns the last layer's `next_norm` of it. k_pools/v_pools: the KV pool's tensors by layer;
  // the rest is the step's PagedPlan.
  // k_scales, v_scales: an 8-bit pool's (kv_cache_dtype="int8"), one per layer; empty for a pool of x's dtype
  T run(T x, T residual, const T& positions, const T& slots, std::vector<T> k_pools, std::vector<T> v_pools,
        const T& q_starts, const T& start_pos, const T& block_tables, std::vector<T> k_scales,
        std::vector<T> v_scales) {
    TORCH_CHECK(max_layer_ < static_cast<int64_t>(std::min(k_pools.size(), v_pools.size())),
                "LayerStack: no KV pool tensor for layer ", max_layer_);
    const bool i8 = !k_scales.empty();
    TORCH_CHECK(!i8 || (k_scales.size() == k_pools.size() && v_scales.size() == v_pools.size()),
                "LayerStack: an 8-bit KV pool needs a scale tensor per layer");
    const int64_t rows = x.size(0);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      const StackLayer* nl = i + 1 < layers_.size() ? &layers_[i + 1] : nullptr;
      T qkv = product(l.qkv, x, &l.o);
      std::vector<T> qk = i8 ? rope_write_kv_i8_.call(qkv, positions, l.cos, l.sin, slots, k_pools[l.layer],
                                                      v_pools[l.layer], k_scales[l.layer], v_scales[l.layer], l.heads,
                                                      l.kv_heads, l.head_dim)
                             : rope_write_kv_.call(qkv, positions, l.cos, l.sin, slots, k_pools[l.layer],
                                                   v_pools[l.layer], l.heads, l.kv_heads, l.head_dim);
      T o = i8 ? paged_attention_i8_.call(qk[0].contiguous(), k_pools[l.layer], v_pools[l.layer], k_scales[l.layer],
                                          v_scales[l.layer], q_starts, start_pos, block_tables, l.scale, l.window)
               : paged_attention_.call(qk[0].contiguous(), k_pools[l.layer], v_pools[l.layer], q_starts, start_pos,
                                       block_tables, l.scale, l.window);
      T a = product(l.o, o.reshape({rows, -1}), &l.gate_up);
      add_rms_norm_.call(a, residual, l.post_norm, l.post_eps);
      T gu = product(l.gate_up, a, &l.down);
      T m = product(l.down, silu_mul_.call(gu), nl != nullptr ? &nl->qkv : nullptr);
      add_rms_norm_.call(m, residual, l.next_norm, l.next_eps);
      x = m;
    }
    return x;
  }

 private:
  // `next`: the product that follows this one (its rows' start prefetched meanwhile), or nullptr
  T product(const Product& p, const T& x, const Product* next) {
    if (p.kind == 0) return gemv_.call(x, p.weight, p.bias);
    if (x.size(0) > p.qgemv_rows)   // a decode batch past qgemv's limit: the many-row kernels
      return (x.size(0) >= p.a8_rows ? qgemm_a8_ : qgemm_)
          .call(x, p.weight, *p.scales, p.mins, p.kind, p.bias_f32, false);
    // the hint lives for this call only (qgemv takes it at entry; cleared however the call ends)
    struct Clear {
      ~Clear() { fastgen_kernels::set_next_rows(nullptr); }
    } clear;
    fastgen_kernels::set_next_rows(next != nullptr && next->kind != 0 ? &next->rows : nullptr);
    T y = qgemv_.call(x, p.weight, *p.scales, p.mins, p.kind, p.act_int8);
    return p.bias ? y + *p.bias : y;
  }

  std::vector<StackLayer> layers_;
  int64_t max_layer_ = -1;
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm_;
  c10::TypedOperatorHandle<SiluMul> silu_mul_;
  c10::TypedOperatorHandle<RopeWriteKv> rope_write_kv_;
  c10::TypedOperatorHandle<PagedAttention> paged_attention_;
  c10::TypedOperatorHandle<RopeWriteKvI8> rope_write_kv_i8_;
  c10::TypedOperatorHandle<PagedAttentionI8> paged_attention_i8_;
  c10::TypedOperatorHandle<Gemv> gemv_;
  c10::TypedOperatorHandle<Qgemv> qgemv_;
  c10::TypedOperatorHandle<Qgemm> qgemm_, qgemm_a8_;
};

Product make_product(int64_t kind, T weight, OptT scales, OptT mins, OptT bias, bool act_int8, int64_t qgemv_rows,
                     int64_t a8_rows) {
  TORCH_CHECK(kind == 0 || kind == 4 || kind == 8, "LayerStack: product kind must be 0 (dense), 4 or 8, got ", kind);
  TORCH_CHECK(kind == 0 || scales.has_value(), "LayerStack: quantized rows need their scales");
  NextRows rows;
  if (kind != 0) {   // qgemv's own checks of the rows (quant_rows.h), which give their pointers
    TORCH_CHECK(weight.dim() == 2, "LayerStack: quantized rows must be [n, bytes]");
    const int64_t k = kind == 4 ? 2 * weight.size(1) : weight.size(1);
    const QuantRowsPtrs p = check_quant_rows("LayerStack", weight, *scales, mins, kind, k);
    rows = NextRows{weight.data_ptr<uint8_t>(), p.scales, p.mins, weight.size(0), weight.size(1), k / 32};
  }
  OptT bias_f32;
  if (bias.has_value() && bias->defined()) bias_f32 = bias->to(at::kFloat).contiguous();
  return Product{kind,     std::move(weight), std::move(scales), std::move(mins), std::move(bias), act_int8, rows,
                 qgemv_rows, a8_rows, std::move(bias_f32)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the handles are looked up once, when Python imports the module (the ops' registrations ran
  // when the library was loaded, before this)
  static auto rms_norm = handle<T(const T&, const T&, double)>("fastgen::rms_norm");
  static auto add_rms_norm_ = handle<void(T&, T&, const T&, double)>("fastgen::add_rms_norm_");
  static auto silu_mul = handle<T(const T&)>("fastgen::silu_mul");
  static auto argmax_rows = handle<T(const T&)>("fastgen::argmax_rows");
  static auto rope_write_kv = handle<std::vector<T>(const T&, const T&, const T&, const T&, const T&, T&, T&,
                                                    int64_t, int64_t, int64_t)>("fastgen::rope_write_kv");
  static auto paged_attention = handle<T(const T&, const T&, const T&, const T&, const T&, const T&, double,
                                         int64_t)>("fastgen::paged_attention");
  static auto rope_write_kv_i8 = handle<RopeWriteKvI8>("fastgen::rope_write_kv_i8");
  static auto paged_attention_i8 = handle<PagedAttentionI8>("fastgen::paged_attention_i8");
  static auto gemv = handle<T(const T&, const T&, const OptT&)>("fastgen::gemv");
  static auto qgemv = handle<T(const T&, const T&, const T&, const OptT&, int64_t, bool)>("fastgen::qgemv");
  static auto qgemm = handle<T(const T&, const T&, const T&, const OptT&, int64_t, const OptT&, bool)>(
      "fastgen::qgemm");
  static auto qgemm_a8 = handle<T(const T&, const T&, const T&, const OptT&, int64_t, const OptT&, bool)>(
      "fastgen::qgemm_a8");
  static auto qembed = handle<T(const T&, const T&, const T&, const OptT&, int64_t, at::ScalarType)>(
      "fastgen::qembed");

  py::class_<Product>(m, "Product");
  m.def("product", &make_product, py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("mins"),
        py::arg("bias"), py::arg("act_int8"), py::arg("qgemv_rows") = std::numeric_limits<int64_t>::max(),
        py::arg("a8_rows") = std::numeric_limits<int64_t>::max());
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<>())
      .def("add_layer",
           [](LayerStack& s, const Product& qkv, const Product& o, const Product& gate_up, const Product& down,
              T post_norm, double post_eps, T next_norm, double next_eps, T cos, T sin, int64_t layer,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, int64_t window) {
             s.add_layer(StackLayer{qkv, o, gate_up, down, std::move(post_norm), std::move(next_norm), std::move(cos),
                                    std::move(sin), post_eps, next_eps, scale, layer, heads, kv_heads, head_dim,
                                    window});
           })
      .def("run", &LayerStack::run, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", [](const T& x, const T& w, double eps) { return rms_norm.call(x, w, eps); });
  m.def("add_rms_norm_", [](T x, T residual, const T& w, double eps) { add_rms_norm_.call(x, residual, w, eps); });
  m.def("silu_mul", [](const T& gate_up) { return silu_mul.call(gate_up); });
  m.def("argmax_rows", [](const T& x) { return argmax_rows.call(x); });
  m.def("rope_write_kv", [](const T& qkv, const T& positions, const T& cos, const T& sin, const T& slots, T k_pool,
                            T v_pool, int64_t h, int64_t kvh, int64_t d) {
    return rope_write_kv.call(qkv, positions, cos, sin, slots, k_pool, v_pool, h, kvh, d);
  });
  m.def("paged_attention", [](const T& q, const T& k_pool, const T& v_pool, const T& q_starts, const T& start_pos,
                              const T& block_tables, double scale, int64_t window) {
    return paged_attention.call(q, k_pool, v_pool, q_starts, start_pos, block_tables, scale, window);
  });
  m.def("rope_write_kv_i8", [](const T& qkv, const T& positions, const T& cos, const T& sin, const T& slots,
                               T k_pool, T v_pool, T k_scales, T v_scales, int64_t h, int64_t kvh, int64_t d) {
    return rope_write_kv_i8.call(qkv, positions, cos, sin, slots, k_pool, v_pool, k_scales, v_scales, h, kvh, d);
  });
  m.def("paged_attention_i8", [](const T& q, const T& k_pool, const T& v_pool, const T& k_scales,
                                 const T& v_scales, const T& q_starts, const T& start_pos, const T& block_tables,
                                 double scale, int64_t window) {
    return paged_attention_i8.call(q, k_pool, v_pool, k_scales, v_scales, q_starts, start_pos, block_tables, scale,
                                   window);
  });
  m.def("gemv", [](const T& x, const T& w, const OptT& bias) { return gemv.call(x, w, bias); });
  m.def("qgemv", [](const T& x, const T& qw, const T& scales, const OptT& mins, int64_t kind, bool act_int8) {
    return qgemv.call(x, qw, scales, mins, kind, act_int8);
  });
  m.def("qgemm", [](const T& x, const T& qw, const T& scales, const OptT& mins, int64_t kind, const OptT& bias,
                    bool silu_mul) { return qgemm.call(x, qw, scales, mins, kind, bias, silu_mul); });
  m.def("qgemm_a8", [](const T& x, const T& qw, const T& scales, const OptT& mins, int64_t kind, const OptT& bias,
                       bool silu_mul) { return qgemm_a8.call(x, qw, scales, mins, kind, bias, silu_mul); });
  m.def("qembed", [](const T& ids, const T& qw, const T& scales, const OptT& mins, int64_t kind,
                     at::ScalarType dtype) { return qembed.call(ids, qw, scales, mins, kind, dtype); });
}
