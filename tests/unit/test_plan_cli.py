"""``hf-superoffload plan`` on model configs shipped as JSON (no network, no GPU)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from hf_superoffload.config import SuperOffloadConfig
from hf_superoffload.plan_cli import (
    EXIT_BAD_INPUT,
    EXIT_DOES_NOT_FIT,
    EXIT_FITS,
    add_plan_parser,
    arrival_numels,
    load_model_config,
    main,
)
from hf_superoffload.planning.hardware import CACHE_ENV, HardwareProfile
from hf_superoffload.planning.memory_model import ModelShape, PlanLike
from hf_superoffload.planning.planner import make_plan
from hf_superoffload.planning.step_time import GEMM_EFFICIENCY, predict_step_time

DATA = Path(__file__).parent / "data"


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="hf-superoffload")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out, _ = plan(capsys, *argv, "--json")
    return rc, json.loads(out)


def model(name: str) -> str:
    return str(DATA / f"{name}.json")


def test_the_anchor_fits_on_our_box(capsys):
    rc, out = plan_json(capsys, "--model", model("llama_3p6b"), "--batch-size", "8", "--seq-len", "2048",
                        "--grad-ckpt", "--profile", "h200")
    assert rc == EXIT_FITS and out["fits"] and out["reason"] is None
    assert out["model"]["numel"] == 3_606_752_256
    assert out["plan"]["buckets"] >= 8
    assert out["memory_gib"]["gpu_required"] < 139
    # measured: 0.805 s (this plan keeps every optimizer state on the GPU and every layer's activations)
    assert 0.72 < out["step_time_s"]["step_s"] < 0.88
    assert out["largest_fitting"]["num_layers"] > 28
    assert out["gpu_adamw_baseline_gib"]["fits"]


def test_text_output_has_the_plan_memory_step_and_largest_model(capsys):
    rc, out, _ = plan(capsys, "--model", model("llama_3p6b"), "--batch-size", "8", "--seq-len", "2048",
                      "--grad-ckpt", "--profile", "h200")
    assert rc == EXIT_FITS
    for needle in ("hf_superoffload plan:", "predicted GPU memory", "predicted host memory", "predicted step",
                   "largest model of this width", "fits: yes"):
        assert needle in out, needle


def test_does_not_fit_exits_1_with_the_reason(capsys):
    rc, out, _ = plan(capsys, "--model", model("llama_8b"), "--batch-size", "8", "--seq-len", "4096",
                      "--profile", "rtx4090")
    assert rc == EXIT_DOES_NOT_FIT
    assert "DOES NOT FIT" in out and "GPU: needs" in out and "gradient checkpointing" not in out.split("fits:")[0]
    rc, data = plan_json(capsys, "--model", model("llama_70b"), "--batch-size", "1", "--seq-len", "2048",
                         "--grad-ckpt", "--profile", "h200")
    assert rc == EXIT_DOES_NOT_FIT and not data["fits"] and "host" in data["reason"]


def test_overrides_decide_fit(capsys):
    argv = ("--model", model("llama_3p6b"), "--batch-size", "8", "--seq-len", "2048", "--grad-ckpt",
            "--profile", "h200")
    assert plan(capsys, *argv, "--gpu-mem", "12")[0] == EXIT_DOES_NOT_FIT  # weights + activations alone
    rc, data = plan_json(capsys, *argv, "--host-mem", "80", "--offload-config", '{"gpu_resident_buckets": 0}')
    assert rc == EXIT_FITS and data["plan"]["rollback"] == "inverse"  # 28 B/param would not fit in 80 GiB
    assert data["profile"]["host_available_bytes"] == 80 * 1024**3


def test_gh200_and_a_workstation_card_get_different_plans(capsys):
    argv = ("--model", model("llama_3p6b"), "--batch-size", "1", "--seq-len", "2048", "--grad-ckpt")
    rc_gh, gh = plan_json(capsys, *argv, "--profile", "gh200")
    rc_rtx, rtx = plan_json(capsys, *argv, "--profile", "rtx4090")
    assert rc_gh == rc_rtx == EXIT_FITS
    assert gh["plan"]["cast_side"] == "gpu" and rtx["plan"]["cast_side"] == "cpu"  # C2C vs PCIe
    assert gh["plan"]["device_numel"] > rtx["plan"]["device_numel"] > 0  # 94 vs 23 GiB of HBM
    assert gh["plan"]["rollback"] != rtx["plan"]["rollback"]  # 410 vs 58 GiB of host RAM
    assert gh["largest_fitting"]["numel"] > rtx["largest_fitting"]["numel"]
    assert gh["step_time_s"]["step_s"] < rtx["step_time_s"]["step_s"]


def test_profile_from_a_json_file_and_presets(capsys, tmp_path):
    path = tmp_path / "box.json"
    dataclasses.replace(HardwareProfile.h200_pcie(), device_free_bytes=3 * 1024**3).save(path)
    rc, data = plan_json(capsys, "--model", "1b", "--batch-size", "8", "--seq-len", "2048", "--grad-ckpt",
                         "--profile", str(path))
    assert rc == EXIT_DOES_NOT_FIT and data["model"]["hidden_size"] == 2048


def test_weight_flow_makes_it_fit_when_stationary_weights_do_not(capsys):
    # 1B at 8 x 2048 with the chunked loss: 6 GiB hold it only with the weights streamed (docs/weight_flow.md)
    args = ("--model", "1b", "--batch-size", "8", "--seq-len", "2048", "--grad-ckpt", "--profile", "h200")
    rc, data = plan_json(capsys, *args, "--gpu-mem", "6")
    assert rc == EXIT_FITS and data["plan"]["weight_mode"] == "flow"
    assert data["plan"]["device_numel"] == 0 and data["memory_gib"]["gpu"]["weights"] < 0.5
    rc, data = plan_json(capsys, *args, "--gpu-mem", "40")
    assert rc == EXIT_FITS and data["plan"]["weight_mode"] == "stationary"


def test_measured_profile_on_a_cpu_machine(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    rc, data = plan_json(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--profile", "measure",
                         "--gpu-mem", "8")
    assert rc == EXIT_FITS and data["profile"]["cpu_adam_gparams"] > 0
    if not torch.cuda.is_available():
        assert data["step_time_s"] is None  # no GPU rates measured here


@pytest.mark.parametrize(
    "argv,match",
    [
        (("--model", "no-such-org/no-such-model"), "cannot load the model config"),
        (("--model", "tiny", "--profile", "abacus"), "--profile 'abacus'"),
    ],  # numbers out of range end at parse time: tests/unit/test_cli_errors.py
)
def test_bad_input_exits_2_with_a_clear_message(capsys, monkeypatch, argv, match):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    full = ["--batch-size", "1", "--seq-len", "16", "--profile", "h200", *argv]
    rc, out, err = plan(capsys, *full)
    assert rc == EXIT_BAD_INPUT and match in err and not out


def test_offline_hub_id_says_so(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = plan(capsys, "--model", "meta-llama/Llama-3.1-8B", "--batch-size", "1", "--seq-len", "16",
                      "--profile", "h200")
    assert rc == EXIT_BAD_INPUT and "HF_HUB_OFFLINE" in err and "config.json" in err


def test_config_json_without_model_type_is_refused(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    rc, _, err = plan(capsys, "--model", str(path), "--batch-size", "1", "--seq-len", "16", "--profile", "h200")
    assert rc == EXIT_BAD_INPUT and "model_type" in err


def test_main_entry_point(capsys):
    rc = main(["--model", model("qwen2_0p5b"), "--batch-size", "1", "--seq-len", "128", "--profile", "gh200"])
    assert rc == EXIT_FITS and "fits: yes" in capsys.readouterr().out


def test_step_time_roofline_on_the_anchor():
    shape = ModelShape.from_config(json.loads(Path(model("llama_3p6b")).read_text()))
    st = predict_step_time(shape, PlanLike.all_host(shape.numel), HardwareProfile.h200_pcie(), batch_size=8,
                           seq_len=2048, grad_ckpt=True)
    assert st.gpu_s == pytest.approx(0.94, rel=0.04)  # the measured all-device step (0.959 s) less its tail's AdamW
    # backward: 4 of 6 FLOPs plus the decoder layers' recompute (not the LM head's): between 2/3 and 3/4
    assert 2 / 3 < st.backward_window_s / st.gpu_s < 0.75
    assert st.cpu_s == pytest.approx(0.87, rel=0.05)  # 3.6B at ~4.2 Gparam/s under DMA contention (no buckets)
    assert st.speculated_fraction == pytest.approx(0.81, abs=0.02)  # a 0.67 s backward holds ~4/5 of the pass
    assert st.step_s >= st.gpu_s + st.tail_s
    slow = dataclasses.replace(HardwareProfile.h200_pcie(), cpu_adam_gparams=1.0)
    assert predict_step_time(shape, PlanLike.all_host(shape.numel), slow, batch_size=8, seq_len=2048,
                             grad_ckpt=True).exposed_s > 1.0
    assert predict_step_time(shape, PlanLike.all_host(shape.numel), HardwareProfile.read("cpu"), batch_size=8,
                             seq_len=2048, grad_ckpt=True) is None


def test_sequence_parallel_reports_the_longest_sequence(capsys):
    """8B on two H200 with Ulysses: the run measured at 262,144 tokens (126.5 GB peak, 2026-11-30) is predicted to fit,
    close to the predicted limit; one GPU per sequence fits about half of it."""
    rc, two = plan_json(capsys, "--model", "8b", "--batch-size", "1", "--seq-len", "262144", "--grad-ckpt",
                        "--profile", "h200", "--sequence-parallel", "2")
    assert rc == EXIT_FITS, two["reason"]
    longest = two["longest_sequence"]["tokens"]
    assert 262_144 <= longest < 400_000 and two["longest_sequence"]["sequence_parallel"] == 2
    assert two["memory_gib"]["gpu_peak_phase"] == "backward_start"
    assert any("sequence parallel: 2 ranks" in n for n in two["notes"])
    rc, one = plan_json(capsys, "--model", "8b", "--batch-size", "1", "--seq-len", "262144", "--grad-ckpt",
                        "--profile", "h200")
    assert rc == EXIT_DOES_NOT_FIT and one["longest_sequence"]["tokens"] < 0.6 * longest
    rc, out, _ = plan(capsys, "--model", "8b", "--batch-size", "1", "--seq-len", "65536", "--grad-ckpt",
                      "--profile", "h200", "--sequence-parallel", "2")
    assert "longest sequence that fits at batch 1:" in out
    with pytest.raises(SystemExit) as info:  # refused at parse time
        plan(capsys, "--model", "8b", "--batch-size", "1", "--seq-len", "8", "--sequence-parallel", "0")
    assert info.value.code == EXIT_BAD_INPUT and "--sequence-parallel" in capsys.readouterr().err


def test_tiled_mlp_makes_512k_fit_on_two_h200(capsys):
    """8B, 524,288 tokens over 2 H200 (the run the tiled MLP is for): refused untiled, fits with MLP tiles of 8192."""
    argv = ("--model", "8b", "--batch-size", "1", "--seq-len", "524288", "--grad-ckpt", "--profile", "h200",
            "--sequence-parallel", "2")
    rc, untiled = plan_json(capsys, *argv)
    assert rc == EXIT_DOES_NOT_FIT
    rc, tiled = plan_json(capsys, *argv, "--tiled-mlp", "8192")
    assert rc == EXIT_FITS, tiled["reason"]
    assert tiled["longest_sequence"]["tokens"] >= 524_288 > untiled["longest_sequence"]["tokens"]
    with pytest.raises(SystemExit) as info:  # refused at parse time
        plan(capsys, *argv, "--tiled-mlp", "-1")
    assert info.value.code == EXIT_BAD_INPUT and "--tiled-mlp" in capsys.readouterr().err


def test_keep_attention_plan_leaves_less_optimizer_state_on_the_gpu(capsys):
    """8B at 256k over 2 H200: keeping attention's outputs (35 GB per rank) still fits, with a smaller GPU tail
    and a shorter predicted step; without --grad-ckpt it is refused."""
    argv = ("--model", "8b", "--batch-size", "1", "--seq-len", "262144", "--grad-ckpt", "--profile", "h200",
            "--sequence-parallel", "2")
    rc, plain = plan_json(capsys, *argv)
    assert rc == EXIT_FITS, plain["reason"]
    rc, keep = plan_json(capsys, *argv, "--keep-attention")
    assert rc == EXIT_FITS, keep["reason"]
    assert keep["plan"]["device_numel"] < plain["plan"]["device_numel"] / 5  # measured: 3.23B -> 0.31B (450ab34)
    assert keep["step_time_s"]["gpu_s"] < 0.85 * plain["step_time_s"]["gpu_s"]
    assert keep["longest_sequence"]["tokens"] < plain["longest_sequence"]["tokens"]
    rc, _, err = plan(capsys, "--model", "8b", "--batch-size", "1", "--seq-len", "8", "--keep-attention")
    assert rc == EXIT_BAD_INPUT and "--grad-ckpt" in err


def test_sequence_parallel_step_time_is_one_ranks_share():
    """Ulysses over P GPUs: each rank computes 1/P of every layer and the P ranks split the host's CPU Adam. The 8B
    step at 262,144 tokens on two H200 was measured at 95.9 s (2026-11-30); one rank's roofline must be near it, and
    the tiled MLP adds exactly one MLP forward per layer."""
    shape = ModelShape.from_config(dict(json.loads(Path(model("llama_3p6b")).read_text()), hidden_size=4096,
                                        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                        num_key_value_heads=8, vocab_size=128256))
    profile = HardwareProfile.h200_pcie()
    run = dict(batch_size=1, seq_len=262_144, grad_ckpt=True)
    host = PlanLike.all_host(shape.numel)
    one = predict_step_time(shape, host, profile, **run)
    two = predict_step_time(shape, PlanLike.all_host(shape.numel // 2), profile, **run, sequence_parallel=2)
    assert two.gpu_s == pytest.approx(one.gpu_s / 2)
    assert two.gpu_s == pytest.approx(95.9, rel=0.1)
    assert two.cpu_s == pytest.approx(one.cpu_s, rel=0.01)  # half the state at half the cores
    tiled = predict_step_time(shape, PlanLike.all_host(shape.numel // 2), profile, **run, sequence_parallel=2,
                              mlp_tile_tokens=8192)
    mlp_forward = 2 * 3 * 4096 * 14336 * 32 * 262_144 / 2 / (profile.matmul_tflops * 1e12 * GEMM_EFFICIENCY)
    assert tiled.gpu_s == pytest.approx(two.gpu_s + mlp_forward)
    one_tile = predict_step_time(shape, PlanLike.all_host(shape.numel // 2), profile, **run, sequence_parallel=2,
                                 mlp_tile_tokens=131_072)  # a tile holds every token of the rank: no recompute
    assert one_tile.gpu_s == pytest.approx(two.gpu_s)
    # keeping attention's outputs: attention runs forward once; measured 75.99 s (450ab34)
    keep = predict_step_time(shape, PlanLike.all_host(shape.numel // 2), profile, **run, sequence_parallel=2,
                             keep_attention=True)
    attention_fwd = 2 * 32 * 4096 * 262_144 * 262_144 / 2 / (profile.matmul_tflops * 1e12 * 0.6)
    assert keep.gpu_s == pytest.approx(two.gpu_s - attention_fwd)
    assert keep.gpu_s == pytest.approx(76.0, rel=0.1)


def test_the_largest_model_is_unknown_without_free_gpu_memory(capsys, tmp_path, monkeypatch):
    """On a machine without a GPU the device tail is unbounded: no search (it used to report 2048 layers)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    cpu = tmp_path / "cpu_profile.json"  # a machine without a GPU, also when the test runs on one
    HardwareProfile.read(torch.device("cpu")).save(cpu)
    argv = ("--model", model("llama_3p6b"), "--batch-size", "1", "--seq-len", "512", "--host-mem", "64",
            "--profile", str(cpu))
    _, out = plan_json(capsys, *argv)
    assert out["largest_fitting"] is None
    _, text, _ = plan(capsys, *argv)
    assert "largest model of this width that fits: unknown (free GPU memory unknown: pass --gpu-mem" in text
    _, with_gpu = plan_json(capsys, *argv, "--gpu-mem", "24")
    assert 0 < with_gpu["largest_fitting"]["num_layers"] < 2048


def test_step_time_predictions_hold_against_the_measured_default_rows():
    """One H200 box, one call each (docs/benchmarks.md, "What the defaults do"): the planner's own plans, predicted
    within 10% of the measured median step, clipping at 1.0 firing on every step of that random data."""
    from hf_superoffload.planning.planner import Workload

    h200 = HardwareProfile.h200_pcie()
    # (kept: the optimizer's workload lets the plan keep layers' activations, [Note: kept layers]). The all-host
    # row ran 32 MB buckets, which it is priced with: 1.320 s on cbf4c69 (2026-12-06); its earlier figures (1.143
    # s keeping layers, 1.274 without, 2026-12-05) were not reproduced there (README) and are not held to here.
    host0 = SuperOffloadConfig(gpu_resident_buckets=0, bucket_size_mb=32)
    for name, batch, config, kept, measured in (("3.6b", 8, SuperOffloadConfig(), False, 0.959),
                                                ("8b", 4, SuperOffloadConfig(), False, 1.018),
                                                ("3.6b", 8, SuperOffloadConfig(), True, 0.805),
                                                ("3.6b", 8, host0, True, 1.320),
                                                ("8b", 4, SuperOffloadConfig(), True, 0.979),
                                                ("8b", 8, SuperOffloadConfig(), True, 1.907),
                                                ("8b", 16, SuperOffloadConfig(), True, 3.610)):
        cfg = load_model_config(name)
        shape = ModelShape.from_config(cfg)
        plan = make_plan(arrival_numels(cfg), element_size=2, config=config, profile=h200,
                         workload=Workload(shape, batch, 2048, True, chunked_loss=True, layer_checkpointing=kept))
        assert (plan.kept_layers > 0) == kept
        st = predict_step_time(shape, PlanLike.from_plan(plan), h200, batch_size=batch, seq_len=2048, grad_ckpt=True,
                               clipping_every_step=True)
        assert st.step_s == pytest.approx(measured, rel=0.10), (name, config)


def test_step_time_predictions_hold_on_the_h100_box_with_its_training_rate():
    """The H100 box (docs/benchmarks.md, "Deferred stores priced, the H100's in-training rate" and "Bucket size in
    the plan search"): with the CPU Adam rate its host reaches in training, which ``h100_sxm`` ships, and the
    buckets' fixed cost, the CPU-bound all-host row at 32 MB buckets (1.088-1.298 s on five instances; 1.155 the
    median) and the snippet (0.950-0.963 s) are predicted within 10%; the optimizer-alone rate (6.98 Gparam/s)
    predicts the all-host row more than 10% fast."""
    from hf_superoffload.planning.planner import Workload

    h100 = HardwareProfile.shipped("h100_sxm")
    host0 = SuperOffloadConfig(gpu_resident_buckets=0, bucket_size_mb=32)
    for config, measured in ((host0, 1.155), (SuperOffloadConfig(), 0.963)):
        cfg = load_model_config("3.6b")
        shape = ModelShape.from_config(cfg)
        plan = make_plan(arrival_numels(cfg), element_size=2, config=config, profile=h100,
                         workload=Workload(shape, 8, 2048, True, chunked_loss=True, layer_checkpointing=True))
        st = predict_step_time(shape, PlanLike.from_plan(plan), h100, batch_size=8, seq_len=2048, grad_ckpt=True,
                               clipping_every_step=True)
        assert st.step_s == pytest.approx(measured, rel=0.10), (config, st.step_s)
    alone = dataclasses.replace(h100, cpu_adam_gparams=6.98)
    plan = make_plan(arrival_numels(cfg), element_size=2, config=host0,
                     profile=alone, workload=Workload(shape, 8, 2048, True, chunked_loss=True, layer_checkpointing=True))
    st = predict_step_time(shape, PlanLike.from_plan(plan), alone, batch_size=8, seq_len=2048, grad_ckpt=True,
                           clipping_every_step=True)
    assert st.step_s < 0.9 * 1.155


def test_grad_accum_prices_every_micro_batch(capsys):
    """``--grad-accum M``: the step covers all M micro-batches; under a 24 GiB GPU the plan streams the weights and
    sums on the host, so a micro-batch costs more than its GPU work ([Note: step-time roofline])."""
    args = ("--model", "8b", "--batch-size", "4", "--seq-len", "2048", "--grad-ckpt", "--profile", "h200",
            "--gpu-mem", "22")
    _, one = plan_json(capsys, *args)
    rc, eight = plan_json(capsys, *args, "--grad-accum", "8")
    assert rc == EXIT_FITS and eight["plan"]["weight_mode"] == "flow"
    st = eight["step_time_s"]
    assert st["micro_batches"] == 8 and st["micro_batch_s"] > st["gpu_s"]
    assert st["step_s"] == pytest.approx(7 * st["micro_batch_s"] + one["step_time_s"]["step_s"], rel=0.02)
    rc, out, _ = plan(capsys, *args, "--grad-accum", "8")
    assert "8 micro-batches, each before the last" in out
    # the printed memory is the planner's own, accumulated gradients included: the figure the tail was sized by
    sized = re.search(r"device tail:.*?, ([\d.]+) of [\d.]+ GiB usable device memory predicted", out)
    printed = re.search(r"predicted GPU memory: ([\d.]+) GiB required", out)
    assert sized and printed and sized.group(1) == printed.group(1), out
    assert "accumulated_gradients" in out


def test_a_setting_that_needs_deferred_stores_constrains_the_search(capsys):
    """A user-set field is a constraint on the plan search, not an end to it: ``defer_master=True`` at 8B on an H100
    box (whose host cannot hold every state and a second landing arena) keeps the deferred moment stores on and
    sizes the tail for them; where they cannot be (streamed weights sum gradients on the host) it is refused with
    the reason and the fix."""
    argv = ("--model", "8b", "--batch-size", "4", "--seq-len", "2048", "--grad-ckpt", "--profile", "h100")
    rc, data = plan_json(capsys, *argv, "--offload-config", '{"overrides": {"defer_master": true}}')
    notes = "\n".join(data["plan"]["notes"])
    assert rc == EXIT_FITS, data["reason"]
    assert "deferred moment stores: on" in notes and "(configured: defer_master=True)" in notes
    assert "deferred master stores: every host bucket (configured)" in notes
    rc, out, _ = plan(capsys, *argv, "--offload-config",
                      '{"weight_placement": "flow", "overrides": {"defer_master": true}}')
    assert rc == EXIT_DOES_NOT_FIT
    assert "PlannerOverrides(defer_master=True) is not supported here" in out
    assert "it needs deferred moment stores): set defer_master='auto' or False" in out
