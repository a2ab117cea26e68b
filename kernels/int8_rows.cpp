// The two ends of an int8 GEMM for many rows (W8A8: per-row int8 activations, per-output-channel
// int8 weights, int32 sums from torch._int_mm): torch.ops.kvserve_int8_rows.
// Built at first use by models/int8_prefill.py; its consumer is models/gguf_linear.py's dense path.
//
// Why: in PyTorch the activation rounding (absmax, divide, round, clamp, cast) and the output
// scaling (cast, two broadcast multiplies, bias, cast) are ~8 passes over [rows, features]
// tensors with a temporary each; for a 1,024 x 3,072 output that cost more than the int8 GEMM
// itself. Here each is one pass, in parallel over rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <tuple>
#include <vector>

namespace {

#if defined(__AVX512F__)
// The rounding pass 16 values at a time: its two loops (a range, then a rounding) did not
// vectorize (290 x 576 bf16: 107 -> 22 us, ~4% of a wide prefill step beside the int8 GEMM)
constexpr int64_t kV = 16;
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#else
constexpr int64_t kV = 0;  // the scalar loops only
#endif

// `smooth` (K factors or nullptr): each column multiplied by its factor before the row's range
// is taken (SmoothQuant: the weight's columns carry the reciprocals).
template <typename T>
void quantize_impl(const at::Tensor& x, const float* smooth, at::Tensor& q, at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1);
  const T* xp = x.data_ptr<T>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t m = begin; m < end; ++m) {
      const T* src = xp + m * K;
      float amax = 0.f;
      int64_t k = 0;
#if defined(__AVX512F__)
      __m512 vmax = _mm512_setzero_ps();
      for (; k + kV <= K; k += kV) {
        __m512 v = load16(src + k);
        if (smooth != nullptr) v = _mm512_mul_ps(v, _mm512_loadu_ps(smooth + k));
        _mm512_storeu_ps(row.data() + k, v);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      }
      amax = _mm512_reduce_max_ps(vmax);
#endif
      for (; k < K; ++k) {
        row[k] = smooth != nullptr ? static_cast<float>(src[k]) * smooth[k] : static_cast<float>(src[k]);
        amax = std::max(amax, std::fabs(row[k]));
      }
      const float scale = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* out = qp + m * K;
      k = 0;
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; k + kV <= K; k += kV) {  // the conversion rounds to nearest-even, as nearbyint
        const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row.data() + k), vinv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtsepi32_epi8(codes));
      }
#endif
      for (; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(row[k] * inv));
      sp[m] = scale;
    }
  });
}

template <typename T>
void scale_impl(const at::Tensor& acc, const at::Tensor& xs, const at::Tensor& ws,
                const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = acc.size(0), N = acc.size(1);
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xp = xs.data_ptr<float>();
  const float* wp = ws.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* a = ap + m * N;
      T* o = op + m * N;
      const float s = xp[m];
      // left to the compiler: AVX-512 intrinsics measured slower here (3,072 columns 66 -> 88 us)
      if (bp != nullptr) {
        for (int64_t n = 0; n < N; ++n) o[n] = static_cast<T>(static_cast<float>(a[n]) * s * wp[n] + bp[n]);
      } else {
        for (int64_t n = 0; n < N; ++n) o[n] = static_cast<T>(static_cast<float>(a[n]) * s * wp[n]);
      }
    }
  });
}

}  // namespace

// x [M, K] float32 or bfloat16, contiguous (times `smooth` [K] float32 per column, where given)
// -> (int8 [M, K], float32 [M]): each row rounded to int8 by its own absolute maximum
// (x * smooth ~= q * scale).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x,
                                                 const c10::optional<at::Tensor>& smooth) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [M, K] contiguous");
  TORCH_CHECK(!smooth.has_value() || (smooth->scalar_type() == at::kFloat &&
                                      smooth->is_contiguous() && smooth->numel() == x.size(1)),
              "smooth: float32 [K]");
  const float* sm = smooth.has_value() ? smooth->data_ptr<float>() : nullptr;
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scales = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) {
    quantize_impl<float>(x, sm, q, scales);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    quantize_impl<at::BFloat16>(x, sm, q, scales);
  }
  return {q, scales};
}

// acc [M, N] int32 (the int8 GEMM's sums), row_scales [M], col_scales [N] (and bias [N])
// float32 -> [M, N] in `dtype`: acc * row_scale * col_scale (+ bias).
at::Tensor scale_rows(const at::Tensor& acc, const at::Tensor& row_scales,
                      const at::Tensor& col_scales, const c10::optional<at::Tensor>& bias,
                      at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt);
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == acc.size(0));
  TORCH_CHECK(col_scales.scalar_type() == at::kFloat && col_scales.numel() == acc.size(1));
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == acc.size(1)));
  auto out = at::empty(acc.sizes(), acc.options().dtype(dtype));
  if (dtype == at::kFloat) {
    scale_impl<float>(acc, row_scales, col_scales, bias, out);
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "float32 or bfloat16 only");
    scale_impl<at::BFloat16>(acc, row_scales, col_scales, bias, out);
  }
  return out;
}

TORCH_LIBRARY(kvserve_int8_rows, m) {
  m.def("quantize_rows(Tensor x, Tensor? smooth=None) -> (Tensor, Tensor)");
  m.impl("quantize_rows", c10::DispatchKey::CPU, TORCH_FN(quantize_rows));
  m.def("scale_rows(Tensor acc, Tensor row_scales, Tensor col_scales, Tensor? bias, "
        "ScalarType dtype) -> Tensor");
  m.impl("scale_rows", c10::DispatchKey::CPU, TORCH_FN(scale_rows));
}
