// Linear layers on GGUF's quantized blocks as the file stores them: torch.ops.kvserve_gguf.linear
// and .dequantize. Built at first use by models/gguf_linear.py; the consumer is models/layers.py.
//
// Why: at a few rows a decode step reads every weight once, so its time is the weights' bytes.
// A Q4_1 weight is 5 bits (20 bytes per 32), a Q8_0 weight 8.5 bits; float32 is 32. The kernel
// reads the blocks directly, dequantizes 32 weights into registers (one FMA per 16: w = d*q + m)
// and multiplies float32 activations, so its product equals the dequantized float32 model's up
// to summation order (llama.cpp also rounds activations to 8 bits: gguf_q8.cpp does that).
//
// Blocks (ggml's layouts), one row of `blocks` = one output row, in_features / 32 blocks:
//   Q4_0 (fmt 2):  f16 d, 16 bytes of nibbles      w = d * (q - 8)
//   Q4_1 (fmt 3):  f16 d, f16 m, 16 bytes           w = d * q + m
//   Q8_0 (fmt 8):  f16 d, 32 int8                   w = d * q
// Nibbles: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kQ40 = 2, kQ41 = 3, kQ80 = 8;

int block_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ40: return 18;
    case kQ41: return 20;
    case kQ80: return 34;
  }
  TORCH_CHECK(false, "unsupported GGUF block format ", fmt);
  return 0;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
      bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// One block's 32 weights as floats, in element order, into w[32].
template <int FMT>
inline void dequant_block(const uint8_t* b, float* w) {
  const float d = half_to_float(b);
  if constexpr (FMT == kQ80) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * q[j];
  } else {
    const float m = FMT == kQ41 ? half_to_float(b + 2) : -8.f * d;
    const uint8_t* q = b + (FMT == kQ41 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * (q[j] & 0x0f) + m;
      w[j + 16] = d * (q[j] >> 4) + m;
    }
  }
}

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
// 32 weights in two registers of 16
template <int FMT>
inline void dequant_regs(const uint8_t* b, vec* w) {
  const vec d = _mm512_set1_ps(half_to_float(b));
  if constexpr (FMT == kQ80) {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else {
    const vec m = FMT == kQ41 ? _mm512_set1_ps(half_to_float(b + 2))
                              : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (FMT == kQ41 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(q, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m);
    w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
template <int FMT>
inline void dequant_regs(const uint8_t* b, vec* w) {
  const vec d = _mm256_set1_ps(half_to_float(b));
  if constexpr (FMT == kQ80) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    w[0] = _mm256_mul_ps(d, i8x8(q0));
    w[1] = _mm256_mul_ps(d, i8x8(_mm_srli_si128(q0, 8)));
    w[2] = _mm256_mul_ps(d, i8x8(q1));
    w[3] = _mm256_mul_ps(d, i8x8(_mm_srli_si128(q1, 8)));
  } else {
    const vec m = FMT == kQ41 ? _mm256_set1_ps(half_to_float(b + 2))
                              : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (FMT == kQ41 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(q, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    w[0] = _mm256_fmadd_ps(d, u8x8(lo), m);
    w[1] = _mm256_fmadd_ps(d, u8x8(_mm_srli_si128(lo, 8)), m);
    w[2] = _mm256_fmadd_ps(d, u8x8(hi), m);
    w[3] = _mm256_fmadd_ps(d, u8x8(_mm_srli_si128(hi, 8)), m);
  }
}
#else
#define KVSERVE_GGUF_SCALAR 1
#endif

// y[m, n] = sum_k x[m, k] * w[n, k] for rows [m0, m0 + MR) and output rows [n0, n1).
template <int FMT, int MR>
void rows_kernel(const float* x, int64_t k, const uint8_t* blocks, int64_t row_bytes, float* y,
                 int64_t n_out, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t nb = k / 32;
  const int bb = block_bytes(FMT);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
#ifdef KVSERVE_GGUF_SCALAR
    float acc[MR] = {};
    float w[32];
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block<FMT>(row + b * bb, w);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + (m0 + r) * k + b * 32;
        for (int j = 0; j < 32; ++j) acc[r] += w[j] * xr[j];
      }
    }
    for (int r = 0; r < MR; ++r) y[(m0 + r) * n_out + n] = acc[r];
#else
    constexpr int kRegs = 32 / kLanes;
    vec acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = vzero();
    vec w[kRegs];
    for (int64_t b = 0; b < nb; ++b) {
      dequant_regs<FMT>(row + b * bb, w);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + (m0 + r) * k + b * 32;
        for (int i = 0; i < kRegs; ++i) acc[r] = vfma(w[i], vload(xr + i * kLanes), acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) y[(m0 + r) * n_out + n] = vsum(acc[r]);
#endif
  }
}

// Activation rows in groups of up to 8 (a group's accumulators stay in registers), the last
// group whatever remains: every weight block is read from memory once per group, so 3 or 7 rows
// (a verify step's 1 + k) cost one pass, not a 2-row and a 1-row pass. A row's sum runs over the
// blocks in the same order in every group size, so its result does not depend on the grouping.
template <typename Run>
inline void by_row_groups(int64_t m, Run&& run) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m; m0 += 8) run(std::integral_constant<int, 8>{}, m0);
  switch (m - m0) {
    case 7: run(std::integral_constant<int, 7>{}, m0); break;
    case 6: run(std::integral_constant<int, 6>{}, m0); break;
    case 5: run(std::integral_constant<int, 5>{}, m0); break;
    case 4: run(std::integral_constant<int, 4>{}, m0); break;
    case 3: run(std::integral_constant<int, 3>{}, m0); break;
    case 2: run(std::integral_constant<int, 2>{}, m0); break;
    case 1: run(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

template <int FMT>
void linear_impl(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t row_bytes,
                 float* y, int64_t n_out) {
  // Output rows split over the threads; each thread runs all activation rows by row groups.
  at::parallel_for(0, n_out, 32, [&](int64_t n0, int64_t n1) {
    by_row_groups(m, [&](auto mr, int64_t m0) {
      rows_kernel<FMT, decltype(mr)::value>(x, k, blocks, row_bytes, y, n_out, m0, n0, n1);
    });
  });
}

// Activations and outputs in float32 or bfloat16 without ATen conversions (each is a dispatch and
// an allocation, per linear layer, per step): bf16 rows are widened into `buf`, and a bf16 output
// is computed into a float32 scratch and narrowed once.
const float* float_rows(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  buf.resize(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) buf[i] = static_cast<float>(src[i]);
  return buf.data();
}

struct Output {
  at::Tensor y;
  std::vector<float> scratch;
  Output(const at::Tensor& x, int64_t m, int64_t n) : y(at::empty({m, n}, x.options())) {
    if (y.scalar_type() != at::kFloat) scratch.resize(m * n);
  }
  float* data() { return scratch.empty() ? y.data_ptr<float>() : scratch.data(); }
  at::Tensor finish() {
    if (!scratch.empty()) {
      at::BFloat16* dst = y.data_ptr<at::BFloat16>();
      for (size_t i = 0; i < scratch.size(); ++i) dst[i] = static_cast<at::BFloat16>(scratch[i]);
    }
    return y;
  }
};

void check_blocks(const at::Tensor& blocks, int64_t fmt, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: a contiguous uint8 [out_features, bytes per row] tensor");
  TORCH_CHECK(k % 32 == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(blocks.size(1) == k / 32 * block_bytes(fmt), "blocks do not match in_features ", k);
}

}  // namespace

// x [m, k] @ the blocks' [n, k] weights, transposed -> [m, n], computed in float32; x and y
// float32 or bfloat16.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2,
              "x: float32 or bfloat16 [rows, in_features]");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = blocks.size(0);
  check_blocks(blocks, fmt, k);
  std::vector<float> xbuf;
  const float* xp = float_rows(xc, xbuf);
  Output out(xc, m, n);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = out.data();
  const int64_t rb = blocks.size(1);
  switch (fmt) {
    case kQ40: linear_impl<kQ40>(xp, m, k, bp, rb, yp, n); break;
    case kQ41: linear_impl<kQ41>(xp, m, k, bp, rb, yp, n); break;
    case kQ80: linear_impl<kQ80>(xp, m, k, bp, rb, yp, n); break;
    default: TORCH_CHECK(false, "unsupported GGUF block format ", fmt);
  }
  return out.finish();
}

// The blocks' weights as a dense float32 [n, k] tensor (for many rows, where a dense GEMM wins).
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t fmt, int64_t k) {
  check_blocks(blocks, fmt, k);
  const int64_t n = blocks.size(0), nb = k / 32, rb = blocks.size(1);
  at::Tensor w = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  const int bb = block_bytes(fmt);
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = bp + r * rb + b * bb;
        float* out = wp + r * k + b * 32;
        switch (fmt) {
          case kQ40: dequant_block<kQ40>(blk, out); break;
          case kQ41: dequant_block<kQ41>(blk, out); break;
          default: dequant_block<kQ80>(blk, out); break;
        }
      }
    }
  });
  return w;
}

TORCH_LIBRARY(kvserve_gguf, m) {
  m.def("linear(Tensor x, Tensor blocks, int fmt) -> Tensor");
  m.def("dequantize(Tensor blocks, int fmt, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_gguf, CPU, m) {
  m.impl("linear", &gguf_linear);
  m.impl("dequantize", &gguf_dequantize);
}
