// The int8 KV cache's row format, shared by the CPU attention ops (cpu_decode.cpp,
// cpu_prefill.cpp) and mirrored in Python by engine/attention/kv_quant.py.
//
// A cached row of one KV head is D int8 values followed by D / 32 float32 scales, one per group
// of 32 values (llama.cpp's q8_0 grouping), symmetric: value = q * scale, scale = max|x| / 127.
// The scales live inside the row, so a block is still one slice of the cache tensor along the
// block dimension: the host and disk tiers, the window pool and the P/D store copy it as bytes.
// A row's scales are its own (not the block's): a block is written a token at a time, and a
// shared scale would have to re-round the block's earlier rows whenever a later one exceeds it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvserve_kv {

constexpr int64_t kGroup = 32;

// Elements of the cache's element type C one row of D values occupies.
template <typename C>
constexpr int64_t row_width(int64_t D) {
  return std::is_same<C, int8_t>::value ? D + 4 * (D / kGroup) : D;
}

inline const float* row_scales(const int8_t* row, int64_t D) {
  return reinterpret_cast<const float*>(row + D);
}

// x (D floats) rounded into an int8 row with its scales.
inline void quantize_row(const float* x, int64_t D, int8_t* row) {
  float* scales = reinterpret_cast<float*>(row + D);
  for (int64_t g = 0; g < D / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float amax = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < kGroup; ++i)
      row[g * kGroup + i] = static_cast<int8_t>(std::nearbyint(xg[i] * inv));
    std::memcpy(scales + g, &scale, sizeof(float));
  }
}

// An int8 row's D values in float32.
inline void dequantize_row(const int8_t* row, int64_t D, float* dst) {
  float scales[512 / kGroup];
  std::memcpy(scales, row + D, sizeof(float) * (D / kGroup));
  for (int64_t g = 0; g < D / kGroup; ++g) {
    const float s = scales[g];
#pragma GCC ivdep
    for (int64_t i = 0; i < kGroup; ++i) dst[g * kGroup + i] = s * row[g * kGroup + i];
  }
}

// A row of D floats stored as the cache's element type (rounded once).
template <typename C>
inline void store_row(const float* x, int64_t D, C* dst) {
  if constexpr (std::is_same<C, int8_t>::value) {
    quantize_row(x, D, dst);
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<C>(x[d]);
  }
}

}  // namespace kvserve_kv
