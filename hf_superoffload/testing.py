"""Test and benchmark helpers: tiny models and the plain reference optimizer we are judged against.

The reference recipe is what SuperOffloadOptimizer promises to equal up to fp32 rounding: bf16 weights for
compute, fp32 master copies, ``torch.nn.utils.clip_grad_norm_`` on the fp32 gradients, ``torch.optim.AdamW``
on the masters, and bf16 weights copied back from the masters after every step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ReferenceAdamW", "TokenDataset", "tiny_llama", "tiny_llama_config"]


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               **overrides: Any) -> torch.nn.Module:
    """A randomly initialised few-layer Llama (no download). Same ``seed`` gives the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides))
    return model.to(device=device, dtype=dtype)


class ReferenceAdamW:
    """Plain mixed-precision AdamW: fp32 masters, ``clip_grad_norm_``, ``torch.optim.AdamW``.

    ``param_groups`` are given like torch's (dicts with ``params`` holding *model* parameters and options).
    """

    def __init__(self, model: torch.nn.Module, param_groups: Iterable[dict[str, Any]] | None = None, *,
                 max_grad_norm: float | None = None, **defaults: Any) -> None:
        if param_groups is None:
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        groups = []
        seen: set[int] = set()
        for g in param_groups:
            masters = []
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                m = p.detach().float().clone().requires_grad_(True)
                self.pairs.append((p, m))
                masters.append(m)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
        self.opt = torch.optim.AdamW(groups, foreach=False, **defaults)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = float("nan")
        self.skipped_steps = 0

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The fp32 gradient ``step()`` uses for model parameter ``p`` (subclasses change where it comes from)."""
        return None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def step(self) -> None:
        grads = []
        for p, m in self.pairs:
            m.grad = self.grad_of(p)
            if m.grad is not None:
                grads.append(m.grad)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else \
            torch.tensor(0.0)
        self.last_grad_norm = float(norm)
        if not torch.isfinite(norm):
            self.skipped_steps += 1
        else:
            if self.max_grad_norm:
                torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs if m.grad is not None], self.max_grad_norm)
            self.opt.step()
            for p, m in self.pairs:
                p.copy_(m)
        for _, m in self.pairs:
            m.grad = None

    def zero_grad(self) -> None:
        for p, _ in self.pairs:
            p.grad = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token blocks (``input_ids`` == ``labels``) for :func:`tiny_llama`'s vocabulary,
    deterministic for ``seed``: what the Trainer tests train on."""

    def __init__(self, n: int = 32, seq: int = 16, seed: int = 1, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
