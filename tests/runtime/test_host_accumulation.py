"""Host-side gradient accumulation (runtime/accumulation.py, [Note: host accumulation] in docs/weight_flow.md).

Every micro-batch's host-bucket gradients are offloaded and summed on the host. The reference is plain torch:
the micro-batches' gradients summed (in fp32 for the fp32 arena; in bf16 ``.grad``, as autograd accumulates, for
the landing mode), then ``clip_grad_norm_`` and AdamW on fp32 masters. The loss is scaled by 1/accum by the
caller, on both sides.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.plan import HostAccumulation, WeightMode
from hf_superoffload.planning.planner import LANDING_RING_SLOTS, PlanError, make_plan
from hf_superoffload.testing import ReferenceAdamW, master_of, tiny_llama

LR = 1e-3
GiB = 1024**3
ACCUM = 3


def config(dtype: str, placement: str, **kw) -> SuperOffloadConfig:
    base = dict(bucket_size_mb=0.004, gpu_resident_buckets=2 if placement == "stationary" else 0,
                weight_placement=placement, accumulate_on_host=True, host_accumulation_dtype=dtype,
                worker_timeout_s=120)
    return SuperOffloadConfig(**(base | kw))


class AccumReference(ReferenceAdamW):
    """ReferenceAdamW whose micro-batch gradients are summed in fp32 (``fp32=True``) or in bf16 ``.grad``."""

    def __init__(self, *a, fp32: bool, **kw) -> None:
        super().__init__(*a, **kw)
        self.fp32 = fp32
        self.sums: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def fold(self) -> None:
        """After each micro-batch's backward: move bf16 ``.grad`` into the fp32 sums."""
        if not self.fp32:
            return
        for p, _ in self.pairs:
            if p.grad is not None:
                g = p.grad.float()
                self.sums[id(p)] = g if id(p) not in self.sums else self.sums[id(p)] + g
                p.grad = None

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        if not self.fp32:
            return super().grad_of(p)
        return self.sums.pop(id(p), None)


def batches(n, seed=1, bs=2, seq=16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (bs, seq), generator=g).to(device) for _ in range(n)]


def build(cfg, *, ckpt=None, max_grad_norm=0.5, reference=False, fp32=True, device="cpu"):
    model = tiny_llama(seed=0, device=device)
    model.train()
    if ckpt is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    if reference:
        return model, AccumReference(model, max_grad_norm=max_grad_norm, lr=LR, weight_decay=0.1, fp32=fp32)
    return model, SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=max_grad_norm, config=cfg)


def train(model, opt, data, *, accum=ACCUM, poison=None, after_backward=None, before_step=None):
    """``accum`` micro-batches per step, the non-final ones inside ``no_sync()`` (ours) and losses / accum.

    ``poison(step, k)`` -> True multiplies that micro-batch's loss by NaN.
    """
    ours = isinstance(opt, SuperOffloadOptimizer)
    losses = []
    for step in range(len(data) // accum):
        total = 0.0
        for k in range(accum):
            ids = data[step * accum + k]
            ctx = opt.no_sync() if ours and k < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss / accum
                if poison is not None and poison(step, k):
                    loss = loss * float("nan")
                loss.backward()
            if not ours:
                opt.fold()
            if after_backward is not None:
                after_backward(step, k)
            total += loss.item()
        if before_step is not None:
            before_step(step)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    if ours:
        opt.synchronize()
    return losses



def masters(opt) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        flat = opt.engine.flat_state()
        return {f"{side}.{k}": v.clone() for side, d in flat.items() for k, v in d.items()}


def assert_matches_reference(model, opt, ref_model, ref, losses, ref_losses):
    assert len(losses) == len(ref_losses)
    for k, (a, b) in enumerate(zip(losses, ref_losses)):
        tol = 2e-5 if k < 3 else 5e-3
        if math.isnan(b):
            assert math.isnan(a), f"step {k}: loss {a} vs reference NaN"
            continue
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"step {k}: loss {a} vs reference {b}"
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref_model.named_parameters())
    worst = 0.0
    for p in opt.engine.params:
        ours = master_of(opt, p)
        rp = ref_params[names[id(p)]]
        m = next(m for q, m in ref.pairs if q is rp)
        worst = max(worst, (ours - m.detach().cpu()).abs().max().item())
    assert worst < 8 * LR, f"final master weights differ by {worst} (> {8 * LR})"


# ---------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("placement", ["stationary", "flow"])
@pytest.mark.parametrize("dtype", ["fp32", "landing"])
def test_parity_with_clipping(placement, dtype):
    data = batches(21 * ACCUM)
    model, opt = build(config(dtype, placement))
    assert opt.plan.host_accumulation is HostAccumulation(dtype)
    assert opt.plan.weight_mode is WeightMode(placement)
    losses = train(model, opt, data)
    ref_model, ref = build(None, reference=True, fp32=dtype == "fp32")
    ref_losses = train(ref_model, ref, data)
    assert opt.clipped_steps >= 5, "clipping must fire for this test to mean anything"
    assert math.isclose(opt.last_grad_norm, ref.last_grad_norm, rel_tol=2e-2), (opt.last_grad_norm, ref.last_grad_norm)
    assert_matches_reference(model, opt, ref_model, ref, losses, ref_losses)
    assert opt.engine.governor.steps == 21


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["fp32", "landing"])
def test_cuda_flow_parity(dtype):
    """The CUDA path: D2H into landing or a pinned ring slot on the D2H stream, adds after its event."""
    data = batches(8 * ACCUM, device="cuda")
    model, opt = build(config(dtype, "flow", gpu_resident_buckets=1), device="cuda")
    host = [p for b in opt.engine.host_buckets for p in b.params]

    def after_backward(step, k):
        assert all(p.grad is None for p in host)

    losses = train(model, opt, data, after_backward=after_backward)
    ref_model, ref = build(None, reference=True, fp32=dtype == "fp32", device="cuda")
    ref_losses = train(ref_model, ref, data)
    assert opt.clipped_steps >= 2
    assert_matches_reference(model, opt, ref_model, ref, losses, ref_losses)


def test_first_step_grad_norm_is_that_of_the_sum():
    """The boundary statistics are the accumulated gradient's, to fp32 rounding (not the last micro-batch's)."""
    data = batches(ACCUM)
    model, opt = build(config("fp32", "flow"), max_grad_norm=1e6)
    train(model, opt, data)
    ref_model, ref = build(None, reference=True, max_grad_norm=1e6)
    train(ref_model, ref, data)
    assert math.isclose(opt.last_grad_norm, ref.last_grad_norm, rel_tol=1e-5), (opt.last_grad_norm, ref.last_grad_norm)


def test_landing_mode_is_bitwise_the_device_accumulation():
    """bf16 sums on the host round exactly like autograd's bf16 ``.grad`` accumulation on the device."""
    data = batches(6 * ACCUM)
    runs = []
    for accumulate in (False, True):
        cfg = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=2, accumulate_on_host=accumulate,
                                 host_accumulation_dtype="landing")
        model, opt = build(cfg, max_grad_norm=None)
        losses = train(model, opt, data)
        runs.append((losses, masters(opt), [p.detach().clone() for p in model.parameters()]))
        assert opt.plan.host_accumulation is (HostAccumulation.LANDING if accumulate else HostAccumulation.OFF)
    (l0, m0, w0), (l1, m1, w1) = runs
    assert l0 == l1
    for k in m0:
        assert torch.equal(m0[k], m1[k]), k
    for a, b in zip(w0, w1):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["fp32", "landing"])
def test_nan_in_a_non_final_micro_batch_skips_the_step_bit_exactly(dtype):
    data = batches(6 * ACCUM)
    model, opt = build(config(dtype, "flow"))
    poison = lambda step, k: step == 2 and k == 0  # noqa: E731
    losses = train(model, opt, data, poison=poison)
    assert opt.skipped_steps == 1

    # bit-exact: rerun the same steps with step 2's micro-batches absent, the states must be identical
    model2, opt2 = build(config(dtype, "flow"))
    kept = data[: 2 * ACCUM] + data[3 * ACCUM :]
    losses2 = train(model2, opt2, kept)
    a, b = masters(opt), masters(opt2)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with opt.materialized(), opt2.materialized():
        for p, q in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p, q)
    assert losses[:2] == losses2[:2] and losses[3:] == losses2[2:]
    assert math.isnan(losses[2])

    ref_model, ref = build(None, reference=True, fp32=dtype == "fp32")
    ref_losses = train(ref_model, ref, data, poison=poison)
    assert ref.skipped_steps == 1
    assert_matches_reference(model, opt, ref_model, ref, losses, ref_losses)


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_gradient_checkpointing(ckpt):
    data = batches(8 * ACCUM)
    model, opt = build(config("fp32", "flow"), ckpt=ckpt)
    losses = train(model, opt, data)
    ref_model, ref = build(None, reference=True, ckpt=ckpt)
    ref_losses = train(ref_model, ref, data)
    assert_matches_reference(model, opt, ref_model, ref, losses, ref_losses)


@pytest.mark.parametrize("dtype", ["fp32", "landing"])
def test_no_accumulated_gradient_stays_on_the_device(dtype):
    """Flow mode: after every micro-batch's backward the host buckets' parameters hold no gradient; every
    micro-batch's gradients crossed the link."""
    cfg = config(dtype, "flow", gpu_resident_buckets=1)
    model, opt = build(cfg)
    eng = opt.engine
    host = [p for b in eng.host_buckets for p in b.params]
    tail = [p for b in eng.device_buckets for p in b.params]
    assert host and tail
    seen = []

    def after_backward(step, k):
        assert all(p.grad is None for p in host), f"step {step}, micro-batch {k}: a host-bucket gradient stayed"
        if k < ACCUM - 1:
            assert all(p.grad is not None for p in tail)  # the device tail accumulates on the device
            assert eng.step_in_progress
        seen.append(eng._flow.stats.materialized_units)  # type: ignore[union-attr]

    data = batches(4 * ACCUM)
    stats = []
    train(model, opt, data, after_backward=after_backward, before_step=lambda s: stats.append(eng.telemetry.current.d2h_bytes))
    host_bytes = sum(b.landing.numel() * b.landing.element_size() for b in eng.host_buckets)
    assert all(s == ACCUM * host_bytes for s in stats), (stats, host_bytes)
    assert max(seen) <= 2


# ---------------------------------------------------------------------------------------------- planner
def _profile(host_gib: float | None = 512, device_gib: float | None = 20) -> HardwareProfile:
    return HardwareProfile(device_type="cuda", device_free_bytes=None if device_gib is None else int(device_gib * GiB),
                           host_available_bytes=None if host_gib is None else int(host_gib * GiB), cpu_threads=8)


def test_planner_auto_is_on_in_flow_and_off_otherwise_and_counts_the_host_bytes():
    numels = [10_000_000] * 40
    flow = make_plan(numels, element_size=2, config=SuperOffloadConfig(weight_placement="flow"), profile=_profile())
    assert flow.host_accumulation is HostAccumulation.FP32
    assert any("gradient accumulation: on the host, fp32" in n for n in flow.notes)
    off = make_plan(numels, element_size=2, config=SuperOffloadConfig(weight_placement="flow", accumulate_on_host=False),
                    profile=_profile())
    assert off.host_accumulation is HostAccumulation.OFF
    assert flow.host_bytes() - off.host_bytes() == 4 * flow.host_numel
    stat = make_plan(numels, element_size=2, config=SuperOffloadConfig(weight_placement="stationary"),
                     profile=_profile())
    assert stat.host_accumulation is HostAccumulation.OFF
    assert "gradient accumulation" in flow.summary()


def test_planner_auto_falls_back_to_landing_when_host_ram_is_short():
    numels = [10_000_000] * 40  # 0.4B params: 16 B/param = 6 GiB, +4 B/param fp32 = 7.5 GiB, + 2 GiB headroom
    cfg = SuperOffloadConfig(weight_placement="flow", rollback="inverse", gpu_resident_buckets=0)
    plan = make_plan(numels, element_size=2, config=cfg, profile=_profile(host_gib=9))
    assert plan.host_accumulation is HostAccumulation.LANDING
    assert plan.accumulation_bytes() == LANDING_RING_SLOTS * 2 * 10_000_000  # a few bf16 buckets, not per param
    with pytest.raises(PlanError, match="B/param"):
        make_plan(numels, element_size=2, config=cfg.replace(host_accumulation_dtype="fp32"),
                  profile=_profile(host_gib=9))


def test_data_parallel_refuses_true_and_auto_is_off():
    numels = [10_000_000] * 8
    with pytest.raises(PlanError, match="accumulate_on_host=True is not supported with data parallelism"):
        make_plan(numels, element_size=2, config=SuperOffloadConfig(accumulate_on_host=True), profile=_profile(),
                  world_size=2, rank=0)
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=_profile(), world_size=2, rank=0)
    assert plan.host_accumulation is HostAccumulation.OFF


def test_memory_model_counts_the_fp32_accumulator():
    from hf_superoffload.planning.memory_model import PlanLike, estimate

    numels = [10_000_000] * 40
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(weight_placement="flow"), profile=_profile())
    pl = PlanLike.from_plan(plan)
    assert pl.accumulation_bytes == 4 * plan.host_numel
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 128}
    est = estimate(shape, batch_size=1, seq_len=16, grad_ckpt=False, plan_like=pl)
    assert est.host["grad_accumulation"] == 4 * plan.host_numel


def test_config_validation():
    with pytest.raises(ValueError, match="accumulate_on_host"):
        SuperOffloadConfig(accumulate_on_host="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_accumulation_dtype"):
        SuperOffloadConfig(host_accumulation_dtype="bf16")  # type: ignore[arg-type]


def test_the_landing_ring_pays_for_one_giant_bucket_once():
    """The ring's slots are the few largest host shards: one LM-head-sized slot, not one per slot."""
    from hf_superoffload.planning.planner import landing_ring_slots

    shards = [700_000_000] + [70_000_000] * 30 + [5_000]
    rest = (70_000_000,) * (LANDING_RING_SLOTS - 1)
    assert landing_ring_slots(shards) == (700_000_000, *rest)
    assert landing_ring_slots([3, 1]) == (3, 1) and landing_ring_slots([]) == ()
    numels = [70_000_000] * 30 + [700_000_000]  # the LM head arrives first in backward: a host bucket
    cfg = SuperOffloadConfig(weight_placement="stationary", accumulate_on_host=True,
                             host_accumulation_dtype="landing", rollback="inverse", gpu_resident_buckets=0)
    plan = make_plan(numels[::-1], element_size=2, config=cfg, profile=_profile(host_gib=64))
    assert plan.landing_ring == (700_000_000, *rest)
    assert plan.accumulation_bytes() == 2 * (700_000_000 + (LANDING_RING_SLOTS - 1) * 70_000_000)


def test_a_hand_built_landing_plan_without_a_large_enough_ring_slot_is_refused():
    import dataclasses

    from hf_superoffload.runtime.layout import check_plan

    cfg = SuperOffloadConfig(weight_placement="stationary", accumulate_on_host=True,
                             host_accumulation_dtype="landing", rollback="inverse", gpu_resident_buckets=0)
    plan = make_plan([70_000] * 4 + [700_000], element_size=2, config=cfg, profile=_profile(host_gib=64))
    check_plan(plan, comm=None)  # the planner's own ring holds every bucket
    with pytest.raises(ValueError, match="ring slot as large as the largest host bucket"):
        check_plan(dataclasses.replace(plan, landing_ring=(70_000,) * 4), comm=None)
