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


def test_a_cached_library_is_loaded_whatever_path_its_sources_sit_at(no_fakes: None, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Another copy of the same sources has the same name: it loads the cached library, it does not run ninja
    (which rebuilt it, as ninja's build file names the sources by path)."""
    import shutil

    from torch.utils import cpp_extension

    if not _build.load_library():
        pytest.skip("the CPU Adam extension cannot be built here")
    name = _build._extension_name()
    monkeypatch.setattr(_build, "CSRC", shutil.copytree(_build.CSRC, tmp_path / "csrc"))
    assert _build._extension_name() == name

    def build(**kw: Any) -> None:
        raise AssertionError(f"built {kw['name']} again")

    monkeypatch.setattr(cpp_extension, "load", build)
    assert _build._build().loaded


def test_a_cached_library_that_does_not_load_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             no_fakes: None, caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_extension_name", lambda: "hf_superoffload_cpu_adam_probe")
    (tmp_path / "hf_superoffload_cpu_adam_probe").mkdir()
    (tmp_path / "hf_superoffload_cpu_adam_probe" / "hf_superoffload_cpu_adam_probe.so").write_bytes(b"\x7fELF")
    built: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw["name"]))
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.WARNING):
        assert _build._build().loaded
    assert built == ["hf_superoffload_cpu_adam_probe"]
    assert "does not load" in caplog.text
