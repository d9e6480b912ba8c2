"""The chunked causal-LM loss gives transformers' ForCausalLMLoss value and logit gradients (to bf16 rounding)."""

from __future__ import annotations

import collections
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_superoffload import SuperOffloadOptimizer, causal_lm_loss
from hf_superoffload.causal_lm_loss import chunked_causal_lm_loss, install_chunked_loss
from hf_superoffload.testing import tiny_llama


def _pair(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, seq, vocab, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < 0.2] = -100  # padding / prompt tokens
    return logits, labels


def _run(fn: object, logits: torch.Tensor, labels: torch.Tensor, vocab: int, **kw: object) -> tuple[torch.Tensor, ...]:
    x = logits.clone().requires_grad_(True)
    loss = fn(x, labels, vocab, **kw)  # type: ignore[operator]
    (2.5 * loss).backward()  # an upstream scale, as accumulation's 1/k is
    return loss.detach(), x.grad


@pytest.mark.parametrize("chunk", [1, 7, 2048])
@pytest.mark.parametrize("batch,seq,vocab", [(1, 5, 3), (2, 33, 101), (3, 17, 1000)])
@pytest.mark.parametrize("items", [None, 23])
def test_value_and_gradient_match_transformers(monkeypatch: pytest.MonkeyPatch, chunk: int, batch: int, seq: int,
                                               vocab: int, items: int | None) -> None:
    monkeypatch.setattr(causal_lm_loss, "CHUNK_TOKENS", chunk)
    logits, labels = _pair(batch, seq, vocab, seed=batch * seq + vocab)
    kw = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    want_loss, want_grad = _run(ForCausalLMLoss, logits, labels, vocab, **kw)
    loss, grad = _run(chunked_causal_lm_loss, logits, labels, vocab, **kw)
    assert grad.dtype == want_grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)  # fp32 sums in another order
    # both round an fp32 gradient to bf16 once: at most one bf16 ulp apart (2**-8 relative), most identical
    diff = (grad.float() - want_grad.float()).abs()
    ulp = want_grad.float().abs().clamp_min(2.0**-133) * 2.0**-7
    assert bool((diff <= ulp).all()), float((diff / ulp).max())
    assert (diff == 0).float().mean() > 0.95


def test_shift_labels_and_all_ignored_match() -> None:
    logits, labels = _pair(2, 9, 11, seed=3)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    a, _ = _run(chunked_causal_lm_loss, logits, None, 11, shift_labels=shifted)  # type: ignore[arg-type]
    b, _ = _run(ForCausalLMLoss, logits, labels, 11)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    none = torch.full_like(labels, -100)
    assert chunked_causal_lm_loss(logits.float(), none, 11).isnan() and ForCausalLMLoss(logits, none, 11).isnan()


def test_fp32_logits_are_left_as_they_were_by_backward() -> None:
    logits, labels = _pair(2, 9, 11, seed=4)
    x = logits.float().requires_grad_(True)
    chunked_causal_lm_loss(x, labels, 11).backward()
    assert torch.equal(x.detach(), logits.float())  # the model's output: backward only reads it
    _, want = _run(ForCausalLMLoss, logits.float(), labels, 11)
    torch.testing.assert_close(x.grad, want / 2.5, rtol=1e-5, atol=1e-7)


def test_installed_only_where_the_default_loss_is() -> None:
    model = tiny_llama(seed=0)
    assert install_chunked_loss(model) == 1 and model.loss_function is chunked_causal_lm_loss
    assert install_chunked_loss(model) == 0  # already set: left alone
    custom = tiny_llama(seed=0)

    def mine(*a: object, **k: object) -> torch.Tensor:
        raise AssertionError

    custom.loss_function = mine
    assert install_chunked_loss(custom) == 0 and custom.loss_function is mine
    assert install_chunked_loss(torch.nn.Linear(2, 2)) == 0


def test_close_gives_the_model_its_own_loss_back() -> None:
    model = tiny_llama(seed=0)
    opt = SuperOffloadOptimizer(model, lr=1e-3, log_plan=False)
    assert model.loss_function is chunked_causal_lm_loss
    opt.close()
    assert model.loss_function is ForCausalLMLoss and "_loss_function" not in vars(model)  # exactly as it was
    model.loss_function = chunked_causal_lm_loss  # the user's own choice after close
    opt.close()  # a second close changes nothing
    assert model.loss_function is chunked_causal_lm_loss

    def mine(*a: object, **k: object) -> torch.Tensor:
        raise AssertionError

    other = tiny_llama(seed=0)
    opt = SuperOffloadOptimizer(other, lr=1e-3, log_plan=False)
    other.loss_function = mine  # set by the user while the optimizer runs: close leaves it
    opt.close()
    assert other.loss_function is mine


def test_model_loss_and_gradients_with_the_chunked_loss_match_transformers() -> None:
    ref, ours = tiny_llama(seed=0), tiny_llama(seed=0)
    install_chunked_loss(ours)
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    a, b = ref(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.logits, b.logits)  # the output the user sees is unchanged
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=2**-7, atol=1e-6, msg=name)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that tensors made under this mode keep alive, and their peak: what the caching
    allocator would count, less what a native op allocates and frees inside itself."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.old = {t.untyped_storage().data_ptr() for t in existing}  # views of these allocate nothing
        self.refs: collections.Counter[int] = collections.Counter()
        self.size: dict[int, int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or (key := t.untyped_storage().data_ptr()) in self.old:
                continue
            if self.refs[key] == 0:
                self.size[key] = t.untyped_storage().nbytes()
                self.live += self.size[key]
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.size.pop(key)


def test_the_memory_model_prices_the_loss_backward_as_it_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: chunked causal-LM loss]: the backward holds the saved bf16 logits, their bf16 gradient and one fp32
    chunk, which is what ``memory_model.estimate`` counts for the loss at sequences of two chunks or more."""
    from hf_superoffload.planning import memory_model

    chunk, batch, seq, vocab = 128, 2, 512, 4096
    monkeypatch.setattr(causal_lm_loss, "CHUNK_TOKENS", chunk)
    monkeypatch.setattr(memory_model, "CHUNK_TOKENS", chunk)
    logits, labels = _pair(batch, seq, vocab, seed=0)
    x = logits.requires_grad_(True)
    forward = _LiveBytes([x, labels])
    with forward:
        loss = chunked_causal_lm_loss(x, labels, vocab)
    backward = _LiveBytes([x, labels, loss])
    with backward:
        loss.backward()
    tokens = batch * seq
    saved = 2 * tokens * vocab  # the bf16 logits, alive through both
    held = saved + backward.peak
    assert held == pytest.approx(2 * saved + 4 * chunk * vocab, rel=0.01)  # their gradient and one fp32 chunk
    assert saved + forward.peak < held  # logsumexp's own temporary is no op here; the forward stays below
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=vocab)
    est = memory_model.estimate(shape, batch_size=batch, seq_len=seq, grad_ckpt=True, chunked_loss=True)
    assert est.gpu_phases["loss"]["logits"] == pytest.approx(held, rel=0.01)
