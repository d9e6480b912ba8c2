"""``hf-superoffload train`` end to end, offline: a model folder given with ``--model`` is fine-tuned and saved
(``from_pretrained`` gives back the trained weights bit for bit), with eval loss and generations before and after,
a loss curve and a metrics file; without ``--model`` and without the Hub, it says so in one line and trains the
bundled tiny model on the local data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_superoffload.cli import main
from hf_superoffload.demo import train_job

SMALL = ["--device", "cpu", "--seq-len", "32", "--batch-size", "4", "--log-every", "10", "--new-tokens", "6"]


def _model_folder(path: Path) -> Path:
    from transformers import LlamaForCausalLM

    from hf_superoffload.demo.local_data import build_tokenizer, format_example, instruction_texts
    from hf_superoffload.demo.presets import llama_config

    tok = build_tokenizer([format_example(r) for r in instruction_texts(300)], vocab_size=320)
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}" \
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config("tiny", vocab_size=len(tok), max_position_embeddings=64))
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_model_folder_is_fine_tuned_and_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from transformers import AutoModelForCausalLM

    folder, out = _model_folder(tmp_path / "model"), tmp_path / "out"
    seen: dict[str, Any] = {}
    resolve = train_job.resolve_model

    def keep(spec: str, device: torch.device) -> Any:
        seen["model"], tok = resolve(spec, device)
        return seen["model"], tok

    monkeypatch.setattr(train_job, "resolve_model", keep)
    from hf_superoffload.integrations import _common

    monkeypatch.setattr(_common, "MODEL_SHARD_SIZE", "120KB")  # [Note: bounded model shards], made small
    from hf_superoffload.integrations import _streamed_save

    streamed: set[str] = set()
    real_write = _streamed_save.save_file_streamed
    monkeypatch.setattr(_streamed_save, "save_file_streamed",
                        lambda t, f, metadata=None: (streamed.add(Path(f).name), real_write(t, f, metadata)))
    assert main(["train", "--model", str(folder), "--steps", "30", "--examples", "300", "--lr", "2e-3",
                 "--output-dir", str(out), *SMALL]) == 0
    stdout = capsys.readouterr().out
    assert "eval loss before: " in stdout and "sample (before)" in stdout and "sample (after)" in stdout

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    initial = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    trained = dict(seen["model"].named_parameters())
    for name, p in saved.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, trained[name].detach()), name
    assert not torch.equal(saved.lm_head.weight, initial.lm_head.weight)  # it did train
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    assert max(f.stat().st_size for f in shards) <= 120_000 + 8_192  # the bound, plus each file's header
    assert {f.name for f in shards} <= streamed, "a shard was not written a piece at a time"

    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 30 and len(m["losses"]) == 30 and m["model"] == str(folder) and m["device"] == "cpu"
    assert m["eval_loss_after"] < m["eval_loss_before"]
    assert "local synthetic instruction data" in m["data"] and m["plan"] and m["tokens_per_s"] > 0
    assert [s["prompt"] for s in m["samples_after"]] == train_job.PROMPTS and len(m["samples_before"]) == 2
    pytest.importorskip("matplotlib")
    assert (out / "loss_curve.png").stat().st_size > 0


def test_offline_without_model_falls_back_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: Any) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    assert main(["train", "--steps", "3", "--examples", "100", "--output-dir", str(out), *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == train_job.FALLBACK_LINE and sum("hub not reachable" in ln for ln in lines) == 1
    m = json.loads((out / "metrics.json").read_text())
    assert m["model"] == "preset 'tiny' (random init)" and not m["pretrained"] and len(m["losses"]) == 3


def test_an_explicit_dataset_that_cannot_load_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: Any) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _model_folder(tmp_path / "model")
    code = main(["train", "--model", str(folder), "--dataset", "no-such-org/no-such-data", "--steps", "1",
                 "--output-dir", str(tmp_path / "out"), *SMALL])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "hf-superoffload train: error: argument --dataset: cannot load 'no-such-org/no-such-data': ")


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {"instruction": "Hi", "input": "", "output": "Hello"},
    {"instruction": "Hi", "response": "Hello"},
])
def test_rows_of_each_dataset_layout_become_one_text(row: dict[str, Any]) -> None:
    assert train_job.format_row(None, row) == "### Instruction:\nHi\n### Response:\nHello\n"


def test_no_network_without_the_offline_switch_falls_back_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_route(*a: Any, **k: Any) -> Any:
        raise OSError("Name or service not known")

    def must_not_download(*a: Any, **k: Any) -> Any:
        raise AssertionError("tried the Hub although it is not reachable")

    monkeypatch.setattr(socket, "create_connection", no_route)
    monkeypatch.setattr(train_job, "_load_pretrained", must_not_download)
    assert train_job.hub_unreachable()
    assert train_job.resolve_model("auto", torch.device("cpu")) is None
    rows, source = train_job.load_rows("auto", 3, seed=0)
    assert len(rows) == 3 and source.startswith("local")


def test_without_matplotlib_the_curve_is_skipped_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the base install has no matplotlib
    line = train_job._plot([3.0, 2.0], tmp_path / "loss_curve.png")
    assert line.startswith("matplotlib not installed: no loss-curve PNG") and not (tmp_path / "loss_curve.png").exists()
