"""[Note: moving the tail to the host] (runtime/tail_move.py): a later batch longer than the plan was made for moves
the first device buckets' optimizer state to the host before its forward runs, and training on equals having
started with that smaller tail, bit for bit: weights, the whole optimizer state, gradient norms and checkpoints."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.planning.memory_model import PlanLike, estimate
from hf_superoffload.planning.plan import HostAccumulation, OffloadPlan, Placement
from hf_superoffload.planning.planner import (
    Workload,
    _move_to_host_transient,
    device_holds,
    make_plan,
    shrink_tail,
)
from hf_superoffload.runtime import layout as layout_module
from hf_superoffload.runtime import streams
from hf_superoffload.runtime.tail_move import check_move
from hf_superoffload.testing import (
    master_of,
    pretend_profile,
    snapshot,
    tiny_llama,
    train_steps,
    weights_and_state,
)

MODEL = dict(seed=3, num_hidden_layers=4)
BATCH, SHORT, LONG = 2, 24, 32  # on the budget below, 2 x 32 tokens leave room for a smaller tail only


def _budget(model: torch.nn.Module, device_share: float = 0.5) -> int:
    """Free device memory whose plan for the short batch keeps about ``device_share`` of the optimizer on the
    device."""
    n = sum(p.numel() for p in model.parameters())
    need = [estimate(model.config, batch_size=BATCH, seq_len=SHORT, grad_ckpt=False, chunked_loss=True,
                     plan_like=PlanLike(device_numel=d, host_numel=n - d, bucket_bytes=2 * n // 8)).gpu_required_bytes
            for d in (0, n)]
    return int((need[0] + device_share * (need[1] - need[0])) / (1 - 0.04))


def _batches(seqs: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 128, (BATCH, s), generator=g) for s in seqs]


def _grad_norms(model: torch.nn.Module, opt: SuperOffloadOptimizer, batches: list[torch.Tensor]) -> list[float]:
    """The gradient norm of every step."""
    return [step.stats.grad_norm for step in train_steps(model, opt, batches)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _runtime_fields(plan: OffloadPlan) -> OffloadPlan:
    """``plan`` without what the runtime does not read."""
    return dataclasses.replace(plan, notes=(), kept_layers=0)


def _started_with(saved: dict[str, object], config: SuperOffloadConfig, k: int, *, seq: int = LONG,
                  ckpt: bool = False) -> tuple[SuperOffloadOptimizer, torch.nn.Module]:
    """A run started with ``k`` device buckets (planned for the long batch), from the saved state."""
    model = tiny_llama(**MODEL, checkpointing=ckpt)
    model.load_state_dict(saved["model"])
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False,
                                config=config.replace(gpu_resident_buckets=k),
                                workload=Workload(model.config, BATCH, seq, grad_ckpt=ckpt))
    opt.load_state_dict(saved["opt"])
    return opt, model


@pytest.mark.parametrize("speculation", [True, False], ids=["speculative", "verdict-first"])
@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
def test_training_after_a_move_equals_starting_with_the_smaller_tail(device_budget, rollback: str,
                                                                     speculation: bool) -> None:
    """The tail's buckets step on the device before the move and on the host after it (different AdamW kernels,
    rounded differently), so the reference starts with the smaller tail from the state just before the move."""
    config = SuperOffloadConfig(rollback=rollback, speculation=speculation)
    model = tiny_llama(**MODEL)
    device_budget(_budget(model))
    data = _batches([SHORT] * 3 + [LONG] * 3)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False, config=config)
    train_steps(model, opt, data[:3])
    tail = len(opt.plan.device_buckets)
    assert 0 < tail < len(opt.plan.buckets), "the budget should leave a partial tail for the short batch"
    before = snapshot(model, opt)
    ptrs = {n: a.tensor.data_ptr() for n, a in opt.engine.layout.arenas.items()}
    norms = _grad_norms(model, opt, data[3:])
    k = len(opt.plan.device_buckets)
    assert 0 < k < tail, "the long batch should move some, not all, device buckets to the host"
    assert opt.engine.layout.plan is opt.plan
    assert {b.index for b in opt.engine.host_buckets} == {s.index for s in opt.plan.host_buckets}

    ref, ref_model = _started_with(before, config, k)
    assert _runtime_fields(ref.plan) == _runtime_fields(opt.plan)
    assert _grad_norms(ref_model, ref, data[3:]) == norms
    assert any(n > 1.0 for n in norms) and any(n < 1.0 for n in norms), "clipping should fire in some steps"
    assert _same(weights_and_state(model, opt), weights_and_state(ref_model, ref))
    # what the engine really holds is what a run started with the smaller tail allocates
    ours, theirs = opt.engine.layout, ref.engine.layout
    assert {n: a.nbytes for n, a in ours.arenas.items()} == {n: a.nbytes for n, a in theirs.arenas.items()}
    # [Note: reserved room in the host arenas]: every host arena grew in place, none was regrown beside itself
    kept = ptrs.keys() & ours.arenas.keys()
    assert "master0" in kept and {n: ours.arenas[n].tensor.data_ptr() for n in kept} == {n: ptrs[n] for n in kept}
    assert ours.device_state_bytes == theirs.device_state_bytes == 12 * opt.plan.device_numel
    opt.close()
    ref.close()


def test_a_tail_holding_every_bucket_moves_to_empty_host_arenas(device_budget) -> None:
    """The short batch leaves room for the whole optimizer on the device (no host arenas at all); the long one
    moves the first buckets to a host that had none."""
    model = tiny_llama(**MODEL)
    n = sum(p.numel() for p in model.parameters())
    need = [estimate(model.config, batch_size=BATCH, seq_len=s, grad_ckpt=False, chunked_loss=True,
                     plan_like=PlanLike(device_numel=n, bucket_bytes=2 * n // 8)).gpu_required_bytes
            for s in (SHORT, LONG)]
    device_budget(int((need[0] + need[1]) / 2 / (1 - 0.04)))
    data = _batches([SHORT] * 2 + [LONG] * 2)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, data[:2])
    assert opt.plan.host_numel == 0
    before = snapshot(model, opt)
    norms = _grad_norms(model, opt, data[2:])
    k = len(opt.plan.device_buckets)
    assert 0 < k < len(opt.plan.buckets)
    assert opt.plan.defer_moments and "landing1" in opt.engine.layout.arenas, "deferred stores follow the host share"
    ref, ref_model = _started_with(before, SuperOffloadConfig(), k)
    assert _runtime_fields(ref.plan) == _runtime_fields(opt.plan)
    assert _grad_norms(ref_model, ref, data[2:]) == norms
    assert _same(weights_and_state(model, opt), weights_and_state(ref_model, ref))
    opt.close()
    ref.close()


def test_a_move_that_turns_the_d2h_gate_on_starts_the_gate(device_budget, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: D2H gate]: the short batch's plan keeps the whole optimizer on the device (no host bucket, no D2H
    lead, no gate: the worker is built without a gate thread); the moved plan holds some of it on the host, so it
    leads and gates. The move starts the gate thread, every host bucket's first CPU task after it passes through the gate, and training
    equals a run started with the smaller tail (gated from its first step)."""
    gated: list[str] = []
    real_wait = streams.Handoff.wait_host

    def wait_host(self: streams.Handoff) -> None:
        if threading.current_thread().name.endswith("-gate"):
            gated.append(threading.current_thread().name)
        real_wait(self)

    monkeypatch.setattr(streams.Handoff, "wait_host", wait_host)
    model = tiny_llama(**MODEL)
    device_budget(_budget(model, device_share=1.1))
    data = _batches([SHORT] * 2 + [LONG] * 2)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, data[:2])
    assert opt.plan.host_numel == 0, "the short batch's budget should hold the whole optimizer on the device"
    assert not opt.plan.d2h_gate and not opt.engine._worker.gated, "the worker is gated only when the plan asks"
    before = snapshot(model, opt)
    norms = _grad_norms(model, opt, data[2:])
    assert opt.plan.d2h_gate and opt.plan.host_numel > 0
    assert len(gated) == 2 * len(opt.engine.host_buckets)
    ref, ref_model = _started_with(before, SuperOffloadConfig(), len(opt.plan.device_buckets))
    assert _runtime_fields(ref.plan) == _runtime_fields(opt.plan)
    assert _grad_norms(ref_model, ref, data[2:]) == norms
    assert _same(weights_and_state(model, opt), weights_and_state(ref_model, ref))
    opt.close()
    ref.close()


def test_a_move_also_sets_the_kept_layers_of_its_plan(device_budget) -> None:
    """Under per-layer checkpointing the kept layers are given back first; when that is not enough, the shrunk
    plan's kept layers (the most the device holds beside the smaller tail) are applied with the move."""
    model = tiny_llama(**MODEL, checkpointing=True)
    device_budget(int((1074000000 + 350000) / 0.96))  # the tiny model's fixed costs, then room for one kept layer
    data = _batches([SHORT] * 2 + [2 * SHORT] * 2)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, data[:2])
    tail, kept = len(opt.plan.device_buckets), opt.plan.kept_layers
    assert tail and kept, "the budget should keep a layer beside a partial tail"
    before = snapshot(model, opt)
    norms = _grad_norms(model, opt, data[2:])
    k = len(opt.plan.device_buckets)
    assert k < tail
    unchecked = sum(not layer.gradient_checkpointing for layer in model.model.layers)
    assert unchecked == opt.plan.kept_layers
    ref, ref_model = _started_with(before, SuperOffloadConfig(), k, seq=2 * SHORT, ckpt=True)
    assert dataclasses.replace(ref.plan, notes=()) == dataclasses.replace(opt.plan, notes=())
    assert _grad_norms(ref_model, ref, data[2:]) == norms
    assert _same(weights_and_state(model, opt), weights_and_state(ref_model, ref))
    opt.close()
    ref.close()


def test_the_shrunk_plan_is_make_plans_for_that_tail(device_budget) -> None:
    """The planner's shrunk plan is exactly ``make_plan(gpu_resident_buckets=k)`` for the longer workload, and k is
    the largest tail that fits it: one bucket more does not."""
    model = tiny_llama(**MODEL)
    profile = pretend_profile(_budget(model))
    numels = [p.numel() for p in reversed(list(model.parameters()))]
    config = SuperOffloadConfig(rollback="double_buffer")
    short = Workload(model.config, BATCH, SHORT, grad_ckpt=False, chunked_loss=True)
    plan = make_plan(numels, element_size=2, config=config, profile=profile, workload=short)
    long = dataclasses.replace(short, seq_len=LONG)
    shrunk = shrink_tail(plan, long, profile, numels=numels, element_size=2, config=config)
    assert shrunk is not None
    k = len(shrunk.device_buckets)
    assert 0 < k < len(plan.device_buckets)
    for field in dataclasses.fields(shrunk):
        if field.compare and field.name != "notes":  # not the plan's caches
            fresh = make_plan(numels, element_size=2, config=config.replace(gpu_resident_buckets=k), profile=profile,
                              workload=long)
            assert getattr(shrunk, field.name) == getattr(fresh, field.name), field.name
    # the fewest moved: the moved buckets are the first device buckets, the host buckets stay where they were
    assert shrunk.buckets[: len(plan.host_buckets)] == plan.buckets[: len(plan.host_buckets)]
    assert [s.placement for s in shrunk.buckets] == [Placement.HOST] * (len(shrunk.buckets) - k) + [Placement.DEVICE] * k
    bigger = make_plan(numels, element_size=2, config=config.replace(gpu_resident_buckets=k + 1), profile=profile,
                       workload=long)
    assert not device_holds(bigger, long, profile, 1)[0]
    assert device_holds(shrunk, long, profile, 1)[0]
    too_long = dataclasses.replace(short, seq_len=40 * SHORT)
    assert shrink_tail(plan, too_long, profile, numels=numels, element_size=2, config=config) is None


def test_only_a_one_process_stationary_tail_moves_and_keeps_room_for_it() -> None:
    """``OffloadPlan.tail_movable``: one process, stationary weights. Only such a plan's host arenas keep room for
    the device tail ([Note: reserved room in the host arenas]); the planner offers no move and the move check
    refuses one for the others (weight flow, data parallelism)."""
    model = tiny_llama(**MODEL)
    profile = pretend_profile(_budget(model))
    numels = [p.numel() for p in reversed(list(model.parameters()))]
    short = Workload(model.config, BATCH, SHORT, grad_ckpt=False, chunked_loss=True)
    long = dataclasses.replace(short, seq_len=LONG)
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=profile, workload=short)
    assert plan.tail_movable and plan.device_numel and plan.host_arena_room == plan.device_numel
    flow_config = SuperOffloadConfig(weight_placement="flow")
    flow = make_plan(numels, element_size=2, config=flow_config, profile=profile, workload=short)
    sharded = dataclasses.replace(plan, world_size=2)
    for other, config in ((flow, flow_config), (sharded, SuperOffloadConfig())):
        assert not other.tail_movable and other.host_arena_room == 0
        assert shrink_tail(other, long, profile, numels=numels, element_size=2, config=config) is None
        with pytest.raises(ValueError, match="one process and stationary weights"):
            check_move(other, other)


def test_the_host_is_priced_with_the_arenas_it_holds() -> None:
    """After a move to the device the host arenas keep their size ([Note: the host arenas keep their size]): a move
    back to the host is priced with what they hold, not with the new plan's share alone."""
    model = tiny_llama(**MODEL)
    profile = pretend_profile(_budget(model), host_available_bytes=8 * 1024**3)
    numels = [p.numel() for p in reversed(list(model.parameters()))]
    config = SuperOffloadConfig()
    short = Workload(model.config, BATCH, SHORT, grad_ckpt=False, chunked_loss=True)
    plan = make_plan(numels, element_size=2, config=config, profile=profile, workload=short)
    long = dataclasses.replace(short, seq_len=LONG)
    shrunk = shrink_tail(plan, long, profile, numels=numels, element_size=2, config=config)
    assert shrunk is not None
    same = shrink_tail(plan, long, profile, numels=numels, element_size=2, config=config,
                       host_arena_numel=shrunk.host_numel)
    assert same == shrunk
    assert shrink_tail(plan, long, profile, numels=numels, element_size=2, config=config,
                       host_arena_numel=10**9) is None, "a billion parameters' arenas do not fit 8 GiB of host"
    # the moment of the move: one arena regrown beside the old one, unless the arenas grow in place ([Note:
    # reserved room in the host arenas]), or one staged device arena
    assert shrunk.host_numel > shrunk.device_numel
    assert _move_to_host_transient(shrunk, None) == 4 * shrunk.host_numel
    assert _move_to_host_transient(shrunk, shrunk.host_numel - 1) == 4 * shrunk.host_numel
    assert _move_to_host_transient(shrunk, shrunk.host_numel) == 4 * shrunk.device_numel


def test_the_staying_tail_waits_on_the_host_one_arena_at_a_time(device_budget, staging_watch) -> None:
    """The device arenas shrink through host memory one at a time: 4 B per staying parameter on the host at once
    (``shrink_tail`` prices that), never two arenas' copies."""
    model = tiny_llama(**MODEL)
    device_budget(_budget(model))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, _batches([SHORT]))
    watch = staging_watch
    train_steps(model, opt, _batches([LONG]))
    assert opt.plan.device_numel > 0, "the long batch should leave a smaller tail"
    assert watch.elements == [opt.plan.device_numel] * 3 and watch.most_alive == 1 and watch.alive == 0
    # and no old device arena outlives its staging: not kept by a view left in the mover's frame
    assert watch.old_alive_at_alloc == [0, 0, 0]
    opt.close()


def test_the_staying_tail_moves_device_to_device_one_arena_at_a_time(device_budget, beside_watch,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: restaging the device arenas]: where the device holds an old and a new arena of one kind, each new arena
    is allocated beside its old one and filled on the device, nothing waits on the host, and each old arena is gone
    before the next new one is allocated (the device holds one old-new pair at a time, never two arenas' copies)."""
    staged: list[int] = []
    monkeypatch.setattr(layout_module, "stage_on_host", lambda arena, pieces: staged.append(1))
    model = tiny_llama(**MODEL)
    device_budget(_budget(model))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, _batches([SHORT]))
    layout = opt.engine.layout
    beside_watch.watch_arenas([layout.dev_master, layout.dev_exp_avg, layout.dev_exp_avg_sq])
    tail = opt.plan.device_numel
    train_steps(model, opt, _batches([LONG]))
    assert 0 < opt.plan.device_numel < tail, "the long batch should leave a smaller tail"
    assert beside_watch.old_alive_at_call == [3, 2, 1] and not staged
    opt.close()


def test_the_moved_device_memory_is_freed(device_budget) -> None:
    model = tiny_llama(**MODEL)
    device_budget(_budget(model))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, _batches([SHORT]))
    layout = opt.engine.layout
    before = layout.device_state_bytes
    old = weakref.ref(layout.dev_exp_avg_sq)
    train_steps(model, opt, _batches([LONG]))
    gc.collect()
    assert old() is None, "the old device arenas must not be kept alive by a stale view"
    assert layout.device_state_bytes == 12 * opt.plan.device_numel < before
    assert all(a.tensor.numel() == opt.plan.host_numel for k, a in layout.arenas.items() if k != "gradient statistics")
    opt.close()


def test_a_checkpoint_after_the_move_resumes_bit_identically(device_budget) -> None:
    model = tiny_llama(**MODEL)
    device_budget(_budget(model))
    data = _batches([SHORT] * 2 + [LONG] * 4)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, data[:4])  # the move happens at the first long batch
    k = len(opt.plan.device_buckets)
    saved = snapshot(model, opt)
    norms = _grad_norms(model, opt, data[4:])
    fresh, fresh_model = _started_with(saved, SuperOffloadConfig(), k)
    assert _grad_norms(fresh_model, fresh, data[4:]) == norms
    assert _same(weights_and_state(model, opt), weights_and_state(fresh_model, fresh))
    opt.load_state_dict(saved["opt"])  # and it loads back into the moved engine
    model.load_state_dict(saved["model"])
    assert _grad_norms(model, opt, data[4:]) == norms
    opt.close()
    fresh.close()


def test_the_export_after_a_move_holds_the_masters(device_budget, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from hf_superoffload import export_checkpoint

    model = tiny_llama(**MODEL)
    device_budget(_budget(model))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    data = _batches([SHORT] * 2 + [LONG])
    train_steps(model, opt, data[:2])
    tail = len(opt.plan.device_buckets)
    train_steps(model, opt, data[2:])
    assert len(opt.plan.device_buckets) < tail
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")
    model.config.save_pretrained(ckpt)
    masters = {n: master_of(opt, p) for n, p in model.named_parameters()}
    loaded = dict(AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "out"),
                                                       dtype=torch.float32).named_parameters())
    assert all(torch.equal(loaded[n].detach(), m) for n, m in masters.items())
    opt.close()


def test_a_batch_no_tail_fits_is_refused_and_changes_nothing(device_budget) -> None:
    model = tiny_llama(**MODEL)
    device_budget(_budget(model))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, _batches([SHORT] * 2))
    plan, before = opt.plan, weights_and_state(model, opt)
    long = torch.randint(0, 128, (BATCH, 40 * SHORT), generator=torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match=r"does not fit the plan made for 2 x 24.*nothing was run or changed") as e:
        model(input_ids=long, labels=long)
    assert "\n" not in str(e.value)
    assert opt.plan is plan and opt.engine.layout.plan is plan
    assert _same(before, weights_and_state(model, opt))
    train_steps(model, opt, _batches([SHORT]))  # the run goes on
    opt.close()


# -- host gradient accumulation ([Note: host accumulation] in docs/weight_flow.md) -----------------------------------
MICRO = 2  # micro-batches per optimizer step
ACCUM_CLIP = 2.0  # the steps after the move clip in some steps, not in others


def _accumulating(config: SuperOffloadConfig, steps: list[int]) -> tuple[SuperOffloadOptimizer, torch.nn.Module,
                                                                          list[torch.Tensor]]:
    """A run whose first batch shows that micro-batches accumulate (its plan sums the host buckets' gradients on
    the host), and ``MICRO`` micro-batches of each of ``steps``' lengths."""
    model = tiny_llama(**MODEL)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=ACCUM_CLIP, log_plan=False, config=config)
    return opt, model, _batches([s for s in steps for _ in range(MICRO)])


def _accumulating_from(saved: dict[str, object], config: SuperOffloadConfig, k: int,
                       seq: int = LONG) -> tuple[SuperOffloadOptimizer, torch.nn.Module]:
    """A run started with ``k`` device buckets, planned for ``MICRO`` accumulated micro-batches of ``seq`` tokens,
    from the saved state."""
    model = tiny_llama(**MODEL)
    model.load_state_dict(saved["model"])
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=ACCUM_CLIP, log_plan=False,
                                config=config.replace(gpu_resident_buckets=k),
                                workload=Workload(model.config, BATCH, seq, grad_ckpt=False, accumulation=True,
                                                  micro_batches=MICRO))
    opt.load_state_dict(saved["opt"])
    return opt, model


def _accumulated_norms(model: torch.nn.Module, opt: SuperOffloadOptimizer, batches: list[torch.Tensor]) -> list[float]:
    return [step.stats.grad_norm for step in train_steps(model, opt, batches, accumulation=MICRO)]


@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
@pytest.mark.parametrize("dtype", ["fp32", "landing"])
def test_a_move_under_host_accumulation_equals_starting_with_the_smaller_tail(device_budget, dtype: str,
                                                                               rollback: str) -> None:
    """The longer batch arrives at a step's first micro-batch, when nothing is summed on the host: the tail moves,
    and the accumulation buffers follow the new host share (the fp32 arena at ``host_numel``; the landing ring
    sized by the largest host shards, here with more slots), so training on equals a run started with the smaller
    tail from the state at the move, bit for bit, with the arenas that run allocates."""
    config = SuperOffloadConfig(rollback=rollback, host_accumulation_dtype=dtype)
    device_budget(_budget(tiny_llama(**MODEL)))
    opt, model, data = _accumulating(config, [SHORT] * 3 + [LONG] * 3)
    train_steps(model, opt, data[: 3 * MICRO], accumulation=MICRO)
    tail, ring = len(opt.plan.device_buckets), opt.plan.landing_ring
    assert opt.plan.host_accumulation.value == dtype, "the run accumulates on the host"
    assert 0 < tail < len(opt.plan.buckets), "the budget should leave a partial tail for the short batch"
    before = snapshot(model, opt)
    ptrs = {n: a.tensor.data_ptr() for n, a in opt.engine.layout.arenas.items()}
    norms = _accumulated_norms(model, opt, data[3 * MICRO :])
    k = len(opt.plan.device_buckets)
    assert 0 < k < tail, "the long batch should move some, not all, device buckets to the host"
    if dtype == "landing":
        assert len(opt.plan.landing_ring) > len(ring), "the ring follows the host shards"

    ref, ref_model = _accumulating_from(before, config, k)
    assert _runtime_fields(ref.plan) == _runtime_fields(opt.plan)
    assert _accumulated_norms(ref_model, ref, data[3 * MICRO :]) == norms
    assert any(n > ACCUM_CLIP for n in norms) and any(n < ACCUM_CLIP for n in norms), "clipping should fire sometimes"
    assert _same(weights_and_state(model, opt), weights_and_state(ref_model, ref))
    ours, theirs = opt.engine.layout, ref.engine.layout
    assert {n: a.nbytes for n, a in ours.arenas.items()} == {n: a.nbytes for n, a in theirs.arenas.items()}
    # [Note: reserved room in the host arenas]: every host arena grew in place, none was regrown beside itself
    kept = ptrs.keys() & ours.arenas.keys()
    assert "master0" in kept and {n: ours.arenas[n].tensor.data_ptr() for n in kept} == {n: ptrs[n] for n in kept}
    sizes = [[b.nbytes for b in e.accumulation_buffers] for e in (opt.engine, ref.engine)]
    assert sizes[0] and sizes[0] == sizes[1], "the accumulation buffers are those of the smaller tail's run"
    assert opt.engine.pinned_bytes == ref.engine.pinned_bytes
    opt.close()
    ref.close()


def test_a_longer_micro_batch_mid_step_is_refused_and_the_next_step_moves(device_budget) -> None:
    """A longer micro-batch after one whose gradients are summed on the host cannot move the tail (the sums are cut
    for the current host share): it is refused in one line naming why and the fix, with the step in progress as it
    was; the step finishes, and the same longer batch at the next step's first micro-batch moves the tail. The run
    equals one that never tried the refused micro-batch, bit for bit."""
    config = SuperOffloadConfig(host_accumulation_dtype="fp32")
    device_budget(_budget(tiny_llama(**MODEL)))
    runs = [_accumulating(config, [SHORT] * 2 + [LONG] * 2) for _ in range(2)]
    for opt, model, data in runs:
        train_steps(model, opt, data[: 2 * MICRO], accumulation=MICRO)
    (opt, model, data), (twin, twin_model, _) = runs
    tail, plan = len(opt.plan.device_buckets), opt.plan
    short = data[0]
    for o, m in ((opt, model), (twin, twin_model)):  # the first micro-batch of the third step
        with o.no_sync():
            m(input_ids=short, labels=short).loss.backward()
    assert opt.engine.mid_accumulation and not opt.engine.can_move_to_host
    long = data[-1]
    refused = r"only at an optimizer step's first micro-batch.*nothing was run or changed.*superoffload_max_seq_len"
    with pytest.raises(RuntimeError, match=refused) as e, opt.no_sync():
        model(input_ids=long, labels=long)
    assert "\n" not in str(e.value)
    assert opt.plan is plan and opt.engine.layout.plan is plan
    with pytest.raises(RuntimeError, match="first micro-batch"):
        opt.engine.move_to_host(plan)
    norms = []
    for o, m in ((opt, model), (twin, twin_model)):
        m(input_ids=short, labels=short).loss.backward()  # the step's boundary micro-batch
        o.step()
        o.zero_grad()
        norms.append([o.last_step_stats.grad_norm, *_accumulated_norms(m, o, data[2 * MICRO :])])
    assert len(opt.plan.device_buckets) < tail, "the longer batch at the step boundary moved the tail"
    assert norms[0] == norms[1]
    assert _same(weights_and_state(model, opt), weights_and_state(twin_model, twin))
    opt.close()
    twin.close()


def test_a_move_keeps_the_accumulation_mode_and_its_ring_follows_the_host_shards() -> None:
    """``shrink_tail`` under host accumulation pins its mode and lets the landing ring follow the host shards, as
    ``make_plan`` sizes it for that tail; ``check_move`` takes that plan and refuses one that changes the mode or
    whose ring cannot hold the largest host shard."""
    model = tiny_llama(**MODEL)
    profile = pretend_profile(_budget(model))
    numels = [p.numel() for p in reversed(list(model.parameters()))]
    config = SuperOffloadConfig(host_accumulation_dtype="landing")
    short = Workload(model.config, BATCH, SHORT, grad_ckpt=False, chunked_loss=True, accumulation=True,
                     micro_batches=MICRO)
    plan = make_plan(numels, element_size=2, config=config, profile=profile, workload=short)
    long = dataclasses.replace(short, seq_len=LONG)
    shrunk = shrink_tail(plan, long, profile, numels=numels, element_size=2, config=config)
    assert shrunk is not None and shrunk.host_accumulation is plan.host_accumulation is HostAccumulation.LANDING
    fresh = make_plan(numels, element_size=2, config=config.replace(gpu_resident_buckets=len(shrunk.device_buckets)),
                      profile=profile, workload=long)
    assert shrunk.landing_ring == fresh.landing_ring != plan.landing_ring
    check_move(plan, shrunk)
    with pytest.raises(ValueError, match=r"changes \['host_accumulation'\]"):
        check_move(plan, dataclasses.replace(shrunk, host_accumulation=HostAccumulation.FP32, landing_ring=()))
    with pytest.raises(ValueError, match="ring slot as large as the largest host bucket"):
        check_move(plan, dataclasses.replace(shrunk, landing_ring=(1,)))
