// The vector primitives of gguf_q8.cpp's integer kernels, per instruction set (AVX-512 with
// VNNI: 16 rows a vector; AVX2 + FMA + F16C: 8, with VNNI's dot where AVX512-VL or AVX-VNNI has
// it, else maddubs + madd), included by gguf_q8.cpp inside its namespace. Each defines
// KVSERVE_Q8 (and KVSERVE_Q8_AVX512 / KVSERVE_Q8_VNNI where they hold); without AVX2 nothing.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
constexpr int NR = 16;
using ivec = __m512i;
using fvec = __m512;
inline ivec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline ivec nib_lo(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
inline ivec nib_hi(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
inline ivec izero() { return _mm512_setzero_si512(); }
inline fvec halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec fset1(float f) { return _mm512_set1_ps(f); }
inline fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec fadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec itof(ivec v) { return _mm512_cvtepi32_ps(v); }
inline void fstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline ivec iset1(int v) { return _mm512_set1_epi32(v); }
inline ivec isrlv(ivec v, ivec n) { return _mm512_srlv_epi32(v, n); }
inline ivec isllv(ivec v, ivec n) { return _mm512_sllv_epi32(v, n); }
inline ivec isra24(ivec v) { return _mm512_srai_epi32(v, 24); }
inline ivec iand(ivec a, ivec b) { return _mm512_and_si512(a, b); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
#define KVSERVE_Q8_VNNI 1
#define KVSERVE_Q8_AVX512 1
inline ivec dot_add(ivec acc, ivec u, ivec s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline ivec xor80(ivec v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
#define KVSERVE_Q8 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int NR = 8;
using ivec = __m256i;
using fvec = __m256;
inline ivec iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline ivec nib_lo(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline ivec nib_hi(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
inline ivec izero() { return _mm256_setzero_si256(); }
inline fvec halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec fset1(float f) { return _mm256_set1_ps(f); }
inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec fadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec itof(ivec v) { return _mm256_cvtepi32_ps(v); }
inline void fstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline ivec iset1(int v) { return _mm256_set1_epi32(v); }
inline ivec isrlv(ivec v, ivec n) { return _mm256_srlv_epi32(v, n); }
inline ivec isllv(ivec v, ivec n) { return _mm256_sllv_epi32(v, n); }
inline ivec isra24(ivec v) { return _mm256_srai_epi32(v, 24); }
inline ivec iand(ivec a, ivec b) { return _mm256_and_si256(a, b); }
inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVSERVE_Q8_VNNI 1
inline ivec dot_add(ivec acc, ivec u, ivec s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define KVSERVE_Q8_VNNI 1
inline ivec dot_add(ivec acc, ivec u, ivec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
inline ivec xor80(ivec v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
#define KVSERVE_Q8 1
#endif

#ifdef KVSERVE_Q8
#ifndef KVSERVE_Q8_VNNI
// AVX2 without VNNI: maddubs (u8 x s8 pairs summed into saturating int16), then pairs to int32
inline ivec pairs16(ivec u, ivec s) { return _mm256_maddubs_epi16(u, s); }
inline ivec to32(ivec p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }
inline ivec dot_add(ivec acc, ivec u, ivec s) { return _mm256_add_epi32(acc, to32(pairs16(u, s))); }
#endif
#endif
