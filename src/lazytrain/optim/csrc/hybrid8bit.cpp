// Fused AdamW step with blockwise 8-bit states, for lazytrain/optim/hybrid8bit.py.
//
// One pass over memory per 128-element block: read the gradient (bf16 or fp32) and scale it
// by the clip coefficient, dequantize m and sqrt(v) (the second moment is stored as its square
// root, see hybrid8bit.py), update them and the fp32 master, write the new weight, keep the new
// m and sqrt(v) in a stack buffer while tracking their absmax, then requantize from that
// buffer. Blocks are independent, so they are spread over torch's intra-op threads.
//
// Nearest codes are found as quant.py describes: with AVX-512 VBMI by the "pieces" method,
// whose table look-ups are register byte shuffles (no gathers, which are slow on AMD Zen 4 and
// on Intel CPUs with the gather-data-sampling fix); elsewhere by the bucket table, one gather
// (AVX2, AVX-512) or one load (scalar) per element. Dequantization is the same split: byte
// shuffles with VBMI, gathers otherwise.
//
// With stochastic rounding (hybrid8bit.py) the sqrt(v) codes found nearest are then moved to
// the code below or above the value by a uniform number hashed from the element's index
// (Scalar::stochastic): byte shuffles give the two code values with VBMI, gathers otherwise.
//
// The master is fp32, split (the streamed bf16 weight + an int16 remainder, exact) or bf16 (the
// streamed weight alone, written with stochastic rounding): MasterRef, load_master and
// store_master (master.h, shared with the 4-bit kernel) are all that differs (optim/master.py).
//
// Built at first use with -march=native on the machine that runs it, so the SIMD path is
// chosen at compile time from what that machine has; kernel.py's VARIANTS build the other
// paths (later instruction sets switched off) to test them on one machine.

// pybind11 with torch's tensor casters: a third of torch/extension.h's compile time (which
// brings the whole C++ frontend, 60% of a build), and each build counts (kernel.VARIANTS)
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define LAZYTRAIN_VBMI 1
#endif

#include "master.h"

namespace {

constexpr int64_t kBlock = 128;  // quant.BLOCK
// Bucket tables (quant.py): bucket = clamp(|bits| >> shift - (kLutExpMin << (23 - shift)),
// 0, buckets - 1), plus `buckets` for negative numbers. 6 mantissa bits for the signed map,
// 7 for the unsigned one.
constexpr int32_t kLutExpMin = 103;
constexpr int32_t kLutBinades = 128 - kLutExpMin;
constexpr int32_t lut_shift(bool is_signed) { return is_signed ? 17 : 16; }
constexpr int32_t lut_buckets(bool is_signed) { return kLutBinades << (23 - lut_shift(is_signed)); }
// Piece tables (quant.py): binade index = clamp(biased exponent - kPieceExpMin, 0, 31).
constexpr int32_t kPieceExpMin = 104;
constexpr int64_t kPieceTableSize = 128;
// Smallest normal float: blocks with a smaller absmax are stored as zeros.
constexpr float kTiny = 1.17549435e-38f;

struct MapTables {
  const float* qmap;       // [256] sorted code values
  const float* midpoints;  // [256] halfway between code k and k+1; [255] = inf
  const int32_t* lut;      // bucket table
  // piece tables
  float first[16], inv_spacing[16];
  int32_t base[16], span[16], binade_piece[32];
  float binade_next[32];
  // byte q of qmap[c] / midpoints[c] at [q][c]: tables for byte shuffles
  alignas(64) uint8_t value_planes[4][256];
  alignas(64) uint8_t midpoint_planes[4][256];
};

// Stochastic rounding of sqrt(v) (quant.stochastic_codes), from the nearest code: the code
// below or above x, the upper one with probability (x - below) / (above - below) against a
// uniform in [0, 1) from the hash of the element's index (quant.rounding_uniforms); a
// positive x never takes code 0. The division is IEEE's, as torch's, so both paths draw
// the same codes for the same x.
struct Scalar : MasterScalar {
  static constexpr int W = 1;
  static constexpr int kRoundChunk = 1;  // elements rounded stochastically at once
  static constexpr int kChunk = 1;       // elements dequantized at once
  static constexpr int kQuantChunk = 1;  // elements quantized at once
  using F = float;
  static void dequantize(const uint8_t* codes, const MapTables& t, F* out) { *out = t.qmap[*codes]; }

  static void stochastic(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t,
                         uint32_t key, uint32_t index) {
    const float x = *values * inv_absmax;
    const int32_t c = *codes;
    const float qc = t.qmap[c];
    const int32_t n = x >= qc ? std::min(c + 1, 255) : std::max(c - 1, 0);
    const float qn = t.qmap[n];
    const float a = std::min(qc, qn), b = std::max(qc, qn);
    const float u = static_cast<float>(fmix32(index ^ key) >> 8) * 0x1p-24f;
    int32_t code = std::min(c, n) + ((b > a && u < (x - a) / (b - a)) ? 1 : 0);
    if (x > 0.0f && code == 0) code = 1;
    *codes = static_cast<uint8_t>(code);
  }

  template <bool kSigned>
  static void quantize(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t) {
    constexpr int32_t shift = lut_shift(kSigned), buckets = lut_buckets(kSigned);
    constexpr int32_t low_mask = (1 << shift) - 1;
    const uint32_t bits = float_to_bits(*values * inv_absmax);
    const int32_t negative = static_cast<int32_t>(bits >> 31);
    int32_t bucket = static_cast<int32_t>((bits & 0x7fffffffu) >> shift) - (kLutExpMin << (23 - shift));
    bucket = std::min(std::max(bucket, 0), buckets - 1) + negative * buckets;
    const int32_t entry = t.lut[bucket];
    const int32_t key = static_cast<int32_t>(bits & low_mask) ^ (negative ? low_mask : 0);
    *codes = static_cast<uint8_t>((entry & 0xff) + (key > (entry >> 8) ? 1 : 0));
  }
};

#if defined(__AVX512F__)
struct Simd : MasterSimd {
  static constexpr int W = 16;
  using F = __m512;

  // uniforms in [0, 1) of the 16 elements from hash input `index` on (quant.rounding_uniforms)
  static __m512 uniforms(uint32_t key, uint32_t index) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(hashes(key, index), 8)), _mm512_set1_ps(0x1p-24f));
  }
  // per lane: rounds up (u < (x - a) / (b - a), b > a) and x > 0
  static __mmask16 rounds_up(__m512 x, __m512 qc, __m512 qn, __m512 u) {
    const __m512 a = _mm512_min_ps(qc, qn), b = _mm512_max_ps(qc, qn);
    const __m512 ratio = _mm512_div_ps(_mm512_sub_ps(x, a), _mm512_sub_ps(b, a));
    return _mm512_cmp_ps_mask(u, ratio, _CMP_LT_OQ) & _mm512_cmp_ps_mask(b, a, _CMP_GT_OQ);
  }

#if defined(LAZYTRAIN_VBMI)
  static constexpr int kChunk = 64;
  static constexpr int kRoundChunk = 64;
  static constexpr int kQuantChunk = 64;

  // table[codes[i]] for 64 codes: each byte of the 32-bit entries is a 256-entry byte table,
  // looked up with two 128-entry shuffles; unpacking the four byte planes gives the entries.
  // The codes are first put in the order that makes the unpacks come out in element order.
  static void lookup64(__m512i codes, const uint8_t (*planes)[256], __m512* out) {
    alignas(64) static constexpr uint8_t kOrder[64] = {
        0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
        4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
        8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    const __m512i c = _mm512_permutexvar_epi8(_mm512_load_si512(kOrder), codes);
    const __mmask64 upper = _mm512_movepi8_mask(c);  // code >= 128
    __m512i plane[4];
    for (int q = 0; q < 4; ++q) {
      const uint8_t* p = planes[q];
      const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(p), c, _mm512_load_si512(p + 64));
      const __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(p + 128), c, _mm512_load_si512(p + 192));
      plane[q] = _mm512_mask_blend_epi8(upper, low, high);
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(plane[0], plane[1]);
    const __m512i hi01 = _mm512_unpackhi_epi8(plane[0], plane[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(plane[2], plane[3]);
    const __m512i hi23 = _mm512_unpackhi_epi8(plane[2], plane[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
  }

  static void dequantize(const uint8_t* codes, const MapTables& t, F* out) {
    lookup64(_mm512_loadu_si512(codes), t.value_planes, out);
  }

  // 64 codes by the pieces method (quant.py): the binade and one compare pick the piece, the
  // piece's arithmetic run gives e with the code in {e, e + 1}, one compare with midpoints[e]
  // decides. Works on |x|; negative x of the signed map take the mirrored code.
  template <bool kSigned>
  static void quantize(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t) {
    const __m512 first = _mm512_loadu_ps(t.first), inv_spacing = _mm512_loadu_ps(t.inv_spacing);
    const __m512i base = _mm512_loadu_si512(t.base), span = _mm512_loadu_si512(t.span);
    const __m512i piece_a = _mm512_loadu_si512(t.binade_piece);
    const __m512i piece_b = _mm512_loadu_si512(t.binade_piece + 16);
    const __m512 next_a = _mm512_loadu_ps(t.binade_next), next_b = _mm512_loadu_ps(t.binade_next + 16);
    const __m512 inv = _mm512_set1_ps(inv_absmax);
    __m512 mag[4];
    __m512i estimate[4];
    __mmask16 negative[4];
    for (int r = 0; r < 4; ++r) {
      __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(values + 16 * r), inv));
      negative[r] = _mm512_movepi32_mask(bits);
      bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
      mag[r] = _mm512_castsi512_ps(bits);
      // max(exponent - kPieceExpMin, 0) by a saturating subtract; |x| <= 1 + rounding keeps it
      // below 32 (NaN wraps around, to a garbage code for a garbage value)
      const __m512i binade = _mm512_subs_epu16(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(kPieceExpMin));
      __m512i piece = _mm512_permutex2var_epi32(piece_a, binade, piece_b);
      const __mmask16 next = _mm512_cmp_ps_mask(mag[r], _mm512_permutex2var_ps(next_a, binade, next_b), _CMP_GE_OQ);
      piece = _mm512_mask_add_epi32(piece, next, piece, _mm512_set1_epi32(1));
      const __m512 run = _mm512_mul_ps(_mm512_sub_ps(mag[r], _mm512_permutexvar_ps(piece, first)),
                                       _mm512_permutexvar_ps(piece, inv_spacing));
      __m512i e = _mm512_cvt_roundps_epi32(run, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      // |x| >= first, so e >= 0
      e = _mm512_min_epi32(e, _mm512_permutexvar_epi32(piece, span));
      estimate[r] = _mm512_add_epi32(e, _mm512_permutexvar_epi32(piece, base));
    }
    const __m256i e01 = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm512_cvtepi32_epi8(estimate[0])), _mm512_cvtepi32_epi8(estimate[1]), 1);
    const __m256i e23 = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm512_cvtepi32_epi8(estimate[2])), _mm512_cvtepi32_epi8(estimate[3]), 1);
    const __m512i packed = _mm512_inserti64x4(_mm512_castsi256_si512(e01), e23, 1);
    __m512 mid[4];
    lookup64(packed, t.midpoint_planes, mid);
    __mmask16 above[4];
    for (int r = 0; r < 4; ++r) {
      // |x| above the midpoint, or on it for negative x: a tie goes to the lower code, as
      // counting the midpoints below x does. Positive floats compare as integers.
      const __m512i key = _mm512_add_epi32(_mm512_castps_si512(mag[r]),
                                           _mm512_maskz_set1_epi32(negative[r], 1));
      above[r] = _mm512_cmpgt_epi32_mask(key, _mm512_castps_si512(mid[r]));
    }
    // the last steps on all 64 codes as bytes
    const __mmask64 up = _mm512_kunpackd(_mm512_kunpackw(above[3], above[2]),
                                         _mm512_kunpackw(above[1], above[0]));
    __m512i c = _mm512_mask_add_epi8(packed, up, packed, _mm512_set1_epi8(1));
    if constexpr (kSigned) {
      // negative codes mirror the positive ones around 127; -1.0 does not exist
      const __mmask64 minus = _mm512_kunpackd(_mm512_kunpackw(negative[3], negative[2]),
                                              _mm512_kunpackw(negative[1], negative[0]));
      const __m512i top = _mm512_set1_epi8(static_cast<char>(254));
      c = _mm512_mask_sub_epi8(c, minus, top, _mm512_min_epu8(c, top));
    }
    _mm512_storeu_si512(codes, c);
  }

  // 64 elements (Scalar::stochastic): the code values by byte shuffles, as in dequantize
  static void stochastic(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t,
                         uint32_t key, uint32_t index) {
    const __m512 inv = _mm512_set1_ps(inv_absmax);
    const __m512i c = _mm512_loadu_si512(codes);
    __m512 x[4], qc[4], qn[4];
    lookup64(c, t.value_planes, qc);
    __mmask16 ge[4], up[4], positive[4];
    for (int r = 0; r < 4; ++r) {
      x[r] = _mm512_mul_ps(_mm512_loadu_ps(values + 16 * r), inv);
      ge[r] = _mm512_cmp_ps_mask(x[r], qc[r], _CMP_GE_OQ);
      positive[r] = _mm512_cmp_ps_mask(x[r], _mm512_setzero_ps(), _CMP_GT_OQ);
    }
    const __m512i one = _mm512_set1_epi8(1);
    // ge ? c + 1 : c - 1, saturated to [0, 255]
    const __m512i n = _mm512_mask_blend_epi8(join(ge), _mm512_subs_epu8(c, one), _mm512_adds_epu8(c, one));
    lookup64(n, t.value_planes, qn);
    for (int r = 0; r < 4; ++r) {
      up[r] = rounds_up(x[r], qc[r], qn[r], uniforms(key, index + 16 * r));
    }
    const __m512i lo = _mm512_min_epu8(c, n);
    __m512i code = _mm512_mask_add_epi8(lo, join(up), lo, one);
    code = _mm512_mask_max_epu8(code, join(positive), code, one);
    _mm512_storeu_si512(codes, code);
  }
  using MasterSimd::join;  // the split master's, beside this one of masks
  static __mmask64 join(const __mmask16* m) {
    return _mm512_kunpackd(_mm512_kunpackw(m[3], m[2]), _mm512_kunpackw(m[1], m[0]));
  }
#else
  static constexpr int kChunk = 16;
  static constexpr int kQuantChunk = 16;
  static __m512i load_codes(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static constexpr int kRoundChunk = 16;
  // 16 elements (Scalar::stochastic), the code values by gathers from the 1 KB map
  static void stochastic(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t,
                         uint32_t key, uint32_t index) {
    const __m512i one = _mm512_set1_epi32(1);
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values), _mm512_set1_ps(inv_absmax));
    const __m512i c = load_codes(codes);
    const __m512 qc = _mm512_i32gather_ps(c, t.qmap, 4);
    __m512i n = _mm512_mask_add_epi32(_mm512_sub_epi32(c, one), _mm512_cmp_ps_mask(x, qc, _CMP_GE_OQ), c, one);
    n = _mm512_min_epi32(_mm512_max_epi32(n, _mm512_setzero_si512()), _mm512_set1_epi32(255));
    const __m512 qn = _mm512_i32gather_ps(n, t.qmap, 4);
    const __m512i lo = _mm512_min_epi32(c, n);
    __m512i code = _mm512_mask_add_epi32(lo, rounds_up(x, qc, qn, uniforms(key, index)), lo, one);
    code = _mm512_mask_max_epi32(code, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), code, one);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(code));
  }
  static void dequantize(const uint8_t* codes, const MapTables& t, F* out) {
    *out = _mm512_i32gather_ps(load_codes(codes), t.qmap, 4);
  }
  template <bool kSigned>
  static void quantize(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t) {
    constexpr int32_t shift = lut_shift(kSigned), buckets = lut_buckets(kSigned);
    const __m512i low_mask = _mm512_set1_epi32((1 << shift) - 1);
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(values), _mm512_set1_ps(inv_absmax)));
    const __m512i negative = _mm512_srai_epi32(bits, 31);  // all ones for negative x
    __m512i bucket = _mm512_srli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), shift);
    bucket = _mm512_sub_epi32(bucket, _mm512_set1_epi32(kLutExpMin << (23 - shift)));
    bucket = _mm512_min_epi32(_mm512_max_epi32(bucket, _mm512_setzero_si512()), _mm512_set1_epi32(buckets - 1));
    bucket = _mm512_add_epi32(bucket, _mm512_and_si512(negative, _mm512_set1_epi32(buckets)));
    const __m512i entry = _mm512_i32gather_epi32(bucket, t.lut, 4);
    const __m512i key = _mm512_xor_si512(_mm512_and_si512(bits, low_mask), _mm512_and_si512(negative, low_mask));
    const __m512i code = _mm512_and_si512(entry, _mm512_set1_epi32(0xff));
    const __mmask16 above = _mm512_cmpgt_epi32_mask(key, _mm512_srli_epi32(entry, 8));
    const __m512i result = _mm512_mask_add_epi32(code, above, code, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(result));
  }
#endif
};
#elif defined(__AVX2__)
struct Simd : MasterSimd {
  static constexpr int W = 8;
  static constexpr int kChunk = 8;
  static constexpr int kQuantChunk = 8;
  using F = __m256;
  static constexpr int kRoundChunk = 8;
  // 8 elements (Scalar::stochastic); compares give all-ones lanes, so "+ 1 where" is "- mask"
  static void stochastic(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t,
                         uint32_t key, uint32_t index) {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(values), _mm256_set1_ps(inv_absmax));
    const __m256i c = load_codes(codes);
    const __m256 qc = _mm256_i32gather_ps(t.qmap, c, 4);
    const __m256i ge = _mm256_castps_si256(_mm256_cmp_ps(x, qc, _CMP_GE_OQ));
    // ge ? c + 1 : c - 1
    __m256i n = _mm256_add_epi32(_mm256_sub_epi32(c, one), _mm256_and_si256(ge, _mm256_set1_epi32(2)));
    n = _mm256_min_epi32(_mm256_max_epi32(n, _mm256_setzero_si256()), _mm256_set1_epi32(255));
    const __m256 qn = _mm256_i32gather_ps(t.qmap, n, 4);
    const __m256 a = _mm256_min_ps(qc, qn), b = _mm256_max_ps(qc, qn);
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hashes(key, index), 8)),
                                   _mm256_set1_ps(0x1p-24f));
    const __m256 ratio = _mm256_div_ps(_mm256_sub_ps(x, a), _mm256_sub_ps(b, a));
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(u, ratio, _CMP_LT_OQ), _mm256_cmp_ps(b, a, _CMP_GT_OQ));
    __m256i code = _mm256_sub_epi32(_mm256_min_epi32(c, n), _mm256_castps_si256(up));
    const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
    code = _mm256_max_epi32(code, _mm256_and_si256(positive, one));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(words, words));
  }
  static __m256i load_codes(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void dequantize(const uint8_t* codes, const MapTables& t, F* out) {
    *out = _mm256_i32gather_ps(t.qmap, load_codes(codes), 4);
  }
  template <bool kSigned>
  static void quantize(const float* values, float inv_absmax, uint8_t* codes, const MapTables& t) {
    constexpr int32_t shift = lut_shift(kSigned), buckets = lut_buckets(kSigned);
    const __m256i low_mask = _mm256_set1_epi32((1 << shift) - 1);
    const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(values), _mm256_set1_ps(inv_absmax)));
    const __m256i negative = _mm256_srai_epi32(bits, 31);
    __m256i bucket = _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), shift);
    bucket = _mm256_sub_epi32(bucket, _mm256_set1_epi32(kLutExpMin << (23 - shift)));
    bucket = _mm256_min_epi32(_mm256_max_epi32(bucket, _mm256_setzero_si256()), _mm256_set1_epi32(buckets - 1));
    bucket = _mm256_add_epi32(bucket, _mm256_and_si256(negative, _mm256_set1_epi32(buckets)));
    const __m256i entry = _mm256_i32gather_epi32(t.lut, bucket, 4);
    const __m256i key = _mm256_xor_si256(_mm256_and_si256(bits, low_mask), _mm256_and_si256(negative, low_mask));
    const __m256i code = _mm256_and_si256(entry, _mm256_set1_epi32(0xff));
    // the compare is -1 where x lies above the bucket's midpoint
    const __m256i result = _mm256_sub_epi32(code, _mm256_cmpgt_epi32(key, _mm256_srli_epi32(entry, 8)));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(result), _mm256_extracti128_si256(result, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(words, words));
  }
};
#else
using Simd = Scalar;
#endif

struct Group8bit {
  int64_t numel;
  int64_t decay_numel;
  float decay;  // 1 - lr * weight_decay
  MasterRef master;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* v_codes;
  float* v_absmax;
  bool stochastic;  // sqrt(v) rounded stochastically (Scalar::stochastic)
  uint32_t key;     // quant.rounding_key of this group's step (master.offset: where the group starts)
};

struct BlockScratch {
  alignas(64) float m[kBlock];
  alignas(64) float root[kBlock];  // sqrt(v): what the second-moment codes hold
  float m_max = 0.0f, root_max = 0.0f;
};

// Adam update of elements [lo, hi) of the block starting at `start`: master and weight_out
// written, the new m and sqrt(v) left in the scratch buffers with their running maxima.
template <class S, bool kStream, class G, class O>
inline void update_range(const Group8bit& g, const G* grad, O* out, const Hyper& h,
                         const MapTables& tm, const MapTables& tv, int64_t start, int64_t lo,
                         int64_t hi, float decay, float m_scale, float v_scale, BlockScratch& s) {
  const uint32_t master_key = high_key(g.master.key, g.master.offset + start);
  using F = typename S::F;
  const F clip = S::set(h.clip), b1 = S::set(h.beta1), omb1 = S::set(h.one_minus_beta1);
  const F b2 = S::set(h.beta2), omb2 = S::set(h.one_minus_beta2), eps = S::set(h.eps);
  const F step_size = S::set(h.step_size), inv_bc2 = S::set(h.inv_bc2_sqrt);
  const F dec = S::set(decay), ms = S::set(m_scale), vs = S::set(v_scale);
  F m_max = S::set(0.0f), root_max = S::set(0.0f);
  constexpr int kVectors = S::kChunk / S::W;
  int64_t i = lo;
  for (; i + S::kChunk <= hi; i += S::kChunk) {
    F m_old[kVectors], root_old[kVectors];
    S::dequantize(g.m_codes + start + i, tm, m_old);
    S::dequantize(g.v_codes + start + i, tv, root_old);
    for (int r = 0; r < kVectors; ++r) {
      const int64_t j = i + r * S::W;
      const int64_t k = start + j;
      const F gr = S::load(grad + k) * clip;
      const F m = b1 * (m_old[r] * ms) + omb1 * gr;
      const F old = root_old[r] * vs;
      const F root = S::sqrt(b2 * (old * old) + omb2 * (gr * gr));
      const F w = load_master<S>(g.master, k) * dec - step_size * (m * S::reciprocal(root * inv_bc2 + eps));
      store_master<S>(g.master, k, w, master_key);
      if constexpr (std::is_same_v<O, void>) {
      } else if constexpr (kStream) {
        S::stream(out + k, w);
      } else {
        S::store(out + k, w);
      }
      S::store(s.m + j, m);
      S::store(s.root + j, root);
      m_max = S::max(m_max, S::abs(m));
      root_max = S::max(root_max, root);
    }
  }
  s.m_max = std::max(s.m_max, S::reduce_max(m_max));
  s.root_max = std::max(s.root_max, S::reduce_max(root_max));
  if constexpr (S::kChunk > 1) {
    update_range<Scalar, false>(g, grad, out, h, tm, tv, start, i, hi, decay, m_scale, v_scale, s);
  }
}

template <class S, bool kSigned>
inline void quantize_range(const float* values, int64_t lo, int64_t hi, float inv_absmax,
                           uint8_t* codes, const MapTables& t) {
  int64_t i = lo;
  for (; i + S::kQuantChunk <= hi; i += S::kQuantChunk) {
    S::template quantize<kSigned>(values + i, inv_absmax, codes + i, t);
  }
  if constexpr (S::kQuantChunk > 1) quantize_range<Scalar, kSigned>(values, i, hi, inv_absmax, codes, t);
}

// Stochastic rounding (Scalar::stochastic) of the nearest codes of values [lo, hi) of a block
// whose element 0 has the hash input `index` under `key`.
template <class S>
inline void stochastic_range(const float* values, int64_t lo, int64_t hi, float inv_absmax,
                             uint8_t* codes, const MapTables& t, uint32_t key, uint32_t index) {
  int64_t i = lo;
  for (; i + S::kRoundChunk <= hi; i += S::kRoundChunk) {
    S::stochastic(values + i, inv_absmax, codes + i, t, key, index + static_cast<uint32_t>(i));
  }
  if constexpr (S::kRoundChunk > 1) stochastic_range<Scalar>(values, i, hi, inv_absmax, codes, t, key, index);
}

// bitsandbytes divides by the new absmax; one reciprocal per block moves x by at most an ulp,
// which matters only for values on a code boundary. Denormal blocks become zeros, so the
// reciprocal stays finite.
inline float store_absmax(float& slot, float absmax) {
  if (!(absmax >= kTiny)) absmax = 0.0f;
  slot = absmax;
  return absmax > 0.0f ? 1.0f / absmax : 0.0f;
}

template <bool kStream, class G, class O>
void step_block(const Group8bit& g, const G* grad, O* out, const Hyper& h, const MapTables& tm,
                const MapTables& tv, int64_t block) {
  BlockScratch s;
  const int64_t start = block * kBlock;
  const int64_t len = std::min(kBlock, g.numel - start);
  const int64_t decay_end = std::clamp<int64_t>(g.decay_numel - start, 0, len);
  const float m_scale = g.m_absmax[block], v_scale = g.v_absmax[block];
  update_range<Simd, kStream>(g, grad, out, h, tm, tv, start, 0, decay_end, g.decay, m_scale, v_scale, s);
  if (decay_end % Simd::kChunk == 0) {
    update_range<Simd, kStream>(g, grad, out, h, tm, tv, start, decay_end, len, 1.0f, m_scale, v_scale, s);
  } else {  // the block where decay stops: its second part starts off the stores' alignment
    update_range<Simd, false>(g, grad, out, h, tm, tv, start, decay_end, len, 1.0f, m_scale, v_scale, s);
  }
  const float m_inv = store_absmax(g.m_absmax[block], s.m_max);
  const float root_inv = store_absmax(g.v_absmax[block], s.root_max);
  quantize_range<Simd, true>(s.m, 0, len, m_inv, g.m_codes + start, tm);
  quantize_range<Simd, false>(s.root, 0, len, root_inv, g.v_codes + start, tv);
  if (g.stochastic) {
    // a block never straddles a multiple of 2**32 elements: its high half keys the block
    const int64_t first = g.master.offset + start;
    const uint32_t key = high_key(g.key, first);
    stochastic_range<Simd>(s.root, 0, len, root_inv, g.v_codes + start, tv, key, static_cast<uint32_t>(first));
  }
}

template <class G, class O>
void step_8bit_typed(const Group8bit& g, const G* grad, O* out, const Hyper& h,
                     const MapTables& tm, const MapTables& tv) {
  const int64_t blocks = (g.numel + kBlock - 1) / kBlock;
  // at least 64 blocks (8192 elements, a few microseconds) per task
  // Streaming stores need the weights aligned (every block then starts on a cache line).
  bool stream = false;
  if constexpr (!std::is_same_v<O, void> && Simd::W > 1) {
    stream = reinterpret_cast<uintptr_t>(out) % 64 == 0;
  }
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    if (stream) {
      for (int64_t b = b0; b < b1; ++b) step_block<true>(g, grad, out, h, tm, tv, b);
#if defined(__AVX2__) || defined(__AVX512F__)
      _mm_sfence();  // streamed weights visible before this task counts as done
#endif
    } else {
      for (int64_t b = b0; b < b1; ++b) step_block<false>(g, grad, out, h, tm, tv, b);
    }
  });
}

// fp32 states, for groups too small to quantize (or kept fp32: fp32_groups).
template <class G, class O>
void step_fp32_typed(int64_t numel, int64_t decay_numel, float decay, const MasterRef& master,
                     float* exp_avg, float* exp_avg_sq, const G* grad, O* out, const Hyper& h) {
  for (int64_t k = 0; k < numel; ++k) {
    const float gr = Scalar::load(grad + k) * h.clip;
    const float m = h.beta1 * exp_avg[k] + h.one_minus_beta1 * gr;
    const float v = h.beta2 * exp_avg_sq[k] + h.one_minus_beta2 * (gr * gr);
    const float denom = std::sqrt(v) * h.inv_bc2_sqrt + h.eps;
    const float w = load_master<Scalar>(master, k) * (k < decay_numel ? decay : 1.0f) - h.step_size * (m / denom);
    exp_avg[k] = m;
    exp_avg_sq[k] = v;
    store_master<Scalar>(master, k, w, high_key(master.key, master.offset + k));
    if constexpr (!std::is_same_v<O, void>) Scalar::store(out + k, w);
  }
}

// One map's tables from quant.QuantTables: qmap, midpoints, bucket table, piece tables.
void fill_tables(MapTables& t, const at::Tensor* tensors, bool is_signed) {
  check_flat(tensors[0], at::kFloat, 256, "qmap");
  check_flat(tensors[1], at::kFloat, 256, "midpoints");
  check_flat(tensors[2], at::kInt, 2 * lut_buckets(is_signed),
             "bucket table (quant.py and the kernel disagree: rebuild the kernel)");
  check_flat(tensors[3], at::kInt, kPieceTableSize,
             "piece table (quant.py and the kernel disagree: rebuild the kernel)");
  t.qmap = tensors[0].data_ptr<float>();
  t.midpoints = tensors[1].data_ptr<float>();
  t.lut = tensors[2].data_ptr<int32_t>();
  const int32_t* p = tensors[3].data_ptr<int32_t>();
  std::memcpy(t.first, p, 16 * 4);
  std::memcpy(t.inv_spacing, p + 16, 16 * 4);
  std::memcpy(t.base, p + 32, 16 * 4);
  std::memcpy(t.span, p + 48, 16 * 4);
  std::memcpy(t.binade_piece, p + 64, 32 * 4);
  std::memcpy(t.binade_next, p + 96, 32 * 4);
  for (int c = 0; c < 256; ++c) {
    const uint32_t value = float_to_bits(t.qmap[c]), mid = float_to_bits(t.midpoints[c]);
    for (int q = 0; q < 4; ++q) {
      t.value_planes[q][c] = static_cast<uint8_t>(value >> (8 * q));
      t.midpoint_planes[q][c] = static_cast<uint8_t>(mid >> (8 * q));
    }
  }
}

// Calls fn(grad_ptr, out_ptr) with pointers typed by the gradient's and weight_out's dtypes
// (bf16 as uint16_t; no weight_out as void*).
template <class Fn>
void dispatch_types(const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, Fn&& fn) {
  auto with_out = [&](auto* grad_ptr) {
    if (!weight_out.has_value()) {
      fn(grad_ptr, static_cast<void*>(nullptr));
    } else if (weight_out->scalar_type() == at::kBFloat16) {
      fn(grad_ptr, reinterpret_cast<uint16_t*>(weight_out->data_ptr()));
    } else {
      fn(grad_ptr, weight_out->data_ptr<float>());
    }
  };
  if (grad.scalar_type() == at::kBFloat16) {
    with_out(reinterpret_cast<const uint16_t*>(grad.data_ptr()));
  } else {
    with_out(grad.data_ptr<float>());
  }
}

// `master` is only sized (any dtype) when `remainder` is given. `key`: sqrt(v)'s rounding
// key, `master_key`: a bf16 master's (quant.rounding_key, quant.weight_rounding_key).
void step_8bit(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& m_codes,
               const at::Tensor& m_absmax, const at::Tensor& v_codes, const at::Tensor& v_absmax,
               const std::optional<at::Tensor>& weight_out, const std::optional<at::Tensor>& remainder,
               const std::vector<at::Tensor>& tables, double clip, double beta1, double beta2,
               double eps, double step_size, double inv_bc2_sqrt, double decay, int64_t decay_numel,
               bool stochastic, int64_t key, int64_t offset, int64_t master_key) {
  const int64_t n = master.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(key >= 0 && key <= 0xFFFFFFFFLL, "rounding key must be a 32-bit value, got ", key);
  const MasterRef p = master_ref(master, weight_out, remainder, master_key, offset, kBlock);
  check_io(grad, weight_out, n);
  check_flat(m_codes, at::kByte, n, "m_codes");
  check_flat(v_codes, at::kByte, n, "v_codes");
  check_flat(m_absmax, at::kFloat, blocks, "m_absmax");
  check_flat(v_absmax, at::kFloat, blocks, "v_absmax");
  TORCH_CHECK(tables.size() == 8, "expected 4 tables of the signed map, then 4 of the unsigned one");
  MapTables tm, tv;
  fill_tables(tm, tables.data(), true);
  fill_tables(tv, tables.data() + 4, false);
  const Hyper h = make_hyper(clip, beta1, beta2, eps, step_size, inv_bc2_sqrt);
  const Group8bit g{n,
                    std::clamp<int64_t>(decay_numel, 0, n),
                    static_cast<float>(decay),
                    p,
                    m_codes.data_ptr<uint8_t>(),
                    m_absmax.data_ptr<float>(),
                    v_codes.data_ptr<uint8_t>(),
                    v_absmax.data_ptr<float>(),
                    stochastic,
                    static_cast<uint32_t>(key)};
  dispatch_types(grad, p.fp32 ? weight_out : std::nullopt, [&](auto* grad_ptr, auto* out_ptr) {
    using G = std::remove_const_t<std::remove_pointer_t<decltype(grad_ptr)>>;
    using O = std::remove_pointer_t<decltype(out_ptr)>;
    step_8bit_typed<G, O>(g, grad_ptr, out_ptr, h, tm, tv);
  });
}

void step_fp32(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& weight_out,
               const std::optional<at::Tensor>& remainder, double clip, double beta1, double beta2,
               double eps, double step_size, double inv_bc2_sqrt, double decay, int64_t decay_numel,
               int64_t offset, int64_t master_key) {
  const int64_t n = master.numel();
  const MasterRef p = master_ref(master, weight_out, remainder, master_key, offset, kBlock);
  check_io(grad, weight_out, n);
  check_flat(exp_avg, at::kFloat, n, "exp_avg");
  check_flat(exp_avg_sq, at::kFloat, n, "exp_avg_sq");
  const Hyper h = make_hyper(clip, beta1, beta2, eps, step_size, inv_bc2_sqrt);
  dispatch_types(grad, p.fp32 ? weight_out : std::nullopt, [&](auto* grad_ptr, auto* out_ptr) {
    using G = std::remove_const_t<std::remove_pointer_t<decltype(grad_ptr)>>;
    using O = std::remove_pointer_t<decltype(out_ptr)>;
    step_fp32_typed<G, O>(n, std::clamp<int64_t>(decay_numel, 0, n), static_cast<float>(decay), p,
                          exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), grad_ptr, out_ptr, h);
  });
}

// The split master's halves (split.py) of fp32 `master`, and back.
void split_master(const at::Tensor& master, const at::Tensor& weight, const at::Tensor& remainder) {
  const int64_t n = master.numel();
  check_flat(master, at::kFloat, n, "master");
  check_flat(weight, at::kBFloat16, n, "weight");
  check_flat(remainder, at::kShort, n, "remainder");
  const float* src = master.data_ptr<float>();
  auto* hi = reinterpret_cast<uint16_t*>(weight.data_ptr());
  auto* lo = reinterpret_cast<uint16_t*>(remainder.data_ptr());
  at::parallel_for(0, n, 1 << 16, [&](int64_t a, int64_t b) {
    int64_t k = a;
    for (; k + Simd::W <= b; k += Simd::W) Simd::split(hi + k, lo + k, Simd::load(src + k));
    for (; k < b; ++k) Scalar::split(hi + k, lo + k, src[k]);
  });
}

void join_master(const at::Tensor& weight, const at::Tensor& remainder, const at::Tensor& master) {
  const int64_t n = master.numel();
  check_flat(master, at::kFloat, n, "master");
  check_flat(weight, at::kBFloat16, n, "weight");
  check_flat(remainder, at::kShort, n, "remainder");
  float* dst = master.data_ptr<float>();
  const auto* hi = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* lo = reinterpret_cast<const uint16_t*>(remainder.data_ptr());
  at::parallel_for(0, n, 1 << 16, [&](int64_t a, int64_t b) {
    int64_t k = a;
    for (; k + Simd::W <= b; k += Simd::W) Simd::store(dst + k, Simd::join(hi + k, lo + k));
    for (; k < b; ++k) dst[k] = Scalar::join(hi + k, lo + k);
  });
}

// Quantize float32 values in [-1, 1] with the kernel's nearest-code search (for tests).
at::Tensor nearest_codes(const at::Tensor& x, const std::vector<at::Tensor>& tables, bool is_signed) {
  check_flat(x, at::kFloat, x.numel(), "x");
  TORCH_CHECK(tables.size() == 4, "expected the 4 tables of one map");
  MapTables t;
  fill_tables(t, tables.data(), is_signed);
  at::Tensor codes = at::empty({x.numel()}, x.options().dtype(at::kByte));
  const float* values = x.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  if (is_signed) {
    quantize_range<Simd, true>(values, 0, x.numel(), 1.0f, out, t);
  } else {
    quantize_range<Simd, false>(values, 0, x.numel(), 1.0f, out, t);
  }
  return codes;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lazytrain fused 8-bit AdamW kernel";
  // The executor steps groups from worker threads: never hold the GIL inside a step.
  m.def("step_8bit", &step_8bit, py::call_guard<py::gil_scoped_release>());
  m.def("step_fp32", &step_fp32, py::call_guard<py::gil_scoped_release>());
  m.def("nearest_codes", &nearest_codes, py::call_guard<py::gil_scoped_release>());
  m.def("stochastic_bf16", &stochastic_bf16, py::call_guard<py::gil_scoped_release>());
  m.def("split_master", &split_master, py::call_guard<py::gil_scoped_release>());
  m.def("join_master", &join_master, py::call_guard<py::gil_scoped_release>());
  m.def("simd", &simd_name);
}
