"""Worker for tests/distributed/test_ulysses.py: one process per rank (gloo, CPU), launched with
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. Runs the named cases and writes ``<out>/rank<r>.json``:
per case, numbers (differences against a single-process reference computed in the same process) or the
error message that was raised."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hf_superoffload import sequence_parallel as sp
from hf_superoffload.testing import tiny_llama

VOCAB = 128


def _batch(seed: int, b: int, s: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _reference(batch: dict[str, torch.Tensor], **model_kw: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """Single process, whole sequence, HF's own loss (it shifts labels itself), SDPA."""
    model = tiny_llama(seed=0, dtype=torch.float32, attn_implementation="sdpa", **model_kw)
    out = model(**batch)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _sp_grads(groups: sp.SequenceParallelGroups, batch: dict[str, torch.Tensor], *, ckpt: bool | str = False,
              chunk_size: int = 7, tile: int | None = None, **model_kw: Any) -> tuple[float, float, dict[str, torch.Tensor]]:
    model = tiny_llama(seed=0, dtype=torch.float32, attn_implementation="sdpa", **model_kw)
    sp.enable_sequence_parallel(model, groups)
    if ckpt == "keep_attention":
        sp.enable_checkpointing_keep_attention(model)
        model.train()
    elif ckpt:
        model.gradient_checkpointing_enable()
        model.train()
    if tile is not None:
        sp.enable_tiled_mlp(model, tile_tokens=tile)
    shard = sp.shard_batch(batch, groups)
    out = sp.causal_lm_loss(model, shard, groups, chunk_size=chunk_size)
    out.loss.backward()
    local = float(out.loss.detach())
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=groups.sp_group)  # what the optimizer's SUM reduction does over the SP ranks
        grads[n] = g
    return float(out.global_loss), local, grads


def _compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Largest |got - ref| over all parameters, relative to the largest |ref| of that parameter."""
    worst = 0.0
    for n, r in ref.items():
        worst = max(worst, float((got[n] - r).abs().max() / r.abs().max().clamp(min=1e-12)))
    return worst


def _parity(groups: sp.SequenceParallelGroups, batch: dict[str, torch.Tensor], *, ckpt: bool | str = False,
            tile: int | None = None, **model_kw: Any) -> dict[str, Any]:
    ref_loss, ref_grads = _reference(batch, **model_kw)
    loss, local, grads = _sp_grads(groups, batch, ckpt=ckpt, tile=tile, **model_kw)
    locals_ = [torch.zeros(()) for _ in range(groups.sp_size)]
    dist.all_gather(locals_, torch.tensor(local), group=groups.sp_group)
    return {"ref_loss": ref_loss, "sp_loss": loss, "sum_of_local_losses": float(sum(locals_)),
            "grad_rel_err": _compare(ref_grads, grads), "n_params": len(ref_grads)}


def case_gqa(groups):  # 4 heads, 2 KV heads, P=2: one KV head per rank
    return _parity(groups, _batch(1, 2, 16))


def case_kv1(groups):  # 1 KV head < P=2: replicated
    return _parity(groups, _batch(2, 2, 16), num_key_value_heads=1)


def case_uneven(groups):  # 15 tokens over 2 ranks: padded to 16
    return _parity(groups, _batch(3, 2, 15))


def case_ckpt(groups):
    return _parity(groups, _batch(4, 1, 16), ckpt=True)


class _CountAttention(TorchDispatchMode):
    """Counts the fused attention kernels (forward and backward) that run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def case_keepattn(groups):  # checkpointing that keeps attention's outputs, with the tiled MLP: parity, and
    # attention runs once forward and once backward per layer (plain checkpointing: twice forward)
    batch = _batch(7, 2, 15)
    out = {}
    for mode in (True, "keep_attention"):
        with _CountAttention() as count:
            res = _parity(groups, batch, ckpt=mode, tile=3)
        out["plain" if mode is True else "keep"] = {**res, "attention_calls": count.calls}
    return out


def case_tiled(groups):  # tiled MLP (3 tokens per tile) + checkpointing, 2 x 15 tokens: 2 x 8 per rank, padded
    return _parity(groups, _batch(6, 2, 15), ckpt=True, tile=3)


def case_padmask(groups):  # right padding: row 1 has 11 real tokens of 16
    batch = _batch(5, 2, 16)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    ref_loss, ref_grads = _reference({**batch, "attention_mask": mask})
    loss, _, grads = _sp_grads(groups, {**batch, "attention_mask": mask})
    return {"ref_loss": ref_loss, "sp_loss": loss, "grad_rel_err": _compare(ref_grads, grads)}


def case_a2a(groups):
    """all_to_all and its backward against explicit indexing of the gathered global tensor."""
    p, r = groups.sp_size, groups.sp_rank
    torch.manual_seed(100 + r)
    b, h, s, d = 2, 4, 3, 5
    x = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    y = sp.all_to_all(x, groups.sp_group, scatter_dim=1, gather_dim=2)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    xs = [torch.empty_like(x.detach()) for _ in range(p)]
    ws = [torch.empty_like(w) for _ in range(p)]
    dist.all_gather(xs, x.detach(), group=groups.sp_group)
    dist.all_gather(ws, w, group=groups.sp_group)
    full = torch.cat(xs, dim=2).requires_grad_(True)  # [B, H, S, D]: the unsharded sequence
    hp = h // p
    ref_ys = [full[:, q * hp:(q + 1) * hp] for q in range(p)]
    sum((yq * wq).sum() for yq, wq in zip(ref_ys, ws)).backward()
    ref_grad = full.grad[:, :, r * s:(r + 1) * s]
    back = sp.all_to_all(y, groups.sp_group, scatter_dim=2, gather_dim=1)
    return {"fwd_err": float((y - ref_ys[r]).detach().abs().max()),
            "grad_err": float((x.grad - ref_grad).abs().max()),
            "roundtrip_err": float((back - x).abs().max()), "shape": list(y.shape)}


def case_errors(groups):
    res = {}
    try:
        sp.init_sequence_parallel(3, device_type="cpu")
    except ValueError as e:
        res["bad_size"] = str(e)
    model = tiny_llama(seed=0, dtype=torch.float32, attn_implementation="sdpa")
    sp.enable_sequence_parallel(model, groups)
    shard = sp.shard_batch(_batch(1, 1, 8), groups)
    ids, pos = shard["input_ids"], shard["position_ids"]
    ref = model(input_ids=ids, position_ids=pos).logits
    ones = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
    res["ones_mask_equal"] = bool(torch.equal(ref, ones))
    padded = torch.ones_like(ids)
    padded[:, -1] = 0
    for key, kw in (("mask", dict(attention_mask=padded)), ("packed", dict(position_ids=pos % 3))):
        try:
            model(input_ids=ids, use_cache=False, **{"position_ids": pos, **kw})
        except ValueError as e:
            res[key] = str(e)
    return res


def case_mesh(groups):
    """dp x sp: each sequence group trains its own batch; SUM over all ranks / dp = mean of full-seq grads."""
    batches = [_batch(10 + i, 1, 12) for i in range(groups.dp_size)]
    refs = [_reference(bt) for bt in batches]
    model = tiny_llama(seed=0, dtype=torch.float32, attn_implementation="sdpa")
    sp.enable_sequence_parallel(model, groups)
    out = sp.causal_lm_loss(model, sp.shard_batch(batches[groups.dp_rank], groups), groups, chunk_size=5)
    out.loss.backward()
    worst = 0.0
    for n, prm in model.named_parameters():
        g = prm.grad.detach().clone()
        dist.all_reduce(g)  # all ranks, SUM
        g /= groups.dp_size
        ref = sum(rg[n] for _, rg in refs) / groups.dp_size
        worst = max(worst, float((g - ref).abs().max() / ref.abs().max().clamp(min=1e-12)))
    return {"grad_rel_err": worst, "sp_loss": float(out.global_loss), "ref_loss": refs[groups.dp_rank][0],
            "dp_rank": groups.dp_rank, "sp_rank": groups.sp_rank}


def case_sp4(groups):
    """All 4 ranks on one sequence (dp=1, sp=4): 2 KV heads and 1 KV head are both replicated."""
    g4 = sp.init_sequence_parallel(4, device_type="cpu")
    try:
        return {"kv2": _parity(g4, _batch(20, 1, 16)), "kv1": _parity(g4, _batch(21, 1, 14), num_key_value_heads=1)}
    finally:
        sp.set_active_groups(groups)


def case_trainer_step(groups):
    """SuperOffloadTrainer's SP training step: ranks bring ragged batches of their own; the gradients summed
    over the SP ranks equal the mean of the batches' single-process gradients (as data parallelism)."""
    import contextlib
    from types import SimpleNamespace

    from hf_superoffload.integrations._sequence_parallel import sequence_parallel_training_step

    batches = [_batch(30 + r, 2, 12 - 3 * r) for r in range(groups.sp_size)]
    refs = [_reference(b) for b in batches]
    model = tiny_llama(seed=0, dtype=torch.float32, attn_implementation="sdpa")
    sp.enable_sequence_parallel(model, groups)
    trainer = SimpleNamespace(
        _prepare_inputs=lambda x: x, current_gradient_accumulation_steps=2,
        compute_loss_context_manager=contextlib.nullcontext,
        accelerator=SimpleNamespace(backward=lambda loss: loss.backward(), unwrap_model=lambda m: m))
    loss = sequence_parallel_training_step(trainer, model, batches[groups.sp_rank], groups, chunk_size=5)
    grads = {}
    for n, prm in model.named_parameters():
        g = prm.grad.detach().clone() * 2  # undo the gradient-accumulation division
        dist.all_reduce(g, group=groups.sp_group)
        grads[n] = g
    ref_grads = {n: sum(rg[n] for _, rg in refs) / len(refs) for n in refs[0][1]}
    return {"sp_loss": float(loss) * 2, "ref_loss": sum(rl for rl, _ in refs) / len(refs),
            "grad_rel_err": _compare(ref_grads, grads)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--sp", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups = sp.init_sequence_parallel(args.sp, device_type="cpu")
    results: dict[str, Any] = {}
    for name in args.cases.split(","):
        try:
            results[name] = globals()[f"case_{name}"](groups)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    sp.set_active_groups(None)  # no group left to interpreter finalization (see benchmarks/long_context.py)
    del groups
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
