"""The causal-LM loss over the model's logits in chunks: HF's value, a third of its memory.

[Note: chunked causal-LM loss]
transformers' ``ForCausalLMLoss`` upcasts all ``[tokens, vocab]`` logits to fp32 and runs ``cross_entropy``,
which saves an fp32 ``log_softmax`` for backward; backward then holds that, the fp32 gradient of it and the fp32
gradient of the logits. That is 12 B per logit element at its peak: 13.9 GiB for 4 x 2048 tokens of a
152,064-token vocabulary, as much device memory as 1B parameters of GPU-resident optimizer state.

:func:`chunked_causal_lm_loss` takes the same arguments and returns the same loss. Its forward keeps the model's
bf16 logits (alive anyway: the LM head made them) and one fp32 log-sum-exp per token; its backward writes the
bf16 logit gradient chunk by chunk (softmax minus the one-hot target, scaled), holding one fp32 chunk at a time:
4 B per logit element plus one fp32 chunk (its forward: the 2 B bf16 logits, an fp32 chunk and logsumexp's fp32
temporary of it; ``memory_model.estimate`` takes the larger). HF's path also ends in a bf16 logit gradient (the
upcast's backward casts it down), so the gradients agree to bf16 rounding; the loss value differs from HF's only in
the fp32 order of its sum.

``SuperOffloadOptimizer`` installs it (``SuperOffloadConfig.chunked_loss``, on by default) on every
transformers model in the optimized module whose loss is HF's default ``ForCausalLMLoss`` and that has no loss of
its own set: the memory model plans with it, and a 15B accumulation run fits one H200 only with it. The model's
``logits`` output is unchanged. ``close()`` gives those models HF's default loss back
(:func:`uninstall_chunked_loss`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHUNK_TOKENS", "chunked_causal_lm_loss", "install_chunked_loss", "loss_inside_the_model",
           "uninstall_chunked_loss", "uses_default_causal_lm_loss"]

CHUNK_TOKENS = 2048
"""Tokens per chunk of every chunked cross-entropy: this loss over logits, and the sequence-parallel loss over
hidden states and the LM head (``sequence_parallel.chunked_cross_entropy``). NOTE: one fp32 chunk of logits is
2048 x 152,064 x 4 B = 1.2 GB (Qwen2.5's vocabulary; 1.05 GB for Llama-3's 128,256), the largest transient of
either loss."""


def cross_entropy_chunk(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, *,
                        lse: torch.Tensor | None = None, grad_scale: torch.Tensor | float | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of a chunked cross-entropy, in fp32: ``(loss_sum, lse, grad)``.

    ``loss_sum`` is the sum over the chunk's valid tokens (``target != ignore_index``) of
    ``logsumexp(logits) - logits[target]``; ``lse [c]`` the per-token log-sum-exp (computed unless given, as a
    backward that saved it does); ``grad [c, V]``, with ``grad_scale``, the chunk's logit gradient
    ``(softmax(logits) - onehot(target)) * grad_scale`` with ignored rows 0, else ``None``.

    ``logits [c, V]`` must be fp32 and is overwritten by ``grad`` (one fp32 chunk alive, not two). Both chunked
    losses use it: :class:`_ChunkedLogitsCrossEntropy` over the model's logits and the sequence-parallel
    ``_ChunkedLinearCrossEntropy`` over hidden states and the LM head.
    """
    valid = target != ignore_index
    tgt = torch.where(valid, target, 0)
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, tgt[:, None]).squeeze(1)
    loss_sum = torch.where(valid, lse - picked, 0.0).sum()
    if grad_scale is None:
        return loss_sum, lse, None
    grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
    grad[torch.arange(grad.shape[0], device=grad.device), tgt] -= 1.0
    grad.mul_((valid.to(grad.dtype) * grad_scale)[:, None])
    return loss_sum, lse, grad


class _ChunkedLogitsCrossEntropy(torch.autograd.Function):
    """Sum over valid tokens of ``logsumexp(logits) - logits[target]``, in fp32, from ``[N, V]`` logits. Forward
    keeps the log-sum-exp; backward recomputes each chunk's softmax from it ([Note: chunked causal-LM loss])."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, chunk: int) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            rows = slice(start, start + chunk)
            loss_sum, chunk_lse, _ = cross_entropy_chunk(logits[rows].float(), target[rows], ignore_index)
            lse[rows] = chunk_lse
            total += loss_sum
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index, ctx.chunk = ignore_index, chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, target, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            # a copy even from fp32 logits: the chunk is overwritten by its gradient, the logits are the model's
            x = logits[rows].to(torch.float32, copy=True)
            grad[rows] = cross_entropy_chunk(x, target[rows], ctx.ignore_index, lse=lse[rows], grad_scale=grad_out)[2]
            del x
        return grad, None, None, None


def chunked_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                           num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                           shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (same arguments, same value) with a third of its memory
    ([Note: chunked causal-LM loss]): mean over the label tokens, or their sum over ``num_items_in_batch``."""
    if shift_labels is None:
        assert labels is not None, "chunked_causal_lm_loss needs labels or shift_labels"
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    flat = logits.reshape(-1, vocab_size)
    target = shift_labels.reshape(-1).to(flat.device)
    total = _ChunkedLogitsCrossEntropy.apply(flat, target, ignore_index, CHUNK_TOKENS)
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _default_loss_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformers causal-LM models inside ``model`` whose loss is HF's default ``ForCausalLMLoss`` and that
    set no loss of their own."""
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # a transformers without the loss registry: nothing to replace
        return []
    # the name first: reading ``loss_function`` of a model without a causal-LM loss logs a warning
    return [m for m in model.modules()
            if isinstance(m, PreTrainedModel) and type(m).__name__.endswith("ForCausalLM")
            and getattr(m, "_loss_function", None) is None and m.loss_function is ForCausalLMLoss]


def loss_inside_the_model(forward_kwargs: dict[str, Any]) -> bool:
    """Whether a causal-LM forward called with ``forward_kwargs`` computes its loss itself: HF's models do when
    given ``labels``. Without them the caller computes it from the logits (a label smoother, the loop's own), so the
    chunked loss never runs and the fp32 logits may be read."""
    return forward_kwargs.get("labels") is not None


def uses_default_causal_lm_loss(model: torch.nn.Module) -> bool:
    """Whether :func:`install_chunked_loss` would change ``model``."""
    return bool(_default_loss_models(model))


def install_chunked_loss(model: torch.nn.Module) -> int:
    """Give every transformers causal-LM model inside ``model`` whose loss is HF's default ``ForCausalLMLoss`` (and
    that has no loss of its own set) :func:`chunked_causal_lm_loss`. Returns how many it changed."""
    found = _default_loss_models(model)
    for m in found:
        m.loss_function = chunked_causal_lm_loss
    return len(found)


def uninstall_chunked_loss(model: torch.nn.Module) -> int:
    """Undo :func:`install_chunked_loss`: every model inside ``model`` whose own loss is
    :func:`chunked_causal_lm_loss` goes back to HF's default (the instance attribute that transformers'
    ``loss_function`` setter made is removed, as it was absent before). A loss set since is left alone. Returns how
    many it changed."""
    found = [m for m in model.modules() if vars(m).get("_loss_function") is chunked_causal_lm_loss]
    for m in found:
        del m._loss_function
    return len(found)
