"""The op library shares torch's libstdc++ ([Note: one libstdc++ per process] in cpu_ext/_build.py).

A private static copy of libstdc++ crashed the H200 box on every contract message that formats a number; the
dev and CI machines' compilers link it dynamically, so the second test builds with ``-static-libstdc++`` to stand
in for the box's toolchain.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_superoffload.cpu_ext import _build


def _needed(library: str) -> list[str]:
    """The DT_NEEDED entries of a shared library, read with ``readelf -d``."""
    out = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def _our_library() -> str:
    ours = [p for p in torch.ops.loaded_libraries if Path(p).name.startswith("hf_superoffload_cpu_adam_")]
    assert len(ours) == 1, f"expected one loaded CPU Adam library, got {ours}"
    return ours[0]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) is not installed")
def test_library_needs_the_shared_libstdcxx(compiled: None) -> None:
    assert any(n.startswith("libstdc++.so") for n in _needed(_our_library())), (
        "the CPU Adam library carries its own libstdc++ (a compiler that links it statically?)"
    )


# Runs in a fresh process with an empty extension cache: builds the library as the box's toolchain does (it links
# libstdc++ statically and finds only libstdc++.a: a -L folder holding nothing else comes first), then formats a
# number into a contract message. argv[1]: that folder.
_STATIC_TOOLCHAIN = """
import sys, torch
from hf_superoffload.cpu_ext import _build
_build._LDFLAGS = _build._LDFLAGS + ("-static-libstdc++", "-L" + sys.argv[1])
state = _build._build()
if not state.loaded:
    print("NOT LOADED", state.reason)
    sys.exit(3)
try:
    torch.ops.hf_superoffload.cpu_adamw_moments(
        torch.randn(16).bfloat16(), torch.randn(16), torch.rand(17), 0.9, 0.999, 1.0, None, None, 1)
except RuntimeError as e:
    print("MESSAGE", str(e).splitlines()[0])
print("LIBRARY", [p for p in torch.ops.loaded_libraries if "hf_superoffload_cpu_adam_" in p][0])
"""


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) is not installed")
def test_a_static_libstdcxx_toolchain_still_links_the_shared_one(compiled: None, tmp_path: Path) -> None:
    cxx = os.environ.get("CXX", "c++")
    archive = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(archive):
        pytest.skip(f"{cxx} has no static libstdc++ to link")
    static_only = tmp_path / "static_only"
    static_only.mkdir()
    (static_only / "libstdc++.a").symlink_to(archive)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop(_build.DISABLE_ENV, None)
    # cwd: the checkout's root would shadow the installed (or staged) package, which alone holds cpu_ext
    r = subprocess.run([sys.executable, "-c", _STATIC_TOOLCHAIN, str(static_only)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(f"this compiler cannot link libstdc++ statically: {r.stdout.strip()[-300:]}")
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("MESSAGE", "LIBRARY")))
    assert lines["MESSAGE"] == "exp_avg_sq has 17 elements, expected 16 (as param)"
    assert any(n.startswith("libstdc++.so") for n in _needed(lines["LIBRARY"]))
