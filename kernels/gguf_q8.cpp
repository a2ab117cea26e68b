// GGUF blocks times int8-rounded activations (llama.cpp's numerics), on weights repacked at load
// for the kernel: torch.ops.kvserve_gguf_q8.repack / .linear / .lanes. Built at first use by
// models/gguf_linear.py, its one consumer.
//
// Why: at a few rows a decode step's time is its weights' bytes, but a kernel that reduces one
// output row at a time spends more cycles per block (a horizontal sum, two scalar half->float
// conversions, a loop-carried add) than the memory system needs to deliver it. Here NR output
// rows (the vector's int32 lanes: 8 with AVX2, 16 with AVX-512) are interleaved so that one
// integer dot instruction advances all NR rows by 4 elements: lane r of every product is row r's
// output, the block's NR scales load as one vector, and nothing is reduced across lanes.
//
// The numerics (each activation row, each block of 32): dx = max|x| / 127, s = round(x / dx)
// (int8), sx = dx * sum(s); per weight block with codes u and y = d * u + m:
//   y_row += d * dx * dot(u, s) + m * sx
// Q4_1: u = q, m = the block's minimum; Q4_0: u = q, m = -8 d; Q8_0: the codes are signed, so
// with VNNI u = q + 128 and m = -128 d (vpdpbusd multiplies unsigned by signed bytes and cannot
// overflow), without it (AVX2 maddubs, whose int16 pairs saturate) u = |q| against s with q's
// signs and m = 0. Each row's sum runs over its blocks in one order whatever else is in the
// batch: a row's result does not depend on its batch.
//
// bf16 activations on a CPU with AVX512-BF16 take a pair-dot variant of the float kernel on the
// same layout (gguf_q8_bf16.h, included below).
//
// Packed layout, one group of NR output rows after another; in a group, block after block:
//   NR float16 d | NR float16 m (Q4 only) | code chunks
// A chunk is one vector: lane r holds 4 bytes of row r. Q4 blocks have 4 chunks (chunk j: bytes
// 4j..4j+3 of ggml's 16, whose low nibbles are elements 4j.. and high nibbles 16 + 4j..), Q8_0
// blocks 8 (chunk j: codes 4j..4j+3). The bytes equal the ggml blocks'; rows are padded to a
// whole group with zero blocks.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kQ40 = 2, kQ41 = 3, kQ80 = 8;

#include "gguf_q8_isa.h"

#ifdef KVSERVE_Q8
constexpr int CHUNK = NR * 4;  // bytes in one chunk (one vector)

int codes_per_block(int64_t fmt) { return fmt == kQ80 ? 32 : 16; }
int scale_bytes(int64_t fmt) { return fmt == kQ80 ? 2 * NR : 4 * NR; }
int64_t group_block_bytes(int64_t fmt) { return scale_bytes(fmt) + NR * codes_per_block(fmt); }
int ggml_block_bytes(int64_t fmt) { return fmt == kQ40 ? 18 : fmt == kQ41 ? 20 : 34; }

// One activation row per block of 32: int8 codes, dx, sx (see the top of the file).
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  // T: float or at::BFloat16 (widened here: an ATen conversion is a dispatch and an allocation
  // per linear layer per step)
  template <typename T>
  Rows(const T* xp, int64_t m, int64_t k) : q(m * k), dx(m * k / 32), sx(m * k / 32) {
    for (int64_t i = 0; i < m * k / 32; ++i) {
      float xb[32];
      for (int j = 0; j < 32; ++j) xb[j] = static_cast<float>(xp[i * 32 + j]);
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(xb[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
        q[i * 32 + j] = static_cast<int8_t>(v);
        sum += v;
      }
      dx[i] = d;
      sx[i] = d * static_cast<float>(sum);
    }
  }
};

// One group's NR outputs for activation rows [0, MR) of `rows`, into y (row stride n_pad).
template <int FMT, int MR>
void group_kernel(const uint8_t* g, int64_t nb, const Rows& rows, int64_t a0, int64_t k,
                  float* y, int64_t n_pad, int64_t col) {
  constexpr int kChunks = FMT == kQ80 ? 8 : 4;
  constexpr int kScale = FMT == kQ80 ? 2 * NR : 4 * NR;
  constexpr int64_t kBytes = kScale + NR * (FMT == kQ80 ? 32 : 16);
  fvec acc[MR], accm[MR];
  for (int a = 0; a < MR; ++a) acc[a] = accm[a] = fzero();
  for (int64_t b = 0; b < nb; ++b, g += kBytes) {
    const fvec d = halves(g);
#if defined(KVSERVE_Q8_VNNI)
    const fvec m = FMT == kQ80 ? fmul(d, fset1(-128.f)) : halves(g + 2 * NR);
#else
    const fvec m = FMT == kQ80 ? fzero() : halves(g + 2 * NR);
#endif
    const uint8_t* c = g + kScale;
    ivec u[kChunks * (FMT == kQ80 ? 1 : 2)];
    if constexpr (FMT == kQ80) {
      for (int j = 0; j < 8; ++j) u[j] = iload(c + j * CHUNK);
    } else {
      for (int j = 0; j < 4; ++j) {
        const ivec v = iload(c + j * CHUNK);
        u[j] = nib_lo(v);      // elements 4j..4j+3
        u[4 + j] = nib_hi(v);  // elements 16+4j..
      }
    }
    for (int a = 0; a < MR; ++a) {
      const int64_t xb = (a0 + a) * (k / 32) + b;
      const int8_t* s = rows.q.data() + xb * 32;
      ivec dot = izero();
      if constexpr (FMT == kQ80) {
        for (int j = 0; j < 8; ++j) {
#if defined(KVSERVE_Q8_VNNI)
          dot = dot_add(dot, xor80(u[j]), bcast32(s + 4 * j));
#else
          const ivec sj = bcast32(s + 4 * j);
          dot = dot_add(dot, _mm256_sign_epi8(u[j], u[j]), _mm256_sign_epi8(sj, u[j]));
#endif
        }
      } else {
#if defined(KVSERVE_Q8_VNNI)
        // two chains: a dot instruction's latency, not its throughput, bounded one chain
        ivec dot2 = izero();
        for (int j = 0; j < 4; ++j) {
          dot = dot_add(dot, u[j], bcast32(s + 4 * j));
          dot2 = dot_add(dot2, u[4 + j], bcast32(s + 16 + 4 * j));
        }
        dot = iadd(dot, dot2);
#else
        // 4-bit codes: a pair is at most 2 * 15 * 127, eight pairs fit int16 before widening
        ivec p = izero();
        for (int j = 0; j < 4; ++j) {
          p = _mm256_add_epi16(p, pairs16(u[j], bcast32(s + 4 * j)));
          p = _mm256_add_epi16(p, pairs16(u[4 + j], bcast32(s + 16 + 4 * j)));
        }
        dot = to32(p);
#endif
      }
      acc[a] = ffma(itof(dot), fmul(d, fset1(rows.dx[xb])), acc[a]);
      accm[a] = ffma(m, fset1(rows.sx[xb]), accm[a]);
    }
  }
  for (int a = 0; a < MR; ++a) fstore(y + (a0 + a) * n_pad + col, fadd(acc[a], accm[a]));
}

// Float activations on the same layout (the exact path: the dequantized product up to float32
// summation order): per weight block y_row += d * sum(u x) + m * sum(x), the codes of element e
// of all NR rows taken out of their chunk by a shift per lane.
struct FloatRows {
  std::vector<float> x, sums;  // [m, k] widened; [m, k / 32] block sums
  template <typename T>
  FloatRows(const T* xp, int64_t m, int64_t k) : x(m * k), sums(m * k / 32) {
    for (int64_t i = 0; i < m * k; ++i) x[i] = static_cast<float>(xp[i]);
    for (int64_t i = 0; i < m * k / 32; ++i) {
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += x[i * 32 + j];
      sums[i] = s;
    }
  }
};

template <int FMT, int MR>
void group_kernel(const uint8_t* g, int64_t nb, const FloatRows& rows, int64_t a0, int64_t k,
                  float* y, int64_t n_pad, int64_t col) {
  constexpr int kScale = FMT == kQ80 ? 2 * NR : 4 * NR;
  constexpr int64_t kBytes = kScale + NR * (FMT == kQ80 ? 32 : 16);
  fvec acc[MR];
  for (int a = 0; a < MR; ++a) acc[a] = fzero();
  const ivec nibble = iset1(0x0f);
  for (int64_t b = 0; b < nb; ++b, g += kBytes) {
    const fvec d = halves(g);
    const fvec m = FMT == kQ80 ? fzero() : halves(g + 2 * NR);
    const uint8_t* c = g + kScale;
    fvec part[MR][2];
    for (int a = 0; a < MR; ++a) part[a][0] = part[a][1] = fzero();
    // element e's codes for the NR rows, then its activation per row (two partial sums per row:
    // a shorter dependency chain)
    auto element = [&](int e, ivec codes) {
      const fvec w = itof(codes);
      for (int a = 0; a < MR; ++a) {
        const float xe = rows.x[(a0 + a) * k + b * 32 + e];
        part[a][e & 1] = ffma(w, fset1(xe), part[a][e & 1]);
      }
    };
    if constexpr (FMT == kQ80) {
      for (int j = 0; j < 8; ++j) {
        const ivec v = iload(c + j * CHUNK);
        for (int byte = 0; byte < 4; ++byte)  // sign-extend byte `byte` of each lane
          element(4 * j + byte, isra24(isllv(v, iset1(24 - 8 * byte))));
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const ivec v = iload(c + j * CHUNK);
        for (int byte = 0; byte < 4; ++byte) {
          element(4 * j + byte, iand(isrlv(v, iset1(8 * byte)), nibble));
          element(16 + 4 * j + byte, iand(isrlv(v, iset1(8 * byte + 4)), nibble));
        }
      }
    }
    for (int a = 0; a < MR; ++a) {
      acc[a] = ffma(fadd(part[a][0], part[a][1]), d, acc[a]);
      if constexpr (FMT != kQ80) acc[a] = ffma(m, fset1(rows.sums[(a0 + a) * (k / 32) + b]), acc[a]);
    }
  }
  for (int a = 0; a < MR; ++a) fstore(y + (a0 + a) * n_pad + col, acc[a]);
}

#include "gguf_q8_bf16.h"

// Rows of activations a group kernel takes at once (its accumulators stay in registers)
template <typename R> constexpr int kMaxRows = 4;
#ifdef KVSERVE_BF16_DOT
template <> constexpr int kMaxRows<Bf16Rows> = kBf16MaxRows;
#endif

template <int FMT, typename R, int MR>
void rows_tail(const uint8_t* gp, int64_t nb, const R& rows, int64_t a0, int64_t left, int64_t k,
               float* y, int64_t n_pad, int64_t col) {
  if constexpr (MR > 0) {
    if (left == MR) return group_kernel<FMT, MR>(gp, nb, rows, a0, k, y, n_pad, col);
    rows_tail<FMT, R, MR - 1>(gp, nb, rows, a0, left, k, y, n_pad, col);
  }
}

template <int FMT, typename R>
void linear_impl(const uint8_t* packed, int64_t groups, int64_t nb, const R& rows, int64_t m,
                 int64_t k, float* y) {
  constexpr int MR = kMaxRows<R>;
  const int64_t gb = nb * group_block_bytes(FMT), n_pad = groups * NR;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = packed + g * gb;
      int64_t a0 = 0;
      for (; a0 + MR <= m; a0 += MR) group_kernel<FMT, MR>(gp, nb, rows, a0, k, y, n_pad, g * NR);
      rows_tail<FMT, R, MR - 1>(gp, nb, rows, a0, m - a0, k, y, n_pad, g * NR);
    }
  });
}
#endif  // KVSERVE_Q8

}  // namespace

// The rows the kernel interleaves (its vector's int32 lanes); 0 where it is not built (no AVX2).
int64_t q8_lanes() {
#ifdef KVSERVE_Q8
  return NR;
#else
  return 0;
#endif
}

// ggml blocks [n, bytes per row] -> the packed layout above, uint8 [groups, nb * group bytes].
at::Tensor q8_repack(const at::Tensor& blocks, int64_t fmt) {
#ifndef KVSERVE_Q8
  TORCH_CHECK(false, "the int8-activation kernel needs AVX2");
  return blocks;
#else
  TORCH_CHECK(fmt == kQ40 || fmt == kQ41 || fmt == kQ80, "unsupported GGUF block format ", fmt);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous());
  const int bb = ggml_block_bytes(fmt);
  TORCH_CHECK(blocks.size(1) % bb == 0, "rows are not whole blocks");
  const int64_t n = blocks.size(0), nb = blocks.size(1) / bb, groups = (n + NR - 1) / NR;
  const int64_t gbb = group_block_bytes(fmt), cb = codes_per_block(fmt);
  at::Tensor out = at::zeros({groups, nb * gbb}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t g = row / NR, r = row % NR;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = src + row * blocks.size(1) + b * bb;
      uint8_t* gb = dst + g * nb * gbb + b * gbb;
      std::memcpy(gb + 2 * r, blk, 2);                              // d
      if (fmt == kQ40) {                                            // m = -8 d
        const at::Half m = static_cast<at::Half>(-8.f * static_cast<float>(*reinterpret_cast<const at::Half*>(blk)));
        std::memcpy(gb + 2 * NR + 2 * r, &m, 2);
      } else if (fmt == kQ41) {
        std::memcpy(gb + 2 * NR + 2 * r, blk + 2, 2);
      }
      const uint8_t* codes = blk + (fmt == kQ41 ? 4 : 2);
      uint8_t* chunks = gb + scale_bytes(fmt);
      for (int64_t j = 0; j < cb / 4; ++j) std::memcpy(chunks + j * CHUNK + 4 * r, codes + 4 * j, 4);
    }
  }
  return out;
#endif
}

#ifdef KVSERVE_Q8
namespace {
// x [m, k] float32 or bfloat16 times the packed weight's [n, k] transposed -> [m, n] in x's
// dtype; R: the activations as the kernel takes them (Rows: int8; FloatRows: float32).
template <typename R>
R make_rows(const at::Tensor& x, int64_t m, int64_t k, int64_t fmt) {
#ifdef KVSERVE_BF16_DOT
  if constexpr (std::is_same_v<R, Bf16Rows>) return R(x.data_ptr<at::BFloat16>(), m, k, fmt);
  else
#endif
  return x.scalar_type() == at::kFloat ? R(x.data_ptr<float>(), m, k)
                                       : R(x.data_ptr<at::BFloat16>(), m, k);
}

template <typename R>
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t n) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2,
              "x: float32 or bfloat16 [rows, in_features]");
  TORCH_CHECK(fmt == kQ40 || fmt == kQ41 || fmt == kQ80, "unsupported GGUF block format ", fmt);
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), nb = k / 32, groups = packed.size(0);
  TORCH_CHECK(k % 32 == 0 && packed.size(1) == nb * group_block_bytes(fmt) && n <= groups * NR,
              "packed weight does not match in_features ", k, " / out_features ", n);
  const bool f32 = xc.scalar_type() == at::kFloat;
  const R rows = make_rows<R>(xc, m, k, fmt);
  // float32 outputs for the whole groups; copied out (narrowed to n, rounded to bf16) unless
  // they already are the result
  const bool direct = f32 && groups * NR == n;
  at::Tensor out = at::empty({m, n}, xc.options());
  std::vector<float> scratch(direct ? 0 : m * groups * NR);
  float* yp = direct ? out.data_ptr<float>() : scratch.data();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  switch (fmt) {
    case kQ40: linear_impl<kQ40>(pp, groups, nb, rows, m, k, yp); break;
    case kQ41: linear_impl<kQ41>(pp, groups, nb, rows, m, k, yp); break;
    default: linear_impl<kQ80>(pp, groups, nb, rows, m, k, yp); break;
  }
  if (!direct) {
    for (int64_t i = 0; i < m; ++i) {
      const float* src = yp + i * groups * NR;
      if (f32) {
        std::copy(src, src + n, out.data_ptr<float>() + i * n);
      } else {
        at::BFloat16* dst = out.data_ptr<at::BFloat16>() + i * n;
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<at::BFloat16>(src[j]);
      }
    }
  }
  return out;
}
}  // namespace
#endif

// int8-rounded activations (llama.cpp's numerics)
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t n) {
#ifndef KVSERVE_Q8
  TORCH_CHECK(false, "the packed-block kernels need AVX2");
  return x;
#else
  return packed_linear<Rows>(x, packed, fmt, n);
#endif
}

// float activations (exact up to summation order)
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t n) {
#ifndef KVSERVE_Q8
  TORCH_CHECK(false, "the packed-block kernels need AVX2");
  return x;
#else
#ifdef KVSERVE_BF16_DOT
  if (x.scalar_type() == at::kBFloat16) return packed_linear<Bf16Rows>(x, packed, fmt, n);
#endif
  return packed_linear<FloatRows>(x, packed, fmt, n);
#endif
}

TORCH_LIBRARY(kvserve_gguf_q8, m) {
  m.def("lanes() -> int", &q8_lanes);
  m.def("repack(Tensor blocks, int fmt) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int fmt, int out_features) -> Tensor");
  m.def("linear_float(Tensor x, Tensor packed, int fmt, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_gguf_q8, CPU, m) {
  m.impl("repack", &q8_repack);
  m.impl("linear", &q8_linear);
  m.impl("linear_float", &float_linear);
}
