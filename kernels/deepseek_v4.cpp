// DeepSeek V4's decode-step kernels for CPU float32: torch.ops.kvserve_deepseek_v4.hc_pre,
// .hc_post, .sparse_decode and .norm_rope. Their consumers are models/deepseek_v4_mix.py (the
// hyper-connections) and models/deepseek_v4_attention.py (the decode rows' attention); the
// PyTorch code beside each call stays the reference, and engine/build/deepseek_v4_choice.py
// times both per geometry at startup.
//
// Why: a V4 layer mixes its hc_mult residual streams twice, and each mixing is a Sinkhorn
// projection of an n x n matrix (20 iterations of two normalisations): ~120 dispatches of
// [rows, 4, 4] tensors a mixing in PyTorch, the whole of a batch-1 step's time. And the PyTorch
// attention of a decode row reads every compressed entry of its sequence and masks all but the
// indexer's top k: at 8k tokens of context 2,048 CSA entries gathered, scored and softmaxed per
// layer for 8 that count. Here a row scores the entries on the indexer's keys alone and attends
// its window and the entries it keeps. The queries' and keys' RMSNorm + interleaved rotary is
// ~20 ops a tensor in PyTorch, four tensors a layer: one call each here.
//
// Plain loops over float32 (vectorised by the compiler for any -march, AVX2 included) and
// at::parallel_for over rows; no intrinsics. Built with -ffast-math: no infinities are relied on
// (masks are counts and flags, never -inf).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

static inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

static inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// (post [T, n], comb [T, n, n], collapsed [T, D]) of streams [T, n, D]: the mixes are
// RMSNorm(streams flattened) @ fn^T (fn [(2 + n) n, n D]); pre = sigmoid(.)+eps collapses the
// streams, post = 2 sigmoid(.), comb = softmax rows + eps, then Sinkhorn-Knopp: a column
// normalisation, then `iters - 1` rounds of rows then columns.
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams,
                                                      const at::Tensor& fn,
                                                      const at::Tensor& base,
                                                      const at::Tensor& scale, int64_t iters,
                                                      double eps, double norm_eps) {
  TORCH_CHECK(streams.scalar_type() == at::kFloat && streams.dim() == 3 &&
                  streams.is_contiguous(),
              "hc_pre: streams float32 [T, n, D], contiguous");
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  const int64_t outs = (2 + n) * n;
  TORCH_CHECK(fn.scalar_type() == at::kFloat && fn.dim() == 2 && fn.size(0) == outs &&
                  fn.size(1) == n * d,
              "hc_pre: fn float32 [(2 + n) n, n D]");
  TORCH_CHECK(base.scalar_type() == at::kFloat && base.numel() == outs && base.is_contiguous());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 3 && scale.is_contiguous());
  const float e = static_cast<float>(eps), ne = static_cast<float>(norm_eps);
  // the normalised streams, then one matmul for the mixes (as F.linear)
  at::Tensor normed = at::empty({t, n * d}, streams.options());
  const float* sp = streams.data_ptr<float>();
  float* np_ = normed.data_ptr<float>();
  at::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = sp + r * n * d;
      float ss = 0.f;
      for (int64_t i = 0; i < n * d; ++i) ss += x[i] * x[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n * d) + ne);
      float* o = np_ + r * n * d;
      for (int64_t i = 0; i < n * d; ++i) o[i] = x[i] * inv;
    }
  });
  at::Tensor mixes = at::mm(normed, fn.t()).contiguous();
  at::Tensor post = at::empty({t, n}, streams.options());
  at::Tensor comb = at::empty({t, n, n}, streams.options());
  at::Tensor collapsed = at::empty({t, d}, streams.options());
  const float* mp = mixes.data_ptr<float>();
  const float* bp = base.data_ptr<float>();
  const float* sc = scale.data_ptr<float>();
  float* pp = post.data_ptr<float>();
  float* cp = comb.data_ptr<float>();
  float* op = collapsed.data_ptr<float>();
  at::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pre(n), col(n);
    for (int64_t r = begin; r < end; ++r) {
      const float* m = mp + r * outs;
      for (int64_t i = 0; i < n; ++i) {
        pre[i] = sigmoid(m[i] * sc[0] + bp[i]) + e;
        pp[r * n + i] = 2.f * sigmoid(m[n + i] * sc[1] + bp[n + i]);
      }
      float* c = cp + r * n * n;
      for (int64_t i = 0; i < n; ++i) {  // softmax over each row of the n x n logits
        float top = -3.4e38f;
        for (int64_t j = 0; j < n; ++j) {
          c[i * n + j] = m[2 * n + i * n + j] * sc[2] + bp[2 * n + i * n + j];
          top = std::max(top, c[i * n + j]);
        }
        float z = 0.f;
        for (int64_t j = 0; j < n; ++j) z += (c[i * n + j] = std::exp(c[i * n + j] - top));
        for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / z + e;
      }
      for (int64_t it = 0; it < iters; ++it) {
        if (it > 0) {  // rows
          for (int64_t i = 0; i < n; ++i) {
            float z = 0.f;
            for (int64_t j = 0; j < n; ++j) z += c[i * n + j];
            for (int64_t j = 0; j < n; ++j) c[i * n + j] /= z + e;
          }
        }
        std::fill(col.begin(), col.end(), 0.f);  // columns
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) col[j] += c[i * n + j];
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) c[i * n + j] /= col[j] + e;
      }
      const float* x = sp + r * n * d;
      float* o = op + r * d;
      for (int64_t k = 0; k < d; ++k) o[k] = pre[0] * x[k];
      for (int64_t i = 1; i < n; ++i)
        for (int64_t k = 0; k < d; ++k) o[k] += pre[i] * x[i * d + k];
    }
  });
  return {post, comb, collapsed};
}

// The streams after a block: new[t, j] = post[t, j] out[t] + sum_i comb[t, i, j] streams[t, i].
at::Tensor hc_post(const at::Tensor& out, const at::Tensor& streams, const at::Tensor& post,
                   const at::Tensor& comb) {
  TORCH_CHECK(streams.scalar_type() == at::kFloat && streams.dim() == 3 &&
                  streams.is_contiguous(),
              "hc_post: streams float32 [T, n, D], contiguous");
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == t * d);
  TORCH_CHECK(post.scalar_type() == at::kFloat && post.is_contiguous() && post.numel() == t * n);
  TORCH_CHECK(comb.scalar_type() == at::kFloat && comb.is_contiguous() &&
              comb.numel() == t * n * n);
  at::Tensor result = at::empty_like(streams);
  const float *xp = streams.data_ptr<float>(), *yp = out.data_ptr<float>();
  const float *pp = post.data_ptr<float>(), *cp = comb.data_ptr<float>();
  float* rp = result.data_ptr<float>();
  at::parallel_for(0, t * n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t rj = begin; rj < end; ++rj) {
      const int64_t r = rj / n, j = rj % n;
      const float* x = xp + r * n * d;
      const float* c = cp + r * n * n;
      const float p = pp[rj];
      const float* y = yp + r * d;
      float* o = rp + rj * d;
      for (int64_t k = 0; k < d; ++k) o[k] = p * y[k] + c[j] * x[k];
      for (int64_t i = 1; i < n; ++i)
        for (int64_t k = 0; k < d; ++k) o[k] += c[i * n + j] * x[i * d + k];
    }
  });
  return result;
}

// One decode row per query: softmax over its visible window keys, the compressed entries it
// keeps, and a sink logit per head (K is V). Entries: all visible ones (HCA), or, given the
// indexer's queries and weights (CSA), the top k of the visible ones by
// sum_h w_h relu(iq_h . ik) * index_scale, where ik is the entry's trailing index_dim values.
// window [blocks, B, D] and entries [blocks, B / m, width] are the pool's planes; *_block and
// *_slot [rows, W or E] address them; *_visible [rows, ...] bool.
at::Tensor sparse_decode(const at::Tensor& q, const at::Tensor& window,
                         const at::Tensor& win_block, const at::Tensor& win_slot,
                         const at::Tensor& win_visible, const c10::optional<at::Tensor>& entries,
                         const c10::optional<at::Tensor>& ent_block,
                         const c10::optional<at::Tensor>& ent_slot,
                         const c10::optional<at::Tensor>& ent_visible,
                         const c10::optional<at::Tensor>& index_q,
                         const c10::optional<at::Tensor>& index_w, int64_t top_k,
                         const at::Tensor& sinks, double scale, double index_scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "sparse_decode: q float32 [rows, H, D], contiguous");
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2);
  TORCH_CHECK(window.scalar_type() == at::kFloat && window.dim() == 3 && window.is_contiguous() &&
                  window.size(2) == hd,
              "sparse_decode: window float32 [blocks, B, D], contiguous");
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == heads);
  const int64_t wn = win_block.size(1);
  TORCH_CHECK(win_block.dim() == 2 && win_slot.sizes() == win_block.sizes() &&
              win_visible.sizes() == win_block.sizes() && win_visible.scalar_type() == at::kBool);
  const bool has_entries = entries.has_value() && entries->defined();
  const bool indexed = has_entries && index_q.has_value() && index_q->defined();
  int64_t en = 0, width = 0, per_block = 1, ih = 0, idim = 0;
  if (has_entries) {
    TORCH_CHECK(entries->scalar_type() == at::kFloat && entries->dim() == 3 &&
                    entries->is_contiguous() && entries->size(2) >= hd,
                "sparse_decode: entries float32 [blocks, B / m, width], contiguous");
    en = ent_block->size(1);
    width = entries->size(2), per_block = entries->size(1);
    TORCH_CHECK(ent_slot->sizes() == ent_block->sizes() &&
                ent_visible->sizes() == ent_block->sizes() &&
                ent_visible->scalar_type() == at::kBool);
    TORCH_CHECK(ent_block->size(0) == rows || ent_block->size(0) == 1);
  }
  if (indexed) {
    TORCH_CHECK(index_q->scalar_type() == at::kFloat && index_q->is_contiguous() &&
                index_q->dim() == 3 && index_q->size(0) == rows);
    ih = index_q->size(1), idim = index_q->size(2);
    TORCH_CHECK(width == hd + idim, "sparse_decode: entries hold the indexer's keys after D");
    TORCH_CHECK(index_w->scalar_type() == at::kFloat && index_w->is_contiguous() &&
                index_w->numel() == rows * ih);
  }
  // index tensors as int64 contiguous, visibility as bool contiguous
  const at::Tensor wb = win_block.to(at::kLong).contiguous(), ws = win_slot.to(at::kLong).contiguous();
  const at::Tensor wv = win_visible.contiguous();
  at::Tensor eb, es, ev;
  if (has_entries) {
    eb = ent_block->to(at::kLong).contiguous(), es = ent_slot->to(at::kLong).contiguous();
    ev = ent_visible->contiguous();
  }
  const bool shared_entries = has_entries && eb.size(0) == 1 && rows > 1;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* winp = window.data_ptr<float>();
  const int64_t bsz = window.size(1);
  const float* entp = has_entries ? entries->data_ptr<float>() : nullptr;
  const float* iqp = indexed ? index_q->data_ptr<float>() : nullptr;
  const float* iwp = indexed ? index_w->data_ptr<float>() : nullptr;
  const float* skp = sinks.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), isc = static_cast<float>(index_scale);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> keys;
    std::vector<int64_t> seen;
    std::vector<float> score, logits, keys_t, head_score, total;
    for (int64_t r = begin; r < end; ++r) {
      keys.clear();
      const int64_t* b = wb.data_ptr<int64_t>() + r * wn;
      const int64_t* s = ws.data_ptr<int64_t>() + r * wn;
      const bool* v = wv.data_ptr<bool>() + r * wn;
      for (int64_t j = 0; j < wn; ++j)
        if (v[j]) keys.push_back(winp + (b[j] * bsz + s[j]) * hd);
      if (has_entries) {
        const int64_t er = shared_entries ? 0 : r;
        const int64_t* b2 = eb.data_ptr<int64_t>() + er * en;
        const int64_t* s2 = es.data_ptr<int64_t>() + er * en;
        const bool* v2 = ev.data_ptr<bool>() + (ev.size(0) == 1 ? 0 : r) * en;
        seen.clear();
        for (int64_t j = 0; j < en; ++j)
          if (v2[j]) seen.push_back(j);
        auto entry = [&](int64_t j) { return entp + (b2[j] * per_block + s2[j]) * width; };
        const int64_t k = std::min<int64_t>(top_k, en);  // as torch.topk over every column
        if (indexed && k > 0 && static_cast<int64_t>(seen.size()) > k) {
          // the seen entries' index keys transposed, [index_dim, seen]: each head's scores are
          // then one pass of multiply-adds along the entries (vectorised over them)
          const int64_t ns = static_cast<int64_t>(seen.size());
          const float* iq = iqp + r * ih * idim;
          const float* iw = iwp + r * ih;
          keys_t.resize(idim * ns);
          head_score.resize(ns);
          total.assign(ns, 0.f);
          for (int64_t jj = 0; jj < ns; ++jj) {
            const float* ik = entry(seen[jj]) + hd;
            for (int64_t c = 0; c < idim; ++c) keys_t[c * ns + jj] = ik[c];
          }
          for (int64_t h = 0; h < ih; ++h) {
            std::fill(head_score.begin(), head_score.end(), 0.f);
            for (int64_t c = 0; c < idim; ++c) {
              const float qc = iq[h * idim + c];
              const float* kc = keys_t.data() + c * ns;
              float* hs = head_score.data();
              for (int64_t jj = 0; jj < ns; ++jj) hs[jj] += qc * kc[jj];
            }
            const float wh = iw[h];
            for (int64_t jj = 0; jj < ns; ++jj)
              total[jj] += std::max(head_score[jj], 0.f) * isc * wh;
          }
          score.resize(en);
          for (int64_t jj = 0; jj < ns; ++jj) score[seen[jj]] = total[jj];
          // the k best scores; among equal scores the lower entry (an order, as topk's is)
          std::partial_sort(seen.begin(), seen.begin() + k, seen.end(), [&](int64_t a, int64_t c) {
            return score[a] > score[c] || (score[a] == score[c] && a < c);
          });
          seen.resize(k);
        }
        for (int64_t j : seen) keys.push_back(entry(j));
      }
      const int64_t nk = static_cast<int64_t>(keys.size());
      logits.resize(nk);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = qp + (r * heads + h) * hd;
        float top = skp[h];
        for (int64_t j = 0; j < nk; ++j) {
          logits[j] = dot(qh, keys[j], hd) * sc;
          top = std::max(top, logits[j]);
        }
        float z = std::exp(skp[h] - top);
        for (int64_t j = 0; j < nk; ++j) z += (logits[j] = std::exp(logits[j] - top));
        const float inv = 1.f / z;
        float* o = outp + (r * heads + h) * hd;
        std::fill(o, o + hd, 0.f);
        for (int64_t j = 0; j < nk; ++j) {
          const float p = logits[j] * inv;
          const float* kj = keys[j];
          for (int64_t c = 0; c < hd; ++c) o[c] += p * kj[c];
        }
      }
    }
  });
  return out;
}

// x [T, ..., D] (float32, contiguous): optionally RMSNorm over D (times `weight` where given),
// then interleaved rotary on the trailing 2P channels, pair (a, b) -> (a c - b s, b c + a s),
// with cos and sin [T, P] shared by the middle dims. A new tensor.
at::Tensor norm_rope(const at::Tensor& x, bool normalise, const c10::optional<at::Tensor>& weight,
                     double eps, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 2,
              "norm_rope: x float32 [T, ..., D], contiguous");
  const int64_t t = x.size(0), d = x.size(-1);
  const int64_t per_token = t ? x.numel() / (t * d) : 0;
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && sn.scalar_type() == at::kFloat && c.dim() == 2 &&
                  c.size(0) == t && sn.sizes() == c.sizes(),
              "norm_rope: cos, sin float32 [T, P]");
  const int64_t pairs = c.size(1);
  TORCH_CHECK(2 * pairs <= d, "norm_rope: 2P > D");
  const bool weighted = weight.has_value() && weight->defined();
  if (weighted)
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->numel() == d &&
                weight->is_contiguous());
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float *cp = c.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const float* wp = weighted ? weight->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t head = d - 2 * pairs;
  at::parallel_for(0, t * per_token, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = xp + row * d;
      float* o = op + row * d;
      float inv = 1.f;
      if (normalise) {
        float ss = 0.f;
        for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
        inv = 1.f / std::sqrt(ss / static_cast<float>(d) + e);
      }
      for (int64_t i = 0; i < d; ++i) o[i] = normalise ? (wp ? wp[i] * (xr[i] * inv) : xr[i] * inv)
                                                      : xr[i];
      const float* cr = cp + (row / per_token) * pairs;
      const float* sr = sp + (row / per_token) * pairs;
      float* tail = o + head;
      for (int64_t k = 0; k < pairs; ++k) {
        const float a = tail[2 * k], b = tail[2 * k + 1];
        tail[2 * k] = a * cr[k] - b * sr[k];
        tail[2 * k + 1] = b * cr[k] + a * sr[k];
      }
    }
  });
  return out;
}

TORCH_LIBRARY(kvserve_deepseek_v4, m) {
  m.def(
      "hc_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float eps, "
      "float norm_eps) -> (Tensor, Tensor, Tensor)");
  m.def("hc_post(Tensor out, Tensor streams, Tensor post, Tensor comb) -> Tensor");
  m.def(
      "norm_rope(Tensor x, bool normalise, Tensor? weight, float eps, Tensor cos, Tensor sin) "
      "-> Tensor");
  m.def(
      "sparse_decode(Tensor q, Tensor window, Tensor win_block, Tensor win_slot, "
      "Tensor win_visible, Tensor? entries, Tensor? ent_block, Tensor? ent_slot, "
      "Tensor? ent_visible, Tensor? index_q, Tensor? index_w, int top_k, Tensor sinks, "
      "float scale, float index_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_deepseek_v4, CPU, m) {
  m.impl("hc_pre", &hc_pre);
  m.impl("hc_post", &hc_post);
  m.impl("sparse_decode", &sparse_decode);
  m.impl("norm_rope", &norm_rope);
}
