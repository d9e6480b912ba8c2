// Torch op library of the CPU AdamW kernels: schemas, contracts and CPU implementations.
//
// The ops are stateless: the optimizer state lives in Python-owned tensors, the step count and bias
// corrections come in as scalars. Mutated tensors are marked `Tensor(x!)` in the schemas. The kernel core
// (adam_kernels.h) has no torch dependency; this file only checks contracts and calls it.
//
// The ISA is resolved per call: HF_SUPEROFFLOAD_CPU_ADAM_ISA=scalar|avx2|avx512|avx512_bf16|neon|sve forces
// one path (error if this CPU cannot run it); unset, empty or "auto" picks the best path.
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "adam_kernels.h"

namespace {

using at::Tensor;

// NOTE: calls touching at least this many elements use non-temporal stores for the write-only outputs
// (the bf16 copy; those of p/m/v an out-of-place step stores), which skips the read-for-ownership of those lines.
// Measured on the 2-core dev VM, 16 Mi params, 1 thread: bf16 out 20.4-20.8 -> 18.9-19.1 ms per step; out
// of place (AVX-512-BF16, bf16 out) 37-41 -> 23-25 ms, against 19-20 ms in place. The DRAM traffic is then
// the same 28 B/param, but one core of this VM runs a STREAM-like 3-in/3-out streaming copy at ~0.76x the
// speed of the in-place 3-array update (21 vs 16 ms), so ~0.8x is this machine's ceiling for out of place
// (not measured on the 16-core host, where bandwidth rather than one core's concurrency should bound both).
// Below the threshold the outputs likely still sit in cache for their next reader (the H2D copy, the next
// step), so regular stores are kept there (not measured).
constexpr int64_t kStreamMinElems = int64_t{1} << 20;

hfso::Isa current_isa() {
  hfso::Isa isa;
  const char* error = nullptr;
  const char* forced = std::getenv("HF_SUPEROFFLOAD_CPU_ADAM_ISA");
  TORCH_CHECK(hfso::resolve_isa(forced, &isa, &error), "HF_SUPEROFFLOAD_CPU_ADAM_ISA=", forced, ": ", error);
  return isa;
}

hfso::Schedule current_schedule() {
  const char* v = std::getenv("HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE");
  if (v == nullptr || *v == '\0' || std::string(v) == "dynamic") return hfso::Schedule::kDynamic;
  TORCH_CHECK_VALUE(std::string(v) == "static", "HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE=", v,
                    ": use 'dynamic' (the default) or 'static'");
  return hfso::Schedule::kStatic;
}

void check_cpu_contiguous(const Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel, " (as param)");
}

void check_f32(const Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  check_cpu_contiguous(t, name, numel);
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void check_disjoint(const std::vector<std::pair<const Tensor*, const char*>>& ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    for (size_t j = i + 1; j < ts.size(); ++j) {
      TORCH_CHECK(!overlaps(*ts[i].first, *ts[j].first), ts[i].second, " and ", ts[j].second,
                  " must not share memory");
    }
  }
}

struct Call {
  hfso::AdamBuffers buffers;
  hfso::AdamHyper hyper;
  int64_t numel;
};

using Named = std::pair<const Tensor*, const char*>;

// Validates the shared arguments of step and undo and builds the kernel's view of them (in place; the step
// then points the source at src_* when given). `ts` returns the tensors that must be pairwise disjoint.
Call prepare(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
             int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
             double grad_scale, const std::optional<Tensor>& param_bf16_out, std::vector<Named>& ts) {
  const int64_t n = param.numel();
  check_f32(param, "param", n);
  check_f32(exp_avg, "exp_avg", n);
  check_f32(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "grad must be float32 or bfloat16, got ", grad.scalar_type());
  check_cpu_contiguous(grad, "grad", n);
  TORCH_CHECK(step >= 1, "step must be >= 1 (the count after this update), got ", step);
  TORCH_CHECK(beta1 > 0.0 && beta1 < 1.0 && beta2 > 0.0 && beta2 < 1.0, "betas must lie in (0, 1), got ",
              beta1, ", ", beta2);
  ts = {{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}};
  if (param_bf16_out.has_value()) {
    TORCH_CHECK(param_bf16_out->scalar_type() == at::kBFloat16, "param_bf16_out must be bfloat16, got ",
                param_bf16_out->scalar_type());
    check_cpu_contiguous(*param_bf16_out, "param_bf16_out", n);
    ts.emplace_back(&*param_bf16_out, "param_bf16_out");
  }
  Call c;
  c.numel = n;
  c.hyper = hfso::make_hyper(step, lr, beta1, beta2, eps, weight_decay, grad_scale);
  c.buffers = hfso::inplace_buffers(
      param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), grad.data_ptr(),
      grad.scalar_type() == at::kBFloat16,
      param_bf16_out.has_value() ? static_cast<uint16_t*>(param_bf16_out->data_ptr()) : nullptr,
      n >= kStreamMinElems);
  return c;
}

// Checks one source tensor of an out-of-place step against its destination and returns whether it is
// distinct (the same data pointer means in place for that array; a partial overlap is an error).
bool check_source(const Tensor& src, const char* src_name, const Tensor& dst, const char* dst_name,
                  int64_t numel, std::vector<Named>& ts) {
  check_f32(src, src_name, numel);
  if (src.data_ptr() == dst.data_ptr()) return false;
  TORCH_CHECK_VALUE(!overlaps(src, dst), src_name, " partially overlaps ", dst_name,
                    ": pass the same tensor for an in-place step or disjoint memory for an out-of-place one");
  ts.emplace_back(&src, src_name);
  return true;
}

void cpu_adamw_step(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                    int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                    double grad_scale, const std::optional<Tensor>& param_bf16_out,
                    const std::optional<Tensor>& src_param, const std::optional<Tensor>& src_exp_avg,
                    const std::optional<Tensor>& src_exp_avg_sq, int64_t num_threads, bool store_moments,
                    bool store_master) {
  // store_master=false writes the bf16 copy only ([Note: deferred moment stores]); checked before any work.
  TORCH_CHECK_VALUE(store_master || !store_moments,
                    "store_master=False requires store_moments=False (a step that stores neither p nor m/v writes "
                    "only the bf16 copy; the state is committed by a later full step): pass store_moments=False "
                    "or store_master=True");
  TORCH_CHECK_VALUE(store_master || param_bf16_out.has_value(),
                    "store_master=False requires param_bf16_out (the bf16 copy is the only output of such a "
                    "step): pass param_bf16_out or store_master=True");
  std::vector<Named> ts;
  Call c = prepare(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                   param_bf16_out, ts);
  const int n_src = src_param.has_value() + src_exp_avg.has_value() + src_exp_avg_sq.has_value();
  TORCH_CHECK_VALUE(n_src == 0 || n_src == 3, "give all three source tensors or none");
  if (n_src == 3) {
    // Every source distinct from its destination joins the disjointness check (so a source may not alias
    // grad, the bf16 copy, another destination or another source either).
    int distinct = check_source(*src_param, "src_param", param, "param", c.numel, ts);
    distinct += check_source(*src_exp_avg, "src_exp_avg", exp_avg, "exp_avg", c.numel, ts);
    distinct += check_source(*src_exp_avg_sq, "src_exp_avg_sq", exp_avg_sq, "exp_avg_sq", c.numel, ts);
    c.buffers.sp = src_param->data_ptr<float>();
    c.buffers.sm = src_exp_avg->data_ptr<float>();
    c.buffers.sv = src_exp_avg_sq->data_ptr<float>();
    // Streaming p/m/v pays off only when none of them is also read (a mixed call stays correct: each array
    // is read from its source and written to its destination, with regular stores).
    c.buffers.out_of_place = distinct == 3;
  }
  c.buffers.store_moments = store_moments;  // false: exp_avg/exp_avg_sq are not written at all
  c.buffers.store_master = store_master;    // false: param is not written at all
  check_disjoint(ts);
  const hfso::Isa isa = current_isa();
  hfso::parallel_chunks(c.numel, static_cast<int>(num_threads), current_schedule(), [&](int64_t begin, int64_t end) {
    hfso::step_range(isa, c.buffers, c.hyper, begin, end);
  });
}

void cpu_adamw_undo(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                    int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                    double grad_scale, const std::optional<Tensor>& param_bf16_out, int64_t num_threads) {
  TORCH_CHECK(lr * weight_decay != 1.0, "cannot undo a step with lr * weight_decay == 1 (it zeroed param)");
  std::vector<Named> ts;
  const Call c = prepare(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                         grad_scale, param_bf16_out, ts);
  check_disjoint(ts);
  const hfso::Isa isa = current_isa();
  hfso::parallel_chunks(c.numel, static_cast<int>(num_threads), current_schedule(), [&](int64_t begin, int64_t end) {
    hfso::undo_range(isa, c.buffers, c.hyper, begin, end);
  });
}

// Stores m_t, v_t of a step taken with store_moments=false ([Note: deferred moment stores]): in place, or from
// src_exp_avg/src_exp_avg_sq (pre-step moments) into exp_avg/exp_avg_sq.
void cpu_adamw_moments(const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq, double beta1,
                       double beta2, double grad_scale, const std::optional<Tensor>& src_exp_avg,
                       const std::optional<Tensor>& src_exp_avg_sq, int64_t num_threads) {
  const int64_t n = exp_avg.numel();
  check_f32(exp_avg, "exp_avg", n);
  check_f32(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "grad must be float32 or bfloat16, got ", grad.scalar_type());
  check_cpu_contiguous(grad, "grad", n);
  TORCH_CHECK(beta1 > 0.0 && beta1 < 1.0 && beta2 > 0.0 && beta2 < 1.0, "betas must lie in (0, 1), got ",
              beta1, ", ", beta2);
  std::vector<Named> ts = {{&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}};
  TORCH_CHECK_VALUE(src_exp_avg.has_value() == src_exp_avg_sq.has_value(), "give both source tensors or none");
  hfso::MomentBuffers b{exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), exp_avg.data_ptr<float>(),
                        exp_avg_sq.data_ptr<float>(), grad.data_ptr(), grad.scalar_type() == at::kBFloat16,
                        false, n >= kStreamMinElems};
  if (src_exp_avg.has_value()) {
    int distinct = check_source(*src_exp_avg, "src_exp_avg", exp_avg, "exp_avg", n, ts);
    distinct += check_source(*src_exp_avg_sq, "src_exp_avg_sq", exp_avg_sq, "exp_avg_sq", n, ts);
    b.sm = src_exp_avg->data_ptr<float>();
    b.sv = src_exp_avg_sq->data_ptr<float>();
    b.out_of_place = distinct == 2;
  }
  check_disjoint(ts);
  // The step's constants for beta1, beta2 and grad_scale, rounded by the same code (the rest is unused).
  const hfso::AdamHyper h = hfso::make_hyper(1, 0.0, beta1, beta2, 0.0, 0.0, grad_scale);
  const hfso::Isa isa = current_isa();
  hfso::parallel_chunks(n, static_cast<int>(num_threads), current_schedule(), [&](int64_t begin, int64_t end) {
    hfso::moments_range(isa, b, h, begin, end);
  });
}

std::tuple<Tensor, Tensor> grad_sumsq_nonfinite(const Tensor& grad, int64_t num_threads) {
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "grad must be float32 or bfloat16, got ", grad.scalar_type());
  check_cpu_contiguous(grad, "grad", grad.numel());
  const hfso::Isa isa = current_isa();
  const bool bf16 = grad.scalar_type() == at::kBFloat16;
  const void* g = grad.data_ptr();
  // fixed blocks, added in block order: the same bits for every thread count ([Note: fixed-order sums])
  const hfso::SumsqResult r = hfso::sumsq_blocks(isa, g, bf16, grad.numel(), static_cast<int>(num_threads));
  return {at::scalar_tensor(r.sumsq, at::kDouble), at::scalar_tensor(r.nonfinite, at::kLong)};
}

// In-place read+write of three fp32 arrays (the p/m/v traffic pattern), for the benchmark's roofline.
void bench_inplace3(const Tensor& a, const Tensor& b, const Tensor& c, int64_t num_threads) {
  check_f32(a, "a", a.numel());
  check_f32(b, "b", a.numel());
  check_f32(c, "c", a.numel());
  float* pa = a.data_ptr<float>();
  float* pb = b.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  check_disjoint({{&a, "a"}, {&b, "b"}, {&c, "c"}});
  const hfso::Isa isa = current_isa();
  hfso::parallel_chunks(a.numel(), static_cast<int>(num_threads), current_schedule(), [&](int64_t begin, int64_t end) {
    hfso::inplace3_range(isa, pa, pb, pc, begin, end);
  });
}

std::string cpu_adam_isa() { return hfso::isa_name(current_isa()); }

std::vector<std::string> cpu_adam_supported_isas() {
  std::vector<std::string> out;
  for (auto isa : {hfso::Isa::kScalar, hfso::Isa::kAvx2, hfso::Isa::kAvx512, hfso::Isa::kAvx512Bf16,
                   hfso::Isa::kNeon, hfso::Isa::kSve}) {
    if (hfso::isa_supported(isa)) out.emplace_back(hfso::isa_name(isa));
  }
  return out;
}

// Team size a call with this many threads actually gets on a large tensor (tests: not OMP_NUM_THREADS).
int64_t cpu_adam_team_size(int64_t num_threads) {
  return hfso::parallel_ranges(int64_t{1} << 30, static_cast<int>(num_threads), [](int64_t, int64_t, int) {});
}

int64_t cpu_adam_default_threads() { return hfso::default_num_threads(); }

}  // namespace

// FRAGMENT, not TORCH_LIBRARY: the `hf_superoffload` namespace is shared with the Python custom ops of
// triton_kernels, and only one TORCH_LIBRARY block may own a namespace.
TORCH_LIBRARY_FRAGMENT(hf_superoffload, m) {
  m.def(
      "cpu_adamw_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, int step, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, "
      "Tensor(d!)? param_bf16_out, Tensor? src_param, Tensor? src_exp_avg, Tensor? src_exp_avg_sq, "
      "int num_threads, bool store_moments=True, bool store_master=True) -> ()");
  m.def(
      "cpu_adamw_moments(Tensor grad, Tensor(a!) exp_avg, Tensor(b!) exp_avg_sq, float beta1, float beta2, "
      "float grad_scale, Tensor? src_exp_avg, Tensor? src_exp_avg_sq, int num_threads) -> ()");
  m.def(
      "cpu_adamw_undo(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, int step, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, "
      "Tensor(d!)? param_bf16_out, int num_threads) -> ()");
  m.def("grad_sumsq_nonfinite(Tensor grad, int num_threads) -> (Tensor, Tensor)");
  m.def("_cpu_bench_inplace3(Tensor(a!) a, Tensor(b!) b, Tensor(c!) c, int num_threads) -> ()");
  m.def("cpu_adam_isa() -> str", &cpu_adam_isa);
  m.def("cpu_adam_supported_isas() -> str[]", &cpu_adam_supported_isas);
  m.def("_cpu_adam_team_size(int num_threads) -> int", &cpu_adam_team_size);
  m.def("_cpu_adam_default_threads() -> int", &cpu_adam_default_threads);
}

TORCH_LIBRARY_IMPL(hf_superoffload, CPU, m) {
  m.impl("cpu_adamw_step", &cpu_adamw_step);
  m.impl("cpu_adamw_undo", &cpu_adamw_undo);
  m.impl("cpu_adamw_moments", &cpu_adamw_moments);
  m.impl("grad_sumsq_nonfinite", &grad_sumsq_nonfinite);
  m.impl("_cpu_bench_inplace3", &bench_inplace3);
}
