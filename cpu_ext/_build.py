"""Just-in-time build and load of the CPU Adam op library (``csrc/``).

[Note: CPU Adam build]
The op library is compiled on first use with ``torch.utils.cpp_extension.load`` into torch's extension
cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). The extension name carries a hash
of every source file, the flags and the torch version, so an edited header or a new torch rebuilds into a
fresh directory instead of reusing a stale binary; torch's file lock serialises concurrent builds of the
same name across processes (e.g. several ranks starting at once), and ``_LOCK`` serialises threads.

torch's lock is a plain file that a killed build (Ctrl-C, the OOM killer) leaves behind, and the next
process waits for it forever. So every build first takes an ``flock`` on ``build.flock`` in the same
directory: the kernel drops it when its holder dies, so whoever holds it knows that a torch ``lock`` file
there is stale and removes it before loading. Concurrent ranks queue on the ``flock`` (blocking, no
polling); the first builds, the others then find the library built. Where ``fcntl`` is missing (Windows)
only a lock older than ``_STALE_LOCK_S`` is taken for stale.

[Note: one libstdc++ per process]
The library must use the libstdc++ that torch already loaded, never a private copy. A toolchain whose driver links
libstdc++ statically by default (seen on the H200 box: ``CXX=/opt/gcc/bin/g++`` gave a library with no
``libstdc++.so.6`` dependency that defined some 4,400 ``std::`` symbols) puts a second copy in the process. The
dynamic linker then binds part of the library's calls to torch's copy and leaves the rest in the private one, so an
``ostream`` built by one copy looks its number facet up in the other's locale: formatting an integer or a double
into a ``TORCH_CHECK`` message crashed (SIGSEGV on the box; with GCC 12 and ``-static-libstdc++`` the message
stopped at the number), while messages made of strings alone went through. That driver finds only its static
``libstdc++.a`` (there is no ``libstdc++.so`` beside it), so ``-Bdynamic -lstdc++`` did not help. The link line
therefore names the very file this process has loaded (``/proc/self/maps``, e.g.
``/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33``) ahead of the driver's implicit libraries: it resolves every
``std::`` reference, the static archive contributes nothing, and the library records ``libstdc++.so.6`` as needed.
With an ordinary driver this changes nothing. The path joins the extension's hash, so a process with another
libstdc++ builds its own library. ``tests/cpu_ext/test_cpu_adam_linkage.py`` stands in for such a toolchain:
``-static-libstdc++`` and a folder holding only ``libstdc++.a`` first in the search.

No ``-march`` flag: each SIMD path carries its own target attribute and the library dispatches on the CPU
it runs on, so a cached build is safe on any machine of the same architecture.

A library already in the cache is loaded directly (``torch.ops.load_library``), not through
``cpp_extension.load``: that one writes a ``build.ninja`` naming the sources by absolute path and runs ninja,
so a second copy of the package (another virtual environment, a mutation test's copy) with the very same
sources, hence the same name, rebuilt the library (~20 s) and left the other copy to rebuild it in turn. The
name already is the hash of everything that goes into the library; a cached file that does not load (a link
killed half-way) is built again.

Messages: a load from the cache says nothing (DEBUG only). A build says so once, when it starts, with the
elapsed time ticking on a terminal (it takes about a minute and the first step waits for it); off a terminal
the one line goes to the ``hf_superoffload`` logging when that shows INFO records, else to stderr. The stale
lock warning appears only when a build was actually interrupted.

If the build fails (no compiler, no OpenMP) the ops fall back to torch (see ``_fallback``) and ONE
warning says what is lost and how to fix it. ``HF_SUPEROFFLOAD_DISABLE_CPU_EXT=1`` forces the fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CSRC", "DISABLE_ENV", "ISA_ENV", "SCHEDULE_ENV", "LoadState", "load_library", "load_state"]

logger = logging.getLogger(__name__)

DISABLE_ENV = "HF_SUPEROFFLOAD_DISABLE_CPU_EXT"
"""Set to 1 to skip the build and use the torch fallback."""
ISA_ENV = "HF_SUPEROFFLOAD_CPU_ADAM_ISA"
"""Force one SIMD path: scalar, avx2, avx512, avx512_bf16, neon or sve (read by the op on every call)."""
SCHEDULE_ENV = "HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE"
"""``dynamic`` (default) or ``static``: how the elementwise ops share a range among their threads (read per call)."""

CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("adam_op.cpp",)
_CFLAGS = (
    "-O3",
    "-fopenmp",
    "-ffp-contract=off",  # every path rounds alike: see [Note: one rounding sequence for every path]
    "-fno-math-errno",  # lets std::sqrt be one instruction
    "-Wno-uninitialized",  # GCC 12 false positives inside avx512fintrin.h
    "-Wno-maybe-uninitialized",
)
_LDFLAGS = ("-fopenmp",)


def _loaded_libstdcxx() -> tuple[str, ...]:
    """The libstdc++ this process (torch) has loaded, as a link input: see [Note: one libstdc++ per process]."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libstdc++.so" in line}
    except OSError:  # not Linux
        return ()
    return (min(paths),) if paths else ()


def _ldflags() -> tuple[str, ...]:
    return (*_LDFLAGS, *_loaded_libstdcxx())


@dataclass(frozen=True, slots=True)
class LoadState:
    """Outcome of the one load attempt of this process."""

    loaded: bool
    """True when the op library is registered under ``torch.ops.hf_superoffload``."""
    reason: str = ""
    """Why it is not loaded (empty when loaded)."""


_LOCK = threading.Lock()
_STATE: LoadState | None = None


def _extension_name() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".h", ".cpp") and path.name != "test_kernels.cpp":
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(repr((_CFLAGS, _ldflags(), torch.__version__)).encode())
    return f"hf_superoffload_cpu_adam_{h.hexdigest()[:16]}"


# Without fcntl: a build takes ~15-60 s, so a lock file much older than that was left by a build that was
# killed. torch's file baton would wait for it forever.
_STALE_LOCK_S = 600.0


def _clear_stale_lock(name: str) -> None:
    """No-``fcntl`` fallback: remove torch's build lock of ``name`` if it is older than ``_STALE_LOCK_S``."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_S:
        logger.warning("removing a stale build lock %s (%.0f s old: an earlier build was interrupted)", lock, age)
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def _exclusive_build(name: str) -> Iterator[None]:
    """Hold ``build.flock`` in ``name``'s build directory for the build and load; a torch ``lock`` file found
    there while holding it was left by a killed build and is removed ([Note: CPU Adam build])."""
    try:
        import fcntl
    except ImportError:  # Windows
        _clear_stale_lock(name)
        yield
        return
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building the CPU Adam extension in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            lock = build_dir / "lock"
            if lock.exists():
                logger.warning("removing the build lock %s left by an interrupted build", lock)
                lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _built_library(name: str) -> Path | None:
    """``name``'s library in the cache, or None where it has not been built."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    return next((lib for ext in (".so", ".pyd", ".dylib") if (lib := build_dir / f"{name}{ext}").is_file()), None)


def _load_built(name: str) -> bool:
    """Load ``name``'s cached library directly, without ``cpp_extension.load``; False where there is none or it
    does not load (a link killed half-way), and the caller builds it again ([Note: CPU Adam build])."""
    library = _built_library(name)
    if library is None:
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        logger.warning("rebuilding the CPU Adam extension: its cached library %s does not load (%s)", library, exc)
        return False
    return True


def _say(message: str) -> None:
    """One line the user should see: through logging when it is set up to show INFO records, else on stderr
    (the library's INFO records reach no handler in a script that configured no logging)."""
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info("%s", message)
    else:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_progress(name: str) -> Iterator[None]:
    """The one build message: on a terminal a status line whose elapsed time ticks until the build ends;
    elsewhere a single line (see [Note: CPU Adam build])."""
    from tqdm.auto import tqdm

    what = "hf_superoffload: compiling the CPU Adam extension (first use only, about a minute)"
    bar = tqdm(desc=what, bar_format="{desc}: {elapsed}", disable=None, file=sys.stderr)
    if bar.disable:
        _say(f"{what}: {name}")
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="hf_superoffload-build-progress", daemon=True)
    ticker.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.close()
        logger.info("built the CPU Adam extension %s in %.0f s", name, time.perf_counter() - start)


def _compile(name: str) -> None:
    """Build ``name`` with ninja in the cache and load it."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=name,
        sources=[str(CSRC / s) for s in _SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_ldflags()),
        is_python_module=False,
        verbose=False,
    )


def _build() -> LoadState:
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        logger.info("%s is set: CPU Adam uses the torch fallback", DISABLE_ENV)
        return LoadState(False, f"disabled by {DISABLE_ENV}")
    try:
        name = _extension_name()
        with _exclusive_build(name):
            if _load_built(name):
                logger.debug("loaded the CPU Adam extension %s from the cache", name)
            else:
                with _build_progress(name):
                    _compile(name)
    except Exception as exc:
        detail = str(exc).strip()
        if len(detail) > 2000:
            detail = "...\n" + detail[-2000:]
        warnings.warn(
            "hf_superoffload: could not build the CPU Adam extension (hf_superoffload.cpu_ext), so the CPU "
            "optimizer step falls back to torch: fused AdamW with separate bf16->fp32 gradient and "
            "fp32->bf16 weight casts (about 1.4x the host memory traffic of the fused pass, no AVX-512/SVE "
            "kernels, torch's intra-op thread count instead of num_threads). To fix it, install a C++ "
            "compiler with OpenMP (e.g. `apt-get install g++` or `conda install -c conda-forge gxx`) and "
            f"ninja (`pip install ninja`), then restart the process. Cause: {type(exc).__name__}: {detail}",
            RuntimeWarning,
            stacklevel=5,  # the caller of the ops.* function
        )
        return LoadState(False, f"build failed: {type(exc).__name__}")
    from ._fake import register_fakes

    register_fakes()
    return LoadState(True)


def load_library() -> bool:
    """Build (first use) and load the op library; True when the compiled ops are available.

    Thread safe; the attempt is made once per process and its outcome cached.
    """
    state = _STATE
    if state is None:
        state = load_state()
    return state.loaded


def load_state() -> LoadState:
    """The cached :class:`LoadState`, attempting the load if it has not happened yet."""
    global _STATE
    if _STATE is None:
        with _LOCK:
            if _STATE is None:
                _STATE = _build()
    return _STATE
