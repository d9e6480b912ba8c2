"""The planner's deferred-moments decision ([Note: deferred moments] in docs/design.md) and its memory accounting."""

from __future__ import annotations

import dataclasses

import pytest

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.memory_model import ENGINE_HOST_BYTES_PER_PARAM, PlanLike, estimate
from hf_superoffload.planning.plan import HostAccumulation, MasterDeferral, Rollback, WeightMode
from hf_superoffload.planning.planner import _HOST_HEADROOM_BYTES, PlanError, make_plan, share_count

GiB = 1024**3
NUMELS = [50_000_000] * 40  # 2B parameters
HOST = SuperOffloadConfig(gpu_resident_buckets=0)  # every optimizer state on the host


def profile(**kw):
    base = dict(device_type="cuda", device_free_bytes=80 * GiB, host_available_bytes=200 * GiB, cpu_threads=15)
    base.update(kw)
    return HardwareProfile(**base)


def plan(config=None, **kw):
    return make_plan(NUMELS, element_size=2, config=config or SuperOffloadConfig(gpu_resident_buckets=0),
                     profile=kw.pop("prof", profile()), **kw)


def test_auto_is_on_for_one_process_and_counts_the_second_landing_arena():
    p = plan()
    assert p.defer_moments and p.weight_mode is WeightMode.STATIONARY and p.rollback is Rollback.DOUBLE_BUFFER
    assert p.deferred_landing_bytes() == 2 * p.host_numel
    assert p.host_bytes() == p.host_numel * (28 + 2)
    assert "deferred moment stores: on" in p.summary()
    off = plan(HOST.with_overrides(defer_moments=False))
    assert not off.defer_moments and off.host_bytes() == p.host_bytes() - 2 * p.host_numel
    gpu_cast = plan(SuperOffloadConfig(gpu_resident_buckets=0, cast_side="gpu"))
    # gradients land in bf16 with either cast side (the engine's second arena has the landing's dtype)
    assert gpu_cast.defer_moments and gpu_cast.deferred_landing_bytes() == 2 * gpu_cast.host_numel
    # the memory model's host prediction carries it
    est = estimate("1b", batch_size=1, seq_len=128, grad_ckpt=True, plan_like=PlanLike.from_plan(p))
    assert est.host["deferred_landing"] == 2 * p.host_numel
    est_off = estimate("1b", batch_size=1, seq_len=128, grad_ckpt=True, plan_like=PlanLike.from_plan(off))
    assert "deferred_landing" not in est_off.host


@pytest.mark.parametrize(("why", "kw", "config"), [
    ("data parallel", {"world_size": 2}, {}),
    ("host gradient accumulation", {}, {"accumulate_on_host": True}),
    ("weight flow", {}, {"weight_placement": "flow"}),
])
def test_auto_is_off_and_true_is_refused_where_unsupported(why, kw, config):
    p = plan(SuperOffloadConfig(gpu_resident_buckets=0, **config), **kw)
    assert not p.defer_moments
    assert any(why in n for n in p.notes), p.notes
    with pytest.raises(PlanError, match=r"PlannerOverrides\(defer_moments=True\) is not supported"):
        plan(HOST.replace(**config).with_overrides(defer_moments=True), **kw)


def test_auto_is_off_when_host_ram_is_short_and_true_then_refused():
    n = sum(NUMELS)
    # room for p/m/v twice, landing and staging, headroom, but not a second landing arena
    keep = _HOST_HEADROOM_BYTES + int(ENGINE_HOST_BYTES_PER_PARAM * n)  # what the planner keeps free
    prof = profile(host_available_bytes=28 * n + keep + n)
    double = SuperOffloadConfig(gpu_resident_buckets=0, rollback="double_buffer")  # auto would not take it this tight
    p = plan(double, prof=prof)
    assert p.rollback is Rollback.DOUBLE_BUFFER and not p.defer_moments
    assert any("host RAM too small for a second" in note for note in p.notes)
    with pytest.raises(PlanError, match="second landing arena"):
        plan(double.with_overrides(defer_moments=True), prof=prof)
    assert plan(double, prof=profile(host_available_bytes=28 * n + keep + 2 * n)).defer_moments


def test_auto_rollback_takes_the_double_buffer_only_where_the_host_affords_it():
    n = sum(NUMELS)
    keep = _HOST_HEADROOM_BYTES + int(ENGINE_HOST_BYTES_PER_PARAM * n)
    tight = plan(prof=profile(host_available_bytes=30 * n + keep))  # it would fit, with nothing to spare
    assert tight.rollback is Rollback.INVERSE
    assert tight.host_bytes() <= 20 * n  # all state on the host: p/m/v, landing, staging and a second landing
    roomy = plan(prof=profile(host_available_bytes=2 * 30 * n + keep))
    assert roomy.rollback is Rollback.DOUBLE_BUFFER


def test_host_accumulation_keeps_it_off():
    p = plan(SuperOffloadConfig(gpu_resident_buckets=0, accumulate_on_host=True))
    assert p.host_accumulation is not HostAccumulation.OFF and not p.defer_moments


def test_the_overrides_validate_the_fields_and_the_config_reads_them():
    with pytest.raises(ValueError, match=r"PlannerOverrides.defer_moments='yes' is invalid"):
        PlannerOverrides(defer_moments="yes")  # type: ignore[arg-type]
    config = HOST.with_overrides(defer_moments=False, defer_master=0.25)
    assert (config.overrides.defer_moments, config.overrides.defer_master) == (False, 0.25)  # what the planner reads
    for name in ("defer_moments", "defer_master"):
        with pytest.raises(TypeError):
            SuperOffloadConfig(**{name: False})  # not a user option
        with pytest.raises(ValueError, match=f"'{name}' is a planner override.*\\{{\"overrides\": "):
            SuperOffloadConfig.from_dict({name: "false"})


def test_plugin_and_trainer_arguments_take_them_under_overrides_only(monkeypatch, tmp_path):
    pytest.importorskip("accelerate")
    from hf_superoffload.integrations.accelerate import SuperOffloadPlugin
    from hf_superoffload.integrations.arguments import SuperOffloadArguments

    spec = {"overrides": {"defer_moments": "false", "defer_master": "0.25"}}
    want = HOST.replace(gpu_resident_buckets="auto").with_overrides(defer_moments=False, defer_master=0.25)
    assert SuperOffloadPlugin(config_file=spec).to_config() == want
    args = SuperOffloadArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, superoffload_config=spec)
    assert args.to_superoffload_config() == want
    for name in ("defer_moments", "defer_master"):
        monkeypatch.setenv(f"HF_SUPEROFFLOAD_{name.upper()}", "false")
        with pytest.raises(ValueError, match=f"HF_SUPEROFFLOAD_{name.upper()} was removed.*'overrides:'"):
            SuperOffloadPlugin()
        monkeypatch.delenv(f"HF_SUPEROFFLOAD_{name.upper()}")
        with pytest.raises(TypeError):
            SuperOffloadPlugin(**{name: False})
        with pytest.raises(ValueError, match=f"superoffload_{name} was removed.*\\{{\"overrides\": "):
            SuperOffloadArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **{f"superoffload_{name}": "false"})


def test_defer_master_needs_deferred_moments_and_the_cpu_cast():
    on = plan(HOST.replace(cast_side="cpu").with_overrides(defer_master=True))
    assert on.defer_moments and on.defer_master is MasterDeferral.ALL and "master weights too" in on.summary()
    assert on.host_bytes() == plan(SuperOffloadConfig(gpu_resident_buckets=0, cast_side="cpu")).host_bytes()
    off = plan(HOST.replace(cast_side="cpu").with_overrides(defer_master=False))
    assert off.defer_master is MasterDeferral.OFF and "master weights" not in off.summary()
    with pytest.raises(PlanError, match="defer_master=True needs deferred moment stores"):
        plan(HOST.with_overrides(defer_master=True, defer_moments=False))
    with pytest.raises(PlanError, match="cast_side='cpu'"):
        plan(HOST.replace(cast_side="gpu").with_overrides(defer_master=True))
    with pytest.raises(ValueError, match=r"PlannerOverrides\.defer_master=.*'auto', true, false or a fraction"):
        PlannerOverrides(defer_master="yes")


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -0.2, "0.5", 2])
def test_a_fixed_master_share_is_a_fraction_strictly_inside_0_1(bad):
    with pytest.raises(ValueError, match=r"defer_master=.*a fraction strictly between 0 and 1"):
        PlannerOverrides(defer_master=bad)


def test_a_fixed_master_share_is_a_plan_field_and_needs_what_true_needs():
    p = plan(HOST.replace(cast_side="cpu").with_overrides(defer_master=0.4))
    host = [b.shard for b in p.host_buckets]
    assert p.defer_master is MasterDeferral.SHARE and p.master_buckets == share_count(host, 0.4)
    assert 0 < p.master_buckets < len(host)
    assert "a fixed share of the buckets" in p.summary() and any("~40% of the host" in n for n in p.notes)
    for other in (True, False, "auto"):
        assert plan(HOST.replace(cast_side="cpu").with_overrides(defer_master=other)).master_buckets == 0
    with pytest.raises(PlanError, match=r"defer_master=0\.4 needs deferred moment stores"):
        plan(HOST.with_overrides(defer_master=0.4, defer_moments=False))


def test_defer_master_auto_is_adaptive_where_it_can_work_and_off_elsewhere():
    auto = plan(SuperOffloadConfig(gpu_resident_buckets=0, cast_side="cpu"))  # the default is "auto"
    assert auto.defer_master is MasterDeferral.ADAPTIVE and "adaptive share" in auto.summary()
    assert any("deferred master stores: adaptive" in n for n in auto.notes)
    # (measured on 2026-12-01 at 8ad7b7a: the adaptive share faster than defer_master=True on the all-host 3.6B step: no hint)
    assert not any(n.startswith("hint:") and "defer_master" in n for n in auto.notes)
    # no deferred moments or the GPU cast: nothing to adapt, and no error (unlike an explicit True)
    assert plan(HOST.with_overrides(defer_moments=False)).defer_master is MasterDeferral.OFF
    assert plan(SuperOffloadConfig(gpu_resident_buckets=0, cast_side="gpu")).defer_master is MasterDeferral.OFF


def test_d2h_lead_is_a_plan_field_shown_in_the_summary():
    p0 = plan(SuperOffloadConfig(gpu_resident_buckets=0, overrides=PlannerOverrides(d2h_lead_buckets=0)))
    assert p0.d2h_lead_buckets == 0 and "D2H lead: 0 bucket(s) (each host bucket's hook waits" in p0.summary()
    # "auto" (the default): 4 wherever the host holds optimizer state, 0 when it holds none
    assert plan().d2h_lead_buckets == 4 and plan().device_numel == 0
    mostly_gpu = plan(SuperOffloadConfig(gpu_resident_buckets=30))
    assert mostly_gpu.device_numel > mostly_gpu.host_numel > 0 and mostly_gpu.d2h_lead_buckets == 4
    all_gpu = plan(SuperOffloadConfig(gpu_resident_buckets=10_000))
    assert all_gpu.host_numel == 0 and all_gpu.d2h_lead_buckets == 0
    # never more than there are host buckets to lead: a larger lead would price buffers no backward fills
    for n_host in (1, 3):
        few = plan(SuperOffloadConfig(gpu_resident_buckets=len(p0.buckets) - n_host))
        assert len(few.host_buckets) == n_host and few.d2h_lead_buckets == n_host
    p = plan(SuperOffloadConfig(gpu_resident_buckets=0, overrides=PlannerOverrides(d2h_lead_buckets=4)))
    assert p.d2h_lead_buckets == 4 and "D2H lead: 4 bucket(s) in flight" in p.summary()


@pytest.mark.parametrize(
    ("name", "text", "want"),
    [("defer_master", " Auto ", "auto"), ("defer_master", "yes", True), ("defer_master", "0", False),
     ("defer_master", "0.25", 0.25), ("defer_moments", "off", False), ("accumulate_on_host", "TRUE", True)],
)
def test_tri_state_text_one_vocabulary(name: str, text: str, want: object) -> None:
    """The Trainer arguments, the Accelerate plugin/env and config files parse these fields with the same function."""
    from hf_superoffload.config import value_from_text

    owner = SuperOffloadConfig if name == "accumulate_on_host" else PlannerOverrides
    got = value_from_text(owner, name, text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(("name", "text", "match"), [("defer_moments", "0.5", "use 'auto', true or false$"),
                                                     ("defer_master", "half", "or a fraction strictly between")])
def test_tri_state_text_errors_name_the_spellings(name: str, text: str, match: str) -> None:
    from hf_superoffload.config import value_from_text

    with pytest.raises(ValueError, match=match):
        value_from_text(PlannerOverrides, name, text)


def test_deferred_speculation_where_the_inverse_rollback_defers_its_stores():
    """[Note: deferred speculation]: 'auto' turns it on wherever it applies (speculation, the inverse rollback,
    deferred moments, the CPU cast); False keeps the algebraic undo; True where it does not apply is refused."""
    inverse = SuperOffloadConfig(gpu_resident_buckets=0, rollback="inverse", cast_side="cpu")
    p = plan(inverse)
    assert p.deferred_speculation and "deferred speculation: speculative passes" in p.summary()
    assert not plan(inverse.with_overrides(deferred_speculation=False)).deferred_speculation
    assert not plan(SuperOffloadConfig(gpu_resident_buckets=0, rollback="double_buffer")).deferred_speculation
    for unusable in (inverse.with_overrides(defer_moments=False),
                     SuperOffloadConfig(gpu_resident_buckets=0, rollback="inverse", cast_side="gpu")):
        assert not plan(unusable).deferred_speculation
        with pytest.raises(PlanError, match=r"deferred_speculation=True\) needs"):
            plan(unusable.with_overrides(deferred_speculation=True))
    with pytest.raises(ValueError, match="deferred_speculation"):
        PlannerOverrides(deferred_speculation="yes")


def test_auto_prices_exactness_with_the_roofline():
    """'auto' keeps deferred speculation where its commits hide in the worker's idle time (8B batch 16 with a
    device tail: the roofline predicts no difference) and the algebraic undo where they would not (3.6B, every
    state on the host: 1.26 s against 0.99 s predicted without clipping); True buys exactness at that price."""
    from hf_superoffload.demo.presets import llama_config
    from hf_superoffload.planning.memory_model import ModelShape
    from hf_superoffload.planning.planner import Workload
    from hf_superoffload.planning.step_time import predict_step_time

    h200 = HardwareProfile.h200_pcie()
    inverse = SuperOffloadConfig(rollback="inverse")

    def plan_for(preset: str, batch: int, config: SuperOffloadConfig):
        cfg = llama_config(preset)
        numels = [p.numel() for p in _params(cfg)]
        w = Workload(cfg, batch, 2048, grad_ckpt=True, layer_checkpointing=True)
        return make_plan(numels, element_size=2, config=config, profile=h200, workload=w), w

    small, w = plan_for("3.6b", 8, inverse.replace(gpu_resident_buckets=0))
    assert small.rollback is Rollback.INVERSE and small.defer_moments
    assert not small.deferred_speculation and "deferred speculation: off (auto" in small.summary()
    forced, _ = plan_for("3.6b", 8, inverse.replace(gpu_resident_buckets=0).with_overrides(deferred_speculation=True))
    assert forced.deferred_speculation
    shape = ModelShape.from_config(w.model)

    def step(p):
        return predict_step_time(shape, PlanLike.from_plan(p), h200, batch_size=8, seq_len=2048,
                                 grad_ckpt=True).step_s

    assert step(forced) > 1.2 * step(small)
    big, _ = plan_for("8b", 16, inverse)
    assert big.host_numel and big.device_numel and big.defer_moments and big.deferred_speculation


def _params(cfg):
    """The parameters of ``cfg``'s model without building it: one tensor shape per weight, on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [p for p in model.parameters() if p.requires_grad]


def _all_host_3_6b(batch: int, config: SuperOffloadConfig | None = None):
    """3.6B with every optimizer state on the host, the workload known, priced on the H200 box's profile."""
    from hf_superoffload.demo.presets import llama_config
    from hf_superoffload.planning.planner import Workload

    cfg = llama_config("3.6b")
    w = Workload(cfg, batch, 2048, grad_ckpt=True, layer_checkpointing=True)
    config = config or SuperOffloadConfig(gpu_resident_buckets=0, rollback="inverse")
    return make_plan([p.numel() for p in _params(cfg)], element_size=2, config=config,
                     profile=HardwareProfile.h200_pcie(), workload=w), w


def test_auto_prices_the_commits_against_the_fused_pass():
    """'auto' is one more switch of the plan search ([Note: one search over the plan]): deferred moment stores where
    their commits fit the CPU worker's idle time (3.6B batch 8: a 0.5 s backward beside a 0.6 s pass), m and v
    stored in the pass where they would not (batch 2: a 0.13 s backward; the commits would delay every next pass);
    the search's note prices the other choice; settings that ask for deferred stores keep them."""
    from hf_superoffload.planning.memory_model import ModelShape
    from hf_superoffload.planning.step_time import predict_step_time

    long, _ = _all_host_3_6b(8)
    assert long.defer_moments and long.defer_master is MasterDeferral.ADAPTIVE
    assert ", deferred moment stores," in long.notes[-1] and "moments stored in the pass" in long.notes[-1]
    short, w = _all_host_3_6b(2)
    assert not short.defer_moments and short.defer_master is MasterDeferral.OFF and not short.deferred_speculation
    assert short.deferred_landing_bytes() == 0
    assert "deferred moment stores: off (auto: the plan search)" in short.summary()
    assert ", moments stored in the pass," in short.notes[-1] and "deferred moment stores" in short.notes[-1]
    assert not any(n.startswith(("deferred master stores:", "deferred speculation:")) for n in short.notes)
    shape, h200 = ModelShape.from_config(w.model), HardwareProfile.h200_pcie()

    def clipped(p):
        t = predict_step_time(shape, PlanLike.from_plan(p), h200, batch_size=2, seq_len=2048, grad_ckpt=True,
                              clipping_every_step=True)
        return t

    forced, _ = _all_host_3_6b(2, SuperOffloadConfig(gpu_resident_buckets=0, rollback="inverse")
                               .with_overrides(defer_moments=True))
    assert forced.defer_moments  # a setting is a constraint: the roofline prices it, it does not overrule it
    spilled, fused = clipped(forced), clipped(short)
    assert spilled.commit_s > 0 and fused.commit_s == 0
    assert spilled.step_s > fused.step_s
    for kw in ({"defer_master": True}, {"defer_master": 0.5}):
        kept, _ = _all_host_3_6b(2, SuperOffloadConfig(gpu_resident_buckets=0, rollback="inverse")
                                 .with_overrides(**kw))
        assert kept.defer_moments


def test_the_roofline_prices_the_master_share_of_the_pass_and_its_commit():
    """Clipping on every step: the verdict-known pass moves 20 B/param with deferred moment stores, 16 with every
    master deferred (a fixed share in between), and the commit the rest (18, 26); the adaptive share is priced from
    where it starts (none)."""
    from hf_superoffload.planning.step_time import verdict_pass_bytes

    p, _ = _all_host_3_6b(8)
    adaptive = PlanLike.from_plan(p)
    assert adaptive.master_share == 0.0 and verdict_pass_bytes(adaptive) == (20, 18)
    every = PlanLike.from_plan(dataclasses.replace(p, defer_master=MasterDeferral.ALL))
    assert every.master_share == 1.0 and verdict_pass_bytes(every) == (16, 26)
    k = share_count([b.shard for b in p.host_buckets], 0.5)
    half = PlanLike.from_plan(dataclasses.replace(p, defer_master=MasterDeferral.SHARE, master_buckets=k))
    share = sum(b.shard for b in p.host_buckets[:k]) / p.host_numel
    assert half.master_share == pytest.approx(share) and 0.4 < share < 0.6
    assert verdict_pass_bytes(half) == pytest.approx((20 - 4 * share, 18 + 8 * share))
    fused = PlanLike.from_plan(dataclasses.replace(p, defer_moments=False, defer_master=MasterDeferral.OFF))
    assert fused.master_share == 0.0 and verdict_pass_bytes(fused) == (28, 0)
    with pytest.raises(ValueError, match="master_share"):
        PlanLike(master_share=1.5)


@pytest.mark.parametrize("setting", [{"defer_moments": True}, {"defer_master": True}, {"defer_master": 0.5},
                                     {"deferred_speculation": True}])
def test_with_no_host_buckets_a_deferral_setting_has_nothing_to_act_on(setting):
    """Every optimizer state on the device: no pass runs on the host, so a setting that asks for deferred stores is
    neither applied nor refused, and the plan says why."""
    p = plan(SuperOffloadConfig(gpu_resident_buckets=10**6).with_overrides(**setting))
    assert p.host_numel == 0 and not p.defer_moments and p.defer_master is MasterDeferral.OFF
    assert not p.deferred_speculation
    (name, value), = setting.items()
    assert f"deferred moment stores: off (no host buckets; {name}={value!r} has nothing to defer)" in p.notes
