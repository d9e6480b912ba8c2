"""The README's Python snippets run as written (here on the CPU: the same code takes the GPU when there is one)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_superoffload.testing import TokenDataset, tiny_llama

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet(after_heading: str) -> str:
    text = README.read_text()
    start = text.index(after_heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)  # type: ignore[union-attr]


def test_the_optimizer_snippet(tmp_path: Path) -> None:
    code = _snippet("## Use it")
    tiny_llama(seed=0).save_pretrained(tmp_path / "model")
    data = TokenDataset(n=6, seq=16)
    loader = [{"input_ids": data.ids[k : k + 2], "labels": data.ids[k : k + 2]} for k in (0, 2, 4)]
    ns: dict[str, Any] = {"name": str(tmp_path / "model"), "loader": loader}
    exec(compile(code, "README.md", "exec"), ns)
    opt = ns["opt"]
    assert opt.engine.stats.verdict in ("commit", "redo") and ns["scheduler"].last_epoch == 3
    opt.close()


def test_the_trainer_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _snippet("### With the Trainer")
    monkeypatch.chdir(tmp_path)  # output_dir="out" lands here
    model = tiny_llama(seed=0)
    before = next(model.parameters()).detach().clone()
    ns: dict[str, Any] = {"model": model, "ds": TokenDataset(n=16, seq=16), "collator": None}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["trainer"].state.global_step > 0
    assert not torch.equal(before, next(model.parameters()).detach())
    ns["trainer"].superoffload_optimizer.close()


def test_the_requirements_line_names_pyproject_version_ranges() -> None:
    """Every version range of pyproject's dependencies (and of the trl extra) is the one the README states."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    text = README.read_text()
    requirements = text[text.index("Requirements (`pyproject.toml`)"):text.index("Run the tests")]
    specs = [d.split(";")[0].strip() for d in (*project["dependencies"], *project["optional-dependencies"]["trl"])]
    ranged = [s for s in specs if any(op in s for op in "<>=")]
    assert ranged and all(f"`{s}`" in requirements for s in ranged), [s for s in ranged if f"`{s}`" not in requirements]
    assert f"Python {project['requires-python']}".replace(">=", ">= ") in requirements


def test_the_trl_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    from hf_superoffload.demo.local_data import build_tokenizer, format_example, instruction_texts
    from hf_superoffload.demo.presets import llama_config

    code = _snippet("### With TRL")
    monkeypatch.chdir(tmp_path)  # output_dir="out" lands here
    texts = [format_example(r) for r in instruction_texts(16)]  # TRL's defaults: 3 epochs of 2 batches
    tok = build_tokenizer(texts, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config("tiny", vocab_size=len(tok), max_position_embeddings=1024))
    model.to(torch.bfloat16)
    before = next(model.parameters()).detach().clone()
    ns: dict[str, Any] = {"model": model, "ds": Dataset.from_dict({"text": texts}), "tok": tok}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["trainer"].state.global_step == 6
    assert not torch.equal(before, next(model.parameters()).detach())
    ns["trainer"].superoffload_optimizer.close()
