"""The standalone C++ kernel test: natively on this machine, and for aarch64 (NEON/SVE) under qemu."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hf_superoffload import cpu_ext

CSRC = Path(cpu_ext.__file__).resolve().parent / "csrc"
CROSS_SCRIPT = CSRC.parents[1] / ".ci" / "cpu_ext_cross.sh"
_SKIP = 77  # the cross script's "tools missing and not installable" status


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def test_kernels_cpp_native(tmp_path: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++) on PATH")
    exe = tmp_path / "test_kernels"
    subprocess.run(
        [cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd",
         "-Wno-uninitialized", "-Wno-maybe-uninitialized", str(CSRC / "test_kernels.cpp"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ALL OK" in res.stdout


def test_kernels_cpp_aarch64_under_qemu() -> None:
    if not CROSS_SCRIPT.exists():
        pytest.skip(f"{CROSS_SCRIPT} not found (not a source checkout)")
    have_tools = shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")
    can_install = shutil.which("apt-get") and (os.geteuid() == 0 or shutil.which("sudo"))
    if not (have_tools or can_install) and not _in_ci():
        pytest.skip("needs g++-aarch64-linux-gnu and qemu-user, and apt-get is unavailable to install them")
    res = subprocess.run(["bash", str(CROSS_SCRIPT)], capture_output=True, text=True, timeout=900)
    if res.returncode == _SKIP and not _in_ci():
        pytest.skip("could not install the aarch64 tools:\n" + res.stdout[-2000:])
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert res.stdout.count("ALL OK") == 5
