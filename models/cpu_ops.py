"""kvserve's few C++ ops for CPU float32, compiled at first use: paged decode attention, and two
fusions of the per-layer elementwise work (residual add + RMSNorm, SiLU x up).

Why paged decode: a decode step's attention is a few dot products per cached token, but in
PyTorch it is a gather or a batched matmul of tiny (group x head_dim x block) matrices per KV
head and layer: per-matrix and per-op overhead, not memory, set its cost (16 sequences of ~300
tokens: ~25 ms of an ~85 ms step, where reading the KV once takes ~10 ms). This op walks each
sequence's block table and reads each K/V row once, for all query heads of its KV head
together, in parallel over (sequence, KV head) with ATen's thread pool (the same OpenMP team as
the matmuls).

Why the fusions: at batch 1 a step is ~22 ms of matmuls and ~8 ms of ~750 small ops; a residual
add + RMSNorm is 7 ops in PyTorch and SiLU x up 4 (two slices, silu, mul), each a dispatch and a
pass over memory. One op each, parallel over rows.

Built with `torch.utils.cpp_extension.load_inline` (g++ and ninja; ~1 min once, then cached
under TORCH_EXTENSIONS_DIR). Where it cannot build, `load()` returns None and callers keep
their pure-PyTorch paths; tests compare the two.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading
from typing import Any

import torch

log = logging.getLogger("kvserve.ops")

SOURCE = r"""
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

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
"""

_lock = threading.Lock()
_ops: Any = None
_tried = False


def load() -> Any:
    """The compiled ops (`.paged_decode`, `.add_rms_norm`, `.silu_mul`), or None where they
    cannot be built (no compiler, or KVSERVE_NO_CPP=1)."""
    global _ops, _tried
    if _tried:  # the hot path: no lock once decided
        return _ops
    with _lock:
        if _tried:
            return _ops
        _tried = True
        if os.environ.get("KVSERVE_NO_CPP") == "1":
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            # the `ninja` that pip installs sits next to this interpreter, maybe not on PATH
            bindir = os.path.dirname(sys.executable)
            if bindir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

            build_dir = os.path.join(
                os.environ.get("TORCH_EXTENSIONS_DIR")
                or os.path.expanduser("~/.cache/torch_extensions"),
                "kvserve_cpu_ops",
            )
            os.makedirs(build_dir, exist_ok=True)
            # torch guards a build with a plain `lock` file that a process killed mid-build
            # leaves behind, and every later start then waits on it forever. An flock is
            # released by the kernel when its holder dies: whoever holds it is the only
            # builder, so a `lock` file it finds is stale.
            with open(os.path.join(build_dir, "kvserve.flock"), "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                stale = os.path.join(build_dir, "lock")
                if os.path.exists(stale):
                    log.warning("removing a stale build lock left by a killed build")
                    os.remove(stale)
                load_inline(
                    name="kvserve_cpu_ops",
                    cpp_sources=[SOURCE],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"],
                    build_directory=build_dir,
                    is_python_module=False,
                    verbose=False,
                )
            _ops = torch.ops.kvserve_cpu
        except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
            log.warning("kvserve's C++ CPU ops unavailable (%s); using PyTorch ops", e)
        return _ops
