// bfloat16 activations on the interleaved blocks with AVX512-BF16's pair dot (vdpbf16ps), included
// by gguf_q8.cpp inside its namespace, after its vector helpers. Exact like the float kernel: a
// block's codes are small integers, exact in bfloat16, the activations already are bfloat16, so
// every product is exact in float32 and the sums are float32 (up to summation order); only
// denormal activations (below 1e-38) read as zero.
//
// Why: the float kernel spends one FMA per element and row and ~3 integer ops per element to take
// the codes out of their chunk, in two dependent chains per row; at one row the chains' latency,
// not memory, bounds it, and each further row (a verify step's drafts) costs a whole FMA per
// weight. Here one vpermw turns a 16-bit lane's low 5 bits into a code's bfloat16 through a
// 32-entry table (entries i and i + 16 alike: the bit above the nibble is ignored), so a chunk's
// 8 Q4 codes per row come out of 4 table lookups and 3 shifts, and one vdpbf16ps advances all NR
// rows by 2 elements; a row's products run in 4 independent chains.
//
// A chunk's lane (bytes b0 b1 b2 b3 of one output row) as two 16-bit words, shifted by 0/4/8/12:
// the low 5 bits hold lo(b0)|lo(b2), hi(b0)|hi(b2), lo(b1)|lo(b3), hi(b1)|hi(b3). For Q4 those
// are elements (4j, 4j+2), (16+4j, 16+4j+2), (4j+1, 4j+3), (16+4j+1, 16+4j+3) of chunk j; each
// pairs with the activations of the same two elements, gathered per row and block in that order
// (`Bf16Rows`). Q8_0 codes are signed bytes c = 16 h + l (l = c & 15, h = c >> 4 signed): the
// low nibbles look up l, the high ones 16 h (exact), and both pair with codes (4j, 4j+2) or
// (4j+1, 4j+3) of chunk j.

#if defined(KVSERVE_Q8_AVX512) && defined(__AVX512BF16__)
#define KVSERVE_BF16_DOT 1

constexpr int kBf16Pairs = 16;  // activation pairs per row and block (both formats)
// a row's products in this many chains (the pair dot's latency, ~6 cycles, over 16-32 of them a
// block), combined in one order; rows per group (kMaxRows) keep rows x chains in registers
constexpr int kBf16Chains = 4;
constexpr int kBf16MaxRows = 4;

// bf16 bits of v (an integer of at most 8 significant bits: exact)
constexpr uint16_t bf16_of(int v) {
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  unsigned a = v < 0 ? -v : v;
  int e = 0;
  while ((a >> e) > 1) ++e;
  // a = 1.f x 2^e: 7 mantissa bits hold the e bits below the leading one, left-aligned
  const unsigned mant = ((a - (1u << e)) << (7 - e)) & 0x7f;
  return sign | static_cast<uint16_t>((127 + e) << 7) | mant;
}

// 32 words: entry i is the code nibble (i & 15) as bf16; `high_q8`: 16 x its signed value.
// Built at compile time: the kernel loads them once a call.
struct NibbleTable {
  alignas(64) uint16_t words[32];
};
constexpr NibbleTable nibble_table(bool high_q8) {
  NibbleTable t{};
  for (int i = 0; i < 32; ++i) {
    const int n = i & 15;
    t.words[i] = bf16_of(high_q8 ? 16 * (n < 8 ? n : n - 16) : n);
  }
  return t;
}
constexpr NibbleTable kQ4Nibbles = nibble_table(false), kQ8HighNibbles = nibble_table(true);

// The activations as the kernel reads them: per row and block, 16 int32 = bf16 pairs in the order
// above, and the block's float32 sum (Q4's minimum term).
struct Bf16Rows {
  std::vector<int32_t> pairs;
  std::vector<float> sums;
  Bf16Rows(const at::BFloat16* xp, int64_t m, int64_t k, int64_t fmt)
      : pairs(m * k / 32 * kBf16Pairs), sums(m * k / 32) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(xp);
    auto pair = [&](const uint16_t* b, int lo, int hi) {
      return static_cast<int32_t>(b[lo] | (static_cast<uint32_t>(b[hi]) << 16));
    };
    for (int64_t i = 0; i < m * k / 32; ++i) {
      const uint16_t* b = x + i * 32;
      int32_t* p = pairs.data() + i * kBf16Pairs;
      if (fmt == kQ80) {
        for (int j = 0; j < 8; ++j) {
          p[2 * j] = pair(b, 4 * j, 4 * j + 2);
          p[2 * j + 1] = pair(b, 4 * j + 1, 4 * j + 3);
        }
      } else {
        for (int j = 0; j < 4; ++j) {
          p[4 * j] = pair(b, 4 * j, 4 * j + 2);
          p[4 * j + 1] = pair(b, 16 + 4 * j, 16 + 4 * j + 2);
          p[4 * j + 2] = pair(b, 4 * j + 1, 4 * j + 3);
          p[4 * j + 3] = pair(b, 16 + 4 * j + 1, 16 + 4 * j + 3);
        }
      }
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += static_cast<float>(xp[i * 32 + j]);
      sums[i] = s;
    }
  }
};

inline __m512 pair_dot(__m512 acc, __m512i codes, int32_t xpair) {
  return _mm512_dpbf16_ps(acc, (__m512bh)codes, (__m512bh)_mm512_set1_epi32(xpair));
}

template <int FMT, int MR>
void group_kernel(const uint8_t* g, int64_t nb, const Bf16Rows& rows, int64_t a0, int64_t,
                  float* y, int64_t n_pad, int64_t col) {
  constexpr bool kQ8 = FMT == kQ80;
  constexpr int kScale = kQ8 ? 2 * NR : 4 * NR;
  constexpr int64_t kBytes = kScale + NR * (kQ8 ? 32 : 16);
  // independent chains per row, the same at every MR: a row's sums run in one order whatever
  // rows share its group, so a verify step's row equals the same token decoded alone
  constexpr int C = kBf16Chains;
  const __m512i lo_table = _mm512_load_si512(kQ4Nibbles.words);
  const __m512i hi_table = _mm512_load_si512((kQ8 ? kQ8HighNibbles : kQ4Nibbles).words);
  __m512 acc[MR];
  for (int a = 0; a < MR; ++a) acc[a] = fzero();
  for (int64_t b = 0; b < nb; ++b, g += kBytes) {
    const fvec d = halves(g);
    const uint8_t* c = g + kScale;
    const int32_t* xp[MR];
    for (int a = 0; a < MR; ++a) xp[a] = rows.pairs.data() + ((a0 + a) * nb + b) * kBf16Pairs;
    __m512 part[MR][C];
    for (int a = 0; a < MR; ++a)
      for (int ch = 0; ch < C; ++ch) part[a][ch] = fzero();
    // step t of the block's 4 per chunk goes to chain t % C (the loops unrolled: registers)
    auto step = [&](__m512i codes, int t, int pair_index) {
      for (int a = 0; a < MR; ++a) part[a][t % C] = pair_dot(part[a][t % C], codes, xp[a][pair_index]);
    };
#pragma GCC unroll 8
    for (int j = 0; j < (kQ8 ? 8 : 4); ++j) {
      const __m512i v = iload(c + j * CHUNK);
      const __m512i w0 = _mm512_permutexvar_epi16(v, lo_table);
      const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), hi_table);
      const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), lo_table);
      const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), hi_table);
      const int t = 4 * j;
      if constexpr (kQ8) {
        step(w0, t, 2 * j), step(w1, t + 1, 2 * j), step(w2, t + 2, 2 * j + 1), step(w3, t + 3, 2 * j + 1);
      } else {
        step(w0, t, 4 * j), step(w1, t + 1, 4 * j + 1), step(w2, t + 2, 4 * j + 2), step(w3, t + 3, 4 * j + 3);
      }
    }
    for (int a = 0; a < MR; ++a) {
      __m512 dot = part[a][0];
      for (int ch = 1; ch < C; ++ch) dot = fadd(dot, part[a][ch]);
      acc[a] = ffma(dot, d, acc[a]);
      if constexpr (!kQ8) acc[a] = ffma(halves(g + 2 * NR), fset1(rows.sums[(a0 + a) * nb + b]), acc[a]);
    }
  }
  for (int a = 0; a < MR; ++a) fstore(y + (a0 + a) * n_pad + col, acc[a]);
}
#endif
