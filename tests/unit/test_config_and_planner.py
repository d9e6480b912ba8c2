"""Config validation and the planner's pure decisions (no CUDA, no model)."""

from __future__ import annotations

import pytest

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.planning.hardware import HardwareProfile, default_cpu_threads
from hf_superoffload.planning.plan import Placement, Rollback
from hf_superoffload.planning.planner import PlanError, make_plan, partition_buckets

GiB = 1024**3


def profile(**kw):
    base = dict(device_type="cuda", device_free_bytes=80 * GiB, host_available_bytes=120 * GiB, cpu_threads=15)
    base.update(kw)
    return HardwareProfile(**base)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("bucket_size_mb", 0, "positive"),
        ("gpu_resident_buckets", -1, "integer >= 0"),
        ("gpu_resident_buckets", "many", "'auto' or an integer"),
        ("rollback", "magic", "'double_buffer' or 'inverse'"),
        ("cast_side", "north", "'cpu' or 'gpu'"),
        ("weight_placement", "x", "'stationary' or 'flow'"),
        ("cpu_threads", 0, ">= 1"),
        ("worker_timeout_s", 0, "positive"),
    ],
)
def test_config_rejects_bad_values_with_the_fix(field, value, match):
    with pytest.raises(ValueError, match=f"SuperOffloadConfig.{field}=.*{match}"):
        SuperOffloadConfig(**{field: value})


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("gpu_resident_fraction", 1.5, r"\[0, 1\]"),
        ("redo_window", 0, ">= 1"),
        ("device_memory_fraction", 0.95, r"\[0, 0.9\]"),
        ("d2h_lead_buckets", -1, "integer >= 0"),
        ("d2h_lead_buckets", True, "integer >= 0"),
    ],
)
def test_planner_overrides_reject_bad_values_with_the_fix(field, value, match):
    with pytest.raises(ValueError, match=f"PlannerOverrides.{field}=.*{match}"):
        PlannerOverrides(**{field: value})


def test_config_is_frozen_and_replace_validates():
    cfg = SuperOffloadConfig()
    with pytest.raises(AttributeError):
        cfg.bucket_size_mb = 1  # type: ignore[misc]
    assert cfg.replace(bucket_size_mb=4).bucket_size_mb == 4
    with pytest.raises(ValueError):
        cfg.replace(bucket_size_mb=-1)


def test_partition_keeps_order_and_gives_big_params_their_own_bucket():
    assert partition_buckets([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]
    assert partition_buckets([1] * 5, 100) == [[0, 1, 2, 3, 4]]


def test_plan_tail_is_the_last_arriving_buckets():
    numels = [1_000_000] * 40
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(bucket_size_mb=4, gpu_resident_buckets=3),
                     profile=profile())
    placements = [b.placement for b in plan.buckets]
    assert placements[-3:] == [Placement.DEVICE] * 3
    assert all(p is Placement.HOST for p in placements[:-3])
    assert plan.host_numel + plan.device_numel == sum(numels)
    # offsets are contiguous per placement
    for pl in Placement:
        off = 0
        for b in plan.buckets:
            if b.placement is pl:
                assert b.offset == off
                off += b.numel


def test_auto_tail_fills_a_share_of_free_device_memory():
    numels = [1_000_000] * 100
    cfg = SuperOffloadConfig(bucket_size_mb=2, overrides=PlannerOverrides(device_memory_fraction=0.25))
    plan = make_plan(numels, element_size=2, config=cfg, profile=profile(device_free_bytes=160 * 1_000_000 * 4))
    # 25% of 640 MB at 16 B/param = 10M params = the last 10 buckets
    assert plan.device_numel == 10_000_000
    assert [b.placement for b in plan.buckets[-10:]] == [Placement.DEVICE] * 10
    # everything fits: everything stays on the device (offloading must never be slower than not offloading)
    assert make_plan(numels, element_size=2, config=cfg, profile=profile()).host_numel == 0
    # without device information (CPU runs) the fraction of parameters applies
    cpu = make_plan(numels, element_size=2, config=cfg.with_overrides(gpu_resident_fraction=0.2),
                    profile=profile(device_type="cpu", device_free_bytes=None))
    assert cpu.device_numel == 20_000_000


def test_rollback_auto_falls_back_to_inverse_when_host_ram_is_short():
    numels = [100_000_000] * 10  # 1B params: 16 GB base, +12 GB for the second state copy
    cfg = SuperOffloadConfig(gpu_resident_buckets=0)
    assert make_plan(numels, element_size=2, config=cfg, profile=profile()).rollback is Rollback.DOUBLE_BUFFER
    tight = make_plan(numels, element_size=2, config=cfg, profile=profile(host_available_bytes=25 * GiB))
    assert tight.rollback is Rollback.INVERSE
    with pytest.raises(PlanError, match="rollback='double_buffer' needs"):
        make_plan(numels, element_size=2, config=cfg.replace(rollback="double_buffer"),
                  profile=profile(host_available_bytes=25 * GiB))


def test_rollback_auto_keeps_one_copy_when_nothing_is_ever_undone():
    numels = [100_000_000] * 10
    off = SuperOffloadConfig(gpu_resident_buckets=0, speculation=False)
    p = make_plan(numels, element_size=2, config=off, profile=profile())
    assert p.rollback is Rollback.INVERSE and any("no step is ever undone" in n for n in p.notes)
    on = make_plan(numels, element_size=2, config=off.replace(speculation=True), profile=profile())
    assert on.rollback is Rollback.DOUBLE_BUFFER and on.host_bytes() == p.host_bytes() + 12 * p.host_numel
    # asked for explicitly, or every step out of place: the second copy is kept
    for asked in (off.replace(rollback="double_buffer"), off.with_overrides(nonspeculative_in_place=False)):
        assert make_plan(numels, element_size=2, config=asked, profile=profile()).rollback is Rollback.DOUBLE_BUFFER


def test_plan_refuses_what_cannot_fit_before_allocating():
    with pytest.raises(PlanError, match=r"needs .* GiB .* available.*gpu_resident_buckets"):
        make_plan([1_000_000_000] * 8, element_size=2, config=SuperOffloadConfig(gpu_resident_buckets=0),
                  profile=profile(host_available_bytes=64 * GiB))


def test_cpu_threads_ignore_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import os

    assert default_cpu_threads() == max(1, len(os.sched_getaffinity(0)) - 1)


def test_summary_mentions_the_decisions():
    plan = make_plan([1000] * 20, element_size=2, config=SuperOffloadConfig(gpu_resident_buckets=1), profile=profile())
    text = plan.summary()
    assert "device tail" in text and "rollback" in text and "bf16" in text


def test_a_known_workload_sizes_the_auto_tail_to_what_the_activations_leave():
    """8B over 2 ranks: with the workload known, the auto tail is the largest the memory model fits beside its
    activations (less the margin); longer sequences leave less; an explicit tail stays the user's call."""
    from hf_superoffload.plan_cli import arrival_numels, load_model_config
    from hf_superoffload.planning.memory_model import PlanLike, estimate
    from hf_superoffload.planning.planner import _COLLECTIVES_BYTES, _DEVICE_MARGIN, Workload

    cfg = load_model_config("8b")
    numels = arrival_numels(cfg)
    prof = profile(device_free_bytes=124 * GiB, host_available_bytes=250 * GiB, cpu_cores=32)
    ranks = dict(world_size=2, rank=0, local_world_size=2, local_rank=0, cores=list(range(32)))
    long = Workload(cfg, 1, 262_144, True, 2, 4096)
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=prof, workload=long, **ranks)
    assert 0 < len(plan.device_buckets) < len(plan.buckets)
    assert "the most the workload leaves room for" in plan.notes[0]

    def required(n_tail: int) -> int:  # the plan with that tail, as the memory model reads it (its own buffers)
        fixed = make_plan(numels, element_size=2, config=SuperOffloadConfig(gpu_resident_buckets=n_tail), profile=prof,
                          workload=long, **ranks)
        return estimate(cfg, batch_size=1, seq_len=262_144, grad_ckpt=True, sequence_parallel=2, loss_chunk_tokens=4096,
                        plan_like=PlanLike.from_plan(fixed)).gpu_required_bytes

    budget = 124 * GiB * (1 - _DEVICE_MARGIN) - _COLLECTIVES_BYTES  # two ranks: NCCL's buffers kept free too
    assert required(len(plan.device_buckets)) <= budget < required(len(plan.device_buckets) + 1)  # fits, and maximal
    short = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=prof,
                      workload=Workload(cfg, 4, 2048, True), **ranks)
    assert len(short.device_buckets) > len(plan.device_buckets)  # short sequences leave more room
    fixed = make_plan(numels, element_size=2, config=SuperOffloadConfig(gpu_resident_buckets=198), profile=prof,
                      workload=long, **ranks)
    assert len(fixed.device_buckets) == 198  # an explicit tail is the user's call


def test_a_workload_that_fits_plain_gpu_training_keeps_every_state_on_the_device():
    """Offloading must never make a run slower than not offloading: 8B at 4 x 2048 fits one 139 GiB GPU."""
    from hf_superoffload.plan_cli import arrival_numels, load_model_config
    from hf_superoffload.planning.planner import Workload

    cfg = load_model_config("8b")
    numels = arrival_numels(cfg)
    prof = profile(device_free_bytes=139 * GiB, host_available_bytes=120 * GiB, cpu_cores=16)
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=prof,
                     workload=Workload(cfg, 4, 2048, True))
    assert plan.host_numel == 0 and len(plan.device_buckets) == len(plan.buckets)
    big = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=prof,
                    workload=Workload(cfg, 16, 2048, True))
    assert 0 < big.host_numel < sum(numels)  # a batch plain GPU training cannot fit offloads the rest


def test_auto_tail_grows_until_the_host_holds_the_rest_when_the_activations_or_the_device_are_unknown():
    """A host too small for every optimizer state: without a workload or without device memory, the auto tail is
    the fewest buckets with which the host holds the rest; an explicit tail stays the user's call (refused)."""
    from hf_superoffload.planning.planner import Workload

    numels = [4_000_000] * 40
    n = sum(numels)
    small_host = dict(host_available_bytes=2 * GiB + 12 * n)  # room for well under all of the state
    for device_free, workload in ((None, None), (None, Workload("tiny", 1, 16, False)), (1 * GiB, None)):
        prof = profile(device_free_bytes=device_free, **small_host)
        plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=prof, workload=workload)
        assert 0 < plan.device_numel < n, (device_free, workload)
        assert "the fewest with which the host RAM holds the rest" in plan.notes[0]
        with pytest.raises(PlanError, match="host"):  # one bucket fewer on the device does not fit the host
            make_plan(numels, element_size=2, profile=prof, workload=workload,
                      config=SuperOffloadConfig(gpu_resident_buckets=len(plan.device_buckets) - 1))
