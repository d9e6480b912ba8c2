"""Causal-LM loss under sequence parallelism: token-count reduction over the group, chunked LM head.

[Note: loss reduction] Rank r holds the tokens of chunk r. Its loss is ``sum of its token losses / N``, where
``N`` is the number of label tokens of the whole SP group (one all-reduce of two numbers). The per-rank losses
then *sum* to the full-sequence mean, and because the all-to-all's backward routes every gradient back to the
rank that produced the input, the parameter gradients of the SP ranks *sum* to the gradient of the
full-sequence mean loss. The optimizer's reduction (SUM over all ranks, divided by the data-parallel size)
therefore yields the mean over sequence groups of full-sequence gradients. ``global_loss`` (the same mean,
all-reduced and detached) is what to log.

[Note: chunked loss] ``[tokens, vocab]`` fp32 logits do not fit at long context (128k tokens x 128,256 vocab x
4 B = 65 GB). :func:`chunked_cross_entropy` runs the LM head and the cross-entropy ``chunk_size`` tokens at a
time and computes the gradients of the hidden states and of the LM-head weight in the same pass (the
softmax of a chunk is its logit gradient), so only one chunk of logits is alive at a time and nothing is
recomputed in backward. It keeps ``grad_hidden`` (the size of ``hidden``) and an fp32 ``grad_weight``
(``vocab x hidden x 4 B``, 2.1 GB for Llama-3 8B) until backward, which scales them by the incoming gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..causal_lm_loss import CHUNK_TOKENS, cross_entropy_chunk
from .batch import IGNORE_INDEX
from .groups import SequenceParallelGroups

__all__ = ["SequenceParallelLoss", "causal_lm_loss", "chunked_cross_entropy", "sequence_parallel_loss"]

DEFAULT_CHUNK = CHUNK_TOKENS  # the name benchmarks/multi_gpu.py imports


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                ignore_index: int) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            logits = (h @ weight.t()).float()  # [c, V], the model's matmul dtype, CE in fp32 (as HF)
            loss_sum, _, g = cross_entropy_chunk(logits, labels[start:start + chunk_size], ignore_index,
                                                 grad_scale=1.0 if need_h or need_w else None)
            total += loss_sum
            if g is not None:
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[start:start + chunk_size] = g @ weight
                if need_w:
                    grad_w += (g.t() @ h).float()
            del logits, g
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (need_h, need_w)
        ctx.w_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        gh = gw = None
        if need_h:
            grad_h = saved.pop(0)
            gh = grad_h * grad_out.to(grad_h.dtype)
        if need_w:
            gw = (saved.pop(0) * grad_out).to(ctx.w_dtype)
        return gh, gw, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          chunk_size: int = CHUNK_TOKENS, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``sum`` over tokens of ``cross_entropy(hidden @ weight.T, labels)`` in fp32, ``chunk_size`` tokens at a
    time (see [Note: chunked loss]). ``hidden [..., d]``, ``weight [V, d]``, ``labels [...]``; ignored labels
    contribute 0. Gradients flow to ``hidden`` and ``weight``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} is invalid: use a positive number of tokens such as 2048")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(device=h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"chunked_cross_entropy: {h.shape[0]} hidden states but {y.shape[0]} labels")
    out = _ChunkedLinearCrossEntropy.apply(h, weight, y, int(chunk_size), int(ignore_index))
    return out


class SequenceParallelLoss(NamedTuple):
    """What :func:`sequence_parallel_loss` returns."""

    loss: torch.Tensor
    """This rank's share: local token-loss sum / the SP group's label-token count. Call ``backward`` on it."""
    global_loss: torch.Tensor
    """The full-sequence mean loss of the SP group (all-reduced, detached): the value to log."""
    num_tokens: torch.Tensor
    """Label tokens in the SP group (float scalar)."""


def sequence_parallel_loss(hidden_or_logits: torch.Tensor, shift_labels: torch.Tensor,
                           groups: SequenceParallelGroups | None, *, lm_head_weight: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_TOKENS, ignore_index: int = IGNORE_INDEX) -> SequenceParallelLoss:
    """Causal-LM loss of this rank's chunk, normalised by the SP group's label-token count.

    ``hidden_or_logits``: final hidden states ``[B, s, d]`` when ``lm_head_weight`` is given (chunked LM head +
    cross-entropy, never ``[s, vocab]`` logits at once), else logits ``[B, s, V]``. ``shift_labels`` are the
    already-shifted labels of :func:`~hf_superoffload.sequence_parallel.batch.shard_batch`. With
    ``groups=None`` (or P=1) this is the plain mean loss. See [Note: loss reduction].
    """
    if lm_head_weight is not None:
        local_sum = chunked_cross_entropy(hidden_or_logits, lm_head_weight, shift_labels, chunk_size=chunk_size,
                                          ignore_index=ignore_index)
    else:
        logits = hidden_or_logits.reshape(-1, hidden_or_logits.shape[-1]).float()
        local_sum = torch.nn.functional.cross_entropy(logits, shift_labels.reshape(-1).to(logits.device),
                                                      ignore_index=ignore_index, reduction="sum")
    count = (shift_labels != ignore_index).sum().to(device=local_sum.device, dtype=torch.float32)
    stats = torch.stack([local_sum.detach().float(), count])
    if groups is not None and groups.sp_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=groups.sp_group)
    n = stats[1].clamp(min=1.0)
    return SequenceParallelLoss(loss=local_sum / n, global_loss=stats[0] / n, num_tokens=stats[1])


def causal_lm_loss(model: torch.nn.Module, shard: dict[str, Any], groups: SequenceParallelGroups | None, *,
                   chunk_size: int = CHUNK_TOKENS) -> SequenceParallelLoss:
    """Run a transformers ``*ForCausalLM`` on a :func:`shard_batch` shard and return its SP loss.

    The decoder runs without computing logits (``model.get_decoder()``), then :func:`sequence_parallel_loss`
    applies the LM head chunk by chunk. Models whose head is more than a bias-free linear layer (logit
    soft-capping, logit scaling) are refused.
    """
    config = model.config
    for attr, neutral in (("final_logit_softcapping", None), ("logit_scale", None), ("logits_scaling", 1.0)):
        val = getattr(config, attr, neutral)
        if val is not None and val != neutral:
            raise ValueError(f"causal_lm_loss: config.{attr}={val} changes the logits after the LM head; the "
                             "chunked sequence-parallel loss only supports a plain linear head")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError("causal_lm_loss: the model's output embedding must be a bias-free nn.Linear")
    if "shift_labels" not in shard:
        raise ValueError("causal_lm_loss: the shard has no shift_labels (give labels to shard_batch)")
    decoder = model.get_decoder()
    out = decoder(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False)
    from ..runtime.engine import module_weights  # weight flow streams the head in through its module hooks

    with module_weights(head):
        return sequence_parallel_loss(out.last_hidden_state, shard["shift_labels"], groups,
                                      lm_head_weight=head.weight, chunk_size=chunk_size)
