// x86-64 AdamW kernels: AVX2+FMA, AVX-512 (F/BW/DQ/VL) and AVX-512 with AVX512_BF16 conversion.
// Every path is compiled with a per-function target attribute, so one build holds all of them and the
// caller picks one at run time from the CPU's features (see adam_kernels.h). No -march flag is needed.
#pragma once

#include <immintrin.h>

#include "kernels_common.h"

#define HFSO_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define HFSO_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#define HFSO_TARGET_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")))

namespace hfso {
namespace x86 {

// NOTE: software prefetch distance in elements (2 KiB ahead on each fp32 stream); 0 disables it. Measured
// on the 2-core dev VM (Sapphire Rapids), 16 Mi params, 1 thread, bf16 grad + bf16 out: 23.1-23.2 GB/s
// without, 25.1-25.3 with 256-1024, 23.8-24.0 with 2048-4096. Re-measure on the 16-core host
// (-DHFSO_PREFETCH_ELEMS=N).
#ifndef HFSO_PREFETCH_ELEMS
#define HFSO_PREFETCH_ELEMS 512
#endif
constexpr int64_t kPrefetchElems = HFSO_PREFETCH_ELEMS;

inline bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

inline bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// ---- fp32 -> bf16, round to nearest even, NaN -> 0xFFFF (see f32_to_bf16_bits) ---------------------------

HFSO_TARGET_AVX512 HFSO_INLINE __m256i cvt_bf16_avx512_int(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7fff));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(kBf16NaN));
  return _mm512_cvtepi32_epi16(r);
}

// VCVTNEPS2BF16 rounds to nearest even but treats denormal inputs as zero and keeps the NaN payload. Lanes
// holding a NaN or a denormal (rare) are redone with the integer path, so the result equals the other paths.
HFSO_TARGET_AVX512BF16 HFSO_INLINE __m256i cvt_bf16_avx512_native(__m512 x) {
  __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 special = _mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80);  // QNaN | denormal | SNaN
  if (__builtin_expect(special != 0, 0)) r = _mm256_mask_mov_epi16(r, special, cvt_bf16_avx512_int(x));
  return r;
}

// ---- AVX2 -----------------------------------------------------------------------------------------------

namespace avx2 {

struct Consts {
  __m256 gscale, decay, omb1, omb2, beta2, neg_step, bc2, eps;
};

HFSO_TARGET_AVX2 HFSO_INLINE Consts make_consts(const AdamHyper& h) {
  return {_mm256_set1_ps(h.grad_scale), _mm256_set1_ps(h.decay),      _mm256_set1_ps(h.one_minus_beta1),
          _mm256_set1_ps(h.one_minus_beta2), _mm256_set1_ps(h.beta2), _mm256_set1_ps(-h.step_size),
          _mm256_set1_ps(h.bc2_sqrt),      _mm256_set1_ps(h.eps)};
}

// 8 x int32 holding the bf16 bits of x.
HFSO_TARGET_AVX2 HFSO_INLINE __m256i rne_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7fff)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(kBf16NaN), nan);
}

// 16 bf16 values (a then b) in one register. packus works per 128-bit lane, the permute restores order.
HFSO_TARGET_AVX2 HFSO_INLINE __m256i pack_bf16(__m256 a, __m256 b) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(rne_bits(a), rne_bits(b)), 0xD8);
}

template <bool kBf16>
HFSO_TARGET_AVX2 HFSO_INLINE __m256 load_grad8(const void* g, int64_t i) {
  if constexpr (kBf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  }
}

HFSO_TARGET_AVX2 HFSO_INLINE void store8(float* dst, __m256 x, bool stream) {
  if (stream) {
    _mm256_stream_ps(dst, x);
  } else {
    _mm256_storeu_ps(dst, x);
  }
}

// The moment update from the scaled gradient: the step and the moment kernel share it.
HFSO_TARGET_AVX2 HFSO_INLINE void moments8(const Consts& c, __m256 g, __m256& m, __m256& v) {
  m = _mm256_fmadd_ps(c.omb1, _mm256_sub_ps(g, m), m);
  v = _mm256_fmadd_ps(c.omb2, _mm256_mul_ps(g, g), _mm256_mul_ps(v, c.beta2));
}

// Reads 8 lanes of the pre-step state from sp/sm/sv, writes the new state to p/m/v (streaming when
// `stream`: out of place only; p only when `store_p`, m/v only when `store_mv`) and returns the new p.
template <bool kBf16Grad>
HFSO_TARGET_AVX2 HFSO_INLINE __m256 step8(const AdamBuffers& b, const Consts& c, int64_t i, bool stream,
                                          bool store_p, bool store_mv) {
  __m256 p = _mm256_loadu_ps(b.sp + i);
  __m256 m = _mm256_loadu_ps(b.sm + i);
  __m256 v = _mm256_loadu_ps(b.sv + i);
  __m256 g = load_grad8<kBf16Grad>(b.grad, i);
  g = _mm256_mul_ps(g, c.gscale);
  p = _mm256_mul_ps(p, c.decay);
  moments8(c, g, m, v);
  const __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bc2), c.eps);
  p = _mm256_fmadd_ps(c.neg_step, _mm256_div_ps(m, den), p);
  if (store_p) store8(b.p + i, p, stream);
  if (store_mv) {
    store8(b.m + i, m, stream);
    store8(b.v + i, v, stream);
  }
  return p;
}

template <bool kBf16Grad, bool kOut, bool kOutOfPlace>
struct Step {
  HFSO_TARGET_AVX2 static void run(const AdamBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
    const Consts c = make_consts(h);
    // Scalar head up to a cache line of the streamed output (see head_elems and the AVX-512 body).
    const int64_t head = head_elems<kOut, kOutOfPlace>(b, i, end);
    adamw_step_scalar_loop<kBf16Grad, kOut, kOutOfPlace>(b, h, i, i + head);
    i += head;
    const auto aligned32 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 31) == 0; };
    const bool stream_out = kOut && b.stream_stores && aligned32(b.p_bf16 + i);
    // Out of place, p/m/v are write-only: streaming skips the destination's read-for-ownership (see the
    // AVX-512 body). 16 elements per iteration = one full line per stream when line aligned.
    const bool stream_state = kOutOfPlace && stream_state_ok(b, i);
    const bool store_p = b.store_master, store_mv = b.store_moments;
    for (; i + 16 <= end; i += 16) {
      if constexpr (kPrefetchElems > 0) {
        const int64_t j = i + kPrefetchElems;
        _mm_prefetch(reinterpret_cast<const char*>(b.sp + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b.sm + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b.sv + j), _MM_HINT_T0);
        _mm_prefetch(static_cast<const char*>(b.grad) + (kBf16Grad ? 2 : 4) * j, _MM_HINT_T0);
      }
      const __m256 p0 = step8<kBf16Grad>(b, c, i, stream_state, store_p, store_mv);
      const __m256 p1 = step8<kBf16Grad>(b, c, i + 8, stream_state, store_p, store_mv);
      if constexpr (kOut) {
        const __m256i o = pack_bf16(p0, p1);
        if (stream_out) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(b.p_bf16 + i), o);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.p_bf16 + i), o);
        }
      }
    }
    adamw_step_scalar_loop<kBf16Grad, kOut, kOutOfPlace>(b, h, i, end);
    if (stream_out || stream_state) _mm_sfence();
  }
};

HFSO_TARGET_AVX2 inline void step_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  dispatch3<Step>(b.grad_bf16, b.p_bf16 != nullptr, b.out_of_place, b, h, begin, end);
}

// Moments only ([Note: deferred moment stores]): 16 elements per iteration, a scalar head up to a cache line
// of m (so out of place the write-only m/v can stream) and a scalar tail.
template <bool kBf16Grad>
HFSO_TARGET_AVX2 void moments_impl(const MomentBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
  const Consts c = make_consts(h);
  int64_t head = static_cast<int64_t>(((64 - (reinterpret_cast<uintptr_t>(b.m + i) & 63)) & 63)) / 4;
  head = head < end - i ? head : end - i;
  adamw_moments_scalar_loop<kBf16Grad>(b, h, i, i + head);
  i += head;
  const bool stream = b.out_of_place && b.stream_stores && line_aligned(b.m + i) && line_aligned(b.v + i);
  for (; i + 16 <= end; i += 16) {
    for (int64_t j = i; j < i + 16; j += 8) {
      __m256 m = _mm256_loadu_ps(b.sm + j);
      __m256 v = _mm256_loadu_ps(b.sv + j);
      const __m256 g = _mm256_mul_ps(load_grad8<kBf16Grad>(b.grad, j), c.gscale);
      moments8(c, g, m, v);
      store8(b.m + j, m, stream);
      store8(b.v + j, v, stream);
    }
  }
  adamw_moments_scalar_loop<kBf16Grad>(b, h, i, end);
  if (stream) _mm_sfence();
}

HFSO_TARGET_AVX2 inline void moments_range(const MomentBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  b.grad_bf16 ? moments_impl<true>(b, h, begin, end) : moments_impl<false>(b, h, begin, end);
}

HFSO_TARGET_AVX2 inline void undo_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const bool out = b.p_bf16 != nullptr;
  if (b.grad_bf16) {
    out ? adamw_undo_loop<true, true>(b, h, begin, end) : adamw_undo_loop<true, false>(b, h, begin, end);
  } else {
    out ? adamw_undo_loop<false, true>(b, h, begin, end) : adamw_undo_loop<false, false>(b, h, begin, end);
  }
}

HFSO_TARGET_AVX2 inline SumsqResult sumsq_range(const void* g, bool bf16, int64_t begin, int64_t end) {
  return bf16 ? sumsq_loop<true>(g, begin, end) : sumsq_loop<false>(g, begin, end);
}

}  // namespace avx2

// ---- AVX-512 and AVX-512 + BF16 -------------------------------------------------------------------------

#define HFSO_K_NS avx512
#define HFSO_K_TARGET HFSO_TARGET_AVX512
#define HFSO_K_CVT cvt_bf16_avx512_int
#include "kernels_avx512_body.h"
#undef HFSO_K_NS
#undef HFSO_K_TARGET
#undef HFSO_K_CVT

#define HFSO_K_NS avx512_bf16
#define HFSO_K_TARGET HFSO_TARGET_AVX512BF16
#define HFSO_K_CVT cvt_bf16_avx512_native
#include "kernels_avx512_body.h"
#undef HFSO_K_NS
#undef HFSO_K_TARGET
#undef HFSO_K_CVT

// Sum of squares in fp64 (fp32 squares are exact there) and the inf/NaN count, 32 elements per iteration.
HFSO_TARGET_AVX512 HFSO_INLINE void sumsq_add16(__m512 x, __m512d& a0, __m512d& a1, int64_t& bad) {
  const __m512i expm = _mm512_set1_epi32(0x7f800000);
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  a0 = _mm512_fmadd_pd(lo, lo, a0);
  a1 = _mm512_fmadd_pd(hi, hi, a1);
  const __mmask16 nf = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), expm), expm);
  bad += __builtin_popcount(static_cast<unsigned>(nf));
}

template <bool kBf16>
HFSO_TARGET_AVX512 SumsqResult sumsq_avx512_impl(const void* g, int64_t i, int64_t end) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd(), a2 = _mm512_setzero_pd(), a3 = _mm512_setzero_pd();
  int64_t bad = 0;
  for (; i + 32 <= end; i += 32) {
    sumsq_add16(avx512::load_grad16<kBf16, false>(g, i, 0), a0, a1, bad);
    sumsq_add16(avx512::load_grad16<kBf16, false>(g, i + 16, 0), a2, a3, bad);
  }
  // the tail (< 32 elements) keeps lane = index mod 32 ([Note: fixed-order sums]): its first 16 go to a0/a1, the
  // rest to a2/a3 (a masked-off element loads 0 and adds +0, which leaves its lane as it was)
  const auto mask = [](int64_t n) { return static_cast<__mmask16>((1u << (n < 16 ? n : 16)) - 1u); };
  if (i < end) sumsq_add16(avx512::load_grad16<kBf16, true>(g, i, mask(end - i)), a0, a1, bad);
  if (i + 16 < end) sumsq_add16(avx512::load_grad16<kBf16, true>(g, i + 16, mask(end - i - 16)), a2, a3, bad);
  alignas(64) double lane[kSumsqLanes];
  _mm512_store_pd(lane, a0);
  _mm512_store_pd(lane + 8, a1);
  _mm512_store_pd(lane + 16, a2);
  _mm512_store_pd(lane + 24, a3);
  return {sumsq_lanes_total(lane), bad};
}

HFSO_TARGET_AVX512 inline SumsqResult sumsq_avx512(const void* g, bool bf16, int64_t begin, int64_t end) {
  return bf16 ? sumsq_avx512_impl<true>(g, begin, end) : sumsq_avx512_impl<false>(g, begin, end);
}

}  // namespace x86
}  // namespace hfso
