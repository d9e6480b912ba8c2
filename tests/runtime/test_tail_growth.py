"""[Note: moving the tail to the device] (runtime/tail_move.py): when the calibration's measured peak leaves room that
kept layers do not take, the last host buckets move their optimizer state to the device before the next forward,
and training on equals a run started with that larger tail from the state at the move, bit for bit: weights, the
whole optimizer state and gradient norms. On CPU the measurement is simulated beside a simulated device budget, as
in test_calibration.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.optimizer import calibration_summary
from hf_superoffload.planning import planner
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.memory_model import PlanLike, estimate
from hf_superoffload.planning.plan import HostAccumulation, OffloadPlan, Placement, Rollback
from hf_superoffload.planning.planner import (
    CALIBRATED_MARGIN,
    CALIBRATION_STEPS,
    Workload,
    device_holds,
    grow_tail,
    make_plan,
    shrink_tail,
)
from hf_superoffload.runtime import layout
from hf_superoffload.runtime.tail_move import check_move, check_move_to_device
from hf_superoffload.testing import pretend_profile, snapshot, tiny_llama, train_steps, weights_and_state

BATCH, SEQ = 2, 24
MODEL = dict(seed=3, num_hidden_layers=4)
CLIP = 1.7  # after the calibration some steps clip, others not (norms 1.13-1.84 plain, 1.54-6.5 accumulating)


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(n)]


def _norms(opt: SuperOffloadOptimizer, model: torch.nn.Module, batches: list[torch.Tensor],
           micro: int = 1) -> list[float]:
    return [step.stats.grad_norm for step in train_steps(model, opt, batches, accumulation=micro)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _need(workload: Workload, plan: OffloadPlan) -> int:
    """The memory model's device need (with the allocator's slack) of ``workload`` under ``plan``."""
    return estimate(workload.model, plan_like=PlanLike.from_plan(plan), **workload.estimate_kwargs()).gpu_required_bytes


def _partial_budget(model: torch.nn.Module) -> int:
    """Free device memory whose first plan keeps about half of the optimizer on the device."""
    n = sum(p.numel() for p in model.parameters())
    need = [estimate(model.config, batch_size=BATCH, seq_len=SEQ, grad_ckpt=False, chunked_loss=True,
                     plan_like=PlanLike(device_numel=d, host_numel=n - d, bucket_bytes=2 * n // 8)).gpu_required_bytes
            for d in (0, n)]
    return int((need[0] + need[1]) / 2 / (1 - 0.04))


def _room_for(config: SuperOffloadConfig, share: float) -> Any:
    """A simulated measured need that leaves room for ``share`` of the host buckets on the device as well: what
    the memory model predicts for that larger tail (the plan ``make_plan`` gives for it on the budget), restated as
    the measured need of the current plan."""

    def measured(opt: SuperOffloadOptimizer) -> int:
        plan, budget = opt.plan, opt._budget
        assert opt.workload is not None and budget is not None and budget.device_free_bytes is not None
        workload = opt._planning_workload(opt.workload)
        k = len(plan.device_buckets) + max(1, round(share * len(plan.host_buckets)))
        target = make_plan([p.numel() for p in opt._ordered], element_size=2, profile=budget, workload=workload,
                           config=config.replace(gpu_resident_buckets=k))
        if workload.layer_checkpointing:  # and room for every kept layer beside it
            target = dataclasses.replace(target, kept_layers=workload.model.num_hidden_layers)
        return int(budget.device_free_bytes * (1 - CALIBRATED_MARGIN) + _need(workload, plan) - _need(workload, target))

    return measured


def _room_grows_the_tail(sim_device, on: torch.device, config: SuperOffloadConfig, *, share: float,
                         ckpt: bool = False, micro: int = 1) -> int:
    """Train ``CALIBRATION_STEPS`` steps on ``on`` with a first plan that keeps a partial tail, then a measured need
    that leaves room for ``share`` of the host buckets on the device too; the forward after the calibration moves
    them, and training on equals a run started with that plan (on the calibrated budget) from the state just
    before, bit for bit, with the arenas that run allocates. ``micro``: micro-batches per step (more than one:
    the first plan sums them on the host, and the move runs at a step's first micro-batch). Returns the first plan's
    device tail in parameters."""
    model = tiny_llama(**MODEL, checkpointing=ckpt).to(on)
    sim_device.budget(_partial_budget(model), device_type=on.type)
    sim_device.measure(_room_for(config, share))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=CLIP, log_plan=False, config=config)
    sim_device.opt = opt
    data = [ids.to(on) for ids in _batches(micro * (CALIBRATION_STEPS + 3))]
    _norms(opt, model, data[: micro * CALIBRATION_STEPS], micro)
    tail, kept, accumulation = len(opt.plan.device_buckets), opt.plan.kept_layers, opt.plan.host_accumulation
    old_tail = opt.plan.device_numel
    assert 0 < tail < len(opt.plan.buckets), "the budget should leave a partial tail"
    assert (accumulation is HostAccumulation.OFF) == (micro == 1)
    before = snapshot(model, opt)
    arenas = {n: (a.tensor.data_ptr(), a.tensor.numel()) for n, a in opt.engine.layout.arenas.items()}
    host_numel = opt.plan.host_numel
    norms = _norms(opt, model, data[micro * CALIBRATION_STEPS :], micro)
    k = len(opt.plan.device_buckets)
    assert tail < k and (k == len(opt.plan.buckets)) == (share == 1.0), "the measured room should grow the tail"
    assert opt.calibration is not None and opt.calibration["device_buckets"] == (tail, k)
    moved = sum(s.numel for s in opt.plan.buckets[-k:-tail])
    assert opt.calibration["moved_to_device_params"] == moved
    assert opt.calibration["move_s"] > 0
    assert f"{moved / 1e6:.1f}M parameters' optimizer state moved to the device in " in calibration_summary(
        opt.calibration, CALIBRATION_STEPS)
    assert opt.engine.layout.plan is opt.plan
    assert {b.index for b in opt.engine.host_buckets} == {s.index for s in opt.plan.host_buckets}
    if ckpt:
        assert opt.plan.kept_layers == 4 > kept, "kept layers take the room first"

    sim_device.opt = None  # the reference measures nothing: it starts with the larger tail on the calibrated budget
    ref_model = tiny_llama(**MODEL, checkpointing=ckpt).to(on)
    ref_model.load_state_dict(before["model"])
    ref = SuperOffloadOptimizer(ref_model, lr=1e-2, max_grad_norm=CLIP, log_plan=False, profile=opt._budget,
                                config=config.replace(gpu_resident_buckets=k),
                                workload=Workload(ref_model.config, BATCH, SEQ, grad_ckpt=ckpt, accumulation=micro > 1,
                                                  micro_batches=micro if micro > 1 else None))
    ref.load_state_dict(before["opt"])
    assert dataclasses.replace(ref.plan, notes=()) == dataclasses.replace(opt.plan, notes=())
    assert opt.plan.host_accumulation is accumulation
    assert _norms(ref, ref_model, data[micro * CALIBRATION_STEPS :], micro) == norms
    assert _same(weights_and_state(model, opt), weights_and_state(ref_model, ref))
    assert any(n > CLIP for n in norms) and any(n < CLIP for n in norms), "clipping should fire in some steps"
    ours, theirs = opt.engine.layout, ref.engine.layout
    # [Note: the host arenas keep their size]: the same arenas, pages and all (an arena the new plan adds, such as
    # a second landing arena, at its host share), unless nothing stays on the host; the reference's at its share
    assert ours.arenas.keys() == theirs.arenas.keys()
    for name, a in ours.arenas.items():
        if opt.plan.host_numel:
            kept = arenas.get(name, (a.tensor.data_ptr(), opt.plan.host_numel))
            assert (a.tensor.data_ptr(), a.tensor.numel()) == kept, f"the host arena {name} was reallocated"
        else:
            assert a.tensor.numel() == 0, f"the host arena {name} outlived the last host bucket"
        assert theirs.arenas[name].tensor.numel() == opt.plan.host_numel < host_numel
    assert ours.host_arena_numel == (host_numel if opt.plan.host_numel else 0)
    assert ours.device_state_bytes == theirs.device_state_bytes == 12 * opt.plan.device_numel
    opt.close()
    ref.close()
    return old_tail


@pytest.mark.parametrize("config", [
    SuperOffloadConfig(),
    SuperOffloadConfig(rollback="double_buffer"),
    SuperOffloadConfig(rollback="inverse"),
    SuperOffloadConfig(rollback="inverse", speculation=False),
], ids=["plain", "double_buffer", "inverse", "inverse-verdict-first"])
def test_training_after_growth_equals_starting_with_the_larger_tail(sim_device, config: SuperOffloadConfig) -> None:
    """Half of the host buckets move; the others stay where they were."""
    _room_grows_the_tail(sim_device, torch.device("cpu"), config, share=0.5)


@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
@pytest.mark.parametrize("dtype", ["fp32", "landing"])
def test_growth_under_host_accumulation_equals_starting_with_the_larger_tail(sim_device, dtype: str,
                                                                             rollback: str) -> None:
    """Micro-batches summed on the host ([Note: host accumulation] in docs/weight_flow.md): the calibration runs at
    a step's first micro-batch, when nothing is summed, and the accumulation buffers shrink with the host share
    (the fp32 arena at ``host_numel``; the landing ring sized by the remaining host shards)."""
    config = SuperOffloadConfig(rollback=rollback, host_accumulation_dtype=dtype)
    _room_grows_the_tail(sim_device, torch.device("cpu"), config, share=0.5, micro=2)


def test_room_for_every_bucket_empties_the_host(sim_device) -> None:
    """Every host bucket moves: the host arenas are freed and the deferred stores turn off with them."""
    _room_grows_the_tail(sim_device, torch.device("cpu"), SuperOffloadConfig(), share=1.0)


def test_the_old_tail_waits_on_the_host_one_arena_at_a_time(sim_device, staging_watch) -> None:
    """The device arenas grow through host memory one at a time: 4 B per parameter of the old tail on the host at
    once (``grow_tail`` prices that), never two arenas' copies (the three of them: 12 B/param)."""
    watch = staging_watch
    old_tail = _room_grows_the_tail(sim_device, torch.device("cpu"), SuperOffloadConfig(), share=0.5)
    assert len(watch.elements) == 3 and watch.most_alive == 1 and watch.alive == 0
    assert watch.elements == [old_tail] * 3
    assert watch.old_alive_at_alloc == [0, 0, 0], "an old device arena outlived its staging"


def test_room_beyond_every_kept_layer_grows_the_tail(sim_device) -> None:
    """Under per-layer checkpointing the room goes to kept layers first (every one of them here); the tail grows
    with what they leave."""
    _room_grows_the_tail(sim_device, torch.device("cpu"), SuperOffloadConfig(), share=0.5, ckpt=True)


def _setting(model: torch.nn.Module, **budget: Any) -> tuple[list[int], Workload, HardwareProfile]:
    numels = [p.numel() for p in reversed(list(model.parameters()))]
    return (numels, Workload(model.config, BATCH, SEQ, grad_ckpt=False, chunked_loss=True),
            pretend_profile(_partial_budget(model), **budget))


def test_the_grown_plan_is_make_plans_for_that_tail() -> None:
    """On a larger budget than the plan was made for, the grown plan is exactly ``make_plan`` for its tail with the
    plan's switches, and its tail is the largest the budget holds: one bucket more does not fit."""
    model = tiny_llama(**MODEL)
    numels, workload, profile = _setting(model)
    config = SuperOffloadConfig(rollback="inverse")
    plan = make_plan(numels, element_size=2, config=config, profile=profile, workload=workload)
    tail = len(plan.device_buckets)
    assert 0 < tail < len(plan.buckets)
    assert grow_tail(plan, workload, profile, numels=numels, element_size=2, config=config) is None, \
        "the budget the plan was made for holds no larger tail"
    larger = dataclasses.replace(profile, device_free_bytes=int(profile.device_free_bytes * 1.0001))
    grown = grow_tail(plan, workload, larger, numels=numels, element_size=2, config=config)
    assert grown is not None
    k = len(grown.device_buckets)
    assert tail < k < len(plan.buckets), "the larger budget should hold some, not all, host buckets"
    fresh = make_plan(numels, element_size=2, config=config.replace(gpu_resident_buckets=k), profile=larger,
                      workload=workload)
    for field in dataclasses.fields(grown):
        if field.compare and field.name != "notes":  # not the plan's caches
            assert getattr(grown, field.name) == getattr(fresh, field.name), field.name
    # the moved buckets are the last host buckets; the other host buckets stay where they were
    n_host = len(grown.host_buckets)
    assert grown.buckets[:n_host] == plan.buckets[:n_host]
    assert [s.placement for s in grown.buckets] == [Placement.HOST] * n_host + [Placement.DEVICE] * k
    bigger = make_plan(numels, element_size=2, config=config.replace(gpu_resident_buckets=k + 1), profile=larger,
                       workload=workload)
    assert device_holds(grown, workload, larger, 1)[0] and not device_holds(bigger, workload, larger, 1)[0]
    check_move_to_device(plan, grown)
    # a configured tail is a user's constraint: the calibration does not grow it
    pinned = config.replace(gpu_resident_buckets=tail)
    assert grow_tail(plan, workload, larger, numels=numels, element_size=2, config=pinned) is None


def test_nothing_grows_where_the_roofline_predicts_the_larger_tail_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: tail from both memories]: the planner's own tail search decides, so a roofline that predicts every
    larger tail slower (a fast host and link, as on GH200) keeps the tail; one that predicts it faster grows it."""
    model = tiny_llama(**MODEL)
    numels, workload, profile = _setting(model)
    config = SuperOffloadConfig()
    plan = make_plan(numels, element_size=2, config=config, profile=profile, workload=workload)
    larger = dataclasses.replace(profile, device_free_bytes=profile.device_free_bytes * 2)
    for sign, grows in ((1.0, False), (-1.0, True)):
        def predicted(shape: Any, plan_like: PlanLike, *args: Any, sign: float = sign, **kwargs: Any) -> Any:
            return SimpleNamespace(step_s=1.0 + sign * plan_like.device_numel * 1e-6)

        monkeypatch.setattr(planner, "predict_step_time", predicted)
        grown = grow_tail(plan, workload, larger, numels=numels, element_size=2, config=config)
        assert (grown is not None) == grows
        if grown is not None:
            assert len(grown.device_buckets) == len(grown.buckets), "the fastest predicted is the largest here"


def test_a_move_that_changes_switches_or_cuts_is_refused() -> None:
    model = tiny_llama(**MODEL)
    numels, workload, profile = _setting(model)
    config = SuperOffloadConfig()
    plan = make_plan(numels, element_size=2, config=config, profile=profile, workload=workload)
    larger = dataclasses.replace(profile, device_free_bytes=profile.device_free_bytes * 2)
    grown = grow_tail(plan, workload, larger, numels=numels, element_size=2, config=config)
    assert grown is not None
    other = Rollback.INVERSE if grown.rollback is Rollback.DOUBLE_BUFFER else Rollback.DOUBLE_BUFFER
    with pytest.raises(ValueError, match=r"changes \['rollback'\].*grow_tail"):
        check_move_to_device(plan, dataclasses.replace(grown, rollback=other))
    with pytest.raises(ValueError, match="last host buckets to the device"):
        check_move_to_device(grown, plan)  # a move to the host is not a growth
    with pytest.raises(ValueError, match="first device buckets to the host"):
        check_move(plan, grown)  # nor the reverse
    recut = make_plan(numels, element_size=2, config=config.replace(bucket_size_mb=0.001), profile=larger,
                      workload=workload)
    with pytest.raises(ValueError, match="cuts the buckets differently"):
        check_move_to_device(plan, recut)
    fewer = make_plan(numels, element_size=2, config=config.replace(gpu_resident_buckets=len(plan.device_buckets) - 1),
                      profile=profile, workload=workload)
    smaller = dataclasses.replace(profile, device_free_bytes=int((_need(workload, fewer) + _need(workload, plan)) / 2
                                                                 / (1 - 0.04)))
    shrunk = shrink_tail(plan, workload, smaller, numels=numels, element_size=2, config=config)
    assert shrunk is not None
    with pytest.raises(ValueError, match="last host buckets to the device"):
        check_move_to_device(plan, shrunk)


def test_nothing_grows_where_the_calibrated_budget_holds_no_more(sim_device) -> None:
    """A measured need at the budget the plan was sized for leaves no room for another bucket: the calibration
    moves nothing and the run trains on as it was."""
    model = tiny_llama(**MODEL)
    sim_device.budget(_partial_budget(model))

    def measured(opt: SuperOffloadOptimizer) -> int:  # exactly what the plan leaves unused, taken
        budget = opt._budget
        assert budget is not None and budget.device_free_bytes is not None and opt.workload is not None
        return int(budget.device_free_bytes * (1 - CALIBRATED_MARGIN) - budget.device_free_bytes * (1 - 0.04)
                   + _need(opt._planning_workload(opt.workload), opt.plan))

    sim_device.measure(measured)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=CLIP, log_plan=False)
    sim_device.opt = opt
    data = _batches(CALIBRATION_STEPS + 1)
    _norms(opt, model, data[:CALIBRATION_STEPS])
    plan = opt.plan
    _norms(opt, model, data[CALIBRATION_STEPS:])
    assert opt.calibration is not None and opt.calibration["moved_to_device_params"] == 0
    assert opt.plan == plan
    opt.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_measured_room_grows_the_tail_and_training_goes_on_as_if_started_so(sim_device) -> None:
    """The growth's CUDA path (device arenas grown beside the old ones, the page-locked host arenas kept, the
    upload thread and the forward hooks of the moved parameters dropped) on a simulated budget. The model's CUDA
    kernels run deterministically (``torch.use_deterministic_algorithms``) so the runs can be compared bit for
    bit."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _room_grows_the_tail(sim_device, torch.device("cuda"), SuperOffloadConfig(), share=0.5)
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_device_that_cannot_hold_a_new_arena_beside_the_old_says_so() -> None:
    """[Note: restaging the device arenas]: an arena larger than the device gets ``None`` (the old arena then waits
    on the host), not an out-of-memory error, and the allocator can still allocate after it."""
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    assert layout.allocate_beside(total // 4 + 1, device) is None
    small = layout.allocate_beside(1024, device)
    assert small is not None and small.numel() == 1024 and small.dtype == torch.float32


def test_a_moved_plan_credits_the_user_only_with_what_they_set() -> None:
    """The grown plan's switches are pinned from the first plan and its tail resized by the planner: its summary (the
    Trainer's log after the calibration) says so; a switch the user did set still reads "configured"."""
    model = tiny_llama(**MODEL)
    numels, workload, profile = _setting(model)
    larger = dataclasses.replace(profile, device_free_bytes=int(profile.device_free_bytes * 1.0001))
    for config, user_set in ((SuperOffloadConfig(), ()), (SuperOffloadConfig(cast_side="cpu"), ("casts fused",))):
        plan = make_plan(numels, element_size=2, config=config, profile=profile, workload=workload)
        grown = grow_tail(plan, workload, larger, numels=numels, element_size=2, config=config)
        assert grown is not None
        configured = [n for n in grown.notes if "configured" in n]
        assert [n for n in configured if not n.startswith(user_set or ("\0",))] == [], configured
        assert len(configured) == len(user_set), grown.notes
        tail = [n for n in grown.notes if n.startswith("device tail:")]
        assert tail == [f"device tail: {len(grown.device_buckets)} bucket(s) (auto: resized since the first plan, "
                        "to the memory the run needs)"]
        shrunk = shrink_tail(grown, workload, profile, numels=numels, element_size=2, config=config)  # and back
        assert shrunk is not None and len(shrunk.device_buckets) < len(grown.device_buckets)
        assert [n for n in shrunk.notes if "configured" in n] == configured
        assert [n for n in shrunk.notes if n.startswith("device tail:")] == [
            f"device tail: {len(shrunk.device_buckets)} bucket(s) (auto: resized since the first plan, to the memory "
            "the run needs)"]
