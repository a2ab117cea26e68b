// A decode step's whole decoder stack in one op: torch.ops.kvserve_decode_stack.forward. Built at
// first use by models/decode_stack.py; its consumer is models/llama.py.
//
// Why: at batch 1 a Llama layer is ~8 kernel calls (norm, qkv, fused rotary/KV/attention, o,
// norm, gate/up, SiLU, down) of 5-30 us each, and the Python between them (module calls, path
// choices, argument checks) costs as much again: ~1.5 ms of a ~6.5 ms step on two cores. Here the
// layers run in C++, each kernel called through the dispatcher (~1 us) by the schema it already
// has, so the numerics are those of the per-layer path exactly: the same ops in the same order.
//
// Serves plain Llama-family layers whose linear weights are GGUF blocks on the block kernel at
// this row count (kind 0: kvserve_gguf::linear, float activations on the blocks; kind 1 / 2:
// kvserve_gguf_q8::linear / linear_float, int8 / float activations on the interleaved copy), no
// biases, no q/k norms,
// every layer writing its own KV; models/llama.py checks that and falls back otherwise.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <optional>
#include <tuple>

namespace {

using at::Tensor;

// The kernels, looked up by schema at first use (their libraries are loaded by then: the Python
// side takes this path only when they are; the int8 one only when some weight takes it).
template <typename F>
c10::TypedOperatorHandle<F> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}
using NormFn = std::tuple<Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&,
                                          const Tensor&, double);
using SiluFn = Tensor(const Tensor&);
using BlockFn = Tensor(const Tensor&, const Tensor&, int64_t);
using Q8Fn = Tensor(const Tensor&, const Tensor&, int64_t, int64_t);
using AttendFn = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, const Tensor&, const Tensor&, int64_t, double, int64_t);

// x [rows, hidden] (the embeddings) -> (the last layer's output, its residual), as the per-layer
// loop returns them. Per layer l: norm weights norm1[l], norm2[l]; linear weights weights[4 l ..
// 4 l + 3] = qkv, o, gate_up, down with formats fmts[..] and output sizes outs[..]; its KV cache
// kv_caches[l] ([2, kv_heads, blocks, block_size, head_dim]).
std::tuple<Tensor, Tensor> forward(const Tensor& x, at::TensorList norm1, at::TensorList norm2,
                                   double eps, at::TensorList weights, int64_t kind,
                                   at::IntArrayRef fmts, at::IntArrayRef outs,
                                   at::TensorList kv_caches, const Tensor& cos, const Tensor& sin,
                                   const Tensor& slot_block, const Tensor& slot_offset,
                                   const Tensor& block_tables, const Tensor& seq_lens,
                                   int64_t num_heads, double scale, int64_t window) {
  const int64_t layers = static_cast<int64_t>(norm1.size());
  TORCH_CHECK(norm2.size() == norm1.size() && kv_caches.size() == norm1.size());
  TORCH_CHECK(weights.size() == 4 * norm1.size() && fmts.size() == weights.size() &&
              outs.size() == weights.size());
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind: 0 float activations on the ggml blocks, 1 int8 or "
              "2 float activations on the interleaved copy");
  static const auto norm = kernel<NormFn>("kvserve_cpu_fused::add_rms_norm");
  static const auto silu_mul = kernel<SiluFn>("kvserve_cpu_fused::silu_mul");
  static const auto attend = kernel<AttendFn>("kvserve_cpu_decode::rope_write_decode");
  static const auto block = kernel<BlockFn>("kvserve_gguf::linear");
  auto linear = [&](const Tensor& in, int64_t i) {
    if (kind == 1) {
      static const auto q8 = kernel<Q8Fn>("kvserve_gguf_q8::linear");
      return q8.call(in, weights[i], fmts[i], outs[i]);
    }
    if (kind == 2) {
      static const auto interleaved = kernel<Q8Fn>("kvserve_gguf_q8::linear_float");
      return interleaved.call(in, weights[i], fmts[i], outs[i]);
    }
    return block.call(in, weights[i], fmts[i]);
  };
  const int64_t rows = x.size(0);
  Tensor hidden = x;
  std::optional<Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    auto [sum, h] = norm.call(hidden, residual, norm1[l], eps);
    const Tensor qkv = linear(h, 4 * l);
    const Tensor attended = attend.call(qkv, cos, sin, kv_caches[l], slot_block,
                                               slot_offset, block_tables, seq_lens, num_heads,
                                               scale, window);
    const Tensor o = linear(attended.view({rows, -1}), 4 * l + 1);
    auto [sum2, h2] = norm.call(o, sum, norm2[l], eps);
    hidden = linear(silu_mul.call(linear(h2, 4 * l + 2)), 4 * l + 3);
    residual = sum2;
  }
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY(kvserve_decode_stack, m) {
  m.def("forward(Tensor x, Tensor[] norm1, Tensor[] norm2, float eps, Tensor[] weights, "
        "int kind, int[] fmts, int[] outs, Tensor(a!)[] kv_caches, Tensor cos, Tensor sin, "
        "Tensor slot_block, Tensor slot_offset, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve_decode_stack, CPU, m) { m.impl("forward", &forward); }
