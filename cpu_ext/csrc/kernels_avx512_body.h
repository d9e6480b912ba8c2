// AVX-512 AdamW body. Included twice by kernels_x86.h (no include guard, on purpose): once for plain
// AVX-512 and once with AVX512_BF16 enabled, because a GCC target attribute is per function, and a helper
// compiled without avx512bf16 may not inline the bf16 conversion intrinsic.
//
// Expects: HFSO_K_NS (namespace), HFSO_K_TARGET (target attribute), HFSO_K_CVT (fp32x16 -> bf16x16 bits).

namespace HFSO_K_NS {

struct Consts {
  __m512 gscale, decay, omb1, omb2, beta2, neg_step, bc2, eps;
};

HFSO_K_TARGET HFSO_INLINE Consts make_consts(const AdamHyper& h) {
  return {_mm512_set1_ps(h.grad_scale), _mm512_set1_ps(h.decay),      _mm512_set1_ps(h.one_minus_beta1),
          _mm512_set1_ps(h.one_minus_beta2), _mm512_set1_ps(h.beta2), _mm512_set1_ps(-h.step_size),
          _mm512_set1_ps(h.bc2_sqrt),      _mm512_set1_ps(h.eps)};
}

template <bool kMasked>
HFSO_K_TARGET HFSO_INLINE __m512 load_f32(const float* p, __mmask16 k) {
  if constexpr (kMasked) return _mm512_maskz_loadu_ps(k, p);
  return _mm512_loadu_ps(p);
}

template <bool kBf16, bool kMasked>
HFSO_K_TARGET HFSO_INLINE __m512 load_grad16(const void* g, int64_t i, __mmask16 k) {
  if constexpr (kBf16) {
    const uint16_t* src = static_cast<const uint16_t*>(g) + i;
    __m256i h;
    if constexpr (kMasked) {
      h = _mm256_maskz_loadu_epi16(k, src);
    } else {
      h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return load_f32<kMasked>(static_cast<const float*>(g) + i, k);
  }
}

template <bool kMasked>
HFSO_K_TARGET HFSO_INLINE void store_f32(float* dst, __m512 x, __mmask16 k, bool stream) {
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(dst, k, x);
  } else if (stream) {
    _mm512_stream_ps(dst, x);
  } else {
    _mm512_storeu_ps(dst, x);
  }
}

// The moment update from the scaled gradient: the step and the moment kernel share it.
HFSO_K_TARGET HFSO_INLINE void moments16(const Consts& c, __m512 g, __m512& m, __m512& v) {
  m = _mm512_fmadd_ps(c.omb1, _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(c.omb2, _mm512_mul_ps(g, g), _mm512_mul_ps(v, c.beta2));
}

// Reads 16 lanes of the pre-step state from sp/sm/sv, writes the new state to p/m/v (streaming when
// `stream`: out of place only, never on masked lanes; p only when `store_p`, m/v only when `store_mv`) and
// returns the new p.
template <bool kBf16Grad, bool kMasked>
HFSO_K_TARGET HFSO_INLINE __m512 step16(const AdamBuffers& b, const Consts& c, int64_t i, __mmask16 k,
                                        bool stream, bool store_p, bool store_mv) {
  __m512 p = load_f32<kMasked>(b.sp + i, k);
  __m512 m = load_f32<kMasked>(b.sm + i, k);
  __m512 v = load_f32<kMasked>(b.sv + i, k);
  __m512 g = load_grad16<kBf16Grad, kMasked>(b.grad, i, k);
  g = _mm512_mul_ps(g, c.gscale);
  p = _mm512_mul_ps(p, c.decay);
  moments16(c, g, m, v);
  const __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bc2), c.eps);
  p = _mm512_fmadd_ps(c.neg_step, _mm512_div_ps(m, den), p);
  if (store_p) store_f32<kMasked>(b.p + i, p, k, stream);
  if (store_mv) {
    store_f32<kMasked>(b.m + i, m, k, stream);
    store_f32<kMasked>(b.v + i, v, k, stream);
  }
  return p;
}

template <bool kBf16Grad, bool kOut>
HFSO_K_TARGET HFSO_INLINE void step_masked(const AdamBuffers& b, const Consts& c, int64_t i, int64_t n,
                                           bool store_p, bool store_mv) {
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1u);  // 1 <= n <= 16
  const __m512 p = step16<kBf16Grad, true>(b, c, i, k, false, store_p, store_mv);
  if constexpr (kOut) _mm256_mask_storeu_epi16(b.p_bf16 + i, k, HFSO_K_CVT(p));
}

template <bool kBf16Grad, bool kOut, bool kOutOfPlace>
struct Step {
  HFSO_K_TARGET static void run(const AdamBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
    const Consts c = make_consts(h);
    const bool store_p = b.store_master, store_mv = b.store_moments;
    int64_t head = head_elems<kOut, kOutOfPlace>(b, i, end);
    while (head > 0) {
      const int64_t n = head < 16 ? head : 16;
      step_masked<kBf16Grad, kOut>(b, c, i, n, store_p, store_mv);
      i += n;
      head -= n;
    }
    const bool stream_out = kOut && b.stream_stores && line_aligned(b.p_bf16 + i);
    // Out of place, p/m/v are write-only: streaming them skips the read-for-ownership of the destination,
    // so the step moves the same 28 B/param as in place. In place the lines were just read: never stream.
    // Only the arrays the call stores stream (and count for the alignment): see stream_state_ok.
    const bool stream_state = kOutOfPlace && stream_state_ok(b, i);
    // 32 elements per iteration: two fp32 lines per p/m/v stream and one full line of bf16 output.
    for (; i + 32 <= end; i += 32) {
      if constexpr (kPrefetchElems > 0) {
        const int64_t j = i + kPrefetchElems;
        _mm_prefetch(reinterpret_cast<const char*>(b.sp + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b.sp + j + 16), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b.sm + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b.sm + j + 16), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b.sv + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b.sv + j + 16), _MM_HINT_T0);
        if constexpr (kBf16Grad) {
          _mm_prefetch(static_cast<const char*>(b.grad) + 2 * j, _MM_HINT_T0);
        } else {
          _mm_prefetch(static_cast<const char*>(b.grad) + 4 * j, _MM_HINT_T0);
          _mm_prefetch(static_cast<const char*>(b.grad) + 4 * j + 64, _MM_HINT_T0);
        }
      }
      const __m512 p0 = step16<kBf16Grad, false>(b, c, i, 0, stream_state, store_p, store_mv);
      const __m512 p1 = step16<kBf16Grad, false>(b, c, i + 16, 0, stream_state, store_p, store_mv);
      if constexpr (kOut) {
        const __m512i o = _mm512_inserti64x4(_mm512_castsi256_si512(HFSO_K_CVT(p0)), HFSO_K_CVT(p1), 1);
        if (stream_out) {
          _mm512_stream_si512(reinterpret_cast<__m512i*>(b.p_bf16 + i), o);
        } else {
          _mm512_storeu_si512(b.p_bf16 + i, o);
        }
      }
    }
    while (i < end) {
      const int64_t n = end - i < 16 ? end - i : 16;
      step_masked<kBf16Grad, kOut>(b, c, i, n, store_p, store_mv);
      i += n;
    }
    if (stream_out || stream_state) _mm_sfence();  // order the weakly-ordered streaming stores
  }
};

HFSO_K_TARGET inline void step_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  dispatch3<Step>(b.grad_bf16, b.p_bf16 != nullptr, b.out_of_place, b, h, begin, end);
}

// Moments only ([Note: deferred moment stores]): m_t, v_t of 16 lanes from sm/sv and the gradient.
template <bool kBf16Grad, bool kMasked>
HFSO_K_TARGET HFSO_INLINE void moments_lanes(const MomentBuffers& b, const Consts& c, int64_t i, __mmask16 k,
                                             bool stream) {
  __m512 m = load_f32<kMasked>(b.sm + i, k);
  __m512 v = load_f32<kMasked>(b.sv + i, k);
  const __m512 g = _mm512_mul_ps(load_grad16<kBf16Grad, kMasked>(b.grad, i, k), c.gscale);
  moments16(c, g, m, v);
  store_f32<kMasked>(b.m + i, m, k, stream);
  store_f32<kMasked>(b.v + i, v, k, stream);
}

// A masked head up to a cache line of m (out of place, the write-only m/v then stream), 32 elements per
// iteration, a masked tail.
template <bool kBf16Grad>
HFSO_K_TARGET void moments_impl(const MomentBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
  const Consts c = make_consts(h);
  int64_t head = static_cast<int64_t>(((64 - (reinterpret_cast<uintptr_t>(b.m + i) & 63)) & 63)) / 4;
  head = head < end - i ? head : end - i;
  if (head > 0) {
    moments_lanes<kBf16Grad, true>(b, c, i, static_cast<__mmask16>((1u << head) - 1u), false);
    i += head;
  }
  const bool stream = b.out_of_place && b.stream_stores && line_aligned(b.m + i) && line_aligned(b.v + i);
  for (; i + 32 <= end; i += 32) {
    moments_lanes<kBf16Grad, false>(b, c, i, 0, stream);
    moments_lanes<kBf16Grad, false>(b, c, i + 16, 0, stream);
  }
  while (i < end) {
    const int64_t n = end - i < 16 ? end - i : 16;
    moments_lanes<kBf16Grad, true>(b, c, i, static_cast<__mmask16>((1u << n) - 1u), false);
    i += n;
  }
  if (stream) _mm_sfence();
}

HFSO_K_TARGET inline void moments_range(const MomentBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  b.grad_bf16 ? moments_impl<true>(b, h, begin, end) : moments_impl<false>(b, h, begin, end);
}

HFSO_K_TARGET inline void undo_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const bool out = b.p_bf16 != nullptr;
  if (b.grad_bf16) {
    out ? adamw_undo_loop<true, true>(b, h, begin, end) : adamw_undo_loop<true, false>(b, h, begin, end);
  } else {
    out ? adamw_undo_loop<false, true>(b, h, begin, end) : adamw_undo_loop<false, false>(b, h, begin, end);
  }
}

}  // namespace HFSO_K_NS
