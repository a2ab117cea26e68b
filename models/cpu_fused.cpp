// Fused per-layer elementwise ops for CPU float32: torch.ops.kvserve_cpu_fused.add_rms_norm and
// .silu_mul. Built at first use by models/cpu_fused.py; their consumer is models/layers.py.
//
// Why: at batch 1 a step is ~22 ms of matmuls and ~8 ms of ~750 small ops; a residual add +
// RMSNorm is 7 ops in PyTorch and SiLU x up 4 (two slices, silu, mul), each a dispatch and a
// pass over memory. One op each, parallel over rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <tuple>

// (residual + x, rms_norm(residual + x) * weight); residual None: (x, rms_norm(x) * weight).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                 const c10::optional<at::Tensor>& residual,
                                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous());
  TORCH_CHECK(weight.dtype() == at::kFloat && weight.is_contiguous());
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes());
  const int64_t rows = x.size(0), h = x.size(1);
  at::Tensor sum = has_res ? at::empty_like(x) : x;
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* rp = has_res ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * h;
      float* sr = sp + r * h;
      if (rp != nullptr) {
        const float* rr = rp + r * h;
        for (int64_t i = 0; i < h; ++i) sr[i] = rr[i] + xr[i];
      }
      float ss = 0.f;
      for (int64_t i = 0; i < h; ++i) ss += sr[i] * sr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + e);
      float* orow = op + r * h;
      for (int64_t i = 0; i < h; ++i) orow[i] = sr[i] * inv * wp[i];
    }
  });
  return {sum, out};
}

// gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dtype() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous());
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * inter;
      const float* u = g + inter;
      float* o = op + r * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

TORCH_LIBRARY(kvserve_cpu_fused, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
