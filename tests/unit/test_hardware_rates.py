"""[Note: known rates]: the bare optimizer's read profile borrows the roofline's rates from this host's cached
measurement or the shipped profile of the same GPU model, so the tail search can weigh its choices."""

from __future__ import annotations

import dataclasses

import pytest

from hf_superoffload.planning.hardware import RATE_FIELDS, HardwareProfile, with_known_rates


def _read(name: str | None, cores: int = 16) -> HardwareProfile:
    return HardwareProfile(device_type="cuda", device_free_bytes=100 << 30, host_available_bytes=100 << 30,
                           cpu_threads=cores - 1, name=name, source="read", cpu_cores=cores)


@pytest.fixture(autouse=True)
def _no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SUPEROFFLOAD_CACHE", str(tmp_path))


@pytest.mark.parametrize(("gpu", "shipped"), [("NVIDIA H200", "h200_pcie"), ("NVIDIA GH200 480GB", "gh200"),
                                              ("NVIDIA H100 80GB HBM3", "h100_sxm"),
                                              ("NVIDIA GeForce RTX 4090", "rtx4090_24gb")])
def test_a_known_gpu_borrows_its_shipped_rates(gpu: str, shipped: str) -> None:
    ref = HardwareProfile.shipped(shipped)
    got = with_known_rates(_read(gpu, cores=ref.cpu_cores or 16), "cuda")
    for k in RATE_FIELDS:
        assert getattr(got, k) == getattr(ref, k), k
    assert got.device_free_bytes == 100 << 30 and got.name == gpu  # the read facts stay
    assert any(shipped in n for n in got.notes)


def test_cpu_rates_scale_with_the_cores() -> None:
    ref = HardwareProfile.shipped("h200_pcie")
    got = with_known_rates(_read("NVIDIA H200", cores=8), "cuda")
    assert got.cpu_adam_gparams == pytest.approx(ref.cpu_adam_gparams * 8 / ref.cpu_cores)
    assert got.h2d_gbps == ref.h2d_gbps  # the link is the GPU's
    many = with_known_rates(_read("NVIDIA H200", cores=128), "cuda")
    assert many.cpu_adam_gparams == pytest.approx(ref.cpu_adam_gparams * 1.5)


def test_the_cached_measurement_wins(tmp_path, monkeypatch) -> None:
    import hf_superoffload.planning.hardware as hw

    measured = dataclasses.replace(HardwareProfile.shipped("h200_pcie"), cpu_adam_gparams=1.25, source="measured")
    measured.save(tmp_path / "profile.json")
    monkeypatch.setattr(hw, "cache_path", lambda device: tmp_path / "profile.json")
    got = with_known_rates(_read("NVIDIA H200", cores=8), "cuda")
    assert got.cpu_adam_gparams == 1.25  # measured on this host: not scaled
    assert any("measured profile" in n for n in got.notes)


def test_unknown_gpu_cpu_or_rates_present_are_left_alone() -> None:
    # an H100 PCIe or NVL is not the SXM card the h100_sxm profile measured (another GEMM rate and link)
    for prof in (_read("Some Future GPU"), _read("NVIDIA H100 PCIe"), _read("NVIDIA H100 NVL"),
                 dataclasses.replace(_read("NVIDIA H200"), device_type="cpu"),
                 dataclasses.replace(_read("NVIDIA H200"), cpu_adam_gparams=2.0)):
        assert with_known_rates(prof, "cuda") == prof
