"""The tutorial notebooks in notebooks/ run end to end on the CPU, with the defaults CI uses.

Each notebook is executed in a fresh ``python3`` kernel (ipykernel's kernelspec; jupyter_client starts it with
this interpreter) with ``HF_HUB_OFFLINE=1``: the defaults train the random-init ``tiny`` preset on the project's
own data, so nothing is downloaded. Outputs go to a temporary folder (``NB_OUTPUT_DIR``), the hardware-profile
cache too (``HF_SUPEROFFLOAD_CACHE``), so a run leaves nothing behind in the checkout or the home folder.

The committed notebooks must be stripped (no outputs, ``execution_count`` null) and start with a code cell
tagged ``parameters`` (papermill's convention).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from hf_superoffload import SuperOffloadConfig

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "notebooks"
EXPECTED = ["01_finetune_trainer.ipynb", "02_accelerate_loop.ipynb", "03_will_it_fit.ipynb"]
NOTEBOOKS = [NOTEBOOK_DIR / name for name in EXPECTED]
TIMEOUT_S = 600  # per cell
# Shorter runs than a user's default (papermill's way: a cell tagged "injected-parameters" after the parameters
# cell): every cell still runs, and the tiny bf16 model's steps are slow on a CPU without bf16 matmul (~1.5 s each
# for the Trainer's batch), so its default 120 steps were most of the test suite's notebook time.
CI_PARAMETERS = {"01_finetune_trainer": {"MAX_STEPS": 30}, "02_accelerate_loop": {"TOTAL_STEPS": 12}}


def test_the_notebooks_are_all_here() -> None:
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_parameterized(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", []), "the first code cell must be tagged 'parameters'"
    assert all(c.outputs == [] and c.execution_count is None for c in code), "commit the notebook without outputs"


def _ci_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the kernel inherits: offline, outputs in tmp_path, and none of the user's overrides."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("NB_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("HF_SUPEROFFLOAD_CACHE", str(tmp_path / "cache"))
    for name in ("NB_MODEL", "NB_TRAIN_MODEL", "ACCELERATE_MIXED_PRECISION", "HF_SUPEROFFLOAD_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for f in dataclasses.fields(SuperOffloadConfig):  # HF_SUPEROFFLOAD_<FIELD> would change the plugin's config
        monkeypatch.delenv(f"HF_SUPEROFFLOAD_{f.name.upper()}", raising=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _ci_environment(monkeypatch, tmp_path)
    nb = nbformat.read(path, as_version=4)
    overrides = CI_PARAMETERS.get(path.stem, {})
    if overrides:
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])) + 1
        injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in overrides.items()),
                                             metadata={"tags": ["injected-parameters"]})
        nb.cells.insert(at, injected)
    client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    elapsed = time.perf_counter() - t0

    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [(c.source.splitlines()[0], o.get("ename"), o.get("evalue"))
              for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert all(c.execution_count is not None for c in code), "some code cells did not run"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the notebook drew no figure"
    assert any((tmp_path / "out").rglob("*.png")), "figures were not saved under NB_OUTPUT_DIR"
    print(f"{path.name}: {elapsed:.1f} s, {len(images)} figure(s)")
