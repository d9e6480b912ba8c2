"""``save_file_streamed`` ([Note: bounded model shards]) writes what ``safetensors.torch.save_file`` writes, a piece
of a tensor at a time: safetensors reads every tensor back bit for bit, with its metadata, across piece boundaries
of odd size; bad input is refused in one line; ``streamed_model_files`` routes the libraries' writers to it and
gives them back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_superoffload.integrations import _streamed_save as ss


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(11, generator=g),
        "big": torch.randn(3, 1001, generator=g, dtype=torch.float64),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.rand(13, generator=g) > 0.5,
        "bytes": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize("chunk", [1, 7, 4096, 64 << 20])
def test_what_it_writes_reads_back_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(ss, "CHUNK_BYTES", chunk)
    tensors = _tensors()
    ss.save_file_streamed(tensors, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    back = load_file(tmp_path / "ours.safetensors")
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    ours, theirs = (tmp_path / "ours.safetensors").stat().st_size, (tmp_path / "theirs.safetensors").stat().st_size
    assert abs(ours - theirs) < 64  # the same tensor bytes; only the header's spelling may differ


def test_bad_input_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot write w: it is not contiguous \(call \.contiguous\(\)"):
        ss.save_file_streamed({"w": torch.randn(4, 6).t()}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=r"cannot write c: dtype torch.complex64 has no safetensors name here"):
        ss.save_file_streamed({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x.safetensors")


def test_the_libraries_writers_are_routed_while_it_lasts_and_given_back(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate.utils.other as accelerate_other
    import safetensors.torch
    import transformers.modeling_utils as modeling_utils

    seen: list[str] = []
    real = ss.save_file_streamed
    monkeypatch.setattr(ss, "save_file_streamed", lambda t, f, metadata=None: (seen.append(str(f)), real(t, f, metadata)))
    writers = [(safetensors.torch, "save_file"), (modeling_utils, "safe_save_file"),
               (accelerate_other, "safe_save_file")]
    before = [getattr(m, a) for m, a in writers]
    with ss.streamed_model_files():
        for k, (m, a) in enumerate(writers):
            getattr(m, a)({"w": torch.ones(3)}, tmp_path / f"{k}.safetensors", metadata={"format": "pt"})
    assert seen == [str(tmp_path / f"{k}.safetensors") for k in range(3)]
    assert [getattr(m, a) for m, a in writers] == before
    assert all(torch.equal(load_file(tmp_path / f"{k}.safetensors")["w"], torch.ones(3)) for k in range(3))
