"""The memory model against the measured H200 points, its structure, and the fit checks (no GPU, no allocation)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.demo.presets import PRESETS
from hf_superoffload.plan_cli import arrival_numels, load_model_config
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.memory_model import (
    MemoryEstimate,
    ModelShape,
    PlanLike,
    check_fits,
    estimate,
    fits,
    largest_model_that_fits,
)
from hf_superoffload.planning.planner import PlanError, make_plan

DATA = Path(__file__).parent / "data"
GiB = 1024**3


def llama(h, f, layers, heads, kv, vocab):
    return dict(hidden_size=h, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=vocab)


L36 = llama(3072, 8192, 28, 24, 8, 128256)
L8 = llama(4096, 14336, 32, 32, 8, 128256)
N36 = ModelShape.from_config(L36).numel
TAIL = 2_080_000_000

# (config, batch, seq, ckpt, plan, measured peak GB) on the team's H200 box, torch.cuda.max_memory_allocated
GPU_POINTS = {
    "3.6B GPU AdamW": (L36, 8, 2048, True, PlanLike(optimizer="gpu_adamw"), 77.1),
    "3.6B all on host": (L36, 8, 2048, True, PlanLike.all_host(N36), 35.7),
    "3.6B 2.08B tail": (L36, 8, 2048, True, PlanLike(device_numel=TAIL, host_numel=N36 - TAIL), 60.7),
    "8B GPU AdamW": (L8, 4, 2048, True, PlanLike(optimizer="gpu_adamw"), 128.8),
    "0.95B fwd+bwd": (llama(2048, 5632, 16, 16, 16, 32000), 8, 2048, False, PlanLike(optimizer="none"), 35.2),
    "1.88B fwd+bwd": (llama(4096, 11008, 8, 32, 32, 32000), 4, 2048, False, PlanLike(optimizer="none"), 23.2),
}
# measured on the H200 box on 2026-11-30 (docs/benchmarks.md) with the plans those runs printed; chunked loss where the
# script used it (benchmarks/long_context.py)
GPU_POINTS_10PCT = {
    "8B default plan, 1 GPU (2026-11-30)": (L8, 4, 2048, True, PlanLike(device_numel=3_302_100_000,
                                                                 host_numel=4_728_200_000, host_bytes_per_param=28),
                                       4096, 66.66),
    "8B data parallel, per rank (2026-11-30)": (L8, 4, 2048, True, PlanLike(device_numel=3_328_800_000,
                                                                      host_numel=686_300_000, host_bytes_per_param=28),
                                           4096, 67.21),
    "8B weight flow, 24 GiB cap (2026-11-30)": (L8, 4, 2048, True, PlanLike(device_numel=525_300_000,
                                                                      host_numel=7_504_900_000, weight_mode="flow"),
                                           None, 20.91 * 1.073741824),
    "15.0B on 1 GPU, GPU cast (2026-11-30)": (dict(PRESETS["14b"], num_hidden_layers=49), 4, 2048, True,
                                             PlanLike(device_numel=6_968_012_800, host_numel=8_076_938_240,
                                                      cast_side="gpu", bucket_bytes=4 * 778_567_680),
                                             4096, 130.0),
}


def test_host_rss_of_the_15b_single_gpu_run_within_10_percent():
    plan = PlanLike(device_numel=6_968_012_800, host_numel=8_076_938_240, cast_side="gpu")
    est = estimate(dict(PRESETS["14b"], num_hidden_layers=49), batch_size=4, seq_len=2048, grad_ckpt=True,
                   plan_like=plan, loss_chunk_tokens=4096)
    assert est.host_expected_bytes / 1e9 == pytest.approx(115.74, rel=0.10)  # ru_maxrss, benchmarks/results


@pytest.mark.parametrize("case", sorted(GPU_POINTS))
def test_gpu_peak_matches_the_measured_points(case):
    cfg, b, s, ckpt, plan, measured = GPU_POINTS[case]
    est = estimate(cfg, batch_size=b, seq_len=s, grad_ckpt=ckpt, plan_like=plan)
    assert est.gpu_peak_bytes / 1e9 == pytest.approx(measured, rel=0.03)  # the brief asks 10%; we hold 3%


@pytest.mark.parametrize("case", sorted(GPU_POINTS_10PCT))
def test_gpu_peak_matches_this_sessions_8b_points_within_10_percent(case):
    cfg, b, s, ckpt, plan, chunk, measured = GPU_POINTS_10PCT[case]
    est = estimate(cfg, batch_size=b, seq_len=s, grad_ckpt=ckpt, plan_like=plan, loss_chunk_tokens=chunk)
    assert est.gpu_peak_bytes / 1e9 == pytest.approx(measured, rel=0.10)


def test_host_rss_of_the_8b_single_gpu_run_within_10_percent():
    plan = PlanLike(device_numel=3_302_100_000, host_numel=4_728_200_000, host_bytes_per_param=28)
    est = estimate(L8, batch_size=4, seq_len=2048, grad_ckpt=True, plan_like=plan)
    assert est.host_expected_bytes / 1e9 == pytest.approx(134.6, rel=0.10)  # ru_maxrss of the 2026-11-30 1-GPU rank


@pytest.mark.parametrize("bpp,fraction,low,high", [(16, 1.0, 64.3, 64.3), (28, 0.89, 94.4, 96.2)])
def test_host_rss_matches_the_measured_points(bpp, fraction, low, high):
    plan = PlanLike.all_host(N36, host_bytes_per_param=bpp, speculated_fraction=fraction)
    est = estimate(L36, batch_size=8, seq_len=2048, grad_ckpt=True, plan_like=plan)
    assert 0.9 * high <= est.host_expected_bytes / 1e9 <= 1.1 * low
    assert est.host_peak_bytes >= est.host_expected_bytes  # fit checks use the conservative figure


def test_parameter_counts_match_the_real_models_built_on_meta():
    for name in ("llama_3p6b", "llama_8b", "qwen2_0p5b"):
        config = load_model_config(str(DATA / f"{name}.json"))
        assert ModelShape.from_config(config).numel == sum(arrival_numels(config)), name
    assert ModelShape.from_config(L36).numel == 3_606_752_256  # the anchor's N = 3.607B
    assert ModelShape.from_config("8b").numel == ModelShape.from_config(L8).numel


def test_shape_rejects_what_it_cannot_model():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelShape.from_config(dict(L36, num_local_experts=8))
    with pytest.raises(ValueError, match="lacks"):
        ModelShape.from_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelShape.from_config("gigantic")
    with pytest.raises(ValueError, match="host_bytes_per_param"):
        PlanLike(host_bytes_per_param=20)


def test_the_knobs_move_memory_the_right_way():
    def est(**kw) -> MemoryEstimate:
        base = dict(batch_size=8, seq_len=2048, grad_ckpt=True, plan_like=PlanLike.all_host(N36))
        return estimate(L36, **(base | kw))

    ref = est()
    assert est(batch_size=16).gpu_peak_bytes > ref.gpu_peak_bytes
    assert est(grad_ckpt=False).gpu_peak_bytes > 2 * ref.gpu_peak_bytes
    tail = est(plan_like=PlanLike(device_numel=TAIL, host_numel=N36 - TAIL))
    assert tail.gpu_peak_bytes > ref.gpu_peak_bytes and tail.host_peak_bytes < ref.host_peak_bytes
    flow = est(plan_like=PlanLike.all_host(N36, weight_mode="flow"))
    # the staging arena is the streamed weights' home: no extra host memory
    assert flow.gpu["weights"] < ref.gpu["weights"] and flow.host_peak_bytes == ref.host_peak_bytes
    lead = est(plan_like=PlanLike.all_host(N36, d2h_lead_buckets=4))  # [Note: D2H lead]: 3 more buckets waiting
    bb = [e.gpu_phases["backward"]["bucket_buffers"] for e in (ref, lead)]
    assert bb[1] == bb[0] + 3 * PlanLike().bucket_bytes
    assert est(plan_like=PlanLike.all_host(N36, d2h_lead_buckets=1)).gpu_phases == ref.gpu_phases
    double = est(plan_like=PlanLike.all_host(N36, host_bytes_per_param=28))
    assert double.host["rollback_copy"] == 12 * N36
    # every phase is reported; the peak is the largest
    assert set(ref.gpu_phases) == {"loss", "backward", "backward_start", "step"}
    assert ref.gpu_peak_bytes == max(sum(p.values()) for p in ref.gpu_phases.values())
    assert ref.gpu_required_bytes > ref.gpu_peak_bytes


def test_from_plan_reads_the_planner_output():
    profile = HardwareProfile.h200_pcie()
    numels = arrival_numels(load_model_config(str(DATA / "llama_3p6b.json")))
    plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(gpu_resident_buckets=4, rollback="inverse"),
                     profile=profile)
    pl = PlanLike.from_plan(plan)
    assert (pl.device_numel, pl.host_numel, pl.host_bytes_per_param) == (plan.device_numel, plan.host_numel, 16)
    # the buckets in flight are at most the largest few host buckets (3, plus the D2H lead's), not the largest alone
    k = 3 + plan.d2h_lead_buckets - 1
    top = sorted((b.numel for b in plan.host_buckets), reverse=True)[:k]
    assert pl.bucket_bytes == 2 * (sum(top) // k) < 2 * max(b.numel for b in plan.buckets)
    assert PlanLike.from_plan(dataclasses.replace(plan, d2h_lead_buckets=4)).d2h_lead_buckets == 4


def test_check_fits_passes_or_explains_what_to_change():
    h200 = HardwareProfile.h200_pcie()
    ok = estimate(L36, batch_size=8, seq_len=2048, grad_ckpt=True)
    check_fits(ok, h200)  # no exception
    small = dataclasses.replace(h200, device_free_bytes=30 * GiB)
    with pytest.raises(PlanError, match=r"GPU: needs .* GiB .* but 30.0 GiB is free") as info:
        check_fits(ok, small)
    msg = str(info.value)
    assert "batch size" in msg and "logits" in msg and "more GPUs" in msg
    no_ckpt = estimate(L36, batch_size=2, seq_len=2048, grad_ckpt=False)
    with pytest.raises(PlanError, match="gradient checkpointing"):
        check_fits(no_ckpt, dataclasses.replace(h200, device_free_bytes=24 * GiB))
    host_heavy = estimate(L36, batch_size=8, seq_len=2048, grad_ckpt=True,
                          plan_like=PlanLike.all_host(N36, host_bytes_per_param=28))
    with pytest.raises(PlanError, match="host: needs") as info:
        check_fits(host_heavy, dataclasses.replace(h200, host_available_bytes=90 * GiB))
    assert "rollback='inverse' saves" in str(info.value) and "on the GPU" in str(info.value)
    # unknown budgets are not checked
    check_fits(host_heavy, dataclasses.replace(h200, device_free_bytes=None, host_available_bytes=None))


def test_largest_model_that_fits_is_the_boundary():
    h200 = HardwareProfile.h200_pcie()
    run = dict(batch_size=4, seq_len=2048, grad_ckpt=True)
    layers, est = largest_model_that_fits(L8, profile=h200, **run)
    assert fits(est, h200) and est.shape.num_layers == layers
    assert 32 < layers < 200  # 8B trains here; something well past it does not
    assert largest_model_that_fits(L8, profile=h200, max_layers=layers + 1, **run)[0] == layers
    smaller, _ = largest_model_that_fits(L8, profile=dataclasses.replace(h200, device_free_bytes=60 * GiB), **run)
    assert smaller < layers
    rtx = HardwareProfile.rtx4090_24gb()
    assert largest_model_that_fits(L8, profile=rtx, batch_size=8, seq_len=4096, grad_ckpt=True) is None
    with pytest.raises(ValueError, match="neither"):
        largest_model_that_fits(L8, profile=dataclasses.replace(h200, device_free_bytes=None,
                                                                host_available_bytes=None), **run)


def test_long_sequence_point_measured_with_ulysses():
    """8B, one 262,144-token sequence over 2 GPUs (Ulysses, chunked loss), the measured plan's per-rank device
    tail (docs/benchmarks.md, 2026-11-30): 126.5 GB measured. At this length the peak is the first recomputed layer
    with every layer's checkpoint alive; the logits are chunked."""
    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
    plan = PlanLike(device_numel=3_328_800_000, host_numel=686_300_000, host_bytes_per_param=28)
    e = estimate(shape, batch_size=1, seq_len=262_144, grad_ckpt=True, plan_like=plan, sequence_parallel=2,
                 loss_chunk_tokens=4096)
    assert e.gpu_peak_phase == "backward_start"
    assert e.gpu_peak_bytes / 1e9 == pytest.approx(126.5, rel=0.10)


def test_sequence_parallel_divides_the_activations_and_chunking_the_logits():
    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
    one = estimate(shape, batch_size=1, seq_len=65_536, grad_ckpt=True)
    two = estimate(shape, batch_size=1, seq_len=65_536, grad_ckpt=True, sequence_parallel=2)
    assert two.gpu_phases["backward_start"]["checkpoints"] * 2 == one.gpu_phases["backward_start"]["checkpoints"]
    chunked = estimate(shape, batch_size=1, seq_len=65_536, grad_ckpt=True, loss_chunk_tokens=4096)
    assert chunked.gpu_phases["loss"]["logits"] * 16 == one.gpu_phases["loss"]["logits"]
    with pytest.raises(ValueError, match="sequence_parallel"):
        estimate(shape, batch_size=1, seq_len=8, grad_ckpt=True, sequence_parallel=0)


def test_tiled_mlp_keeps_one_tile_of_mlp_intermediates():
    """``mlp_tile_tokens``: the layers save no MLP intermediates, the backward holds one tile's (8f bytes per token,
    x1.5 with their gradients) and the fp32 sums of the MLP's weight gradients; 8B at 512k over 2 GPUs fits an
    H200's memory tiled, not untiled (all optimizer state on the host)."""
    s = ModelShape.from_config(L8)
    h, f, layers = s.hidden_size, s.intermediate_size, s.num_layers
    run = dict(batch_size=1, seq_len=524_288, grad_ckpt=True, sequence_parallel=2, loss_chunk_tokens=4096)
    tokens, tile = 262_144, 8192
    untiled = estimate(L8, **run)
    tiled = estimate(L8, **run, mlp_tile_tokens=tile)
    for phase in ("backward", "backward_start"):
        saved = untiled.gpu_phases[phase]["activations"] - tiled.gpu_phases[phase]["activations"]
        assert saved == pytest.approx(1.5 * 8 * f * (tokens - tile), abs=2)
        assert tiled.gpu_phases[phase]["mlp_tile_grad_sums"] == 6 * 3 * h * f
    assert tiled.gpu_phases["loss"] == untiled.gpu_phases["loss"]  # checkpointed: only layer inputs are saved
    assert tiled.mlp_tile_tokens == tile
    # 256k tokens per rank: 4 x 7.5 GB of [T, f] intermediates (x1.5) less one tile and the 1.1 GB of sums
    assert (untiled.gpu_peak_bytes - tiled.gpu_peak_bytes) / 1e9 == pytest.approx(42.6, abs=0.1)
    assert tiled.gpu_required_bytes < HardwareProfile.h200_pcie().device_free_bytes < untiled.gpu_required_bytes
    # one tile (tile >= tokens): the untiled peak, no gradient sums
    whole = estimate(L8, **run, mlp_tile_tokens=tokens)
    assert whole.gpu_phases["backward_start"] == untiled.gpu_phases["backward_start"]
    # without checkpointing the layers keep everything they save: the MLP's intermediates no more
    short = dict(batch_size=1, seq_len=4096, grad_ckpt=False)
    drop = (estimate(L8, **short).gpu_phases["loss"]["activations"]
            - estimate(L8, **short, mlp_tile_tokens=512).gpu_phases["loss"]["activations"])
    assert drop == layers * 8 * f * 4096
    with pytest.raises(ValueError, match="mlp_tile_tokens=0"):
        estimate(L8, **run, mlp_tile_tokens=0)


def test_kept_attention_adds_every_layers_output_and_lse():
    """``keep_attention``: each layer's attention output (bf16) and log-sum-exp (fp32) live from the forward to its
    backward; with Ulysses the same bytes per rank (all tokens of 1/P of the heads)."""
    s = ModelShape.from_config(L8)
    run = dict(batch_size=1, seq_len=262_144, grad_ckpt=True, sequence_parallel=2, loss_chunk_tokens=4096)
    plain, keep = estimate(L8, **run), estimate(L8, **run, keep_attention=True)
    kept = s.num_layers * 131_072 * (2 * s.num_heads * s.head_dim + 4 * s.num_heads)
    for phase in ("loss", "backward_start"):
        assert keep.gpu_phases[phase]["kept_attention"] == kept
        assert sum(keep.gpu_phases[phase].values()) - sum(plain.gpu_phases[phase].values()) == kept
    assert keep.gpu_phases["backward"] == plain.gpu_phases["backward"]
    assert keep.keep_attention and kept / 1e9 == pytest.approx(34.9, abs=0.1)  # 8B at 256k over 2 GPUs
    with pytest.raises(ValueError, match="grad_ckpt=True"):
        estimate(L8, batch_size=1, seq_len=4096, grad_ckpt=False, keep_attention=True)


def test_planner_workload_with_tiled_mlp_leaves_room_for_a_bigger_tail():
    h200 = HardwareProfile.h200_pcie()
    numels = arrival_numels(load_model_config("8b"))
    cfg = SuperOffloadConfig(rollback="inverse")
    from hf_superoffload.planning.planner import Workload

    plans = [make_plan(numels, element_size=2, config=cfg, profile=h200, world_size=2, rank=0,
                       local_world_size=2, local_rank=0,
                       workload=Workload("8b", 1, 393_216, True, sequence_parallel=2, loss_chunk_tokens=4096,
                                         mlp_tile_tokens=tile))
             for tile in (None, 8192)]
    assert plans[1].device_numel > plans[0].device_numel
    assert "MLP tiles of 8192 tokens" in " ".join(plans[1].notes)


def test_accumulation_keeps_the_summed_gradients_alive_through_the_loss():
    """15.0B, batch 4 x 2048, 8 micro-batches, 7.15B of optimizer state on the GPU, host accumulation (2026-12-04,
    fb4df27): the second micro-batch's loss asked for 4.64 GiB with 133.5 GiB allocated, so its peak was at least
    138.1 GiB; without the accumulated tail gradients the model said 126 GiB."""
    cfg = dict(PRESETS["14b"], num_hidden_layers=49)
    plan = PlanLike(device_numel=7_146_280_960, host_numel=7_898_670_080, cast_side="gpu",
                    bucket_bytes=754_974_720, accumulation_bytes=6_228_541_440, d2h_lead_buckets=4)
    one = estimate(cfg, batch_size=4, seq_len=2048, grad_ckpt=True, plan_like=plan)
    acc = estimate(cfg, batch_size=4, seq_len=2048, grad_ckpt=True, plan_like=plan, accumulation=True)
    assert one.gpu_peak_bytes / GiB < 138.1 <= acc.gpu_peak_bytes / GiB
    assert acc.gpu_phases["loss"]["accumulated_gradients"] == 2 * plan.device_numel  # host buckets: summed on host
    on_device = estimate(cfg, batch_size=4, seq_len=2048, grad_ckpt=True, accumulation=True,
                         plan_like=dataclasses.replace(plan, accumulation_bytes=0))
    assert on_device.gpu_phases["loss"]["accumulated_gradients"] == 2 * (plan.device_numel + plan.host_numel)


def test_the_slack_holds_the_largest_block_where_5_percent_does_not() -> None:
    """[Note: the allocator's slack]: on a small budget one block of the loss (Llama-3 8B at 4 x 2048: its bf16 logit
    gradient, 1.96 GiB) is more than 5% of the peak; a fragmented pool may have to reserve it anew."""
    flow = PlanLike(device_numel=768_600_000, host_numel=ModelShape.from_config(L8).numel - 768_600_000,
                    weight_mode="flow")
    small = estimate(L8, batch_size=4, seq_len=2048, grad_ckpt=True, plan_like=flow, chunked_loss=True)
    block = 2 * 4 * 2048 * 128256
    assert small.largest_block_bytes == block
    assert 0.05 * small.gpu_peak_bytes < block
    assert small.gpu_required_bytes == small.gpu_peak_bytes + block + GiB
    # HF's loss upcasts the logits to fp32, the sequence-parallel one holds an fp32 chunk of them
    hf = estimate(L8, batch_size=4, seq_len=2048, grad_ckpt=True, plan_like=flow)
    assert hf.largest_block_bytes == 2 * block
    chunked = estimate(L8, batch_size=1, seq_len=65536, grad_ckpt=True, plan_like=flow, sequence_parallel=2,
                       loss_chunk_tokens=2048)
    assert chunked.largest_block_bytes == 4 * 2048 * 128256
    # a short batch under the chunked loss: its fp32 chunk outgrows the bf16 logits
    short = estimate(L36, batch_size=1, seq_len=3072, grad_ckpt=True, chunked_loss=True)
    assert short.largest_block_bytes == 4 * 2048 * 128256 > 2 * 3072 * 128256  # bf16 logits; the LM head alike
    # where 5% of the peak is larger (every state on a large GPU), it is the slack, as before
    n = ModelShape.from_config(L8).numel
    big = estimate(L8, batch_size=4, seq_len=2048, grad_ckpt=True, chunked_loss=True,
                   plan_like=PlanLike(device_numel=n, host_numel=0))
    assert big.gpu_required_bytes == big.gpu_peak_bytes + int(0.05 * big.gpu_peak_bytes) + GiB
