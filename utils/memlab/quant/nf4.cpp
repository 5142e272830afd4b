// NF4 dequantize on the CPU (memlab.quant.blockwise.dequantize_nf4's fast path), parallel over blocks with OpenMP.
//
// Value i of n is code[q_i] * absmax[i / blocksize], one float32 multiply, then rounded once to the output
// format (float32: as is; bfloat16 and float16: round to nearest, ties to even, as torch's .to(dtype) rounds).
// q_i is a 4-bit code: element 2k in the high nibble of byte k, element 2k + 1 in its low nibble.
//
// Each block first makes its 16 possible outputs (the 16 products, rounded): an output is one of them, so a
// table lookup per element gives the same bits as the multiply per element, and a block of 64 pays 16
// multiplies. The lookups are AVX2 shuffles where the compiler targets AVX2 (the cross-lane permute for
// float32, byte shuffles of the table's low and high bytes for the 16-bit formats), plain loads elsewhere.
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum Kind : int { F32 = 0, F16 = 1, BF16 = 2 };

inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// torch's vectorised float -> bfloat16: round to nearest even on the bits; every NaN becomes 0xFFFF
inline uint16_t to_bf16(float f) {
  const uint32_t u = bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE float -> half, round to nearest even (what the F16C instruction and torch give); a NaN keeps its sign and
// its top mantissa bits, made quiet
inline uint16_t to_f16(float f) {
  const uint32_t u = bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x3FFu);
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and up (and inf) round to inf
  if (a >= 0x38800000u) {                        // a normal half: rebias the exponent, round off 13 bits
    const uint32_t m = a - 0x38000000u;
    return sign | static_cast<uint16_t>((m + 0xFFFu + ((m >> 13) & 1u)) >> 13);
  }
  // a subnormal half (or zero): adding 0.5f rounds |f| to a multiple of 2^-24 (0.5f's ulp), ties to even
  const float r = from_bits(a) + 0.5f;
  return sign | static_cast<uint16_t>(bits(r) - 0x3F000000u);
}

template <int K> struct Out;
template <> struct Out<F32> { using T = float; static T cvt(float x) { return x; } };
template <> struct Out<F16> { using T = uint16_t; static T cvt(float x) { return to_f16(x); } };
template <> struct Out<BF16> { using T = uint16_t; static T cvt(float x) { return to_bf16(x); } };

// elements [lo, hi) of one block from its 16-entry table ``t``, one element at a time where a byte is split
template <typename T>
inline void expand_scalar(const uint8_t* p, const T* t, T* out, int64_t lo, int64_t hi) {
  int64_t i = lo;
  if (i < hi && (i & 1)) { out[i] = t[p[i >> 1] & 15]; ++i; }
  for (; i + 1 < hi; i += 2) {
    const uint8_t b = p[i >> 1];
    out[i] = t[b >> 4];
    out[i + 1] = t[b & 15];
  }
  if (i < hi) out[i] = t[p[i >> 1] >> 4];
}

template <int K>
void block_scalar(const uint8_t* p, float am, const float* code, typename Out<K>::T* out, int64_t lo, int64_t hi) {
  typename Out<K>::T t[16];
  for (int j = 0; j < 16; ++j) t[j] = Out<K>::cvt(code[j] * am);
  expand_scalar(p, t, out, lo, hi);
}

#if defined(__AVX2__)
// 16 nibble indices of 8 bytes in output order (high nibble first) as two vectors of 8 int32
inline void nibbles8(const uint8_t* p, __m256i& i0, __m256i& i1) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
  i0 = _mm256_cvtepu8_epi32(nib);
  i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8));
}

inline __m256 lookup16(__m256 s0, __m256 s1, __m256i i) {
  // entries 0-7 from s0, 8-15 from s1: bit 3 of the index, moved to the sign bit, picks
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(s0, i), _mm256_permutevar8x32_ps(s1, i),
                          _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}

// a block of elements [lo, hi), lo even, float32 out
void block_f32(const uint8_t* p, float am, const float* code, float* out, int64_t lo, int64_t hi) {
  const __m256 a = _mm256_set1_ps(am);
  const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(code), a), s1 = _mm256_mul_ps(_mm256_loadu_ps(code + 8), a);
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m256i i0, i1;
    nibbles8(p + (i >> 1), i0, i1);
    _mm256_storeu_ps(out + i, lookup16(s0, s1, i0));
    _mm256_storeu_ps(out + i + 8, lookup16(s0, s1, i1));
  }
  if (i < hi) {
    alignas(32) float t[16];
    _mm256_store_ps(t, s0);
    _mm256_store_ps(t + 8, s1);
    expand_scalar(p, t, out, i, hi);
  }
}

// the block's 16 outputs as 16-bit words -> its low bytes and its high bytes, each a 16-byte table in both lanes
inline void byte_planes(__m256i t16, __m256i& lo_plane, __m256i& hi_plane) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i s = _mm256_shuffle_epi8(t16, split);  // per lane: 8 low bytes, then 8 high bytes
  const __m128i l0 = _mm256_castsi256_si128(s), l1 = _mm256_extracti128_si256(s, 1);
  lo_plane = _mm256_broadcastsi128_si256(_mm_unpacklo_epi64(l0, l1));
  hi_plane = _mm256_broadcastsi128_si256(_mm_unpackhi_epi64(l0, l1));
}

template <int K>
inline __m256i table16(__m256 s0, __m256 s1) {
  if constexpr (K == BF16) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), ffff = _mm256_set1_epi32(0xFFFF);
    auto round = [&](__m256 s) {
      const __m256i u = _mm256_castps_si256(s);
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q));
      return _mm256_blendv_epi8(r, ffff, nan);
    };
    // packus works per lane: [s0 0-3, s1 0-3, s0 4-7, s1 4-7] -> reorder the 64-bit quarters
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(round(s0), round(s1)), 0xD8);
  } else {
#if defined(__F16C__)
    return _mm256_set_m128i(_mm256_cvtps_ph(s1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                            _mm256_cvtps_ph(s0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    alignas(32) float f[16];
    alignas(32) uint16_t h[16];
    _mm256_store_ps(f, s0);
    _mm256_store_ps(f + 8, s1);
    for (int j = 0; j < 16; ++j) h[j] = to_f16(f[j]);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
#endif
  }
}

// a block of elements [lo, hi), lo even, 16-bit out (float16 or bfloat16)
template <int K>
void block_16(const uint8_t* p, float am, const float* code, uint16_t* out, int64_t lo, int64_t hi) {
  const __m256 a = _mm256_set1_ps(am);
  const __m256i t16 = table16<K>(_mm256_mul_ps(_mm256_loadu_ps(code), a), _mm256_mul_ps(_mm256_loadu_ps(code + 8), a));
  __m256i lp, hp;
  byte_planes(t16, lp, hp);
  const __m128i m = _mm_set1_epi8(0x0F);
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (i >> 1)));
    const __m128i h = _mm_and_si128(_mm_srli_epi16(b, 4), m), l = _mm_and_si128(b, m);
    // outputs 0-15 in the low lane, 16-31 in the high lane
    const __m256i n = _mm256_set_m128i(_mm_unpackhi_epi8(h, l), _mm_unpacklo_epi8(h, l));
    const __m256i lb = _mm256_shuffle_epi8(lp, n), hb = _mm256_shuffle_epi8(hp, n);
    const __m256i w0 = _mm256_unpacklo_epi8(lb, hb), w1 = _mm256_unpackhi_epi8(lb, hb);  // 0-7|16-23, 8-15|24-31
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
  }
  if (i < hi) {
    alignas(32) uint16_t t[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), t16);
    expand_scalar(p, t, out, i, hi);
  }
}
#endif

template <int K>
void run(const uint8_t* p, const float* absmax, const float* code, void* out_, int64_t n, int64_t bs, int threads) {
  using T = typename Out<K>::T;
  T* out = static_cast<T*>(out_);
  const int64_t nblocks = (n + bs - 1) / bs;
  // below ~64K values a block each thread takes costs more than it saves
  const bool parallel = threads > 1 && n >= (int64_t{1} << 16);
#ifdef _OPENMP
  #pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
#endif
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * bs, hi = (lo + bs < n) ? lo + bs : n;
#if defined(__AVX2__)
    if (bs % 2 == 0) {  // every block starts on a whole byte
      if constexpr (K == F32) block_f32(p, absmax[b], code, out, lo, hi);
      else block_16<K>(p, absmax[b], code, out, lo, hi);
      continue;
    }
#endif
    block_scalar<K>(p, absmax[b], code, out, lo, hi);
  }
  (void)parallel;
}

}  // namespace

// out: n values of ``kind`` (0 float32, 1 float16, 2 bfloat16); packed: ceil(n / 2) bytes; absmax: ceil(n /
// blocksize) float32; code: the 16 float32 NF4 levels. Returns 0, or -1 for an unknown kind or a size below 1.
extern "C" int memlab_nf4_dequantize(const uint8_t* packed, const float* absmax, const float* code, void* out,
                                     int64_t n, int64_t blocksize, int kind, int threads) {
  if (n < 0 || blocksize < 1) return -1;
  switch (kind) {
    case F32: run<F32>(packed, absmax, code, out, n, blocksize, threads); return 0;
    case F16: run<F16>(packed, absmax, code, out, n, blocksize, threads); return 0;
    case BF16: run<BF16>(packed, absmax, code, out, n, blocksize, threads); return 0;
    default: return -1;
  }
}
