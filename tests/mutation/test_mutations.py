"""The mutation check in the normal test run: every mutation of mutations.py is applied to a copy of the package
and must be caught by its guarding tests (about 4-5 minutes on a 2-core box, two mutations at a time)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_spec = importlib.util.spec_from_file_location("mutations", HERE / "mutations.py")
mutations = sys.modules.setdefault("mutations", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(mutations)


@pytest.mark.parametrize("m", mutations.MUTATIONS, ids=lambda m: m.name)
def test_snippet_occurs_exactly_once(m: mutations.Mutation) -> None:
    """A stale mutation (its code was edited) must be updated, not silently skipped."""
    text = (ROOT / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.path}: the snippet of {m.name} occurs {text.count(m.old)} times"
    assert m.new != m.old and m.tests


def test_names_are_unique() -> None:
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) == len(set(names))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_mutation_is_killed() -> None:
    proc = subprocess.run([sys.executable, str(HERE / "run_mutations.py")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
