// The decode attention of one task (G query heads of one KV head over a sequence's cached rows)
// with the rows widened straight into registers: cpu_decode.cpp's fast path for head sizes that
// are a multiple of the vector width.
//
// Why: the plain loops (cpu_decode.cpp's attend_one) widen each row into a buffer, reduce every
// dot product through memory, exponentiate one score at a time and keep the output accumulator
// in memory, loading and storing it for every cached row: at batch 64 the op was ~45% of a
// decode step and no faster on an int8 cache than on a float32 one (instruction-bound, not
// memory-bound). Here a key row is loaded once into registers for all G heads, the softmax runs
// in vectors (2^x in log2 units, as the prefill op does), and the values are accumulated in
// registers for up to GB heads a pass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_simd.h"
#include "kv_int8.h"

namespace kvserve_decode {

using namespace kvserve_simd;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kVectorized = true;
constexpr int kRegisters = W == 16 ? 32 : 16;
constexpr int64_t kMaxHeads = 8;  // query heads a KV head's key block is scored for at once

// Row `row` of the cache (kD values) into NV registers, in float32.
template <int kD, typename C>
inline void load_row(const C* row, vf* x) {
  constexpr int NV = kD / W;
  if constexpr (std::is_same<C, float>::value) {
    for (int c = 0; c < NV; ++c) x[c] = vload(row + c * W);
  } else if constexpr (std::is_same<C, int8_t>::value) {
    const float* scales = kvserve_kv::row_scales(row, kD);
    for (int c = 0; c < NV; ++c)
      x[c] = vmul(vwiden_i8(row + c * W), vset1(scales[c * W / kvserve_kv::kGroup]));
  } else {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(row);
    for (int c = 0; c < NV; ++c) x[c] = vwiden(raw + c * W);
  }
}

// Prefetch the cache row at position pos (every 64-byte line of it) into L1: a sequence's rows
// are contiguous only within a block, and one stream per core leaves the hardware prefetcher
// far below the memory rate once the KV no longer fits in cache (batch 64 at ~1,000 tokens:
// 14 of ~28 GB/s).
template <int kD, typename C>
inline void prefetch_row(const C* base, const int32_t* table, int64_t pos, int64_t BS) {
  constexpr int64_t bytes = kvserve_kv::row_width<C>(kD) * sizeof(C);
  const char* row = reinterpret_cast<const char*>(
      base + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * kvserve_kv::row_width<C>(kD));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
}
constexpr int64_t kAhead = 16;  // rows

// acc[g] += p[g] * V for GB heads (starting at g0) over the rows [first, len).
template <int kD, int GB, typename C>
inline void accumulate(const C* vbase, const int32_t* table, int64_t first, int64_t len,
                       int64_t BS, const float* probs, int64_t L, int64_t g0, float* out) {
  constexpr int NV = kD / W;
  constexpr int64_t RS = kvserve_kv::row_width<C>(kD);
  vf acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = vset1(0.f);
  for (int64_t t = 0; t < len - first; ++t) {
    const int64_t pos = first + t;
    if (pos + kAhead < len) prefetch_row<kD>(vbase, table, pos + kAhead, BS);
    vf v[NV];
    load_row<kD>(vbase + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * RS, v);
    for (int g = 0; g < GB; ++g) {
      const vf p = vset1(probs[(g0 + g) * L + t]);
      for (int c = 0; c < NV; ++c) acc[g][c] = vfma(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) vstore(out + (g0 + g) * kD + c * W, acc[g][c]);
}

// One task, as cpu_decode.cpp's attend_one computes it: qs [G, kD] float32, the output os
// [G, kD] float32, scores [G, len - first] scratch.
template <int kD, typename C>
void attend(const float* qs, const C* kbase, const C* vbase, const int32_t* table,
            int64_t first, int64_t len, int64_t BS, int64_t G, float sc, float* scores,
            float* os) {
  constexpr int NV = kD / W;
  constexpr int64_t RS = kvserve_kv::row_width<C>(kD);
  // heads a value pass holds in registers beside one row
  constexpr int GB = std::max(1, std::min(4, kRegisters / 2 / NV));
  const int64_t L = len - first;
  const float sc2 = sc * static_cast<float>(M_LOG2E);  // scores in log2 units: 2^x below
  int64_t t = 0;
  for (; t + W <= L && G <= kMaxHeads; t += W) {  // W keys: their G x W dot products at once
    vf parts[kMaxHeads][W];
    for (int j = 0; j < W; ++j) {
      const int64_t pos = first + t + j;
      if (pos + kAhead < len) prefetch_row<kD>(kbase, table, pos + kAhead, BS);
      vf k[NV];
      load_row<kD>(kbase + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * RS, k);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * kD;
        vf a = vmul(vload(qg), k[0]);
        for (int c = 1; c < NV; ++c) a = vfma(vload(qg + c * W), k[c], a);
        parts[g][j] = a;
      }
    }
    for (int64_t g = 0; g < G; ++g) vstore(scores + g * L + t, vmul(vhsums(parts[g]), vset1(sc2)));
  }
  for (; t < L; ++t) {
    const int64_t pos = first + t;
    vf k[NV];
    load_row<kD>(kbase + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * RS, k);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * kD;
      vf a = vmul(vload(qg), k[0]);
      for (int c = 1; c < NV; ++c) a = vfma(vload(qg + c * W), k[c], a);
      scores[g * L + t] = vhsum(a) * sc2;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * L;
    float mx = -INFINITY;
    for (t = 0; t < L; ++t) mx = std::max(mx, row[t]);
    const vf m = vset1(mx);
    vf sum = vset1(0.f);
    for (t = 0; t + W <= L; t += W) {
      const vf p = vexp2(vsub(vload(row + t), m));
      vstore(row + t, p);
      sum = vadd(sum, p);
    }
    float total = vhsum(sum);
    for (; t < L; ++t) {
      row[t] = std::exp2(row[t] - mx);
      total += row[t];
    }
    const float inv = 1.f / total;
    for (t = 0; t < L; ++t) row[t] *= inv;
  }
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    switch (std::min<int64_t>(GB, G - g0)) {
      case 4: accumulate<kD, std::min(GB, 4)>(vbase, table, first, len, BS, scores, L, g0, os); break;
      case 3: accumulate<kD, std::min(GB, 3)>(vbase, table, first, len, BS, scores, L, g0, os); break;
      case 2: accumulate<kD, std::min(GB, 2)>(vbase, table, first, len, BS, scores, L, g0, os); break;
      default: accumulate<kD, 1>(vbase, table, first, len, BS, scores, L, g0, os);
    }
  }
}
#else
constexpr bool kVectorized = false;
#endif

}  // namespace kvserve_decode
