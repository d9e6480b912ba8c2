"""The package's import graph: every module imports on its own from a fresh start (no cycle that only bites in
some import order), and the core never imports the demo subpackage when it is imported.

Each module is imported first in its own forked child of one fresh interpreter that has imported torch and the
HF libraries but nothing of ``hf_superoffload``: a fresh package state per module for the cost of a fork.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "hf_superoffload"
DEMO = f"{PACKAGE}.demo"
# Outside the core: the demo itself, the command line that runs it, and the test helpers.
NOT_CORE = (DEMO, f"{PACKAGE}.cli", f"{PACKAGE}.plan_cli", f"{PACKAGE}._cli_args", f"{PACKAGE}.testing")
# Installed inside the package from top-level folders (pyproject's package-dir), so not found by walking it.
MAPPED = (f"{PACKAGE}.triton_kernels", f"{PACKAGE}.cpu_ext")
TOP_LEVEL = "<hf_superoffload and every name of its __all__>"

# Runs in a fresh interpreter: argv[1] is JSON {"modules": [...], "top": TOP_LEVEL, "demo": DEMO}; prints one JSON
# object: per module, the import error (or None), the demo modules that import loaded and which of our modules
# imported them (a meta-path finder that finds nothing, placed first, sees every first import of a demo module).
_PROBE = r"""
import importlib, json, os, sys, traceback
# Third-party imports every child would repeat, made once here (only speed depends on this list); nothing of ours.
import torch, torch.distributed, accelerate
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
for optional in ("triton", "trl"):
    try:
        importlib.import_module(optional)
    except ImportError:
        pass
assert not any(m == "hf_superoffload" or m.startswith("hf_superoffload.") for m in sys.modules)
job = json.loads(sys.argv[1])
is_demo = lambda m: m == job["demo"] or m.startswith(job["demo"] + ".")


class WhoImportsDemo:
    importers = set()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        frame = sys._getframe(1) if is_demo(fullname) else None
        while frame is not None:
            caller = frame.f_globals.get("__name__", "")
            if caller.startswith("hf_superoffload") and not is_demo(caller):
                cls.importers.add(caller)
                break
            frame = frame.f_back
        return None


sys.meta_path.insert(0, WhoImportsDemo)
results = {}
for name in job["modules"]:
    sys.stdout.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        error = None
        try:
            if name == job["top"]:
                package = importlib.import_module("hf_superoffload")
                for attr in package.__all__:
                    getattr(package, attr)
            else:
                importlib.import_module(name)
        except BaseException:
            error = traceback.format_exc(limit=-3)
        demo = sorted(m for m in sys.modules if is_demo(m))
        result = {"error": error, "demo": demo, "importers": sorted(WhoImportsDemo.importers)}
        os.write(write_end, json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        payload = f.read()
    os.waitpid(pid, 0)
    results[name] = json.loads(payload) if payload else {"error": "the child died", "demo": [], "importers": []}
print(json.dumps(results))
"""


def _modules(*, packages_only: bool = False) -> list[str]:
    """Every module (or every package) of the package, found on disk: this process imports nothing of it beyond
    the package itself, which finding the mapped folders needs."""
    names: list[str] = []

    def walk(package: str) -> None:
        names.append(package)
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations is not None, package
        for info in pkgutil.iter_modules(spec.submodule_search_locations, package + "."):
            if info.ispkg:
                walk(info.name)
            elif not packages_only:
                names.append(info.name)

    for package in (PACKAGE, *MAPPED):
        walk(package)
    return names


def _is_core(name: str) -> bool:
    return not any(name == m or name.startswith(m + ".") for m in NOT_CORE)


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    if not hasattr(os, "fork"):
        pytest.skip("the probe forks one child per module")
    job = {"modules": [*_modules(), TOP_LEVEL], "top": TOP_LEVEL, "demo": DEMO}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # A scratch working directory: the repo root on sys.path would make `triton_kernels` the bare folder.
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(job)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=tmp_path_factory.mktemp("imports"))
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_walk_finds_the_layers() -> None:
    names = set(_modules())
    for expected in (f"{PACKAGE}.planning.planner", f"{PACKAGE}.runtime.engine", f"{PACKAGE}.optimizer",
                     f"{PACKAGE}.config", f"{PACKAGE}.integrations.transformers", f"{PACKAGE}.triton_kernels",
                     f"{PACKAGE}.cpu_ext", f"{DEMO}.presets", f"{DEMO}.local_data", f"{DEMO}.train_job"):
        assert expected in names


def test_every_module_imports_first_from_a_fresh_start(probed: dict[str, dict]) -> None:
    failed = {name: r["error"] for name, r in probed.items() if r["error"]}
    assert not failed, "\n".join(f"{name}:\n{err}" for name, err in failed.items())


def test_the_core_never_imports_the_demo(probed: dict[str, dict]) -> None:
    assert probed[f"{DEMO}.presets"]["demo"], "the probe does not see the demo package loaded"
    offenders = {name for name, r in probed.items() if _is_core(name) and r["demo"]}
    importers = sorted({i for name in offenders for i in probed[name]["importers"]})
    assert not offenders, (f"{importers} import {DEMO} at import time (import it inside the function that needs "
                           f"it); {len(offenders)} core modules load it: {sorted(offenders)}")


def test_the_public_api_names_no_demo_piece() -> None:
    import hf_superoffload

    for name in hf_superoffload.__all__:
        module = getattr(getattr(hf_superoffload, name), "__module__", None) or ""
        assert not module.startswith(DEMO), f"{name} comes from {module}"


def test_every_subpackage_is_packaged() -> None:
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    listed = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = sorted(set(_modules(packages_only=True)) - set(listed))
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml, or they do not install"
