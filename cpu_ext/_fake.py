"""Fake (meta) kernels of the CPU Adam ops, for FakeTensor tracing and ``torch.library.opcheck``."""

from __future__ import annotations

import torch

__all__ = ["register_fakes"]

_REGISTERED = False


def _check_state(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    for t in (param, exp_avg, exp_avg_sq):
        torch._check(t.dtype == torch.float32, lambda: "param, exp_avg and exp_avg_sq must be float32")
        torch._check(t.numel() == param.numel(), lambda: "state tensors must match param's numel")
    torch._check(grad.dtype in (torch.float32, torch.bfloat16), lambda: "grad must be float32 or bfloat16")
    torch._check(grad.numel() == param.numel(), lambda: "grad must match param's numel")


def register_fakes() -> None:
    """Register the fake kernels once (after the op library is loaded)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True

    @torch.library.register_fake("hf_superoffload::cpu_adamw_step")
    def _step_fake(
        param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
        step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float,
        param_bf16_out: torch.Tensor | None, src_param: torch.Tensor | None,
        src_exp_avg: torch.Tensor | None, src_exp_avg_sq: torch.Tensor | None, num_threads: int,
        store_moments: bool = True, store_master: bool = True,
    ) -> None:
        _check_state(param, grad, exp_avg, exp_avg_sq)
        torch._check_value(store_master or not store_moments,
                           lambda: "store_master=False requires store_moments=False")
        torch._check_value(store_master or param_bf16_out is not None,
                           lambda: "store_master=False requires param_bf16_out")
        sources = (src_param, src_exp_avg, src_exp_avg_sq)
        given = [t for t in sources if t is not None]
        torch._check(len(given) in (0, 3), lambda: "give all three source tensors or none")
        for t in given:
            torch._check(t.dtype == torch.float32, lambda: "source tensors must be float32")
            torch._check(t.numel() == param.numel(), lambda: "source tensors must match param's numel")

    @torch.library.register_fake("hf_superoffload::cpu_adamw_moments")
    def _moments_fake(
        grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, beta1: float, beta2: float,
        grad_scale: float, src_exp_avg: torch.Tensor | None, src_exp_avg_sq: torch.Tensor | None, num_threads: int,
    ) -> None:
        _check_state(exp_avg, grad, exp_avg, exp_avg_sq)
        given = [t for t in (src_exp_avg, src_exp_avg_sq) if t is not None]
        torch._check(len(given) in (0, 2), lambda: "give both source tensors or none")
        for t in given:
            torch._check(t.dtype == torch.float32, lambda: "source tensors must be float32")
            torch._check(t.numel() == exp_avg.numel(), lambda: "source tensors must match exp_avg's numel")

    @torch.library.register_fake("hf_superoffload::cpu_adamw_undo")
    def _undo_fake(
        param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
        step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float,
        param_bf16_out: torch.Tensor | None, num_threads: int,
    ) -> None:
        _check_state(param, grad, exp_avg, exp_avg_sq)

    @torch.library.register_fake("hf_superoffload::grad_sumsq_nonfinite")
    def _sumsq_fake(grad: torch.Tensor, num_threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        return grad.new_empty((), dtype=torch.float64), grad.new_empty((), dtype=torch.int64)

    @torch.library.register_fake("hf_superoffload::_cpu_bench_inplace3")
    def _bench_fake(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, num_threads: int) -> None:
        return None
