// The flash-attention blocks of kernels/cpu_prefill.cpp: the register-blocked micro-kernels
// (scores of R query rows against KB keys, probabilities times values, in float32 FMAs or bf16
// dot products), the online-softmax row update, the positional mask, and the per-call packing of
// a sequence's paged keys and values into the operand layouts those micro-kernels read.

#pragma once

#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"
#include "kv_int8.h"

namespace kvserve_prefill {

using namespace kvserve_simd;
using kvserve_kv::row_width;

constexpr int QB = 32;  // query rows per task
constexpr int KB = 64;  // keys per block
constexpr int R = 4;    // query rows per micro-kernel

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr int NJ = W == 16 ? 4 : 2;  // key vectors per score micro-kernel

// S[r][0..KB) = sum_d Q[r][d] * Kt[d][0..KB) for R rows
inline void scores(const float* q, const float* kt, float* s, int64_t D) {
  for (int j0 = 0; j0 < KB; j0 += NJ * W) {
    vf acc[R][NJ];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NJ; ++c) acc[r][c] = vset1(0.f);
    for (int64_t d = 0; d < D; ++d) {
      vf k[NJ];
      for (int c = 0; c < NJ; ++c) k[c] = vload(kt + d * KB + j0 + c * W);
      for (int r = 0; r < R; ++r) {
        const vf b = vset1(q[r * D + d]);
        for (int c = 0; c < NJ; ++c) acc[r][c] = vfma(b, k[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NJ; ++c) vstore(s + r * KB + j0 + c * W, acc[r][c]);
  }
}

// O[r][:] += sum_j P[r][j] * V[j][:] for R rows over nk keys, NV vectors of D at a time
template <int NV>
inline void accumulate(const float* p, const float* v, float* o, int nk, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += NV * W) {
    vf acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = vload(o + r * D + d0 + c * W);
    for (int j = 0; j < nk; ++j) {
      vf x[NV];
      for (int c = 0; c < NV; ++c) x[c] = vload(v + j * D + d0 + c * W);
      for (int r = 0; r < R; ++r) {
        const vf b = vset1(p[r * KB + j]);
        for (int c = 0; c < NV; ++c) acc[r][c] = vfma(b, x[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NV; ++c) vstore(o + r * D + d0 + c * W, acc[r][c]);
  }
}

// A row of n values in float32 (an int8 row's scales follow its values).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same<T, int8_t>::value) {
    kvserve_kv::dequantize_row(src, n, dst);
  } else {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
    int64_t i = 0;
    for (; i + W <= n; i += W) vstore(dst + i, vwiden(raw + i));
    for (; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
      std::memcpy(dst + i, &bits, 4);
    }
  }
}

// x rounded to bfloat16 (nearest even), its bits
inline uint32_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// One row's scores over a key block in log2 units (-inf where masked) become its
// probabilities under the running maximum m; l and the row's output o are rescaled to it.
// False: the row sees none of the block (its probabilities are zeros).
inline bool softmax_row(float* sr, float& m, float& l, float* o, int64_t D) {
  vf mx = vload(sr);
  for (int j = W; j < KB; j += W) mx = vmax(mx, vload(sr + j));
  const float bmax = vhmax(mx);
  if (bmax == -INFINITY) {
    std::fill(sr, sr + KB, 0.f);
    return false;
  }
  const float m_new = std::max(m, bmax);
  const vf mn = vset1(m_new);
  vf sum = vset1(0.f);
  for (int j = 0; j < KB; j += W) {
    const vf p = vexp2(vsub(vload(sr + j), mn));
    vstore(sr + j, p);
    sum = vadd(sum, p);
  }
  const float alpha = m == -INFINITY ? 0.f : std::exp2(m - m_new);
  l = l * alpha + vhsum(sum);
  m = m_new;
  if (alpha != 1.f) {
    const vf a = vset1(alpha);
    for (int64_t d = 0; d < D; d += W) vstore(o + d, vmul(a, vload(o + d)));
  }
  return true;
}

// Masks row r's scores (query position pos) in a key block starting at k0 with nk keys.
inline void mask_row(float* sr, int64_t pos, int64_t k0, int nk, int64_t window) {
  for (int j = 0; j < KB; ++j) {
    const int64_t kp = k0 + j;
    if (j >= nk || kp > pos || (window > 0 && kp <= pos - window)) sr[j] = -INFINITY;
  }
}

// The sequence's keys and values, packed once per call for the micro-kernels, per KV head and
// block of KB keys (positions from k_lo; keys past the sequence are zeros). Float: keys
// transposed [D][KB], values as rows [KB][D]. bf16: keys as dimension pairs [D/2][KB] and
// values as key pairs [KB/2][D], the operand layouts of vdpbf16ps (an int8 cache's rows are
// dequantized and rounded to bf16 first).
template <typename C, bool kBF16>
struct Packed {
  using E = std::conditional_t<kBF16, uint32_t, float>;
  int64_t D, k_lo, nkb, per_block;
  std::vector<E> k, v;
  Packed(int64_t KVH, int64_t D_, int64_t k_lo_, int64_t seq)
      : D(D_), k_lo(k_lo_), nkb((seq - k_lo_ + KB - 1) / KB),
        per_block(kBF16 ? KB * D_ / 2 : KB * D_), k(KVH * nkb * per_block),
        v(KVH * nkb * per_block) {}
  const E* kblock(int64_t kh, int64_t k0) const { return &k[(kh * nkb + (k0 - k_lo) / KB) * per_block]; }
  const E* vblock(int64_t kh, int64_t k0) const { return &v[(kh * nkb + (k0 - k_lo) / KB) * per_block]; }
  // int8 rows in the bf16 operand layouts (null rows: past the sequence, zeros)
  void pack_int8_as_bf16(const C* const* krow, const C* const* vrow, E* kd, E* vd) const {
    std::vector<float> kf(KB * D, 0.f), vf_(KB * D, 0.f);
    for (int j = 0; j < KB; ++j) {
      if (krow[j] == nullptr) continue;
      to_float(krow[j], &kf[j * D], D);
      to_float(vrow[j], &vf_[j * D], D);
    }
    for (int j = 0; j < KB; ++j)
      for (int64_t p = 0; p < D / 2; ++p)
        kd[p * KB + j] = bf16_bits(kf[j * D + 2 * p]) | bf16_bits(kf[j * D + 2 * p + 1]) << 16;
    for (int jp = 0; jp < KB / 2; ++jp)
      for (int64_t x = 0; x < D; ++x)
        vd[jp * D + x] = bf16_bits(vf_[2 * jp * D + x]) | bf16_bits(vf_[(2 * jp + 1) * D + x]) << 16;
  }
  // block b of KV head kh from the caches (kb, vb: that head's [num_blocks, BS, row])
  void pack(int64_t kh, int64_t b, const C* kb, const C* vb, const int32_t* pages, int64_t BS,
            int64_t seq) {
    E* kd = &k[(kh * nkb + b) * per_block];
    E* vd = &v[(kh * nkb + b) * per_block];
    const int64_t k0 = k_lo + b * KB;
    const C* krow[KB];
    const C* vrow[KB];
    for (int j = 0; j < KB; ++j) {
      const int64_t pos = k0 + j;
      const int64_t off = (static_cast<int64_t>(pages[pos / BS]) * BS + pos % BS) * row_width<C>(D);
      krow[j] = pos < seq ? kb + off : nullptr;
      vrow[j] = pos < seq ? vb + off : nullptr;
    }
    if constexpr (kBF16 && std::is_same<C, int8_t>::value) {
      pack_int8_as_bf16(krow, vrow, kd, vd);
    } else if constexpr (kBF16) {
      const int64_t D2 = D / 2;
      for (int j = 0; j < KB; ++j) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(krow[j]);
        for (int64_t p = 0; p < D2; ++p) kd[p * KB + j] = src ? src[p] : 0u;
      }
      for (int jp = 0; jp < KB / 2; ++jp) {
        const uint16_t* lo = reinterpret_cast<const uint16_t*>(vrow[2 * jp]);
        const uint16_t* hi = reinterpret_cast<const uint16_t*>(vrow[2 * jp + 1]);
        for (int64_t x = 0; x < D; ++x)
          vd[jp * D + x] = (lo ? lo[x] : 0u) | (hi ? static_cast<uint32_t>(hi[x]) << 16 : 0u);
      }
    } else {
      std::vector<float> row(D);
      for (int j = 0; j < KB; ++j) {
        if (krow[j] == nullptr) {
          for (int64_t x = 0; x < D; ++x) kd[x * KB + j] = 0.f;
          std::fill(vd + j * D, vd + (j + 1) * D, 0.f);
          continue;
        }
        to_float(krow[j], row.data(), D);
        for (int64_t x = 0; x < D; ++x) kd[x * KB + j] = row[x];
        to_float(vrow[j], vd + j * D, D);
      }
    }
  }
};

#if defined(__AVX512BF16__)
// bf16 operands: S[r][0..KB) = sum over dimension pairs of Q[r] pair x K pair (vdpbf16ps)
inline void scores_bf16(const uint32_t* q, const uint32_t* kt, float* s, int64_t D2) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D2; ++p) {
    __m512bh k[4];
    for (int c = 0; c < 4; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kt + p * KB + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * D2 + p]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], k[c], b);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * KB + c * 16, acc[r][c]);
}

// O[r][:] += sum over key pairs of P[r] pair x V pair, P as bf16 pairs [R][KB / 2]
template <int NV>
inline void accumulate_bf16(const uint32_t* p, const uint32_t* v, float* o, int nk, int64_t D) {
  const int npairs = (nk + 1) / 2;
  for (int64_t d0 = 0; d0 < D; d0 += NV * 16) {
    __m512 acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + d0 + c * 16);
    for (int jp = 0; jp < npairs; ++jp) {
      __m512bh x[NV];
      for (int c = 0; c < NV; ++c) x[c] = (__m512bh)_mm512_loadu_si512(v + jp * D + d0 + c * 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * KB / 2 + jp]));
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x[c], b);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + d0 + c * 16, acc[r][c]);
  }
}
constexpr bool kHaveBF16Dot = true;
#else
constexpr bool kHaveBF16Dot = false;
#endif
#endif  // AVX2 + FMA or AVX-512

}  // namespace kvserve_prefill
