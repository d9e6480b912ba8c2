// Standalone check of every compiled AdamW path against the scalar reference (no torch, no Python).
//
//   g++ -O2 -std=c++17 -ffp-contract=off -fopenmp-simd test_kernels.cpp -o test_kernels && ./test_kernels
//   ./test_kernels --expect-best=neon      (also fail unless run-time dispatch picks that path)
//   ./test_kernels --quick                 (fewer and smaller cases, for slow emulators such as qemu)
//
// fp32 state: within kUlpTol ulps of the scalar path (the paths are designed to agree bit for bit; the
// report says whether they did). bf16 output: exactly the round-to-nearest-even of the path's own fp32
// result, including NaN, infinities, ties and denormals. Out of place (and mixed: one array in place, the
// others not): bit for bit the same path's in-place result, source unchanged, over several ping-pong steps.
// Deferred stores (store_moments=false, then also store_master=false): the skipped arrays are not written and
// the later commit (moment kernel, or a full step) stores the full step's values bit for bit.
// Exit status 0 when every check passed.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "adam_kernels.h"

namespace {

using hfso::AdamBuffers;
using hfso::AdamHyper;
using hfso::Isa;

constexpr int64_t kUlpTol = 2;
int g_failures = 0;
int64_t g_max_ulp = 0;

#define CHECK(cond, ...)                                     \
  do {                                                       \
    if (!(cond)) {                                           \
      if (g_failures < 20) {                                 \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__);     \
        std::printf(__VA_ARGS__);                            \
        std::printf("\n");                                   \
      }                                                      \
      ++g_failures;                                          \
    }                                                        \
  } while (0)

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int64_t ulp_diff(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return (std::isnan(a) && std::isnan(b)) ? 0 : INT64_MAX;
  auto key = [](float f) {
    const int64_t u = bits(f);
    return (u & 0x80000000) ? -(u & 0x7fffffff) : u;
  };
  const int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

// A buffer whose data pointer sits `offset` elements past a 64-byte boundary.
template <class T>
struct Buf {
  std::vector<unsigned char> raw;
  T* data;
  Buf(int64_t n, int offset) : raw(static_cast<size_t>((n + offset) * sizeof(T) + 128)) {
    uintptr_t base = (reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t{63};
    data = reinterpret_cast<T*>(base) + offset;
  }
};

constexpr uint32_t kSentinel = 0x7fc0dead;  // initial contents of the out-of-place destinations

struct State {
  Buf<float> p, m, v, g32, dp, dm, dv;
  Buf<uint16_t> g16, out;
  State(int64_t n, int off, int off_out, int off_dst)
      : p(n, off), m(n, off), v(n, off), g32(n, off), dp(n, off_dst), dm(n, off_dst), dv(n, off_dst),
        g16(n, off), out(n, off_out) {}
};

void fill(State& s, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    s.p.data[i] = nd(rng);
    s.m.data[i] = 0.1f * nd(rng);
    s.v.data[i] = std::fabs(0.01f * nd(rng));
    s.g32.data[i] = nd(rng) * (i % 7 == 0 ? 100.0f : 1.0f);
    s.g16.data[i] = hfso::f32_to_bf16_bits(s.g32.data[i]);
    s.out.data[i] = 0xdead;
    s.dp.data[i] = s.dm.data[i] = s.dv.data[i] = from_bits(kSentinel);
  }
}

// kMixed: m in place, p and v out of place (the kernel then keeps regular stores).
enum class Mode { kInPlace, kOutOfPlace, kMixed };

struct Options {
  bool bf16_grad, out;
  Mode mode;
  bool stream;
};

// Where each of p/m/v currently lives in a State and where the next step writes it: out of place the
// state ping-pongs between the two buffers (double buffering), in place it stays put.
struct Cursor {
  float* cur[3];
  float* nxt[3];
  bool moves[3];
  Cursor(State& s, Mode mode) {
    float* src[3] = {s.p.data, s.m.data, s.v.data};
    float* dst[3] = {s.dp.data, s.dm.data, s.dv.data};
    for (int k = 0; k < 3; ++k) {
      moves[k] = mode == Mode::kOutOfPlace || (mode == Mode::kMixed && k != 1);
      cur[k] = src[k];
      nxt[k] = moves[k] ? dst[k] : src[k];
    }
  }
  AdamBuffers buffers(State& s, const Options& o) const {
    return AdamBuffers{nxt[0],
                       nxt[1],
                       nxt[2],
                       cur[0],
                       cur[1],
                       cur[2],
                       o.bf16_grad ? static_cast<const void*>(s.g16.data) : static_cast<const void*>(s.g32.data),
                       o.bf16_grad,
                       o.out ? s.out.data : nullptr,
                       o.mode == Mode::kOutOfPlace,
                       o.stream};
  }
  void advance() {
    for (int k = 0; k < 3; ++k) {
      if (moves[k]) std::swap(cur[k], nxt[k]);
    }
  }
};

AdamBuffers inplace(State& s, bool bf16_grad, bool out) {
  return Cursor(s, Mode::kInPlace).buffers(s, {bf16_grad, out, Mode::kInPlace, false});
}

// Runs `steps` steps over [begin, end) with `isa` (in o.mode), with `isa` in place, and with the scalar path
// in place, and compares: the same path bit for bit, the scalar path within kUlpTol.
void check_step(Isa isa, int64_t n, int64_t begin, int64_t end, int off, int off_out, int off_dst,
                const Options& o, int steps, double wd, double grad_scale) {
  State a(n, off, off_out, off_dst), ip(n, off, off_out, off_dst), r(n, off, off_out, off_dst);
  for (State* s : {&a, &ip, &r}) fill(*s, n, 1234 + static_cast<uint32_t>(n));
  const std::vector<float*> arrays_a = {a.p.data, a.m.data, a.v.data, a.dp.data, a.dm.data, a.dv.data};
  std::vector<std::vector<float>> init;
  for (float* x : arrays_a) init.emplace_back(x, x + n);
  Cursor ca(a, o.mode), cip(ip, Mode::kInPlace), cr(r, Mode::kInPlace);
  const Options o_in{o.bf16_grad, o.out, Mode::kInPlace, o.stream};
  const char* name = hfso::isa_name(isa);
  for (int step = 1; step <= steps; ++step) {
    const AdamHyper h = hfso::make_hyper(step, 1e-2, 0.9, 0.999, 1e-8, wd, grad_scale);
    std::vector<std::vector<float>> pre;
    for (int k = 0; k < 3; ++k) pre.emplace_back(ca.cur[k], ca.cur[k] + n);
    hfso::step_range(isa, ca.buffers(a, o), h, begin, end);
    hfso::step_range(isa, cip.buffers(ip, o_in), h, begin, end);
    hfso::step_range(Isa::kScalar, cr.buffers(r, o_in), h, begin, end);
    ca.advance();
    for (int k = 0; k < 3; ++k) {
      if (!ca.moves[k]) continue;
      for (int64_t i = 0; i < n; ++i) {
        CHECK(bits(ca.nxt[k][i]) == bits(pre[static_cast<size_t>(k)][static_cast<size_t>(i)]),
              "%s n=%" PRId64 " step %d modified source array %d at %" PRId64, name, n, step, k, i);
      }
    }
  }
  const float* got[3] = {ca.cur[0], ca.cur[1], ca.cur[2]};
  const float* twin[3] = {ip.p.data, ip.m.data, ip.v.data};
  const float* ref[3] = {r.p.data, r.m.data, r.v.data};
  for (int64_t i = 0; i < n; ++i) {
    if (i < begin || i >= end) {  // nothing outside the range is written, in any buffer
      for (size_t k = 0; k < arrays_a.size(); ++k) {
        CHECK(bits(arrays_a[k][i]) == bits(init[k][static_cast<size_t>(i)]),
              "%s wrote outside its range: array %zu at %" PRId64, name, k, i);
      }
      if (o.out) CHECK(a.out.data[i] == 0xdead, "%s wrote bf16 outside its range at %" PRId64, name, i);
      continue;
    }
    int64_t d = 0;
    for (int k = 0; k < 3; ++k) {
      d = std::max(d, ulp_diff(got[k][i], ref[k][i]));
      CHECK(bits(got[k][i]) == bits(twin[k][i]), "%s n=%" PRId64 " i=%" PRId64 " array %d: %.9g differs from "
            "the in-place result %.9g (mode %d)", name, n, i, k, got[k][i], twin[k][i], static_cast<int>(o.mode));
    }
    g_max_ulp = std::max(g_max_ulp, d);
    CHECK(d <= kUlpTol, "%s n=%" PRId64 " i=%" PRId64 " p %.9g vs %.9g (%" PRId64 " ulp)", name, n, i,
          got[0][i], ref[0][i], d);
    if (o.out) {
      const uint16_t want = hfso::f32_to_bf16_bits(got[0][i]);
      CHECK(a.out.data[i] == want && a.out.data[i] == ip.out.data[i], "%s n=%" PRId64 " i=%" PRId64
            " bf16 %04x want %04x (in place %04x)", name, n, i, a.out.data[i], want, ip.out.data[i]);
    }
  }
}

// lr = 0, zero grad and zero moments leave p unchanged, so the bf16 output is the conversion of p itself.
void check_bf16_rounding(Isa isa, int n_random) {
  std::vector<uint32_t> specials = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,
      0x7fbfffff, 0x7fffffff, 0xffffffff, 0x00000001, 0x80000001, 0x007fffff, 0x807fffff, 0x00400000,
      0x00008000, 0x00018000, 0x00800000, 0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff, 0x7f7fffff,
      0xff7fffff, 0x7f7f8000, 0x7f7f7fff, 0x3f800000, 0xbf808000, 0x40490fdb, 0x1,
  };
  std::mt19937 rng(7);
  for (int i = 0; i < n_random; ++i) specials.push_back(rng());
  const int64_t n = static_cast<int64_t>(specials.size());
  for (int off : {0, 3}) {
    State s(n, off, off, off);
    for (int64_t i = 0; i < n; ++i) {
      s.p.data[i] = from_bits(specials[i]);
      s.m.data[i] = s.v.data[i] = s.g32.data[i] = 0.0f;
      s.g16.data[i] = 0;
    }
    const AdamHyper h = hfso::make_hyper(1, 0.0, 0.9, 0.999, 1e-8, 0.0, 1.0);
    hfso::step_range(isa, inplace(s, true, true), h, 0, n);
    for (int64_t i = 0; i < n; ++i) {
      CHECK(bits(s.p.data[i]) == specials[i] || (std::isnan(s.p.data[i]) && std::isnan(from_bits(specials[i]))),
            "%s lr=0 changed p %08x -> %08x", hfso::isa_name(isa), specials[i], bits(s.p.data[i]));
      const uint16_t want = hfso::f32_to_bf16_bits(from_bits(specials[i]));
      CHECK(s.out.data[i] == want, "%s bf16(%08x) = %04x, want %04x", hfso::isa_name(isa), specials[i],
            s.out.data[i], want);
    }
  }
  // The scalar rule itself, against hand-computed values.
  CHECK(hfso::f32_to_bf16_bits(from_bits(0x3f808000)) == 0x3f80, "tie to even (down)");
  CHECK(hfso::f32_to_bf16_bits(from_bits(0x3f818000)) == 0x3f82, "tie to even (up)");
  CHECK(hfso::f32_to_bf16_bits(from_bits(0x7f7fffff)) == 0x7f80, "overflow to inf");
  CHECK(hfso::f32_to_bf16_bits(from_bits(0x00018000)) == 0x0002, "denormal kept");
  CHECK(hfso::f32_to_bf16_bits(from_bits(0x7f800001)) == 0xffff, "NaN");
}

// [Note: deferred moment stores]: a step with store_moments=false leaves m/v untouched (in place: as they were;
// out of place: the destination keeps its contents) and gives the full step's p and bf16 copy; the moment
// kernel then stores the full step's m/v, bit for bit. Compared with the same path's full step.
void check_deferred(Isa isa, int64_t n, int64_t begin, int64_t end, int off, int off_dst, bool bf16_grad,
                    bool out_of_place, bool stream, double grad_scale) {
  State a(n, off, off, off_dst), full(n, off, off, off_dst);
  for (State* s : {&a, &full}) fill(*s, n, 4321 + static_cast<uint32_t>(n));
  const Mode mode = out_of_place ? Mode::kOutOfPlace : Mode::kInPlace;
  const Options o{bf16_grad, true, mode, stream};
  const Cursor ca(a, mode), cf(full, mode);
  const AdamHyper h = hfso::make_hyper(5, 1e-2, 0.9, 0.999, 1e-8, 0.1, grad_scale);
  const std::vector<float> m0(ca.nxt[1], ca.nxt[1] + n), v0(ca.nxt[2], ca.nxt[2] + n);
  AdamBuffers lazy = ca.buffers(a, o);
  lazy.store_moments = false;
  hfso::step_range(isa, lazy, h, begin, end);
  hfso::step_range(isa, cf.buffers(full, o), h, begin, end);
  const char* name = hfso::isa_name(isa);
  for (int64_t i = 0; i < n; ++i) {
    CHECK(bits(ca.nxt[1][i]) == bits(m0[i]) && bits(ca.nxt[2][i]) == bits(v0[i]),
          "%s store_moments=false wrote m/v at %" PRId64 " (n=%" PRId64 ", oop %d)", name, i, n, out_of_place);
    CHECK(bits(ca.nxt[0][i]) == bits(cf.nxt[0][i]) && a.out.data[i] == full.out.data[i],
          "%s store_moments=false: p/bf16 differ from the full step at %" PRId64, name, i);
  }
  const hfso::MomentBuffers mb{ca.nxt[1], ca.nxt[2], ca.cur[1], ca.cur[2],
                               bf16_grad ? static_cast<const void*>(a.g16.data) : static_cast<const void*>(a.g32.data),
                               bf16_grad, out_of_place, stream};
  hfso::moments_range(isa, mb, hfso::make_hyper(1, 0.0, 0.9, 0.999, 0.0, 0.0, grad_scale), begin, end);
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 1; k < 3; ++k) {
      CHECK(bits(ca.nxt[k][i]) == bits(cf.nxt[k][i]), "%s moments n=%" PRId64 " i=%" PRId64 " array %d: %.9g, the "
            "full step stored %.9g (oop %d)", name, n, i, k, ca.nxt[k][i], cf.nxt[k][i], out_of_place);
    }
  }
}

// store_master=false (with store_moments=false): the step writes only the bf16 copy, equal to the full step's;
// p/m/v are untouched (in place: the pre-step state; out of place and mixed: the destinations keep their
// sentinel) and nothing outside [begin, end) is written. The commit, an ordinary full step without a bf16 copy
// on the same pre-step state, then stores p/m/v bit for bit as the single full step. Same path throughout.
void check_late_master(Isa isa, int64_t n, int64_t begin, int64_t end, int off, int off_out, int off_dst,
                       bool bf16_grad, Mode mode, bool stream, double grad_scale) {
  State a(n, off, off_out, off_dst), full(n, off, off_out, off_dst);
  for (State* s : {&a, &full}) fill(*s, n, 777 + static_cast<uint32_t>(n));
  const Cursor ca(a, mode), cf(full, mode);
  const Options o{bf16_grad, true, mode, stream};
  const AdamHyper h = hfso::make_hyper(7, 1e-2, 0.9, 0.999, 1e-8, 0.1, grad_scale);
  std::vector<std::vector<float>> before;  // every fp32 array of `a`, sources and destinations
  const std::vector<float*> arrays = {a.p.data, a.m.data, a.v.data, a.dp.data, a.dm.data, a.dv.data};
  for (float* x : arrays) before.emplace_back(x, x + n);
  AdamBuffers late = ca.buffers(a, o);
  late.store_moments = false;
  late.store_master = false;
  hfso::step_range(isa, late, h, begin, end);
  hfso::step_range(isa, cf.buffers(full, o), h, begin, end);
  const char* name = hfso::isa_name(isa);
  const int md = static_cast<int>(mode);
  for (int64_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < arrays.size(); ++k) {
      CHECK(bits(arrays[k][i]) == bits(before[k][static_cast<size_t>(i)]), "%s store_master=false wrote fp32 "
            "array %zu at %" PRId64 " (n=%" PRId64 ", mode %d)", name, k, i, n, md);
    }
    const bool inside = i >= begin && i < end;
    CHECK(a.out.data[i] == (inside ? full.out.data[i] : 0xdead), "%s store_master=false bf16 at %" PRId64
          " is %04x, the full step wrote %04x (n=%" PRId64 ", mode %d)", name, i, a.out.data[i], full.out.data[i],
          n, md);
  }
  // The commit: a full step without the bf16 copy, from the same (untouched) pre-step state.
  hfso::step_range(isa, ca.buffers(a, {bf16_grad, false, mode, stream}), h, begin, end);
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 3; ++k) {
      CHECK(bits(ca.nxt[k][i]) == bits(cf.nxt[k][i]), "%s commit n=%" PRId64 " i=%" PRId64 " array %d: %.9g, the "
            "full step stored %.9g (mode %d)", name, n, i, k, ca.nxt[k][i], cf.nxt[k][i], md);
      if (ca.moves[k]) {
        CHECK(bits(ca.cur[k][i]) == bits(cf.cur[k][i]), "%s commit modified source array %d at %" PRId64, name, k, i);
      }
    }
    CHECK(a.out.data[i] == (i >= begin && i < end ? full.out.data[i] : 0xdead), "%s commit wrote bf16 at %" PRId64,
          name, i);
  }
}

void check_undo(Isa isa, int64_t n, bool bf16_grad, bool out) {
  State s(n, 1, 1, 1);
  fill(s, n, 99);
  const std::vector<float> p0(s.p.data, s.p.data + n), m0(s.m.data, s.m.data + n), v0(s.v.data, s.v.data + n);
  const AdamHyper h = hfso::make_hyper(3, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.5);
  hfso::step_range(isa, inplace(s, bf16_grad, out), h, 0, n);
  const std::vector<float> p1(s.p.data, s.p.data + n), m1(s.m.data, s.m.data + n), v1(s.v.data, s.v.data + n);
  hfso::undo_range(isa, inplace(s, bf16_grad, out), h, 0, n);
  // The inverse cancels terms of the post-step value, so its error scales with that value.
  const auto tol = [](float post, float orig) { return 16 * 1.1920929e-7f * (std::fabs(post) + std::fabs(orig)) / 0.9f; };
  for (int64_t i = 0; i < n; ++i) {
    CHECK(std::fabs(s.p.data[i] - p0[i]) <= tol(p1[i], p0[i]), "%s undo p[%" PRId64 "] %.9g vs %.9g",
          hfso::isa_name(isa), i, s.p.data[i], p0[i]);
    CHECK(std::fabs(s.m.data[i] - m0[i]) <= tol(m1[i], m0[i]), "%s undo m[%" PRId64 "]", hfso::isa_name(isa), i);
    CHECK(std::fabs(s.v.data[i] - v0[i]) <= tol(v1[i], v0[i]) / 0.999f * 0.9f, "%s undo v[%" PRId64 "] %.9g vs %.9g",
          hfso::isa_name(isa), i, s.v.data[i], v0[i]);
    if (out) CHECK(s.out.data[i] == hfso::f32_to_bf16_bits(s.p.data[i]), "%s undo bf16 out", hfso::isa_name(isa));
  }
}

void check_sumsq(Isa isa, int64_t n, bool bf16, int n_bad) {
  State s(n, 1, 1, 1);
  fill(s, n, 5);
  for (int k = 0; k < n_bad && n > 0; ++k) {
    const int64_t i = (k * 7919) % n;
    const float bad = (k % 2) ? INFINITY : NAN;
    s.g32.data[i] = bad;
    s.g16.data[i] = hfso::f32_to_bf16_bits(bad);
  }
  int64_t want_bad = 0;
  double want = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float f = bf16 ? hfso::bf16_bits_to_f32(s.g16.data[i]) : s.g32.data[i];
    want += static_cast<double>(f) * f;
    want_bad += std::isfinite(f) ? 0 : 1;
  }
  const void* g = bf16 ? static_cast<const void*>(s.g16.data) : static_cast<const void*>(s.g32.data);
  const hfso::SumsqResult r = hfso::sumsq_range(isa, g, bf16, 0, n);
  CHECK(r.nonfinite == want_bad, "%s sumsq nonfinite %" PRId64 " want %" PRId64, hfso::isa_name(isa), r.nonfinite,
        want_bad);
  if (want_bad == 0) {
    CHECK(std::fabs(r.sumsq - want) <= 1e-12 * want + 1e-300, "%s sumsq %.17g want %.17g", hfso::isa_name(isa),
          r.sumsq, want);
    // [Note: fixed-order sums]: every path adds in the scalar path's order, and the blocked sum is the same for
    // every thread count (a build without OpenMP runs the blocks on one thread: the order is checked all the same)
    const double scalar = hfso::sumsq_range(Isa::kScalar, g, bf16, 0, n).sumsq;
    CHECK(r.sumsq == scalar, "%s sumsq %.17g differs from the scalar path's %.17g", hfso::isa_name(isa), r.sumsq,
          scalar);
    const double blocked = hfso::sumsq_blocks(Isa::kScalar, g, bf16, n, 1).sumsq;
    for (int threads : {2, 3}) {
      const double b = hfso::sumsq_blocks(isa, g, bf16, n, threads).sumsq;
      CHECK(b == blocked, "%s blocked sumsq %.17g on %d threads, %.17g on one (scalar)", hfso::isa_name(isa), b,
            threads, blocked);
    }
  } else {
    CHECK(!std::isfinite(r.sumsq), "%s sumsq should be non-finite", hfso::isa_name(isa));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* expect_best = nullptr;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--expect-best=", 14) == 0) {
      expect_best = argv[i] + 14;
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::printf("unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  const Isa best = hfso::best_isa();
  std::printf("best=%s supported:", hfso::isa_name(best));
  std::vector<Isa> isas;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kNeon, Isa::kSve}) {
    if (hfso::isa_supported(isa)) {
      isas.push_back(isa);
      std::printf(" %s", hfso::isa_name(isa));
    }
  }
#if defined(__aarch64__)
  if (hfso::isa_supported(Isa::kSve)) std::printf(" (sve vector length %d bits)", 8 * hfso::arm::sve_vector_bytes());
#endif
  std::printf("\n");
  if (expect_best != nullptr) CHECK(std::strcmp(expect_best, hfso::isa_name(best)) == 0, "best=%s, expected %s",
                                    hfso::isa_name(best), expect_best);

  const std::vector<int64_t> sizes = quick ? std::vector<int64_t>{0, 1, 7, 17, 33, 100, 1029, 4099}
                                           : std::vector<int64_t>{0, 1, 7, 15, 16, 17, 31, 32, 33, 63, 100,
                                                                  1023, 4099, 70001};
  for (Isa isa : isas) {
    for (int64_t n : sizes) {
      for (int mask = 0; mask < 16; ++mask) {
        const Options o{(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0 ? Mode::kOutOfPlace : Mode::kInPlace,
                        (mask & 8) != 0};
        const int off = (n + mask) % 5, off_out = (n + 3 * mask) % 3, off_dst = (n + 5 * mask) % 7;
        check_step(isa, n, 0, n, off, off_out, off_dst, o, 1, 0.01, 1.0);
        if (n > 10) check_step(isa, n, 3, n - 5, off, off_out, off_dst, o, 1, 0.0, 0.37);  // a thread's share
      }
      // Several steps (ping-pong when out of place); all aligned, so the bf16 copy anchors the head and
      // p/m/v stream; then a destination that cannot share the bf16 copy's alignment (anchor on p).
      for (Mode mode : {Mode::kInPlace, Mode::kOutOfPlace, Mode::kMixed}) {
        check_step(isa, n, 0, n, 0, 0, 0, {true, true, mode, true}, 6, 0.1, 0.5);
        check_step(isa, n, 0, n, 1, 0, 3, {false, true, mode, true}, 3, 0.1, 0.5);
        if (n > 10) check_step(isa, n, 5, n - 2, 2, 1, 9, {true, false, mode, true}, 2, 0.0, 1.0);
      }
      for (int mask = 0; mask < 8; ++mask) {
        const bool bf16 = (mask & 1) != 0, oop = (mask & 2) != 0, stream = (mask & 4) != 0;
        check_deferred(isa, n, 0, n, (n + mask) % 5, (n + 3 * mask) % 7, bf16, oop, stream, mask < 4 ? 1.0 : 0.37);
        if (n > 10) check_deferred(isa, n, 3, n - 5, 0, 0, bf16, oop, stream, 0.5);
      }
      for (int mask = 0; mask < 12; ++mask) {
        const bool bf16 = (mask & 1) != 0, stream = (mask & 2) != 0;
        const Mode mode = mask < 4 ? Mode::kInPlace : mask < 8 ? Mode::kOutOfPlace : Mode::kMixed;
        check_late_master(isa, n, 0, n, (n + mask) % 5, (n + 3 * mask) % 3, (n + 5 * mask) % 7, bf16, mode, stream,
                          mask & 4 ? 0.37 : 1.0);
        check_late_master(isa, n, 0, n, 0, 0, 0, bf16, mode, stream, 1.0);  // aligned: the bf16 copy streams
        if (n > 10) check_late_master(isa, n, 3, n - 5, 1, 2, 3, bf16, mode, stream, 0.5);
      }
      check_undo(isa, n, (n & 1) != 0, true);
      check_undo(isa, n, (n & 1) == 0, false);
      for (int bad : {0, 3}) {
        check_sumsq(isa, n, true, bad);
        check_sumsq(isa, n, false, bad);
      }
    }
    check_bf16_rounding(isa, quick ? 300 : 4000);
    std::printf("%-12s %s\n", hfso::isa_name(isa), g_failures == 0 ? "ok" : "FAILED");
  }
  std::printf("max fp32 difference to the scalar path: %" PRId64 " ulp (tolerance %" PRId64 ")\n", g_max_ulp,
              kUlpTol);
  if (g_failures != 0) {
    std::printf("%d check(s) FAILED\n", g_failures);
    return 1;
  }
  std::printf("ALL OK\n");
  return 0;
}
