// aarch64 AdamW kernels: NEON (baseline on every aarch64 CPU) and SVE (vector-length agnostic, any VL).
// SVE code carries a per-function target attribute, so the library is built for plain armv8-a and the
// SVE path is only entered when the kernel reports HWCAP_SVE (see adam_kernels.h).
#pragma once

#include <arm_neon.h>
#include <arm_sve.h>
#include <sys/auxv.h>

#include "kernels_common.h"

#ifndef HWCAP_SVE
#define HWCAP_SVE (1 << 22)
#endif

#if defined(__clang__)
#define HFSO_TARGET_SVE __attribute__((target("sve")))  // clang spelling (not tested: only GCC 12 was)
#else
#define HFSO_TARGET_SVE __attribute__((target("+sve")))
#endif

namespace hfso {
namespace arm {

inline bool cpu_has_sve() { return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0; }

// SVE vector length in bytes (call only when cpu_has_sve()).
HFSO_TARGET_SVE inline int sve_vector_bytes() { return static_cast<int>(svcntb()); }

// ---- NEON -----------------------------------------------------------------------------------------------

namespace neon {

struct Consts {
  float32x4_t gscale, decay, omb1, omb2, beta2, neg_step, bc2, eps;
};

HFSO_INLINE Consts make_consts(const AdamHyper& h) {
  return {vdupq_n_f32(h.grad_scale),      vdupq_n_f32(h.decay), vdupq_n_f32(h.one_minus_beta1),
          vdupq_n_f32(h.one_minus_beta2), vdupq_n_f32(h.beta2), vdupq_n_f32(-h.step_size),
          vdupq_n_f32(h.bc2_sqrt),        vdupq_n_f32(h.eps)};
}

HFSO_INLINE uint16x4_t cvt_bf16(float32x4_t x) {
  const uint32x4_t u = vreinterpretq_u32_f32(x);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint16x4_t r = vshrn_n_u32(vaddq_u32(vaddq_u32(u, lsb), vdupq_n_u32(0x7fff)), 16);
  const uint16x4_t is_num = vmovn_u32(vceqq_f32(x, x));
  return vbsl_u16(is_num, r, vdup_n_u16(kBf16NaN));
}

template <bool kBf16>
HFSO_INLINE float32x4_t load_grad4(const void* g, int64_t i) {
  if constexpr (kBf16) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(g) + i), 16));
  } else {
    return vld1q_f32(static_cast<const float*>(g) + i);
  }
}

// The moment update from the scaled gradient: the step and the moment kernel share it.
HFSO_INLINE void moments4(const Consts& c, float32x4_t g, float32x4_t& m, float32x4_t& v) {
  m = vfmaq_f32(m, c.omb1, vsubq_f32(g, m));
  v = vfmaq_f32(vmulq_f32(v, c.beta2), c.omb2, vmulq_f32(g, g));
}

// Reads 4 lanes of the pre-step state from sp/sm/sv, writes the new state to p/m/v (p only when `store_p`,
// m/v only when `store_mv`), returns the new p.
template <bool kBf16Grad>
HFSO_INLINE float32x4_t step4(const AdamBuffers& b, const Consts& c, int64_t i, bool store_p, bool store_mv) {
  float32x4_t p = vld1q_f32(b.sp + i);
  float32x4_t m = vld1q_f32(b.sm + i);
  float32x4_t v = vld1q_f32(b.sv + i);
  float32x4_t g = load_grad4<kBf16Grad>(b.grad, i);
  g = vmulq_f32(g, c.gscale);
  p = vmulq_f32(p, c.decay);
  moments4(c, g, m, v);
  const float32x4_t den = vaddq_f32(vdivq_f32(vsqrtq_f32(v), c.bc2), c.eps);
  p = vfmaq_f32(p, c.neg_step, vdivq_f32(m, den));
  if (store_p) vst1q_f32(b.p + i, p);
  if (store_mv) {
    vst1q_f32(b.m + i, m);
    vst1q_f32(b.v + i, v);
  }
  return p;
}

// NOTE: out of place, NEON keeps regular stores (plain NEON has no non-temporal store intrinsic; STNP would
// need inline asm). Arm cores detect streaming full-line writes and skip the read-for-ownership themselves
// (write streaming mode), which is not measured here (qemu only).
template <bool kBf16Grad, bool kOut, bool kOutOfPlace>
struct Step {
  static void run(const AdamBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
    const Consts c = make_consts(h);
    const bool store_p = b.store_master, store_mv = b.store_moments;
    for (; i + 16 <= end; i += 16) {
      __builtin_prefetch(b.sp + i + 1024);
      __builtin_prefetch(b.sm + i + 1024);
      __builtin_prefetch(b.sv + i + 1024);
      const float32x4_t p0 = step4<kBf16Grad>(b, c, i, store_p, store_mv);
      const float32x4_t p1 = step4<kBf16Grad>(b, c, i + 4, store_p, store_mv);
      const float32x4_t p2 = step4<kBf16Grad>(b, c, i + 8, store_p, store_mv);
      const float32x4_t p3 = step4<kBf16Grad>(b, c, i + 12, store_p, store_mv);
      if constexpr (kOut) {
        vst1q_u16(b.p_bf16 + i, vcombine_u16(cvt_bf16(p0), cvt_bf16(p1)));
        vst1q_u16(b.p_bf16 + i + 8, vcombine_u16(cvt_bf16(p2), cvt_bf16(p3)));
      }
    }
    adamw_step_scalar_loop<kBf16Grad, kOut, kOutOfPlace>(b, h, i, end);
  }
};

inline void step_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  dispatch3<Step>(b.grad_bf16, b.p_bf16 != nullptr, b.out_of_place, b, h, begin, end);
}

// Moments only ([Note: deferred moment stores]), 8 elements per iteration, scalar tail (regular stores, as
// the out-of-place step).
template <bool kBf16Grad>
void moments_impl(const MomentBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
  const Consts c = make_consts(h);
  for (; i + 8 <= end; i += 8) {
    for (int64_t j = i; j < i + 8; j += 4) {
      float32x4_t m = vld1q_f32(b.sm + j);
      float32x4_t v = vld1q_f32(b.sv + j);
      const float32x4_t g = vmulq_f32(load_grad4<kBf16Grad>(b.grad, j), c.gscale);
      moments4(c, g, m, v);
      vst1q_f32(b.m + j, m);
      vst1q_f32(b.v + j, v);
    }
  }
  adamw_moments_scalar_loop<kBf16Grad>(b, h, i, end);
}

inline void moments_range(const MomentBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  b.grad_bf16 ? moments_impl<true>(b, h, begin, end) : moments_impl<false>(b, h, begin, end);
}

}  // namespace neon

// ---- SVE ------------------------------------------------------------------------------------------------

namespace sve {

// The scaled gradient of one vector (bf16 upcast in registers).
template <bool kBf16Grad>
HFSO_TARGET_SVE HFSO_INLINE svfloat32_t load_grad_vec(const void* grad, const AdamHyper& h, int64_t i,
                                                      svbool_t pg) {
  svfloat32_t g;
  if constexpr (kBf16Grad) {
    const svuint32_t gh = svld1uh_u32(pg, static_cast<const uint16_t*>(grad) + i);
    g = svreinterpret_f32_u32(svlsl_n_u32_x(pg, gh, 16));
  } else {
    g = svld1_f32(pg, static_cast<const float*>(grad) + i);
  }
  return svmul_n_f32_x(pg, g, h.grad_scale);
}

// The moment update from the scaled gradient: the step and the moment kernel share it.
HFSO_TARGET_SVE HFSO_INLINE void moments_vec(const AdamHyper& h, svbool_t pg, svfloat32_t g, svfloat32_t& m,
                                             svfloat32_t& v) {
  m = svmla_n_f32_x(pg, m, svsub_f32_x(pg, g, m), h.one_minus_beta1);
  v = svmla_n_f32_x(pg, svmul_n_f32_x(pg, v, h.beta2), svmul_f32_x(pg, g, g), h.one_minus_beta2);
}

HFSO_TARGET_SVE HFSO_INLINE void store_vec(svbool_t pg, float* dst, svfloat32_t x, bool stream) {
  if (stream) {
    svstnt1_f32(pg, dst, x);
  } else {
    svst1_f32(pg, dst, x);
  }
}

// Reads one vector of the pre-step state from sp/sm/sv and writes the new state to p/m/v, non-temporal
// (STNT1) when `stream`: out of place only; p only when `store_p`, m/v only when `store_mv`.
template <bool kBf16Grad, bool kOut>
HFSO_TARGET_SVE HFSO_INLINE void step_vec(const AdamBuffers& b, const AdamHyper& h, int64_t i, svbool_t pg,
                                          bool stream, bool store_p, bool store_mv) {
  svfloat32_t p = svld1_f32(pg, b.sp + i);
  svfloat32_t m = svld1_f32(pg, b.sm + i);
  svfloat32_t v = svld1_f32(pg, b.sv + i);
  const svfloat32_t g = load_grad_vec<kBf16Grad>(b.grad, h, i, pg);
  p = svmul_n_f32_x(pg, p, h.decay);
  moments_vec(h, pg, g, m, v);
  const svfloat32_t den = svadd_n_f32_x(pg, svdiv_n_f32_x(pg, svsqrt_f32_x(pg, v), h.bc2_sqrt), h.eps);
  p = svmla_n_f32_x(pg, p, svdiv_f32_x(pg, m, den), -h.step_size);
  if (store_p) store_vec(pg, b.p + i, p, stream);
  if (store_mv) {
    store_vec(pg, b.m + i, m, stream);
    store_vec(pg, b.v + i, v, stream);
  }
  if constexpr (kOut) {
    const svuint32_t u = svreinterpret_u32_f32(p);
    const svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, u, 16), 1);
    svuint32_t r = svlsr_n_u32_x(pg, svadd_n_u32_x(pg, svadd_u32_x(pg, u, lsb), 0x7fff), 16);
    r = svsel_u32(svcmpuo_f32(pg, p, p), svdup_n_u32(kBf16NaN), r);
    svst1h_u32(pg, b.p_bf16 + i, r);
  }
}

template <bool kBf16Grad, bool kOut, bool kOutOfPlace>
struct Step {
  // Two vectors per iteration; the predicates cover the tail, so there is no scalar remainder.
  HFSO_TARGET_SVE static void run(const AdamBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
    const int64_t vl = static_cast<int64_t>(svcntw());
    // Out of place, p/m/v are write-only (see the AVX-512 body); STNT1 has no alignment requirement.
    const bool stream = kOutOfPlace && b.stream_stores;
    const bool store_p = b.store_master, store_mv = b.store_moments;
    for (; i < end; i += 2 * vl) {
      svprfw(svptrue_b32(), b.sp + i + 1024, SV_PLDL1STRM);
      svprfw(svptrue_b32(), b.sm + i + 1024, SV_PLDL1STRM);
      svprfw(svptrue_b32(), b.sv + i + 1024, SV_PLDL1STRM);
      step_vec<kBf16Grad, kOut>(b, h, i, svwhilelt_b32_s64(i, end), stream, store_p, store_mv);
      step_vec<kBf16Grad, kOut>(b, h, i + vl, svwhilelt_b32_s64(i + vl, end), stream, store_p, store_mv);
    }
  }
};

// Moments only ([Note: deferred moment stores]); predicated, no scalar remainder.
template <bool kBf16Grad>
HFSO_TARGET_SVE void moments_impl(const MomentBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
  const int64_t vl = static_cast<int64_t>(svcntw());
  const bool stream = b.out_of_place && b.stream_stores;
  for (; i < end; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, end);
    svfloat32_t m = svld1_f32(pg, b.sm + i);
    svfloat32_t v = svld1_f32(pg, b.sv + i);
    moments_vec(h, pg, load_grad_vec<kBf16Grad>(b.grad, h, i, pg), m, v);
    store_vec(pg, b.m + i, m, stream);
    store_vec(pg, b.v + i, v, stream);
  }
}

HFSO_TARGET_SVE inline void moments_range(const MomentBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  b.grad_bf16 ? moments_impl<true>(b, h, begin, end) : moments_impl<false>(b, h, begin, end);
}

HFSO_TARGET_SVE inline void step_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  dispatch3<Step>(b.grad_bf16, b.p_bf16 != nullptr, b.out_of_place, b, h, begin, end);
}

HFSO_TARGET_SVE inline void undo_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const bool out = b.p_bf16 != nullptr;
  if (b.grad_bf16) {
    out ? adamw_undo_loop<true, true>(b, h, begin, end) : adamw_undo_loop<true, false>(b, h, begin, end);
  } else {
    out ? adamw_undo_loop<false, true>(b, h, begin, end) : adamw_undo_loop<false, false>(b, h, begin, end);
  }
}

}  // namespace sve
}  // namespace arm
}  // namespace hfso
