"""HardwareProfile: cheap reads, the quick CPU measurement, the JSON cache and the shipped profiles (CPU only)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_superoffload.planning import hardware
from hf_superoffload.planning.hardware import CACHE_ENV, HardwareProfile, cache_path, shipped_profile_names

GiB = 1024**3


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def test_read_is_cheap_and_keeps_the_old_fields():
    prof = HardwareProfile.read(torch.device("cpu"))
    assert prof.device_type == "cpu" and prof.device_free_bytes is None
    assert prof.cpu_threads >= 1 and prof.source == "read"
    assert prof.h2d_gbps is None and prof.cpu_adam_gparams is None
    # the four original fields stay positional-compatible
    assert HardwareProfile("cuda", 1, 2, 3).cpu_threads == 3


def test_cache_path_honours_the_env_and_names_host_and_device(cache_dir):
    path = cache_path("cpu")
    assert path.parent == cache_dir
    assert path.name.startswith("profile-") and path.name.endswith("-cpu.json")


def test_quick_measure_on_cpu_gives_sane_values_and_caches(cache_dir, monkeypatch):
    prof = HardwareProfile.measure("cpu", quick=True)
    assert prof.source == "measured-quick"
    # the real fused kernel on a couple of shared cores: somewhere between 10 Mparam/s and 100 Gparam/s
    assert 0.01 < prof.cpu_adam_gparams < 100
    # the in-place streaming rate: a memory bus, from a slow VM's few GB/s to a Grace's ~500
    assert 0.5 < prof.host_memory_gbps < 2000
    for f in ("h2d_gbps", "d2h_gbps", "h2d_concurrent_gbps", "d2h_concurrent_gbps", "matmul_tflops",
              "device_memory_gbps", "device_free_bytes"):
        assert getattr(prof, f) is None, f
    assert cache_path("cpu").is_file()

    def boom(*a, **k):
        raise AssertionError("measured again although a cached profile exists")

    monkeypatch.setattr(hardware, "_measure_cpu_adam", boom)
    again = HardwareProfile.measure("cpu", quick=True)
    assert again.cpu_adam_gparams == prof.cpu_adam_gparams
    # a quick cache does not satisfy a full measurement, and refresh always measures
    with pytest.raises(AssertionError, match="measured again"):
        HardwareProfile.measure("cpu")
    with pytest.raises(AssertionError, match="measured again"):
        HardwareProfile.measure("cpu", quick=True, refresh=True)


def test_host_memory_rate_counts_the_in_place_pattern_bytes_and_restores_the_threads(monkeypatch):
    # a += s * b reads 8 B and writes 4 B per fp32 element: the rate the roofline prices host memory with
    seen = []

    def timed(fn, reps):
        fn()
        seen.append(torch.get_num_threads())
        return 0.5

    monkeypatch.setattr(hardware, "_median_seconds", timed)
    before = torch.get_num_threads()
    assert hardware._measure_host_memory(1, quick=True) == pytest.approx(12 * 8 * 1024 * 1024 / 0.5 / 1e9)
    assert seen == [1] and torch.get_num_threads() == before


def test_measure_rereads_free_memory_over_the_cache(cache_dir, monkeypatch):
    cached = dataclasses.replace(HardwareProfile.read(torch.device("cpu")), source="measured", cpu_adam_gparams=1.5,
                                 host_available_bytes=1)
    cached.save(cache_path("cpu"))
    # (a fixed reading: MemAvailable read twice moves with whatever else the machine does; the test flaked beside a
    # CI rehearsal)
    monkeypatch.setattr(hardware, "available_host_bytes", lambda: 123 * 1024**3)
    prof = HardwareProfile.measure("cpu")
    assert prof.cpu_adam_gparams == 1.5
    assert prof.host_available_bytes == 123 * 1024**3


def test_save_load_round_trip(tmp_path):
    prof = dataclasses.replace(HardwareProfile.gh200(), cpu_threads=7, notes=("a", "b"))
    path = tmp_path / "sub" / "p.json"
    prof.save(path)
    assert HardwareProfile.load(path) == prof
    assert json.loads(path.read_text())["schema"] == 1


@pytest.mark.parametrize(
    "data,match",
    [
        ({"device_type": "cuda", "cpu_threads": 1, "warp_speed": 9}, "unknown hardware profile field"),
        ({"device_type": "cuda"}, "lacks required field"),
        ({"schema": 99, "device_type": "cuda", "cpu_threads": 1}, "schema 99"),
    ],
)
def test_from_dict_rejects_bad_profiles(data, match):
    with pytest.raises(ValueError, match=match):
        HardwareProfile.from_dict(data)


def test_load_rejects_non_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON hardware profile"):
        HardwareProfile.load(path)


def test_shipped_profiles_load_with_their_published_figures():
    assert {"gh200", "h200_pcie", "h100_sxm", "rtx4090_24gb"} <= set(shipped_profile_names())
    gh, h200, rtx = HardwareProfile.gh200(), HardwareProfile.h200_pcie(), HardwareProfile.rtx4090_24gb()
    assert (gh.h2d_gbps, gh.d2h_gbps, gh.cpu_cores) == (375.0, 297.0, 72)
    assert gh.host_total_bytes == 480 * 10**9 and gh.device_total_bytes == 96 * GiB
    # host bandwidth ~4x ours, and the CPU Adam rate derived from it
    assert 3.5 < gh.cpu_adam_gparams / h200.cpu_adam_gparams < 4.5
    assert gh.cpu_adam_gparams == pytest.approx(gh.host_memory_gbps / 28, rel=0.02)
    assert (h200.h2d_gbps, h200.d2h_gbps, h200.matmul_tflops, h200.cpu_cores) == (55.5, 55.3, 802.0, 16)
    assert h200.h2d_concurrent_gbps + h200.d2h_concurrent_gbps == pytest.approx(101.5)
    assert h200.device_free_bytes == 139 * GiB and h200.host_total_bytes == 128 * GiB
    assert rtx.source == "assumed" and rtx.device_free_bytes < 24 * GiB and rtx.host_total_bytes == 64 * GiB
    for prof in (gh, h200, rtx):
        assert prof.device_type == "cuda" and prof.notes
        assert all(getattr(prof, f.name) is not None for f in dataclasses.fields(prof)), prof.name


def test_every_field_can_be_overridden():
    prof = HardwareProfile.h200_pcie()
    for f in dataclasses.fields(prof):
        assert getattr(dataclasses.replace(prof, **{f.name: None}), f.name) is None
    with pytest.raises(ValueError, match="no shipped hardware profile"):
        HardwareProfile.shipped("abacus")
