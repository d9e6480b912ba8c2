"""What the CPU Adam build prints ([Note: CPU Adam build]): nothing on a load from the cache; on a build, one
line (a ticking status line on a terminal); never a lock warning on a normal run."""

from __future__ import annotations

import io
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hf_superoffload.cpu_ext import _build, _fake


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def no_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The process's one real load first: made under the patch, it would be cached with no fake kernels registered
    # and the later FakeTensor tests of the session would fail.
    _build.load_state()
    monkeypatch.setattr(_fake, "register_fakes", lambda: None)


def test_a_cached_load_says_nothing(no_fakes: None, capsys: Any, caplog: pytest.LogCaptureFixture) -> None:
    if not _build.load_library():
        pytest.skip("the CPU Adam extension cannot be built here")
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _build._build().loaded  # the library is in the cache: only loaded
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    assert capsys.readouterr().err == "" and not caught


@pytest.mark.parametrize("terminal", [True, False])
def test_a_build_says_so_once(terminal: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_fakes: None,
                              caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: the library must be built
    monkeypatch.setattr(_build, "_extension_name", lambda: "hf_superoffload_cpu_adam_probe")
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: time.sleep(1.3))  # a build that takes a moment
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _build._build().loaded
    text = err.getvalue()
    assert text.count("compiling the CPU Adam extension") >= 1 and "lock" not in text and not caught
    if terminal:  # the status line is redrawn with the elapsed time
        assert "00:01" in text
    else:
        assert text.count("compiling the CPU Adam extension") == 1 and "\r" not in text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
