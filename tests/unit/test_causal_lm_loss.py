"""The chunked causal-LM loss gives transformers' ForCausalLMLoss value and logit gradients (to bf16 rounding)."""

from __future__ import annotations

import pytest
import torch
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
