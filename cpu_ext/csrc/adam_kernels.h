// CPU AdamW kernel core: ISA detection, run-time dispatch, and the static parallel partition.
// Plain C++ (no torch); included by the torch op (adam_op.cpp) and by the standalone test
// (test_kernels.cpp). OpenMP is optional: without -fopenmp the driver runs on the calling thread.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "kernels_common.h"

#if defined(__x86_64__)
#include "kernels_x86.h"
#elif defined(__aarch64__)
#include "kernels_arm.h"
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace hfso {

// Paths this build contains and this CPU can run, as a bit mask over Isa.
inline unsigned supported_isa_mask() {
  unsigned mask = 1u << static_cast<int>(Isa::kScalar);
#if defined(__x86_64__)
  if (x86::cpu_has_avx2()) mask |= 1u << static_cast<int>(Isa::kAvx2);
  if (x86::cpu_has_avx512()) mask |= 1u << static_cast<int>(Isa::kAvx512);
  if (x86::cpu_has_avx512_bf16()) mask |= 1u << static_cast<int>(Isa::kAvx512Bf16);
#elif defined(__aarch64__)
  mask |= 1u << static_cast<int>(Isa::kNeon);
  if (arm::cpu_has_sve()) mask |= 1u << static_cast<int>(Isa::kSve);
#endif
  return mask;
}

inline bool isa_supported(Isa isa) { return (supported_isa_mask() >> static_cast<int>(isa)) & 1u; }

inline Isa best_isa() {
  static const Isa best = [] {
    for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kSve, Isa::kNeon}) {
      if (isa_supported(isa)) return isa;
    }
    return Isa::kScalar;
  }();
  return best;
}

inline bool parse_isa(const char* s, Isa* out) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kNeon, Isa::kSve}) {
    if (std::strcmp(s, isa_name(isa)) == 0) {
      *out = isa;
      return true;
    }
  }
  return false;
}

// The path to run: `forced` (e.g. from HF_SUPEROFFLOAD_CPU_ADAM_ISA) or the best supported one. Returns
// false with a message in `error` when the forced name is unknown or this CPU cannot run it.
inline bool resolve_isa(const char* forced, Isa* out, const char** error) {
  *error = nullptr;
  if (forced == nullptr || forced[0] == '\0' || std::strcmp(forced, "auto") == 0) {
    *out = best_isa();
    return true;
  }
  Isa isa;
  if (!parse_isa(forced, &isa)) {
    *error = "unknown ISA; expected one of auto, scalar, avx2, avx512, avx512_bf16, neon, sve";
    return false;
  }
  if (!isa_supported(isa)) {
    *error = "this ISA is not supported by this CPU (or not compiled for this architecture)";
    return false;
  }
  *out = isa;
  return true;
}

// ---- range kernels (one thread's share) -----------------------------------------------------------------

template <bool kBf16Grad, bool kOut, bool kOutOfPlace>
struct ScalarStep {
  static void run(const AdamBuffers& b, const AdamHyper& h, int64_t i, int64_t end) {
    adamw_step_scalar_loop<kBf16Grad, kOut, kOutOfPlace>(b, h, i, end);
  }
};

inline void scalar_undo_range(const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  const bool out = b.p_bf16 != nullptr;
  if (b.grad_bf16) {
    out ? adamw_undo_loop<true, true>(b, h, begin, end) : adamw_undo_loop<true, false>(b, h, begin, end);
  } else {
    out ? adamw_undo_loop<false, true>(b, h, begin, end) : adamw_undo_loop<false, false>(b, h, begin, end);
  }
}

inline void step_range(Isa isa, const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAvx2: return x86::avx2::step_range(b, h, begin, end);
    case Isa::kAvx512: return x86::avx512::step_range(b, h, begin, end);
    case Isa::kAvx512Bf16: return x86::avx512_bf16::step_range(b, h, begin, end);
#elif defined(__aarch64__)
    case Isa::kNeon: return arm::neon::step_range(b, h, begin, end);
    case Isa::kSve: return arm::sve::step_range(b, h, begin, end);
#endif
    default:
      return dispatch3<ScalarStep>(b.grad_bf16, b.p_bf16 != nullptr, b.out_of_place, b, h, begin, end);
  }
}

// Moments only ([Note: deferred moment stores]).
inline void moments_range(Isa isa, const MomentBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAvx2: return x86::avx2::moments_range(b, h, begin, end);
    case Isa::kAvx512: return x86::avx512::moments_range(b, h, begin, end);
    case Isa::kAvx512Bf16: return x86::avx512_bf16::moments_range(b, h, begin, end);
#elif defined(__aarch64__)
    case Isa::kNeon: return arm::neon::moments_range(b, h, begin, end);
    case Isa::kSve: return arm::sve::moments_range(b, h, begin, end);
#endif
    default:
      return b.grad_bf16 ? adamw_moments_scalar_loop<true>(b, h, begin, end)
                         : adamw_moments_scalar_loop<false>(b, h, begin, end);
  }
}

// The undo is in place only (sp/sm/sv are ignored: it reads and writes p/m/v).
inline void undo_range(Isa isa, const AdamBuffers& b, const AdamHyper& h, int64_t begin, int64_t end) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAvx2: return x86::avx2::undo_range(b, h, begin, end);
    case Isa::kAvx512: return x86::avx512::undo_range(b, h, begin, end);
    case Isa::kAvx512Bf16: return x86::avx512_bf16::undo_range(b, h, begin, end);
#elif defined(__aarch64__)
    case Isa::kSve: return arm::sve::undo_range(b, h, begin, end);
#endif
    default: return scalar_undo_range(b, h, begin, end);  // NEON is baseline: the compiler vectorises it
  }
}

inline SumsqResult sumsq_range(Isa isa, const void* g, bool bf16, int64_t begin, int64_t end) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAvx2: return x86::avx2::sumsq_range(g, bf16, begin, end);
    case Isa::kAvx512:
    case Isa::kAvx512Bf16: return x86::sumsq_avx512(g, bf16, begin, end);
#endif
    default: return bf16 ? sumsq_loop<true>(g, begin, end) : sumsq_loop<false>(g, begin, end);
  }
}

// STREAM-like in-place update of three fp32 arrays (the p/m/v traffic pattern, as anchors/stream.c's
// "inplace3"): the bandwidth roofline the benchmark compares the Adam pass against.
HFSO_INLINE void inplace3_loop(float* __restrict a, float* __restrict b, float* __restrict c, int64_t i,
                               int64_t end) {
  for (; i < end; ++i) {
    const float x = a[i], y = b[i], z = c[i];
    a[i] = x * 0.999f + y;
    b[i] = y * 0.9f + z;
    c[i] = z * 0.99f + x;
  }
}

#if defined(__x86_64__)
HFSO_TARGET_AVX2 inline void inplace3_avx2(float* a, float* b, float* c, int64_t i, int64_t end) {
  inplace3_loop(a, b, c, i, end);
}
HFSO_TARGET_AVX512 inline void inplace3_avx512(float* a, float* b, float* c, int64_t i, int64_t end) {
  inplace3_loop(a, b, c, i, end);
}
#endif

inline void inplace3_range(Isa isa, float* a, float* b, float* c, int64_t begin, int64_t end) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAvx2: return inplace3_avx2(a, b, c, begin, end);
    case Isa::kAvx512:
    case Isa::kAvx512Bf16: return inplace3_avx512(a, b, c, begin, end);
#endif
    default: return inplace3_loop(a, b, c, begin, end);
  }
}

// ---- threads --------------------------------------------------------------------------------------------

// Cores in this thread's affinity mask minus one (kept for the Python/launch thread), at least one.
inline int default_num_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int n = 1;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
  return n > 1 ? n - 1 : 1;
}

// NOTE: a thread gets at least kGrainElems elements (~1 MB of traffic), so small buckets run on one
// thread instead of paying the fork/join cost; shares are multiples of kAlignElems (4 KiB of fp32), so
// each thread starts on a page boundary when the buffers are page aligned (first-touch/NUMA locality).
constexpr int64_t kGrainElems = 32 * 1024;
constexpr int64_t kAlignElems = 1024;

// Runs f(begin, end, thread_index) over a static contiguous partition of [0, n) on `threads` threads
// (<= 0: default), independent of OMP_NUM_THREADS (an explicit num_threads clause); thread_index < threads.
// Returns the team size used.
template <class F>
int parallel_ranges(int64_t n, int threads, F&& f) {
  if (threads <= 0) threads = default_num_threads();
  int64_t max_useful = (n + kGrainElems - 1) / kGrainElems;
  if (max_useful < 1) max_useful = 1;
  const int t = static_cast<int>(threads < max_useful ? threads : max_useful);
  if (t <= 1) {
    if (n > 0) f(int64_t{0}, n, 0);
    return 1;
  }
#ifdef _OPENMP
  int used = t;
#pragma omp parallel num_threads(t)
  {
    // The runtime may grant fewer threads than asked (OMP_THREAD_LIMIT, nesting): partition by the team.
    const int team = omp_get_num_threads();
    int64_t share = (n + team - 1) / team;
    share = (share + kAlignElems - 1) / kAlignElems * kAlignElems;
    const int64_t begin = static_cast<int64_t>(omp_get_thread_num()) * share;
    const int64_t end = begin + share < n ? begin + share : n;
    if (begin < end) f(begin, end, omp_get_thread_num());
    if (omp_get_thread_num() == 0) used = team;
  }
  return used;
#else
  int64_t share = (n + t - 1) / t;
  share = (share + kAlignElems - 1) / kAlignElems * kAlignElems;
  for (int tid = 0; tid < t; ++tid) {
    const int64_t begin = static_cast<int64_t>(tid) * share;
    const int64_t end = begin + share < n ? begin + share : n;
    if (begin < end) f(begin, end, tid);
  }
  return t;
#endif
}

// NOTE: [dynamic chunks] ([Note: CPU Adam threads] in docs/design.md): the elementwise kernels (step, undo,
// moments) share their range in aligned chunks taken from an atomic counter instead of one static slice per
// thread. A static slice makes every bucket wait for its slowest thread, and on the training box the team shares
// the cores with the training thread, the upload thread and the driver's threads: one preempted team thread
// stretches the whole bucket (the all-host 3.6B pass varied 0.58-0.78 s for the same bytes; 0.44-0.54 s with
// chunks). With ~kChunksPerThread chunks per thread the others take over a descheduled thread's remaining chunks.
// Chunks are multiples of kAlignElems (the static slices' alignment) and at least kGrainElems; results are bitwise
// the same either way (elementwise), so only the reductions (sumsq) keep the static, per-thread-index partition.
constexpr int64_t kChunksPerThread = 8;

enum class Schedule { kStatic, kDynamic };

// Runs f(begin, end) over [0, n) on `threads` threads (<= 0: default): kStatic as parallel_ranges, kDynamic
// in chunks claimed from a shared counter. Returns the team size used.
template <class F>
int parallel_chunks(int64_t n, int threads, Schedule schedule, F&& f) {
  if (schedule == Schedule::kStatic) {
    return parallel_ranges(n, threads, [&](int64_t begin, int64_t end, int) { f(begin, end); });
  }
  if (threads <= 0) threads = default_num_threads();
  int64_t max_useful = (n + kGrainElems - 1) / kGrainElems;
  if (max_useful < 1) max_useful = 1;
  const int t = static_cast<int>(threads < max_useful ? threads : max_useful);
  if (t <= 1) {
    if (n > 0) f(int64_t{0}, n);
    return 1;
  }
  int64_t chunk = (n + t * kChunksPerThread - 1) / (t * kChunksPerThread);
  if (chunk < kGrainElems) chunk = kGrainElems;
  chunk = (chunk + kAlignElems - 1) / kAlignElems * kAlignElems;
  const int64_t chunks = (n + chunk - 1) / chunk;
#ifdef _OPENMP
  std::atomic<int64_t> next{0};
  int used = t;
#pragma omp parallel num_threads(t)
  {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t begin = c * chunk;
      f(begin, begin + chunk < n ? begin + chunk : n);
    }
    if (omp_get_thread_num() == 0) used = omp_get_num_threads();
  }
  return used;
#else
  for (int64_t c = 0; c < chunks; ++c) f(c * chunk, (c + 1) * chunk < n ? (c + 1) * chunk : n);
  return t;
#endif
}

// NOTE: [Note: fixed-order sums] (kernels_common.h): a sum of squares is cut into blocks of this many elements
// at fixed offsets from the tensor's start, whatever the thread count; threads take whole blocks and the blocks'
// sums are added in block order. A multiple of kSumsqLanes, and at least kGrainElems (a block is worth a thread).
constexpr int64_t kSumsqBlockElems = 64 * 1024;

// Sum of squares and non-finite count of the n elements of g, the same bits on every thread count and on every
// ISA (a static per-thread partition gave a different sum for each thread count).
inline SumsqResult sumsq_blocks(Isa isa, const void* g, bool bf16, int64_t n, int threads) {
  const int64_t blocks = (n + kSumsqBlockElems - 1) / kSumsqBlockElems;
  std::vector<SumsqResult> parts(static_cast<size_t>(blocks));
  if (threads <= 0) threads = default_num_threads();
  const int t = static_cast<int>(threads < blocks ? threads : (blocks > 0 ? blocks : 1));
#ifdef _OPENMP
#pragma omp parallel for num_threads(t) schedule(static) if (t > 1)
#endif
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t lo = k * kSumsqBlockElems;
    const int64_t hi = lo + kSumsqBlockElems < n ? lo + kSumsqBlockElems : n;
    parts[static_cast<size_t>(k)] = sumsq_range(isa, g, bf16, lo, hi);
  }
  SumsqResult total;
  for (const auto& r : parts) {  // block order
    total.sumsq += r.sumsq;
    total.nonfinite += r.nonfinite;
  }
  return total;
}

}  // namespace hfso
