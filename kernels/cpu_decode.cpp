// Paged decode attention for CPU float32 and bfloat16 (a bf16 or int8 KV cache widened to float32,
// scores, softmax and accumulation in float32, the output rounded to bf16 once; int8 rows:
// kv_int8.h):
// torch.ops.kvserve_cpu_decode.paged_decode.
// Built at first use by engine/attention/cpu_decode.py; its consumer is the torch backend.
//
// Why: a decode step's attention is a few dot products per cached token, but in PyTorch it is a
// gather or a batched matmul of tiny (group x head_dim x block) matrices per KV head and layer:
// per-matrix and per-op overhead, not memory, set its cost (16 sequences of ~300 tokens: ~25 ms
// of an ~85 ms step, where reading the KV once takes ~10 ms). This op walks each sequence's
// block table and reads each K/V row once, for all query heads of its KV head together, in
// parallel over (sequence, KV head) with ATen's thread pool (the same OpenMP team as the
// matmuls).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "decode_attend.h"
#include "kv_int8.h"

using kvserve_kv::row_width;

// A cached row in float32: bf16 widened by a shift (a loop the compiler vectorizes; c10's
// per-element conversion it does not), int8 times its group scales.
template <int kD, typename T>
static inline const float* widened(const T* row, int64_t D, float* buf) {
  if constexpr (std::is_same<T, float>::value) {
    return row;
  } else if constexpr (std::is_same<T, int8_t>::value) {
    kvserve_kv::dequantize_row(row, kD > 0 ? kD : D, buf);
    return buf;
  } else {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(row);
    uint32_t* bits = reinterpret_cast<uint32_t*>(buf);
    const int64_t n = kD > 0 ? kD : D;
    for (int64_t d = 0; d < n; ++d) bits[d] = static_cast<uint32_t>(raw[d]) << 16;
    return buf;
  }
}

// One task: G query heads (of one KV head) over the sequence's keys [first, len).
// kD > 0 fixes the head size at compile time, so the dot products unroll and vectorize.
// qs is the G query heads in float32; T is the cache's element type.
template <int kD, typename T>
static void attend_one(const float* qs, const T* kbase, const T* vbase,
                       const int32_t* table, int64_t first, int64_t len, int64_t BS, int64_t G,
                       int64_t Drt, float sc, float* scores, float* acc, float* os) {
  const int64_t D = kD > 0 ? kD : Drt, RS = row_width<T>(D);
  const int64_t L = len - first;
  float buf[kD > 0 ? kD : 512];
  for (int64_t t = 0; t < L; ++t) {
    const int64_t pos = first + t;
    const float* krow = widened<kD>(
        kbase + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * RS, D, buf);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      float dot = 0.f;
#pragma GCC ivdep
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * krow[d];
      scores[g * L + t] = dot * sc;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * L;
    float mx = -INFINITY;
    for (int64_t t = 0; t < L; ++t) mx = std::max(mx, row[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      row[t] = std::exp(row[t] - mx);
      sum += row[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) row[t] *= inv;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t pos = first + t;
    const float* vrow = widened<kD>(
        vbase + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * RS, D, buf);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      float* a = acc + g * D;
#pragma GCC ivdep
      for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
    }
  }
  std::copy(acc, acc + G * D, os);  // os: float32 scratch or the output
}

// Calls f(T{}, C{}) for the query dtype dt and the cache dtype ct the ops take: the cache is the
// queries' dtype, bfloat16 (--kv-cache-dtype bfloat16 under a float32 model) or int8.
template <typename F>
static void with_types(at::ScalarType dt, at::ScalarType ct, F&& f) {
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(ct == dt || ct == at::kBFloat16 || ct == at::kChar,
              "the cache is the queries' dtype, bfloat16 or int8");
  if (dt == at::kFloat && ct == at::kFloat) {
    f(float{}, float{});
  } else if (ct == at::kChar) {
    dt == at::kFloat ? f(float{}, int8_t{}) : f(at::BFloat16{}, int8_t{});
  } else if (dt == at::kFloat) {
    f(float{}, at::BFloat16{});
  } else {
    f(at::BFloat16{}, at::BFloat16{});
  }
}

// One task with the head size fixed at compile time where it is a common one: in registers
// (decode_attend.h) where the build has vectors, else attend_one's plain loops.
template <typename C>
static inline void attend_any(const float* qs, const C* kb, const C* vb, const int32_t* table,
                              int64_t first, int64_t len, int64_t BS, int64_t G, int64_t D,
                              float sc, float* scores, float* acc, float* os) {
  if constexpr (kvserve_decode::kVectorized) {
    if (D == 64) return kvserve_decode::attend<64>(qs, kb, vb, table, first, len, BS, G, sc, scores, os);
    if (D == 128) return kvserve_decode::attend<128>(qs, kb, vb, table, first, len, BS, G, sc, scores, os);
  }
  if (D == 64) {
    attend_one<64>(qs, kb, vb, table, first, len, BS, G, D, sc, scores, acc, os);
  } else if (D == 128) {
    attend_one<128>(qs, kb, vb, table, first, len, BS, G, D, sc, scores, acc, os);
  } else {
    attend_one<0>(qs, kb, vb, table, first, len, BS, G, D, sc, scores, acc, os);
  }
}

// T: the queries' and output's element type; C: the cache's.
template <typename T, typename C>
static void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, float sc, int64_t window,
                              at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), RS = row_width<C>(D);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / KVH, MB = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  constexpr bool kF32 = std::is_same<T, float>::value;

  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    std::vector<float> qf(kF32 ? 0 : G * D), of(kF32 ? 0 : G * D);  // bf16: float32 copies
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, kh = task % KVH;
      const int64_t len = sl[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(G * (len - first));
      const T* qsrc = qp + (s * H + kh * G) * D;
      T* odst = op + (s * H + kh * G) * D;
      const float* qs;
      float* os;
      if constexpr (kF32) {
        qs = qsrc;
        os = odst;
      } else {
        for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qsrc[i]);
        qs = qf.data();
        os = of.data();
      }
      const C* kb = kp + kh * NB * BS * RS;
      const C* vb = vp + kh * NB * BS * RS;
      attend_any(qs, kb, vb, bt + s * MB, first, len, BS, G, D, sc, scores.data(), acc.data(), os);
      if constexpr (!kF32) {
        for (int64_t i = 0; i < G * D; ++i) odst[i] = static_cast<T>(of[i]);
      }
    }
  });
}

// q [n, H, D]; k_cache, v_cache [kv_heads, num_blocks, block_size, row] (contiguous; row = D,
// or D + D / 8 for int8 rows with their scales); q float32 or bfloat16, the caches the same,
// bfloat16 or int8; block_tables [n, max_blocks] int32; seq_lens [n] int32; window 0 = full.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale, int64_t window) {
  const auto dt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == ct, "k/v cache dtypes differ");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt);
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0);
  TORCH_CHECK(q.size(2) <= 512, "head_dim above 512");
  auto out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  with_types(dt, ct, [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    TORCH_CHECK(k_cache.size(3) == row_width<C>(q.size(2)), "cache rows do not fit head_dim");
    paged_decode_impl<T, C>(q, k_cache, v_cache, block_tables, seq_lens, sc, window, out);
  });
  return out;
}

// Rotate-half rotary (HF layout) of one head x into y, with this row's cos / sin tables c, s
// [D / 2] (float32: a bf16 table would round every rotation).
template <typename T, typename O>
static inline void rotate_half(const T* x, const float* c, const float* s, int64_t half, O* y) {
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
    y[d] = static_cast<O>(x1 * c[d] - x2 * s[d]);
    y[d + half] = static_cast<O>(x2 * c[d] + x1 * s[d]);
  }
}

// Row i of the fused qkv (q heads, k heads, v heads): its k heads rotated and its v heads copied
// into their cache slots, rounded once to the cache's type (an int8 row with its scales).
template <typename T, typename C>
static inline void write_kv_row(int64_t i, const T* row, const float* c, const float* s, C* kc,
                                C* vc, const int64_t* sb, const int64_t* so, int64_t H,
                                int64_t KVH, int64_t NB, int64_t BS, int64_t D) {
  const int64_t RS = row_width<C>(D);
  float buf[512];
  for (int64_t kh = 0; kh < KVH; ++kh) {
    const int64_t slot = (kh * NB + sb[i]) * BS + so[i];
    rotate_half(row + (H + kh) * D, c, s, D / 2, buf);
    kvserve_kv::store_row(buf, D, kc + slot * RS);
    const T* v = row + (H + KVH + kh) * D;
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(v[d]);
    kvserve_kv::store_row(buf, D, vc + slot * RS);
  }
}

// The checks both fused ops make; returns head_dim (from qkv: an int8 cache's rows are wider).
static int64_t check_fused(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& kv_cache, const at::Tensor& slot_block,
                           const at::Tensor& slot_offset, int64_t H) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && kv_cache.is_contiguous());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(slot_block.scalar_type() == at::kLong && slot_offset.scalar_type() == at::kLong);
  const int64_t n = qkv.size(0), KVH = kv_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && qkv.size(1) % (H + 2 * KVH) == 0);
  const int64_t D = qkv.size(1) / (H + 2 * KVH);
  TORCH_CHECK(cos.numel() == n * (D / 2) && D <= 512, "rotary tables or head_dim");
  TORCH_CHECK(slot_block.numel() == n && slot_offset.numel() == n);
  const int64_t width = kv_cache.scalar_type() == at::kChar ? row_width<int8_t>(D) : D;
  TORCH_CHECK(kv_cache.size(4) == width, "cache rows do not fit head_dim");
  return D;
}

// One decode step's attention for one layer from its fused qkv projection: rotary on q and k
// (rotate-half, HF layout), k and v written into their cache slots, then attention as
// `paged_decode` computes it. In PyTorch that is ~15 small ops per layer (slices, the rotation's
// muls and cat, two indexed writes, casts); at batch 1 their dispatch costs more than the
// arithmetic. The keys and values are written first, on the calling thread (a few hundred
// values: rows of one sequence, a verify step's 1 + k, attend over each other's), then one
// parallel region: each (row, KV head) task rotates its query heads and attends.
// qkv [n, (H + 2 KVH) * D] (q heads, then k, then v); cos, sin [n, D / 2] float32 (a bf16
// table would round every rotation);
// kv_cache [2, KVH, num_blocks, block_size, row]; slot_block, slot_offset [n] int64.
template <typename T, typename C>
static void rope_attend_impl(const at::Tensor& qkv, const float* cp, const float* sp,
                             C* kc, C* vc, const int64_t* sb, const int64_t* so,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             int64_t H, int64_t KVH, int64_t NB, int64_t BS, int64_t D, float sc,
                             int64_t window, at::Tensor& out) {
  const int64_t n = qkv.size(0), G = H / KVH, half = D / 2, MB = block_tables.size(1);
  const int64_t RS = row_width<C>(D);
  const T* src = qkv.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    write_kv_row(i, src + i * (H + 2 * KVH) * D, cp + i * half, sp + i * half, kc, vc, sb, so, H,
                 KVH, NB, BS, D);
  }
  // Fewer (row, KV head) tasks than twice the threads (batch 1: 3 on 2 threads, one idle half
  // the time): a task per query head instead, each reading its KV head's rows (from cache).
  const int64_t P = n * KVH >= 2 * at::get_num_threads() ? G : 1;  // query heads per task
  at::parallel_for(0, n * KVH * (G / P), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(P * D), qf(P * D), of(P * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (H / P), head0 = task % (H / P) * P, kh = head0 / G;
      const T* row = src + i * (H + 2 * KVH) * D;
      for (int64_t g = 0; g < P; ++g)
        rotate_half(row + (head0 + g) * D, cp + i * half, sp + i * half, half, qf.data() + g * D);
      if constexpr (!std::is_same<T, float>::value) {  // rounded as the unfused path's q is
        for (int64_t j = 0; j < P * D; ++j) qf[j] = static_cast<float>(static_cast<T>(qf[j]));
      }
      const int64_t len = sl[i];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(P * (len - first));
      attend_any(qf.data(), kc + kh * NB * BS * RS, vc + kh * NB * BS * RS, bt + i * MB, first,
                 len, BS, P, D, sc, scores.data(), acc.data(), of.data());
      T* odst = op + (i * H + head0) * D;
      for (int64_t j = 0; j < P * D; ++j) odst[j] = static_cast<T>(of[j]);
    }
  });
}

at::Tensor rope_write_decode(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& kv_cache, const at::Tensor& slot_block,
                             const at::Tensor& slot_offset, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t num_heads, double scale,
                             int64_t window) {
  const int64_t H = num_heads;
  const int64_t D = check_fused(qkv, cos, sin, kv_cache, slot_block, slot_offset, H);
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt);
  const int64_t n = qkv.size(0), KVH = kv_cache.size(1), NB = kv_cache.size(2);
  const int64_t BS = kv_cache.size(3);
  at::Tensor out = at::empty({n, H, D}, qkv.options());
  const int64_t* sb = slot_block.data_ptr<int64_t>();
  const int64_t* so = slot_offset.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  with_types(qkv.scalar_type(), kv_cache.scalar_type(), [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    rope_attend_impl<T, C>(qkv, cp, sp, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), sb, so,
                           block_tables, seq_lens, H, KVH, NB, BS, D, sc, window, out);
  });
  return out;
}

// Any step's rotary and KV write from its fused qkv projection, without the attention: rotary
// on q and k (as `rope_write_decode` computes it), k and v written into their cache slots, the
// rotated q returned [n, H, D] for the step's attention (prefill chunks: cpu_prefill.cpp). In
// PyTorch that is the rotation's float32 round trip, a cat and two indexed writes per layer:
// ~6% of a prefill. Parallel over rows.
template <typename T, typename C>
static void rope_write_impl(const T* src, const float* cp, const float* sp, C* kc, C* vc,
                            const int64_t* sb, const int64_t* so, int64_t n, int64_t H,
                            int64_t KVH, int64_t NB, int64_t BS, int64_t D, T* q) {
  const int64_t half = D / 2;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * half;
      const float* s = sp + i * half;
      const T* row = src + i * (H + 2 * KVH) * D;
      for (int64_t h = 0; h < H; ++h) rotate_half(row + h * D, c, s, half, q + (i * H + h) * D);
      write_kv_row(i, row, c, s, kc, vc, sb, so, H, KVH, NB, BS, D);
    }
  });
}

at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& kv_cache, const at::Tensor& slot_block,
                      const at::Tensor& slot_offset, int64_t num_heads) {
  const int64_t H = num_heads;
  const int64_t D = check_fused(qkv, cos, sin, kv_cache, slot_block, slot_offset, H);
  const int64_t n = qkv.size(0), KVH = kv_cache.size(1), NB = kv_cache.size(2);
  const int64_t BS = kv_cache.size(3);
  at::Tensor q = at::empty({n, H, D}, qkv.options());
  const int64_t* sb = slot_block.data_ptr<int64_t>();
  const int64_t* so = slot_offset.data_ptr<int64_t>();
  at::Tensor kcache = kv_cache.select(0, 0), vcache = kv_cache.select(0, 1);
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  with_types(qkv.scalar_type(), kv_cache.scalar_type(), [&](auto t, auto c) {
    using T = decltype(t);
    using C = decltype(c);
    rope_write_impl<T, C>(qkv.data_ptr<T>(), cp, sp, kcache.data_ptr<C>(), vcache.data_ptr<C>(),
                          sb, so, n, H, KVH, NB, BS, D, q.data_ptr<T>());
  });
  return q;
}

TORCH_LIBRARY(kvserve_cpu_decode, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
  m.def("rope_write_decode(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_block, Tensor slot_offset, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, float scale, int window) -> Tensor");
  m.impl("rope_write_decode", c10::DispatchKey::CPU, TORCH_FN(rope_write_decode));
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slot_block, "
        "Tensor slot_offset, int num_heads) -> Tensor");
  m.impl("rope_write", c10::DispatchKey::CPU, TORCH_FN(rope_write));
}
