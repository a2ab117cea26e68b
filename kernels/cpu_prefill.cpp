// Paged prefill attention for CPU float32 and bfloat16: torch.ops.kvserve_cpu_prefill.
// Built at first use by engine/attention/cpu_prefill.py; its consumer is the torch backend.
//
// Why: a long prompt's prefill spent 61% of its time in torch's CPU flash attention (a
// 1,024-token causal pass of 9 heads of 64 at ~100 GFLOP/s, a quarter of the machine's float32
// FMA rate), and a chunk with earlier context first gathered the sequence's pages into a copy
// and attended it under a boolean mask. This op reads the keys and values where the paged cache
// holds them and runs flash attention (online softmax) with register-blocked micro-kernels:
// a block of query rows of one head against blocks of KB keys, scores as a small GEMM on the
// keys transposed once per block, probabilities times values the same way. Causality, the
// earlier context and a sliding window are positions, not a mask tensor: key blocks no row can
// see are skipped, and only blocks on a boundary are masked element by element.
// Arithmetic is float32 throughout (a bf16 cache or query is widened by a shift, an int8 row
// multiplied by its scales: kv_int8.h); the output is rounded to the query's dtype once.
// paged_prefill_tiles: the same op with the bf16 blocks' two products (Q K^T and P V) as tile
// GEMMs through PyTorch's own brgemm (at::native::cpublas::brgemm, oneDNN's ukernel: AMX tiles
// where the CPU has them, AVX-512 otherwise), on the very pair-interleaved (VNNI) blocks the
// dot-product path packs; the engine times both at startup (engine/build/prefill_choice.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_prefill_blocks.h"
#include "cpu_simd.h"
#include "kv_int8.h"

namespace {

using namespace kvserve_prefill;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

// Per-thread scratch for one task.
struct Scratch {
  std::vector<float> q, o, s, m, l;
  std::vector<uint32_t> qb, pb;  // bf16 operands: query pairs, probability pairs
  explicit Scratch(int64_t D)
      : q(QB * D), o(QB * D), s(QB * KB), m(QB), l(QB), qb(QB * D / 2), pb(QB * KB / 2) {}
};

// One task: query rows [r0, r0 + nq) of head h (positions ctx + r0 ...) over the keys they see.
template <typename T, typename C, bool kBF16, int NV>
void attend_block(const T* qp, int64_t q_row_stride, T* op, int64_t o_row_stride,
                  const Packed<C, kBF16>& kv, int64_t kh, int64_t h, int64_t r0, int64_t nq,
                  int64_t ctx, int64_t window, float sc2, Scratch& w, bool tiles) {
  const int64_t D = kv.D;
  float *q = w.q.data(), *o = w.o.data(), *s = w.s.data();
  std::fill(o, o + QB * D, 0.f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  if constexpr (kBF16) {
    std::fill(w.qb.begin(), w.qb.end(), 0u);
    for (int64_t r = 0; r < nq; ++r)
      std::memcpy(&w.qb[r * D / 2], qp + (r0 + r) * q_row_stride + h * D, D * 2);
  } else {
    std::fill(q, q + QB * D, 0.f);
    for (int64_t r = 0; r < nq; ++r) {
      to_float(qp + (r0 + r) * q_row_stride + h * D, q + r * D, D);
      for (int64_t d = 0; d < D; ++d) q[r * D + d] *= sc2;  // scores in log2 units: exp2 below
    }
  }
  const int64_t first_pos = ctx + r0, last_pos = ctx + r0 + nq - 1;
  const int64_t k_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / KB * KB : 0;
  const int64_t k_end = last_pos + 1;
  const int64_t nqr = (nq + R - 1) / R * R;
  for (int64_t k0 = std::max(k_begin, kv.k_lo); k0 < k_end; k0 += KB) {
    const int nk = static_cast<int>(std::min<int64_t>(KB, k_end - k0));
    if constexpr (kBF16) {
#if defined(__AVX512BF16__)
      if (tiles) {  // S [nqr, KB] = Q [nqr, D] x K^T [D, KB] (pairs along D: VNNI)
        at::native::cpublas::brgemm(nqr, KB, D, D, KB, KB, false,
                                    reinterpret_cast<const at::BFloat16*>(w.qb.data()),
                                    reinterpret_cast<const at::BFloat16*>(kv.kblock(kh, k0)), s, true);
      } else {
        for (int64_t r = 0; r < nqr; r += R) scores_bf16(&w.qb[r * D / 2], kv.kblock(kh, k0), s + r * KB, D / 2);
      }
      for (int64_t i = 0; i < nqr * KB; i += W) vstore(s + i, vmul(vload(s + i), vset1(sc2)));
#endif
    } else {
      for (int64_t r = 0; r < nqr; r += R) scores(q + r * D, kv.kblock(kh, k0), s + r * KB, D);
    }
    // a block some row cannot see all of: mask by position
    const bool edge = k0 + KB - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
    for (int64_t r = 0; r < nqr; ++r) {
      float* sr = s + r * KB;
      if (r >= nq) {
        std::fill(sr, sr + KB, 0.f);
        continue;
      }
      if (edge) mask_row(sr, first_pos + r, k0, nk, window);
      softmax_row(sr, w.m[r], w.l[r], o + r * D, D);
    }
    if constexpr (kBF16) {
#if defined(__AVX512BF16__)
      for (int64_t i = 0; i < nqr * KB; i += 32) {  // probabilities to bf16 pairs
        const __m512bh pr = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + i + 16), _mm512_loadu_ps(s + i));
        _mm512_storeu_si512(&w.pb[i / 2], (__m512i)pr);
      }
      if (tiles) {  // O [nqr, D] += P [nqr, KB] x V [KB, D] (pairs along KB: VNNI)
        at::native::cpublas::brgemm(nqr, D, KB, KB, D, D, true,
                                    reinterpret_cast<const at::BFloat16*>(w.pb.data()),
                                    reinterpret_cast<const at::BFloat16*>(kv.vblock(kh, k0)), o, true);
      } else {
        for (int64_t r = 0; r < nqr; r += R)
          accumulate_bf16<NV>(&w.pb[r * KB / 2], kv.vblock(kh, k0), o + r * D, nk, D);
      }
#endif
    } else {
      for (int64_t r = 0; r < nqr; r += R) accumulate<NV>(s + r * KB, kv.vblock(kh, k0), o + r * D, nk, D);
    }
  }
  for (int64_t r = 0; r < nq; ++r) {
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    T* dst = op + (r0 + r) * o_row_stride + h * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r * D + d] * inv);
  }
}

template <typename T, typename C, bool kBF16, int NV>
void prefill_impl(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& pages, int64_t ctx, float scale,
                  int64_t window, bool tiles) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), seq = ctx + n;
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / KVH, nqb = (n + QB - 1) / QB, tasks = H * nqb;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int32_t* pg = pages.data_ptr<int32_t>();
  const int64_t qs = q.stride(0), os = out.stride(0);
  const float sc2 = scale * static_cast<float>(M_LOG2E);
  const int64_t k_lo = window > 0 ? std::max<int64_t>(0, ctx - window + 1) / KB * KB : 0;
  Packed<C, kBF16> kv(KVH, D, k_lo, seq);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < KVH * kv.nkb; ++t) {
      const int64_t kh = t / kv.nkb;
      const int64_t head = kh * NB * BS * row_width<C>(D);
      kv.pack(kh, t % kv.nkb, kp + head, vp + head, pg, BS, seq);
    }
    Scratch w(D);
    // the last query blocks see the most keys: handed out first, the rest fill in behind them
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = nqb - 1 - t / H, h = t % H;
      const int64_t r0 = b * QB, nq = std::min<int64_t>(QB, n - r0);
      attend_block<T, C, kBF16, NV>(qp, qs, op, os, kv, h / G, h, r0, nq, ctx, window, sc2, w,
                                    tiles);
    }
    if (tiles) at::native::cpublas::brgemm_release();  // this thread's tile configuration
  }
}

template <typename T, typename C>
void prefill_nv(const at::Tensor& q, at::Tensor& out, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& pages, int64_t ctx, float scale, int64_t window, bool tiles) {
  const int64_t D = q.size(2);
  // bf16 queries on a bf16 cache: bf16 dot products where the CPU has them
  constexpr bool kBF16 = kHaveBF16Dot && std::is_same<T, at::BFloat16>::value;
  tiles = tiles && kBF16;
  if (D % (4 * W) == 0) {
    prefill_impl<T, C, kBF16, 4>(q, out, k, v, pages, ctx, scale, window, tiles);
  } else if (D % (2 * W) == 0) {
    prefill_impl<T, C, kBF16, 2>(q, out, k, v, pages, ctx, scale, window, tiles);
  } else {
    prefill_impl<T, C, kBF16, 1>(q, out, k, v, pages, ctx, scale, window, tiles);
  }
}
#endif

}  // namespace

// The vector width the kernels were built for (floats); 0: not built (no AVX2), and head sizes
// that are not a multiple of it are refused.
int64_t simd_width() { return W; }

// Whether bf16 queries on a bf16 cache take bf16 dot products (AVX512-BF16), not float32 FMAs.
bool bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// q [n, H, D] (rows may be strided: a view of the fused qkv), out the same shape; k_cache,
// v_cache [KVH, num_blocks, block_size, row] contiguous (row = D, or an int8 row with its scales), holding this sequence's keys and values
// at positions [0, ctx + n) (this chunk's already written); pages int32, the sequence's blocks;
// query row i is at position ctx + i; window 0 = full.
void prefill(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& pages, int64_t ctx, double scale,
             int64_t window, bool tiles) {
  TORCH_CHECK(W > 0, "built without AVX2");
  const auto dt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(out.scalar_type() == dt && out.sizes() == q.sizes());
  TORCH_CHECK(v_cache.scalar_type() == ct && (ct == dt || ct == at::kBFloat16 || ct == at::kChar));
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows of [H, D] contiguous");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(pages.scalar_type() == at::kInt && pages.is_contiguous());
  const int64_t D = q.size(2);
  const int64_t width = ct == at::kChar ? row_width<int8_t>(D) : D;
  TORCH_CHECK(W > 0 && D % (W > 0 ? W : 1) == 0 && k_cache.size(3) == width, "head size");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0);
  TORCH_CHECK(pages.numel() * k_cache.size(2) >= ctx + q.size(0), "pages cover the sequence");
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const float sc = static_cast<float>(scale);
  if (dt == at::kFloat && ct == at::kFloat) {
    prefill_nv<float, float>(q, out, k_cache, v_cache, pages, ctx, sc, window, false);
  } else if (ct == at::kChar && dt == at::kFloat) {
    prefill_nv<float, int8_t>(q, out, k_cache, v_cache, pages, ctx, sc, window, false);
  } else if (ct == at::kChar) {
    prefill_nv<at::BFloat16, int8_t>(q, out, k_cache, v_cache, pages, ctx, sc, window, tiles);
  } else if (dt == at::kFloat) {
    prefill_nv<float, at::BFloat16>(q, out, k_cache, v_cache, pages, ctx, sc, window, false);
  } else {
    prefill_nv<at::BFloat16, at::BFloat16>(q, out, k_cache, v_cache, pages, ctx, sc, window, tiles);
  }
#endif
}

void paged_prefill(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& pages, int64_t ctx, double scale,
                   int64_t window) {
  prefill(q, out, k_cache, v_cache, pages, ctx, scale, window, false);
}

// The same with tile GEMMs for bf16 queries (on a bf16 or int8 cache); other dtypes as above.
void paged_prefill_tiles(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& pages, int64_t ctx,
                         double scale, int64_t window) {
  prefill(q, out, k_cache, v_cache, pages, ctx, scale, window, true);
}

// Whether paged_prefill_tiles multiplies bf16 blocks as tile GEMMs here (built with AVX512-BF16,
// the pair-interleaved blocks it hands to brgemm).
bool tiles() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY(kvserve_cpu_prefill, m) {
  m.def("simd_width() -> int", &simd_width);
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("paged_prefill(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, Tensor pages, "
        "int context, float scale, int window) -> ()");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(paged_prefill));
  m.def("tiles() -> bool", &tiles);
  m.def("paged_prefill_tiles(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, "
        "Tensor pages, int context, float scale, int window) -> ()");
  m.impl("paged_prefill_tiles", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_tiles));
}
