// Shared pieces of the CPU AdamW kernels: ISA names, call arguments, and the scalar element math that
// every SIMD path reproduces bit for bit. No torch dependency (the standalone test includes this).
//
// [Note: one rounding sequence for every path]
// Each path evaluates, per element and in fp32, exactly the same IEEE operations in the same order:
//
//   g   = grad * grad_scale
//   p   = p * decay                               decay = 1 - lr * weight_decay
//   m   = fma(1 - beta1, g - m, m)                torch's lerp_(g, 1 - beta1) for weights < 0.5
//   v   = fma(1 - beta2, g * g, v * beta2)        torch's mul_(beta2).addcmul_(g, g, 1 - beta2)
//   den = sqrt(v) / sqrt(1 - beta2**step) + eps   exact sqrt and division, as torch (no rsqrt)
//   p   = fma(-lr / (1 - beta1**step), m / den, p)
//
// sqrt, division and fma are correctly rounded on every ISA, and the build uses -ffp-contract=off, so the
// scalar reference, AVX2, AVX-512, NEON and SVE give identical fp32 results (the C++ test checks this).
// torch itself rounds some steps differently (no fma in places), so parity with torch is up to fp32
// rounding, not bitwise.
//
// [Note: deferred moment stores]
// A step may leave m and v unstored (AdamBuffers::store_moments = false): p and the bf16 copy are computed
// from the new m and v held in registers, and the moment kernel (MomentBuffers, moments_range) stores them
// later from the same pre-step m, v and gradient. Both evaluate the g, m and v lines above with the same
// operations in the same order (each path shares one helper between its step and its moment kernel), so the
// stored moments are bit for bit those of a step with store_moments = true.
//
// A step may also leave p unstored (AdamBuffers::store_master = false, only with store_moments = false and a
// bf16 copy): it then writes the bf16 copy of p_t and nothing else (reads p, m, v 12 B + bf16 grad 2 B, writes
// 2 B: 16 B/param). In place p, m, v keep p_{t-1}, m_{t-1}, v_{t-1}; out of place the destinations are not
// written at all. The state is committed later by an ordinary full step (store_moments = store_master = true)
// on the same pre-step state and gradient: since every store is of a value computed by the one sequence above,
// that step stores p_t, m_t, v_t bit for bit, and the early bf16 copy equals the bf16 copy of the full step.
// No SIMD path issues a store (streaming or not) for p when it is not stored; the head that aligns the
// streamed outputs then anchors on the bf16 copy (see head_elems).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define HFSO_INLINE inline __attribute__((always_inline))

namespace hfso {

enum class Isa : int { kScalar = 0, kAvx2, kAvx512, kAvx512Bf16, kNeon, kSve };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kNeon: return "neon";
    case Isa::kSve: return "sve";
  }
  return "unknown";
}

// fp32 constants of one AdamW call. Derived in double from the Python scalars, then rounded once, as torch
// does for its fp32 math.
struct AdamHyper {
  float decay;           // 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;       // lr / (1 - beta1**step)
  float bc2_sqrt;        // sqrt(1 - beta2**step)
  float eps;
  float grad_scale;
};

inline AdamHyper make_hyper(int64_t step, double lr, double beta1, double beta2, double eps,
                            double weight_decay, double grad_scale) {
  AdamHyper h;
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  h.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  h.eps = static_cast<float>(eps);
  h.grad_scale = static_cast<float>(grad_scale);
  return h;
}

// Pointers of one call. The step reads the pre-step state from sp/sm/sv and writes the new state to p/m/v:
// in place the two are the same arrays; out of place (double-buffered state) they are disjoint, p/m/v are
// pure outputs and the source is left unchanged. Optional outputs are null when absent.
struct AdamBuffers {
  float* p;              // new state (written)
  float* m;
  float* v;
  const float* sp;       // pre-step state (read): equal to p/m/v in place
  const float* sm;
  const float* sv;
  const void* grad;      // float* or uint16_t* (bf16 bits), see grad_bf16
  bool grad_bf16;
  uint16_t* p_bf16;      // bf16 bits of the updated param (optional)
  bool out_of_place;     // sp/sm/sv are all disjoint from p/m/v (the p/m/v stores may then stream)
  bool stream_stores;    // write-only outputs may use non-temporal stores (large calls only)
  bool store_moments = true;  // false: m/v are neither written nor modified ([Note: deferred moment stores])
  bool store_master = true;   // false: p is neither written nor modified, only the bf16 copy (same Note)
};

// Pointers of one moment-only call: m_t, v_t from the pre-step sm/sv and the gradient, stored to m/v (in place:
// the same arrays; out of place: disjoint, m/v are pure outputs).
struct MomentBuffers {
  float* m;
  float* v;
  const float* sm;
  const float* sv;
  const void* grad;
  bool grad_bf16;
  bool out_of_place;
  bool stream_stores;
};

// In-place buffers (the source is the destination).
inline AdamBuffers inplace_buffers(float* p, float* m, float* v, const void* grad, bool grad_bf16,
                                   uint16_t* p_bf16, bool stream_stores) {
  return AdamBuffers{p, m, v, p, m, v, grad, grad_bf16, p_bf16, false, stream_stores};
}

// ---- bf16 <-> fp32 bit conversions ----------------------------------------------------------------------

HFSO_INLINE float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as ATen's vectorised fp32->bf16 conversion: NaN -> 0xFFFF (ATen's scalar c10 path
// gives 0x7FC0; both are NaN), denormals kept (no flush to zero), overflow rounds to +-inf.
constexpr uint16_t kBf16NaN = 0xFFFF;

HFSO_INLINE uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return kBf16NaN;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <bool kBf16>
HFSO_INLINE float load_grad(const void* g, int64_t i) {
  if constexpr (kBf16) {
    return bf16_bits_to_f32(static_cast<const uint16_t*>(g)[i]);
  } else {
    return static_cast<const float*>(g)[i];
  }
}

// ---- scalar element math (the reference every SIMD path matches) -----------------------------------------

// The moment update of one element, from the scaled gradient (shared by the step and the moment kernel).
HFSO_INLINE void adamw_moments_elem(const AdamHyper& h, float& m, float& v, float g) {
  m = std::fma(h.one_minus_beta1, g - m, m);
  v = std::fma(h.one_minus_beta2, g * g, v * h.beta2);
}

HFSO_INLINE void adamw_elem(const AdamHyper& h, float& p, float& m, float& v, float g) {
  g = g * h.grad_scale;
  p = p * h.decay;
  adamw_moments_elem(h, m, v, g);
  const float den = std::sqrt(v) / h.bc2_sqrt + h.eps;
  p = std::fma(-h.step_size, m / den, p);
}

// Algebraic inverse of adamw_elem on the post-step state (exact up to fp32 rounding, not bitwise).
HFSO_INLINE void adamw_undo_elem(const AdamHyper& h, float& p, float& m, float& v, float g) {
  g = g * h.grad_scale;
  const float den = std::sqrt(v) / h.bc2_sqrt + h.eps;
  p = std::fma(h.step_size, m / den, p);
  p = p / h.decay;
  m = std::fma(-h.one_minus_beta1, g, m) / h.beta1;
  const float vv = std::fma(-h.one_minus_beta2, g * g, v) / h.beta2;
  v = vv < 0.0f ? 0.0f : vv;  // NaN propagates (comparison is false)
}

// One element of the step, with the optional outputs. Used by the scalar path and by SIMD heads and tails.
// kOutOfPlace only selects the SIMD paths' store flavour; the element is read from sp/sm/sv either way.
template <bool kBf16Grad, bool kOut, bool kOutOfPlace>
HFSO_INLINE void adamw_step_one(const AdamBuffers& b, const AdamHyper& h, int64_t i) {
  float p = b.sp[i], m = b.sm[i], v = b.sv[i];
  adamw_elem(h, p, m, v, load_grad<kBf16Grad>(b.grad, i));
  if (b.store_master) b.p[i] = p;
  if (b.store_moments) {
    b.m[i] = m;
    b.v[i] = v;
  }
  if constexpr (kOut) b.p_bf16[i] = f32_to_bf16_bits(p);
}

template <bool kBf16Grad, bool kOut, bool kOutOfPlace>
HFSO_INLINE void adamw_step_scalar_loop(const AdamBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
  for (; i < end; ++i) adamw_step_one<kBf16Grad, kOut, kOutOfPlace>(b, h, i);
}

template <bool kBf16Grad>
HFSO_INLINE void adamw_moments_one(const MomentBuffers& b, const AdamHyper& h, int64_t i) {
  float m = b.sm[i], v = b.sv[i];
  adamw_moments_elem(h, m, v, load_grad<kBf16Grad>(b.grad, i) * h.grad_scale);
  b.m[i] = m;
  b.v[i] = v;
}

template <bool kBf16Grad>
HFSO_INLINE void adamw_moments_scalar_loop(const MomentBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
  for (; i < end; ++i) adamw_moments_one<kBf16Grad>(b, h, i);
}

// True when q sits on a 64-byte (cache line) boundary.
HFSO_INLINE bool line_aligned(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 63) == 0; }

// Elements to peel (scalar or masked) before a SIMD main loop starting at i, so that the main loop's stores
// start on a cache line: needed for streaming stores, and loads/stores then never split a line when the
// buffers share an alignment. In place the anchor is the bf16 copy when there is one (its streaming store
// is a full line), else p. Out of place the p/m/v stores are the ones that stream (12 B/param against 2),
// so the anchor is p, unless aligning the bf16 copy aligns p/m/v as well (same element offset in
// line-aligned arenas, the usual layout). When a step stores neither p nor m/v ([Note: deferred moment
// stores]) the bf16 copy is its only output and the anchor. Clamped to end - i.
template <bool kOut, bool kOutOfPlace>
HFSO_INLINE int64_t head_elems(const AdamBuffers& b, int64_t i, int64_t end) {
  const auto to_line = [](const void* q, int64_t esize) {
    return static_cast<int64_t>(((64 - (reinterpret_cast<uintptr_t>(q) & 63)) & 63)) / esize;
  };
  int64_t head = to_line(b.p + i, 4);
  if constexpr (kOut) {
    const int64_t h_out = to_line(b.p_bf16 + i, 2);
    const bool state_stored = b.store_master || b.store_moments;
    if (!kOutOfPlace || !state_stored ||
        (line_aligned(b.p + i + h_out) && line_aligned(b.m + i + h_out) && line_aligned(b.v + i + h_out))) {
      head = h_out;
    }
  }
  return head < end - i ? head : end - i;
}

// Whether an out-of-place step's p/m/v stores may stream from element i on: every array it stores starts on a
// cache line there (the main loops then write whole lines), and it stores at least one of them.
HFSO_INLINE bool stream_state_ok(const AdamBuffers& b, int64_t i) {
  const bool p_ok = !b.store_master || line_aligned(b.p + i);
  const bool mv_ok = !b.store_moments || (line_aligned(b.m + i) && line_aligned(b.v + i));
  return b.out_of_place && b.stream_stores && (b.store_master || b.store_moments) && p_ok && mv_ok;
}

// The undo loop is written once and compiled under each ISA's target attribute (the compiler vectorises
// it there). Rollback is rare, so it carries no hand-written SIMD.
template <bool kBf16Grad, bool kOut>
HFSO_INLINE void adamw_undo_loop(const AdamBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
  float* __restrict p = b.p;
  float* __restrict m = b.m;
  float* __restrict v = b.v;
  uint16_t* __restrict out = b.p_bf16;
  for (; i < end; ++i) {
    float pp = p[i], mm = m[i], vv = v[i];
    adamw_undo_elem(h, pp, mm, vv, load_grad<kBf16Grad>(b.grad, i));
    p[i] = pp;
    m[i] = mm;
    v[i] = vv;
    if constexpr (kOut) out[i] = f32_to_bf16_bits(pp);
  }
}

// Sum of squares (fp64 accumulation; fp32 squares are exact in fp64) and count of inf/NaN elements.
struct SumsqResult {
  double sumsq = 0.0;
  int64_t nonfinite = 0;
};

// [Note: fixed-order sums]
// The gradient norm decides the clip coefficient, so its sum of squares must not depend on how the work is
// split: every path adds in one order, defined on the element index relative to the start of the range. Lane
// k of kSumsqLanes fp64 accumulators adds x_j^2 for every j = k (mod kSumsqLanes), in increasing j (a square is
// exact in fp64, so fma(x, x, acc) and acc + x * x are the same operation); the lanes are then summed by the
// fixed tree of sumsq_lanes_total. The scalar loop below (which the compiler may vectorise: the lanes are
// independent, nothing is reassociated) and the AVX-512 loop (four vectors of 8 lanes) give the same bits. A
// whole tensor is cut into kSumsqBlockElems blocks at fixed offsets, whatever the thread count, and the blocks'
// sums are added in block order (sumsq_blocks in adam_kernels.h). A `#pragma omp simd reduction` instead lets
// the compiler pick the order, and it peels for alignment: the bits then depended on the ISA and the address.
constexpr int kSumsqLanes = 32;

// The fixed reduction tree: halving, lane k += lane k + w for w = 16, 8, 4, 2, 1.
HFSO_INLINE double sumsq_lanes_total(double* lane) {
  for (int w = kSumsqLanes / 2; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) lane[k] += lane[k + w];
  }
  return lane[0];
}

template <bool kBf16>
HFSO_INLINE void sumsq_add_one(const void* grad, int64_t j, double& lane, int64_t& bad) {
  const float f = load_grad<kBf16>(grad, j);
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const double d = static_cast<double>(f);
  lane += d * d;
  bad += ((u & 0x7f800000u) == 0x7f800000u) ? 1 : 0;
}

template <bool kBf16>
HFSO_INLINE SumsqResult sumsq_loop(const void* grad, int64_t i, int64_t end) {
  double lane[kSumsqLanes] = {};
  int64_t bad = 0;
  for (; i + kSumsqLanes <= end; i += kSumsqLanes) {
    for (int k = 0; k < kSumsqLanes; ++k) sumsq_add_one<kBf16>(grad, i + k, lane[k], bad);
  }
  for (int k = 0; i + k < end; ++k) sumsq_add_one<kBf16>(grad, i + k, lane[k], bad);
  return {sumsq_lanes_total(lane), bad};
}

// Dispatches a runtime flag triple to a template instantiation.
template <template <bool, bool, bool> class K, class... A>
HFSO_INLINE void dispatch3(bool a, bool b, bool c, A&&... args) {
  if (a) {
    if (b) {
      c ? K<true, true, true>::run(args...) : K<true, true, false>::run(args...);
    } else {
      c ? K<true, false, true>::run(args...) : K<true, false, false>::run(args...);
    }
  } else {
    if (b) {
      c ? K<false, true, true>::run(args...) : K<false, true, false>::run(args...);
    } else {
      c ? K<false, false, true>::run(args...) : K<false, false, false>::run(args...);
    }
  }
}

}  // namespace hfso
