"""Under ``TRITON_INTERPRET=1`` only: stop Triton's interpreter from re-patching ``triton.language`` on every
call of a ``@triton.jit`` helper inside a launch.

Why: the interpreter swaps every builtin of ``triton.language`` (and ``tl.tensor``, ``tl.math``,
``tl.core``) for a Python twin through ``triton.runtime.interpreter._patch_lang(fn)``, a walk of each
module's members with :func:`inspect.getmembers`. It does that once per launch (and undoes it at the
launch's end) *and again on every call of a device function* (``InterpretedFunction.__call__``), where
the builtins are already swapped and the walk finds nothing left to do. Our row kernels call small
helpers per tile (loads, rounding, the statistics sums): ~2,000 calls per launch at ~1.7 ms of walking
apiece were half of CI's interpreter time (measured: one flatten launch 2.1 s -> 0.9 s without them).

What changes: inside a launch, a helper whose globals see only ``triton.language`` modules the launch
(or an earlier helper of it) already patched skips the walk; a helper that sees one not yet patched this
launch (e.g. ``tl.standard``'s ``sum``, whose globals hold ``tl.core``) gets the original call, as before.
Nothing else: the launch-level patch and its undo are Triton's own, and a helper's patches were never
undone by Triton either. The kernel tests compare every interpreted launch bit for bit with the torch
twins, so a Triton whose patching works differently fails them rather than passing silently.

Applied by :mod:`._kernels` at import when interpreted; never in a compiled process. A Triton without
this internal API (``_patch_lang`` returning a scope with ``restore``) is left untouched (slower, same
results; ``test_interpreter_walks_triton_language_once_per_launch`` then fails and says why).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["skip_repeated_lang_patches"]

_WRAPPED = "_hf_superoffload_skips_repeats"


class _NoPatch:
    """What a skipped helper call gets instead of a scope (Triton drops a helper's scope anyway)."""

    def restore(self) -> None:
        pass


def skip_repeated_lang_patches() -> bool:
    """Wrap the interpreter's ``_patch_lang`` (idempotent). True when the wrapper is in place."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ip
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    original: Callable[[Any], Any] | None = getattr(ip, "_patch_lang", None)
    if original is None or not hasattr(ip, "_LangPatchScope"):
        return False
    if getattr(original, _WRAPPED, False):
        return True
    langs = (tl, tl.core)
    seen: dict[Any, frozenset[int]] = {}  # fn -> ids of the triton.language modules in its globals
    state = threading.local()  # .patched: ids patched by the running launch on this thread, or None

    def modules_of(fn: Any) -> frozenset[int]:
        got = seen.get(fn)
        if got is None:
            got = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)
            seen[fn] = got
        return got

    def patch_lang(fn: Any) -> Any:
        patched: set[int] | None = getattr(state, "patched", None)
        mods = modules_of(fn)
        if patched is not None:  # a helper called inside a launch
            if mods <= patched:
                return _NoPatch()
            patched |= mods
            return original(fn)
        scope = original(fn)  # a launch: Triton patches, and restores in its `finally`
        restore = scope.restore
        state.patched = set(mods)

        def restore_and_forget() -> None:
            state.patched = None
            restore()

        scope.restore = restore_and_forget
        return scope

    setattr(patch_lang, _WRAPPED, True)
    patch_lang.__wrapped__ = original  # type: ignore[attr-defined]
    ip._patch_lang = patch_lang
    return True
