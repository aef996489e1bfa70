// The master weights of the fused AdamW kernels (hybrid8bit.cpp, hybrid4bit.cpp): fp32, split
// (the streamed bf16 weight + an int16 remainder, exact) or bf16 (the streamed weight alone,
// written with stochastic rounding), optim/master.py. MasterRef, load_master and store_master
// are the only code that knows the forms; both kernels include this header, so a bf16 master's
// new weight is the same function of the fp32 update (and the key) in either of them.
//
// MasterScalar and MasterSimd hold the vector operations the master needs (loads, bf16 stores,
// the split master's halves, the hash and stochastic rounding); each kernel's Scalar and Simd
// derive from them and add their own arithmetic. kernel.py hashes this header into every
// kernel's build directory: a change here rebuilds both kernels.

#pragma once

#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Round to nearest even, NaN to a quiet NaN: c10::BFloat16's own rounding.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t b = float_to_bits(f);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// MurmurHash3's 32-bit finalizer: quant.fmix32.
inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// The hash key of the elements whose index in their group shares `first`'s high 32 bits
// (quant.uniforms_at): the low 32 bits are then hashed under it.
inline uint32_t high_key(uint32_t key, int64_t first) {
  return fmix32(key ^ (static_cast<uint32_t>(first >> 32) * 0x27D4EB2Fu));
}

// A bf16 master's stochastic rounding (master.py, stochastic_bf16): 16 random bits `r` added
// to x's bits, the sum truncated to its high half, so x moves to the bf16 neighbour away from
// zero with probability (x's low 16 bits) / 2**16 = (|x| - |toward|) / (|away| - |toward|),
// exactly; a bf16 value stays put, an infinity stays, NaN becomes the quiet NaN.
inline uint16_t bf16_stochastic(float x, uint32_t r) {
  if (std::isnan(x)) return 0x7fc0;
  return static_cast<uint16_t>((float_to_bits(x) + r) >> 16);
}

// Smallest normal float: sqrt's estimate starts from max(v, it), so v = 0 stays finite
// (0 * rsqrt(it) = 0).
constexpr float kSqrtFloor = 1.17549435e-38f;

// The vector operations both kernels (hybrid8bit.cpp, hybrid4bit.cpp) share, per ISA: float
// math (sqrt and 1 / x from the hardware estimates and one Newton step each, about an ulp off:
// the divide and square-root units would otherwise bound the whole step) and the masters'
// loads and stores.
struct MasterScalar {
  static constexpr int W = 1;
  using F = float;
  static F set(float x) { return x; }
  static F sqrt(F v) { return std::sqrt(v); }
  static F reciprocal(F d) { return 1.0f / d; }
  static F abs(F x) { return std::fabs(x); }
  static F max(F a, F b) { return a > b ? a : b; }
  static float reduce_max(F x) { return x; }
  static F load(const float* p) { return *p; }
  static F load(const uint16_t* p) { return bits_to_float(static_cast<uint32_t>(*p) << 16); }
  static void store(float* p, F x) { *p = x; }
  static void store(uint16_t* p, F x) { *p = float_to_bf16(x); }
  template <class T>
  static void stream(T* p, F x) { store(p, x); }
  // the split master (split.py): bits = (weight << 16) + sign-extended remainder
  static F join(const uint16_t* hi, const uint16_t* lo) {
    return bits_to_float((static_cast<uint32_t>(*hi) << 16) +
                         static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(*lo))));
  }
  static void split(uint16_t* hi, uint16_t* lo, F x) {
    const uint32_t b = float_to_bits(x);
    *hi = static_cast<uint16_t>((b + 0x8000u) >> 16);
    *lo = static_cast<uint16_t>(b);
  }
  // x as a bf16 master (bf16_stochastic), the random bits hashed from the element's index
  // under `key` (high_key's), as quant.rounding_bits draws them
  static void store_stochastic(uint16_t* p, F x, uint32_t key, uint32_t index) {
    *p = bf16_stochastic(x, fmix32(index ^ key) >> 16);
  }
};

#if defined(__AVX512F__)
struct MasterSimd {
  static constexpr int W = 16;
  using F = __m512;
  static F set(float x) { return _mm512_set1_ps(x); }
  // from the 14-bit estimates
  static F sqrt(F v) {
    const F r = _mm512_rsqrt14_ps(_mm512_max_ps(v, set(kSqrtFloor)));
    const F root = v * r;
    return root + root * (set(0.5f) - root * (r * set(0.5f)));
  }
  static F reciprocal(F d) {
    const F q = _mm512_rcp14_ps(d);
    return q + q * (set(1.0f) - d * q);
  }
  static F abs(F x) { return _mm512_abs_ps(x); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float reduce_max(F x) { return _mm512_reduce_max_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static __m256i to_bf16(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
  }
  static void store(uint16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  // non-temporal stores, for the weights: written once, read next by a copy to the GPU
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void stream(uint16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static F join(const uint16_t* hi, const uint16_t* lo) {
    const __m512i h = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi))), 16);
    const __m512i l = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
    return _mm512_castsi512_ps(_mm512_add_epi32(h, l));
  }
  static void split(uint16_t* hi, uint16_t* lo, F x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x8000)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(b));  // truncates
  }
  static __m512i fmix32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0x85EBCA6Bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0xC2B2AE35u)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  // the hashes of the 16 elements from hash input `index` on (quant.rounding_bits)
  static __m512i hashes(uint32_t key, uint32_t index) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return fmix32(_mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(index)), lanes),
                                   _mm512_set1_epi32(static_cast<int32_t>(key))));
  }
  // 16 elements as a bf16 master (MasterScalar::store_stochastic)
  static void store_stochastic(uint16_t* p, F x, uint32_t key, uint32_t index) {
    const __m512i r = _mm512_srli_epi32(hashes(key, index), 16);
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(h));
  }
};
#elif defined(__AVX2__)
struct MasterSimd {
  static constexpr int W = 8;
  using F = __m256;
  static F set(float x) { return _mm256_set1_ps(x); }
  // from the 12-bit estimates (one Newton step leaves 1-2 ulps); operators, not FMA
  // intrinsics: an AVX2 build need not have FMA (the compiler fuses where it can)
  static F sqrt(F v) {
    const F r = _mm256_rsqrt_ps(_mm256_max_ps(v, set(kSqrtFloor)));
    const F root = v * r;
    return root + root * (set(0.5f) - root * (r * set(0.5f)));
  }
  static F reciprocal(F d) {
    const F q = _mm256_rcp_ps(d);
    return q + q * (set(1.0f) - d * q);
  }
  static F abs(F x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float reduce_max(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static __m128i to_bf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static void store(uint16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void stream(uint16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static F join(const uint16_t* hi, const uint16_t* lo) {
    const __m256i h = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi))), 16);
    const __m256i l = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
    return _mm256_castsi256_ps(_mm256_add_epi32(h, l));
  }
  static __m128i low_halves(__m256i x) {  // masked first, so the saturating pack is exact
    x = _mm256_and_si256(x, _mm256_set1_epi32(0xffff));
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  }
  static void split(uint16_t* hi, uint16_t* lo, F x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x8000)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), low_halves(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), low_halves(b));
  }
  static __m256i fmix32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x85EBCA6Bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xC2B2AE35u)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static __m256i hashes(uint32_t key, uint32_t index) {  // as MasterSimd::hashes of AVX-512, 8 lanes
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return fmix32(_mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(index)), lanes),
                                   _mm256_set1_epi32(static_cast<int32_t>(key))));
  }
  // 8 elements as a bf16 master (MasterScalar::store_stochastic)
  static void store_stochastic(uint16_t* p, F x, uint32_t key, uint32_t index) {
    const __m256i r = _mm256_srli_epi32(hashes(key, index), 16);
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  }
};
#else
using MasterSimd = MasterScalar;
#endif

// One group's master in any of its three forms (optim/master.py).
struct MasterRef {
  float* fp32 = nullptr;          // an fp32 master, or nullptr:
  uint16_t* weight = nullptr;     // the streamed bf16 weight: a split master's high half, or a bf16 master
  uint16_t* remainder = nullptr;  // a split master's low 16 bits (split.py); nullptr: a bf16 master
  uint32_t key = 0;               // a bf16 master's rounding key (quant.weight_rounding_key)
  int64_t offset = 0;             // index in the whole group of element 0 (a data-parallel shard's start)
};

// The master's elements from k on, as fp32 (a bf16 master widened: exact).
template <class S>
inline typename S::F load_master(const MasterRef& m, int64_t k) {
  if (m.fp32) return S::load(m.fp32 + k);
  if (m.remainder) return S::join(m.weight + k, m.remainder + k);
  return S::load(m.weight + k);
}

// New values w of the master's elements from k on: fp32 stored, split, or (a bf16 master)
// rounded stochastically under `key`, high_key(m.key, m.offset + k): the elements of one call
// must share the high 32 bits of their group index (a 128-element block always does).
template <class S>
inline void store_master(const MasterRef& m, int64_t k, typename S::F w, uint32_t key) {
  if (m.fp32) {
    S::store(m.fp32 + k, w);
  } else if (m.remainder) {
    S::split(m.weight + k, m.remainder + k, w);
  } else {
    S::store_stochastic(m.weight + k, w, key, static_cast<uint32_t>(m.offset + k));
  }
}

void check_flat(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

// The vector path this build compiled (kernel.VARIANTS' names).
inline const char* simd_name() {
#if defined(LAZYTRAIN_VBMI)
  return "avx512vbmi";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// One AdamW step's numbers (bias corrections folded in: hybrid8bit.StepScalars), in float.
struct Hyper {
  float clip, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_bc2_sqrt;
};

inline Hyper make_hyper(double clip, double beta1, double beta2, double eps, double step_size,
                        double inv_bc2_sqrt) {
  return {static_cast<float>(clip),        static_cast<float>(beta1),
          static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
          static_cast<float>(1.0 - beta2), static_cast<float>(eps),
          static_cast<float>(step_size),   static_cast<float>(inv_bc2_sqrt)};
}

// The gradient (bf16 or fp32) and a separate weight output, if any, as flat tensors of numel.
inline void check_io(const at::Tensor& grad, const std::optional<at::Tensor>& weight_out, int64_t numel) {
  const auto gt = grad.scalar_type();
  TORCH_CHECK(gt == at::kBFloat16 || gt == at::kFloat, "gradient must be bf16 or fp32, got ", gt);
  check_flat(grad, gt, numel, "gradient");
  if (weight_out.has_value()) {
    const auto ot = weight_out->scalar_type();
    TORCH_CHECK(ot == at::kBFloat16 || ot == at::kFloat, "weight_out must be bf16 or fp32, got ", ot);
    check_flat(*weight_out, ot, numel, "weight_out");
  }
}

// The master: an fp32 tensor; (remainder given) split into weight_out's bf16 bits and the
// int16 remainder; or (a bf16 `master`, no weight_out) a bf16 master, rounded stochastically
// under `key`. A split or bf16 master's weight is written with the master, so the step writes
// no separate copy. `offset` must be a multiple of the kernel's `block` (a shard starts on one).
MasterRef master_ref(const at::Tensor& master, const std::optional<at::Tensor>& weight_out,
                     const std::optional<at::Tensor>& remainder, int64_t key, int64_t offset, int64_t block) {
  const int64_t n = master.numel();
  TORCH_CHECK(key >= 0 && key <= 0xFFFFFFFFLL, "rounding key must be a 32-bit value, got ", key);
  TORCH_CHECK(offset >= 0 && offset % block == 0, "offset must be a multiple of ", block, ", got ", offset);
  MasterRef m;
  m.key = static_cast<uint32_t>(key);
  m.offset = offset;
  if (remainder.has_value()) {
    TORCH_CHECK(weight_out.has_value() && weight_out->scalar_type() == at::kBFloat16,
                "a split master needs its bf16 weight as weight_out");
    check_flat(*weight_out, at::kBFloat16, n, "weight_out");
    check_flat(*remainder, at::kShort, n, "remainder");
    m.weight = reinterpret_cast<uint16_t*>(weight_out->data_ptr());
    m.remainder = reinterpret_cast<uint16_t*>(remainder->data_ptr());
  } else if (master.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!weight_out.has_value(), "a bf16 master is the streamed weight: pass no weight_out");
    check_flat(master, at::kBFloat16, n, "master");
    m.weight = reinterpret_cast<uint16_t*>(master.data_ptr());
  } else {
    check_flat(master, at::kFloat, n, "master");
    m.fp32 = master.data_ptr<float>();
  }
  return m;
}

// fp32 `x` as a bf16 master's elements `offset` on rounds it (store_master under `key`), for
// tests: each kernel exposes it, so both can be checked against the torch path and each other.
at::Tensor stochastic_bf16(const at::Tensor& x, int64_t key, int64_t offset) {
  constexpr int64_t kPiece = 128;  // within a piece starting at a multiple, the index's high 32 bits agree
  check_flat(x, at::kFloat, x.numel(), "x");
  at::Tensor out = at::empty({x.numel()}, x.options().dtype(at::kBFloat16));
  MasterRef m = master_ref(out, std::nullopt, std::nullopt, key, offset, kPiece);
  const float* src = x.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, (n + kPiece - 1) / kPiece, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * kPiece, end = std::min(n, start + kPiece);
      const uint32_t piece_key = high_key(m.key, m.offset + start);
      int64_t k = start;
      for (; k + MasterSimd::W <= end; k += MasterSimd::W) {
        store_master<MasterSimd>(m, k, MasterSimd::load(src + k), piece_key);
      }
      for (; k < end; ++k) store_master<MasterScalar>(m, k, src[k], piece_key);
    }
  });
  return out;
}

}  // namespace
