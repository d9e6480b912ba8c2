"""Apply each mutation of ``mutations.py`` to a copy of the package and run its guarding tests there.

Usage: ``python tests/mutation/run_mutations.py [name ...]`` (default: every mutation). Prints one line per
mutation (KILLED, SURVIVED, STALE or ERROR, with seconds; for KILLED the first failed assertion) and exits
non-zero unless every one was KILLED. ``MUTATION_JOBS`` sets how many run at once (default 2).

The copy is laid out as the installed package (``triton_kernels/`` and ``cpu_ext/`` *inside*
``hf_superoffload/``, as pyproject's package-dir maps them) and put first on ``PYTHONPATH``, so it shadows the
editable install (whose finder sits behind the path finder); a pytest plugin in the copy checks that before any
test runs. A mutation counts as KILLED only when pytest reports failed tests (exit code 1): a collection error,
a missing node id or a timeout is an ERROR, so a broken test cannot pass for a caught mutation. The C++ sources
are copied unchanged: the op library's cache key is a hash of them, so the copy loads the existing build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300.0
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build")

_GUARD = '''
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def pytest_configure(config):
    import hf_superoffload
    from hf_superoffload import cpu_ext, ops, runtime, triton_kernels

    for mod in (hf_superoffload, cpu_ext, ops, runtime, triton_kernels):
        if ROOT not in Path(mod.__file__).resolve().parents:
            raise pytest.UsageError(f"mutation run imports {mod.__name__} from {mod.__file__}, not the copy")
'''


def _source_path(copy: Path, rel: str) -> Path:
    """Where repository path ``rel`` lives in the copy (the mapped folders sit inside the package)."""
    head, _, rest = rel.partition("/")
    if head in ("triton_kernels", "cpu_ext"):
        return copy / "hf_superoffload" / head / rest
    return copy / rel


def make_copy(dest: Path) -> None:
    shutil.copytree(ROOT / "hf_superoffload", dest / "hf_superoffload", ignore=_IGNORE)
    for sub in ("triton_kernels", "cpu_ext"):
        shutil.copytree(ROOT / sub, dest / "hf_superoffload" / sub, ignore=_IGNORE)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=_IGNORE)
    shutil.copytree(ROOT / "examples", dest / "examples", ignore=_IGNORE)  # some tests run the examples
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    (dest / "_mutation_guard.py").write_text(_GUARD)


def apply(copy: Path, m: Mutation) -> None:
    """Replace the snippet in the copy; raises LookupError unless it occurs exactly once."""
    path = _source_path(copy, m.path)
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise LookupError(f"{m.path}: the snippet occurs {count} times (expected once): update the mutation")
    path.write_text(text.replace(m.old, m.new))


def run_one(m: Mutation) -> tuple[str, float, str]:
    """(verdict, seconds, detail) for one mutation."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{m.name}-") as tmp:
        copy = Path(tmp)
        make_copy(copy)
        try:
            apply(copy, m)
        except LookupError as e:
            return "STALE", time.perf_counter() - t0, str(e)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "_mutation_guard",
               "--rootdir", str(copy), "-c", str(copy / "pyproject.toml"), *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "ERROR", time.perf_counter() - t0, f"timed out after {TIMEOUT_S:.0f} s"
    seconds = time.perf_counter() - t0
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    if proc.returncode == 1:  # the first assertion line says what caught it
        caught = next((ln for ln in proc.stdout.splitlines() if ln.startswith("E ")), "")
        return "KILLED", seconds, caught[:160]
    if proc.returncode == 0:
        return "SURVIVED", seconds, tail
    return "ERROR", seconds, f"pytest exit code {proc.returncode}\n{tail}"


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutation(s): {sorted(unknown)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    jobs = int(os.environ.get("MUTATION_JOBS", "2"))  # the CI box has two cores
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(run_one, chosen))
    for m, (verdict, seconds, detail) in zip(chosen, results):
        print(f"{verdict:8s} {seconds:6.1f} s  {m.name}", flush=True)
        if detail:
            print("    " + detail.replace("\n", "\n    "))
    killed = sum(v == "KILLED" for v, _, _ in results)
    print(f"{killed}/{len(chosen)} mutations killed in {time.perf_counter() - t0:.0f} s")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
