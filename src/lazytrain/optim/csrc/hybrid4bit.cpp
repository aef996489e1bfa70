// Fused AdamW step with blockwise 4-bit states, for lazytrain/optim/hybrid4bit.py.
//
// The 8-bit kernel's structure (hybrid8bit.cpp) with 16-code maps: one pass over memory per
// 128-element block. Dequantize the block's m and sqrt(v) codes (two per byte, the even
// element in the low nibble) into a stack buffer, update m, v and the master (in fp32) with the
// gradient times the clip coefficient, write the new weight, keep the new m and sqrt(v) while
// tracking their absmax, then requantize: the nearest code is the number of the map's 15
// midpoints below the value (ties to the lower code), exactly as the torch path's bucketize.
// Blocks are independent, so they are spread over torch's intra-op threads.
//
// A 16-entry map fits in one AVX-512 register (and two AVX2 ones), so dequantizing is a
// register permute, and quantizing a binary search of 4 permute-compares over the midpoints
// (AVX2: 15 compares; sqrt(v)'s linear map: a formula): no tables in memory, no gathers.
//
// The master is read and written by master.h's load_master / store_master, the 8-bit kernel's
// own: fp32, the exact split master (split.py) or a bf16 master, stochastically rounded under
// the same key and per-element draw as in the 8-bit kernel, so the same fp32 update gives the
// same bf16 weight in both. master.h also holds the loads, bf16 stores and the hash.

#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

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

constexpr int64_t kBlock = 128;  // hybrid4bit.BLOCK
constexpr int kCodes = 16;
constexpr float kTiny = 1.17549435e-38f;  // smaller absmax: the block is stored as zeros

struct Map4 {
  alignas(64) float qmap[kCodes];       // sorted code values
  alignas(64) float midpoints[kCodes];  // [k] between codes k and k + 1; [15] unused
  // the map is k / 16, k = 1..16 (hybrid4bit.linear_map4): its midpoints are (2k + 1) / 32, so
  // the count of those below x is clamp(ceil((32 x - 3) / 2), 0, 15), each step exact in float32
  bool linear = false;
};

inline int nearest_code(float x, const Map4& t) {
  int c = 0;
  for (int k = 0; k < kCodes - 1; ++k) c += x > t.midpoints[k] ? 1 : 0;
  return c;
}

struct Scalar : MasterScalar {
  static constexpr int W = 1;
  using F = float;
  // codes of elements i .. i + W - 1 (i even for W > 1) -> their values times `scale`
  static F dequantize(const uint8_t* packed, int64_t i, const Map4& t, F scale) {
    return t.qmap[(packed[i >> 1] >> (4 * (i & 1))) & 15] * scale;
  }
  static void quantize(const float* values, float inv_absmax, uint8_t* codes, const Map4& t) {
    *codes = static_cast<uint8_t>(nearest_code(*values * inv_absmax, t));
  }
};

#if defined(__AVX512F__)
struct Simd : MasterSimd {
  static constexpr int W = 16;
  using F = __m512;
  // 16 codes from 8 bytes: each byte twice, the odd copies shifted down a nibble; the map is
  // one register, so the look-up is one permute
  static F dequantize(const uint8_t* packed, int64_t i, const Map4& t, F scale) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + (i >> 1)));
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(wide, shifts), _mm512_set1_epi32(15));
    return _mm512_mul_ps(_mm512_permutexvar_ps(codes, _mm512_load_ps(t.qmap)), scale);
  }
  static void quantize(const float* values, float inv_absmax, uint8_t* codes, const Map4& t) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values), _mm512_set1_ps(inv_absmax));
    __m512i c = _mm512_setzero_si512();
    if (t.linear) {
      const __m512 half = _mm512_mul_ps(_mm512_fmsub_ps(x, _mm512_set1_ps(32.0f), _mm512_set1_ps(3.0f)),
                                        _mm512_set1_ps(0.5f));
      c = _mm512_cvt_roundps_epi32(half, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
      c = _mm512_min_epi32(_mm512_max_epi32(c, _mm512_setzero_si512()), _mm512_set1_epi32(kCodes - 1));
    } else {
      // the count of midpoints below x by a binary search over the sorted midpoints, one
      // permute-compare per halving (8, 4, 2, 1): it reads midpoints[0..14] only and gives the
      // 15 compares' count exactly (NaN: 0, as they do)
      const __m512 mids = _mm512_load_ps(t.midpoints);
      for (int half = 8; half >= 1; half >>= 1) {
        const __m512i probe = _mm512_add_epi32(c, _mm512_set1_epi32(half - 1));
        const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(probe, mids), _CMP_GT_OQ);
        c = _mm512_mask_add_epi32(c, above, c, _mm512_set1_epi32(half));
      }
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(c));
  }
  // 16 nearest codes -> stochastically rounded ones (the scalar `stochastic` below, 16 lanes;
  // `index`: the hash input of the first)
  static void round_stochastic(const float* values, float inv_absmax, uint8_t* codes, const Map4& t,
                               uint32_t key, uint32_t index) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values), _mm512_set1_ps(inv_absmax));
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i one = _mm512_set1_epi32(1);
    const __m512 qmap = _mm512_load_ps(t.qmap);
    const __m512 qc = _mm512_permutexvar_ps(c, qmap);
    const __m512i above = _mm512_min_epi32(_mm512_add_epi32(c, one), _mm512_set1_epi32(kCodes - 1));
    const __m512i below = _mm512_max_epi32(_mm512_sub_epi32(c, one), _mm512_setzero_si512());
    const __m512i n = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, qc, _CMP_GE_OQ), below, above);
    const __m512 qn = _mm512_permutexvar_ps(n, qmap);
    const __m512 a = _mm512_min_ps(qc, qn), b = _mm512_max_ps(qc, qn);
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(hashes(key, index), 8)), _mm512_set1_ps(0x1p-24f));
    const __m512 p = _mm512_div_ps(_mm512_sub_ps(x, a), _mm512_sub_ps(b, a));
    const __mmask16 up = _mm512_cmp_ps_mask(b, a, _CMP_GT_OQ) & _mm512_cmp_ps_mask(u, p, _CMP_LT_OQ);
    const __m512i low = _mm512_min_epi32(c, n);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(low, up, low, one)));
  }
  // 16 codes (bytes) -> 8 bytes, two codes each
  static void pack16(const uint8_t* codes, uint8_t* out) {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i both = _mm_and_si128(_mm_or_si128(w, _mm_srli_epi16(w, 4)), _mm_set1_epi16(0xff));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(both, both));
  }
};
#elif defined(__AVX2__)
struct Simd : MasterSimd {
  static constexpr int W = 8;
  using F = __m256;
  // 8 codes from 4 bytes; the map is two registers, picked by the code's bit 3
  static F dequantize(const uint8_t* packed, int64_t i, const Map4& t, F scale) {
    int32_t four;
    std::memcpy(&four, packed + (i >> 1), 4);
    const __m128i bytes = _mm_cvtsi32_si128(four);
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
    const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(wide, shifts), _mm256_set1_epi32(15));
    return _mm256_mul_ps(lookup(codes, t), scale);
  }
  // the map's values of 8 codes (< 16)
  static F lookup(__m256i codes, const Map4& t) {
    const __m256 low = _mm256_permutevar8x32_ps(_mm256_load_ps(t.qmap), codes);
    const __m256 high = _mm256_permutevar8x32_ps(_mm256_load_ps(t.qmap + 8), codes);
    const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28));  // bit 3 as the sign
    return _mm256_blendv_ps(low, high, upper);
  }
  static void quantize(const float* values, float inv_absmax, uint8_t* codes, const Map4& t) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(values), _mm256_set1_ps(inv_absmax));
    __m256i c = _mm256_setzero_si256();
    if (t.linear) {
      const __m256 half = _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(x, _mm256_set1_ps(32.0f)), _mm256_set1_ps(3.0f)),
                                        _mm256_set1_ps(0.5f));
      c = _mm256_cvtps_epi32(_mm256_ceil_ps(half));
      c = _mm256_min_epi32(_mm256_max_epi32(c, _mm256_setzero_si256()), _mm256_set1_epi32(kCodes - 1));
    } else {
      for (int k = 0; k < kCodes - 1; ++k) {  // a true compare is -1
        c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_set1_ps(t.midpoints[k]), _CMP_GT_OQ)));
      }
    }
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(words, words));
  }
  // 8 nearest codes -> stochastically rounded ones (AVX-512's round_stochastic, 8 lanes)
  static void round_stochastic(const float* values, float inv_absmax, uint8_t* codes, const Map4& t,
                               uint32_t key, uint32_t index) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(values), _mm256_set1_ps(inv_absmax));
    int64_t eight;
    std::memcpy(&eight, codes, 8);
    const __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
    const __m256i one = _mm256_set1_epi32(1);
    const __m256 qc = lookup(c, t);
    const __m256i above = _mm256_min_epi32(_mm256_add_epi32(c, one), _mm256_set1_epi32(kCodes - 1));
    const __m256i below = _mm256_max_epi32(_mm256_sub_epi32(c, one), _mm256_setzero_si256());
    const __m256i n = _mm256_blendv_epi8(below, above, _mm256_castps_si256(_mm256_cmp_ps(x, qc, _CMP_GE_OQ)));
    const __m256 qn = lookup(n, t);
    const __m256 a = _mm256_min_ps(qc, qn), b = _mm256_max_ps(qc, qn);
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hashes(key, index), 8)), _mm256_set1_ps(0x1p-24f));
    const __m256 p = _mm256_div_ps(_mm256_sub_ps(x, a), _mm256_sub_ps(b, a));
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(b, a, _CMP_GT_OQ), _mm256_cmp_ps(u, p, _CMP_LT_OQ));
    const __m256i code = _mm256_sub_epi32(_mm256_min_epi32(c, n), _mm256_castps_si256(up));  // a true compare is -1
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(words, words));
  }
  static void pack16(const uint8_t* codes, uint8_t* out) {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i both = _mm_and_si128(_mm_or_si128(w, _mm_srli_epi16(w, 4)), _mm_set1_epi16(0xff));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(both, both));
  }
};
#else
using Simd = Scalar;
#endif

// codes [0, len) (len even, or codes[len] = 0) two to a byte into `out`
inline void pack_range(const uint8_t* codes, int64_t len, uint8_t* out) {
  int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  for (; j + 16 <= len; j += 16) Simd::pack16(codes + j, out + j / 2);
#endif
  for (; j < len; j += 2) out[j / 2] = static_cast<uint8_t>(codes[j] | (codes[j + 1] << 4));
}

struct Group4bit {
  int64_t numel;
  int64_t decay_numel;
  float decay;       // 1 - lr * weight_decay
  MasterRef master;  // its offset: index in the whole group of element 0 (a data-parallel shard's start)
  uint8_t* m_codes;  // two codes a byte, the even element in the low nibble
  float* m_absmax;
  uint8_t* v_codes;  // codes of sqrt(v)
  float* v_absmax;
  bool stochastic;    // sqrt(v) rounded stochastically (hybrid4bit.stochastic_codes4)
  uint32_t key;       // quant.rounding_key of this group's step
  bool m_stochastic;  // m rounded stochastically, the same way
  uint32_t m_key;     // quant.moment_rounding_key of this group's step
};

struct BlockScratch {
  alignas(64) float m[kBlock];     // old m, then new m
  alignas(64) float root[kBlock];  // old sqrt(v), then new
  alignas(64) uint8_t codes[kBlock + 16];
  float m_max = 0.0f, root_max = 0.0f;
};

// Adam update of elements [lo, hi) of the block at `start`, from the old m and sqrt(v) in the
// scratch buffers, which then hold the new ones; master and weight_out written (a bf16 master
// rounded under `master_key`, high_key of the block's first element, as the 8-bit kernel).
template <class S, class G, class O>
inline void update_range(const Group4bit& g, const G* grad, O* out, const Hyper& h, int64_t start,
                         int64_t lo, int64_t hi, float decay, uint32_t master_key, BlockScratch& s) {
  using F = typename S::F;
  const F clip = S::set(h.clip), b1 = S::set(h.beta1), omb1 = S::set(h.one_minus_beta1);
  const F b2 = S::set(h.beta2), omb2 = S::set(h.one_minus_beta2), eps = S::set(h.eps);
  const F step_size = S::set(h.step_size), inv_bc2 = S::set(h.inv_bc2_sqrt), dec = S::set(decay);
  F m_max = S::set(0.0f), root_max = S::set(0.0f);
  int64_t j = lo;
  for (; j + S::W <= hi; j += S::W) {
    const int64_t k = start + j;
    const F gr = S::load(grad + k) * clip;
    const F m = b1 * S::load(s.m + j) + omb1 * gr;
    const F old = S::load(s.root + j);
    const F root = S::sqrt(b2 * (old * old) + omb2 * (gr * gr));
    const F w = load_master<S>(g.master, k) * dec - step_size * (m * S::reciprocal(root * inv_bc2 + eps));
    store_master<S>(g.master, k, w, master_key);
    if constexpr (!std::is_same_v<O, void>) S::store(out + k, w);
    S::store(s.m + j, m);
    S::store(s.root + j, root);
    m_max = S::max(m_max, S::abs(m));
    root_max = S::max(root_max, root);
  }
  s.m_max = std::max(s.m_max, S::reduce_max(m_max));
  s.root_max = std::max(s.root_max, S::reduce_max(root_max));
  if constexpr (S::W > 1) update_range<Scalar>(g, grad, out, h, start, j, hi, decay, master_key, s);
}

template <class S>
inline void dequantize_range(const uint8_t* packed, float scale, const Map4& t, int64_t start, int64_t len,
                             float* out) {
  int64_t j = 0;
  for (; j + S::W <= len; j += S::W) S::store(out + j, S::dequantize(packed, start + j, t, S::set(scale)));
  if constexpr (S::W > 1) {
    for (; j < len; ++j) out[j] = Scalar::dequantize(packed, start + j, t, scale);
  }
}

// Stochastic rounding of m or sqrt(v) (hybrid4bit.stochastic_codes4): from the nearest code c, the
// code below or above x, the upper one with probability (x - below) / (above - below) against
// the uniform hashed from the element's index. The division is IEEE's, as torch's.
inline void stochastic(const float* values, float inv_absmax, uint8_t* codes, const Map4& t, int64_t len,
                       uint32_t key, uint32_t index) {
  for (int64_t j = 0; j < len; ++j) {
    const float x = values[j] * inv_absmax;
    const int c = codes[j];
    const float qc = t.qmap[c];
    const int n = x >= qc ? std::min(c + 1, kCodes - 1) : std::max(c - 1, 0);
    const float qn = t.qmap[n];
    const float a = std::min(qc, qn), b = std::max(qc, qn);
    const float u = static_cast<float>(fmix32((index + static_cast<uint32_t>(j)) ^ key) >> 8) * 0x1p-24f;
    codes[j] = static_cast<uint8_t>(std::min(c, n) + ((b > a && u < (x - a) / (b - a)) ? 1 : 0));
  }
}

// Quantize `len` values into packed codes starting at element `start` (even): nearest codes, or
// with `stochastic_codes` codes rounded stochastically under `group_key` (its group's step's),
// `first` being the index of element `start` in the whole group.
template <class S>
inline void quantize_range(const float* values, int64_t len, float inv_absmax, const Map4& t, uint8_t* codes,
                           bool stochastic_codes, uint32_t group_key, int64_t first, int64_t start,
                           uint8_t* packed) {
  int64_t j = 0;
  for (; j + S::W <= len; j += S::W) S::quantize(values + j, inv_absmax, codes + j, t);
  for (; j < len; ++j) Scalar::quantize(values + j, inv_absmax, codes + j, t);
  if (stochastic_codes) {
    // a block never straddles a multiple of 2**32 elements: its high half keys the block
    const uint32_t key = high_key(group_key, first);
    const auto index = static_cast<uint32_t>(first);
    j = 0;
    if constexpr (S::W > 1) {
      for (; j + S::W <= len; j += S::W) S::round_stochastic(values + j, inv_absmax, codes + j, t, key, index + j);
    }
    stochastic(values + j, inv_absmax, codes + j, t, len - j, key, index + static_cast<uint32_t>(j));
  }
  codes[len] = 0;  // an odd tail's last byte holds one code
  pack_range(codes, len, packed + (start >> 1));
}

// Denormal blocks become zeros, so the reciprocal stays finite (as the 8-bit kernel).
inline float store_absmax(float& slot, float absmax) {
  if (!(absmax >= kTiny)) absmax = 0.0f;
  slot = absmax;
  return absmax > 0.0f ? 1.0f / absmax : 0.0f;
}

template <class G, class O>
void step_block(const Group4bit& g, const G* grad, O* out, const Hyper& h, const Map4& tm, const Map4& tv,
                int64_t block) {
  BlockScratch s;
  const int64_t start = block * kBlock;
  const int64_t len = std::min(kBlock, g.numel - start);
  const int64_t decay_end = std::clamp<int64_t>(g.decay_numel - start, 0, len);
  dequantize_range<Simd>(g.m_codes, g.m_absmax[block], tm, start, len, s.m);
  dequantize_range<Simd>(g.v_codes, g.v_absmax[block], tv, start, len, s.root);
  const uint32_t master_key = high_key(g.master.key, g.master.offset + start);
  update_range<Simd>(g, grad, out, h, start, 0, decay_end, g.decay, master_key, s);
  update_range<Simd>(g, grad, out, h, start, decay_end, len, 1.0f, master_key, s);
  const float m_inv = store_absmax(g.m_absmax[block], s.m_max);
  const float root_inv = store_absmax(g.v_absmax[block], s.root_max);
  const int64_t first = g.master.offset + start;
  quantize_range<Simd>(s.m, len, m_inv, tm, s.codes, g.m_stochastic, g.m_key, first, start, g.m_codes);
  quantize_range<Simd>(s.root, len, root_inv, tv, s.codes, g.stochastic, g.key, first, start, g.v_codes);
}

void fill_map(Map4& t, const at::Tensor& qmap, const at::Tensor& midpoints) {
  check_flat(qmap, at::kFloat, kCodes, "qmap");
  check_flat(midpoints, at::kFloat, kCodes, "midpoints");
  std::memcpy(t.qmap, qmap.data_ptr<float>(), sizeof(t.qmap));
  std::memcpy(t.midpoints, midpoints.data_ptr<float>(), sizeof(t.midpoints));
}

// Calls fn(grad_ptr, out_ptr) typed by the gradient's and weight_out's dtypes (bf16 as
// uint16_t; void* without a separate weight_out: none given, or a split or bf16 master's
// weight, which the master's write fills).
template <class Fn>
void dispatch(const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, bool separate_out, Fn&& fn) {
  auto with_out = [&](auto* grad_ptr) {
    if (!weight_out.has_value() || !separate_out) {
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

template <class G, class O>
void step_typed(const Group4bit& g, const G* grad, O* out, const Hyper& h, const Map4& tm, const Map4& tv) {
  const int64_t blocks = (g.numel + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) step_block(g, grad, out, h, tm, tv, b);
  });
}

// `master` is only sized (any dtype) when `remainder` is given, and is the bf16 master itself
// when bf16 (master_ref); `maps` = (signed qmap, its midpoints, unsigned qmap, its midpoints),
// 16 float32 each. `key`: sqrt(v)'s rounding key, `m_key` m's, `master_key`: a bf16 master's
// (quant.rounding_key, quant.moment_rounding_key, quant.weight_rounding_key), as the 8-bit
// kernel's step_8bit.
void step_4bit(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& m_codes,
               const at::Tensor& m_absmax, const at::Tensor& v_codes, const at::Tensor& v_absmax,
               const std::optional<at::Tensor>& weight_out, const std::optional<at::Tensor>& remainder,
               const std::vector<at::Tensor>& maps, double clip, double beta1, double beta2, double eps,
               double step_size, double inv_bc2_sqrt, double decay, int64_t decay_numel, bool stochastic,
               int64_t key, bool m_stochastic, int64_t m_key, int64_t offset, int64_t master_key) {
  const int64_t n = master.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(key >= 0 && key <= 0xFFFFFFFFLL, "rounding key must be a 32-bit value, got ", key);
  TORCH_CHECK(m_key >= 0 && m_key <= 0xFFFFFFFFLL, "m's rounding key must be a 32-bit value, got ", m_key);
  Group4bit g{};
  g.numel = n;
  g.decay_numel = std::clamp<int64_t>(decay_numel, 0, n);
  g.decay = static_cast<float>(decay);
  g.master = master_ref(master, weight_out, remainder, master_key, offset, kBlock);
  check_io(grad, weight_out, n);
  check_flat(m_codes, at::kByte, (n + 1) / 2, "m_codes");
  check_flat(v_codes, at::kByte, (n + 1) / 2, "v_codes");
  check_flat(m_absmax, at::kFloat, blocks, "m_absmax");
  check_flat(v_absmax, at::kFloat, blocks, "v_absmax");
  TORCH_CHECK(maps.size() == 4, "expected the signed map and its midpoints, then the unsigned ones");
  Map4 tm, tv;
  fill_map(tm, maps[0], maps[1]);
  fill_map(tv, maps[2], maps[3]);
  tv.linear = true;
  for (int k = 0; k < kCodes; ++k) TORCH_CHECK(tv.qmap[k] == (k + 1) / 16.0f, "the second moment's map must be k / 16");
  g.m_codes = m_codes.data_ptr<uint8_t>();
  g.m_absmax = m_absmax.data_ptr<float>();
  g.v_codes = v_codes.data_ptr<uint8_t>();
  g.v_absmax = v_absmax.data_ptr<float>();
  g.stochastic = stochastic;
  g.key = static_cast<uint32_t>(key);
  g.m_stochastic = m_stochastic;
  g.m_key = static_cast<uint32_t>(m_key);
  const Hyper h = make_hyper(clip, beta1, beta2, eps, step_size, inv_bc2_sqrt);
  // a split or bf16 master's weight is written with the master: no separate weight_out
  dispatch(grad, weight_out, g.master.fp32 != nullptr, [&](auto* grad_ptr, auto* out_ptr) {
    using G = std::remove_const_t<std::remove_pointer_t<decltype(grad_ptr)>>;
    using O = std::remove_pointer_t<decltype(out_ptr)>;
    step_typed<G, O>(g, grad_ptr, out_ptr, h, tm, tv);
  });
}

// fp32 states, for groups too small to quantize (or kept fp32 by choice): scalar, as the 8-bit
// kernel's step_fp32.
template <class G, class O>
void step_fp32_typed(const Group4bit& g, float* exp_avg, float* exp_avg_sq, const G* grad, O* out,
                     const Hyper& h) {
  for (int64_t k = 0; k < g.numel; ++k) {
    const float gr = Scalar::load(grad + k) * h.clip;
    const float m = h.beta1 * exp_avg[k] + h.one_minus_beta1 * gr;
    const float v = h.beta2 * exp_avg_sq[k] + h.one_minus_beta2 * (gr * gr);
    const float denom = std::sqrt(v) * h.inv_bc2_sqrt + h.eps;
    const float w = load_master<Scalar>(g.master, k) * (k < g.decay_numel ? g.decay : 1.0f) - h.step_size * (m / denom);
    exp_avg[k] = m;
    exp_avg_sq[k] = v;
    store_master<Scalar>(g.master, k, w, high_key(g.master.key, g.master.offset + k));
    if constexpr (!std::is_same_v<O, void>) Scalar::store(out + k, w);
  }
}

void step_fp32(const at::Tensor& grad, const at::Tensor& master, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& weight_out,
               const std::optional<at::Tensor>& remainder, double clip, double beta1, double beta2,
               double eps, double step_size, double inv_bc2_sqrt, double decay, int64_t decay_numel,
               int64_t offset, int64_t master_key) {
  Group4bit g{};
  g.numel = master.numel();
  g.decay_numel = std::clamp<int64_t>(decay_numel, 0, g.numel);
  g.decay = static_cast<float>(decay);
  g.master = master_ref(master, weight_out, remainder, master_key, offset, kBlock);
  check_io(grad, weight_out, g.numel);
  check_flat(exp_avg, at::kFloat, g.numel, "exp_avg");
  check_flat(exp_avg_sq, at::kFloat, g.numel, "exp_avg_sq");
  const Hyper h = make_hyper(clip, beta1, beta2, eps, step_size, inv_bc2_sqrt);
  dispatch(grad, weight_out, g.master.fp32 != nullptr, [&](auto* grad_ptr, auto* out_ptr) {
    using G = std::remove_const_t<std::remove_pointer_t<decltype(grad_ptr)>>;
    using O = std::remove_pointer_t<decltype(out_ptr)>;
    step_fp32_typed<G, O>(g, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), grad_ptr, out_ptr, h);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lazytrain fused 4-bit AdamW kernel";
  // The executor steps groups from worker threads: never hold the GIL inside a step.
  m.def("step_4bit", &step_4bit, py::call_guard<py::gil_scoped_release>());
  m.def("step_fp32", &step_fp32, py::call_guard<py::gil_scoped_release>());
  m.def("stochastic_bf16", &stochastic_bf16, py::call_guard<py::gil_scoped_release>());
  m.def("simd", &simd_name);
}
