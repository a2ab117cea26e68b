// Paged decode attention for CPU float32: torch.ops.kvserve_cpu_decode.paged_decode.
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
#include <vector>

// One (sequence, KV head) task: G query heads over the sequence's keys [first, len).
// kD > 0 fixes the head size at compile time, so the dot products unroll and vectorize.
template <int kD>
static void attend_one(const float* qs, const float* kbase, const float* vbase,
                       const int32_t* table, int64_t first, int64_t len, int64_t BS, int64_t G,
                       int64_t Drt, float sc, float* scores, float* acc, float* os) {
  const int64_t D = kD > 0 ? kD : Drt;
  const int64_t L = len - first;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t pos = first + t;
    const float* krow = kbase + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * D;
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
    const float* vrow = vbase + (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      float* a = acc + g * D;
#pragma GCC ivdep
      for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
    }
  }
  std::copy(acc, acc + G * D, os);
}

// q [n, H, D]; k_cache, v_cache [kv_heads, num_blocks, block_size, D] (contiguous);
// block_tables [n, max_blocks] int32; seq_lens [n] int32; window 0 = full attention.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kFloat, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D);
  const int64_t G = H / KVH, MB = block_tables.size(1);
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, kh = task % KVH;
      const int64_t len = sl[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(G * (len - first));
      const float* qs = qp + (s * H + kh * G) * D;
      const float* kb = kp + kh * NB * BS * D;
      const float* vb = vp + kh * NB * BS * D;
      float* os = op + (s * H + kh * G) * D;
      const int32_t* table = bt + s * MB;
      if (D == 64) {
        attend_one<64>(qs, kb, vb, table, first, len, BS, G, D, sc, scores.data(), acc.data(), os);
      } else if (D == 128) {
        attend_one<128>(qs, kb, vb, table, first, len, BS, G, D, sc, scores.data(), acc.data(), os);
      } else {
        attend_one<0>(qs, kb, vb, table, first, len, BS, G, D, sc, scores.data(), acc.data(), os);
      }
    }
  });
  return out;
}

TORCH_LIBRARY(kvserve_cpu_decode, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
