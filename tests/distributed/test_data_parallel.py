"""Data parallel over gloo on CPU: two ranks against one process on the same global batch.

The ranks train the same tiny Llama, each on half of every global batch; the optimizer reduce-scatters the
gradients per bucket, steps its shard of the offloaded state, and all-gathers the weights. The result must
match the plain reference (fp32 masters + clip_grad_norm_ + torch AdamW) on the full batch, with the
tolerance the single-process parity tests use.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.state import consolidate_state_dicts
from hf_superoffload.testing import ReferenceAdamW, tiny_llama

WORKER = Path(__file__).with_name("_dp_worker.py")
LR = 1e-3


def reference(steps: int, *, max_norm: float = 1.0, nan_step: int | None = None, device: str = "cpu",
              model_kw: dict[str, str] | None = None):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_dp_worker", WORKER)
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)
    model = w.build_model(model_kw or {}, device)
    ropt = ReferenceAdamW(model, max_grad_norm=max_norm, lr=LR, weight_decay=0.1)
    losses = []
    for step, ids in enumerate(w.batches(steps)):
        ids = ids.to(device)
        hook = next(model.parameters()).register_hook(w.poison) if step == nan_step else None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if hook is not None:
            hook.remove()
        ropt.step()
        ropt.zero_grad()
        losses.append(loss.item())
    return model, ropt, losses


def run(launcher, tmp_path: Path, scenario: str, world: int = 2, deadline: float = 240.0, **kw):
    args = [scenario, str(tmp_path), *(f"{k}={v}" for k, v in kw.items())]
    fin = launcher(WORKER, world, args, deadline=deadline)
    return fin


def results(tmp_path: Path, world: int):
    return [torch.load(tmp_path / f"result_rank{r}.pt", weights_only=False) for r in range(world)]


def masters_by_name(model, state) -> dict[str, torch.Tensor]:
    """fp32 masters per parameter name from a single-process (consolidated) optimizer state."""
    ordered = [p for p in model.parameters() if p.requires_grad][::-1]  # the optimizer's arrival order (deduplicated)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, p in enumerate(ordered):
        side, off = state["locations"][i]
        out[names[id(p)]] = state[side]["master"][off : off + p.numel()].view(p.shape)
    return out


def assert_matches_reference(res, ref_model, ropt, ref_losses, *, tight_steps: int = 3) -> None:
    for k, (a, b) in enumerate(zip(res[0]["losses"], ref_losses, strict=True)):
        tol = 2e-5 if k < tight_steps else 5e-3
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"step {k}: loss {a} vs reference {b}"
    assert math.isclose(res[0]["grad_norm"], ropt.last_grad_norm, rel_tol=5e-2)
    merged = consolidate_state_dicts([r["state"] for r in res])
    ours = masters_by_name(ref_model, merged)
    names = {id(p): n for n, p in ref_model.named_parameters()}
    worst = max((ours[names[id(p)]] - m.detach().cpu()).abs().max().item() for p, m in ropt.pairs if p.requires_grad)
    assert worst < 8 * LR, f"final masters differ from the reference by {worst}"
    for r in res[1:]:  # every replica holds the same weights, bit for bit
        for n, t in res[0]["params"].items():
            assert torch.equal(t, r["params"][n]), n


@pytest.mark.parametrize("tail,rollback", [(2, "double_buffer"), (0, "inverse")])
def test_two_ranks_match_the_reference_on_the_global_batch(launcher, tmp_path, tail, rollback):
    fin = run(launcher, tmp_path, "train", steps=30, tail=tail, rollback=rollback)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    res = results(tmp_path, 2)
    ref_model, ropt, ref_losses = reference(30)
    assert res[0]["clipped"] > 0, "clipping must fire in this test"
    assert "rank 0 of 2" in res[0]["plan"] and "rank 1 of 2" in res[1]["plan"]
    assert_matches_reference(res, ref_model, ropt, ref_losses)


def test_accumulation_tied_embeddings_and_a_frozen_parameter(launcher, tmp_path):
    """Two micro-batches per step (the first under no_sync), tied input/output embeddings, a frozen norm."""
    kw = {"accum": "2", "tied": "1", "freeze": "1"}
    fin = run(launcher, tmp_path, "train", steps=12, **kw)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    res = results(tmp_path, 2)
    ref_model, ropt, ref_losses = reference(12, model_kw=kw)
    assert_matches_reference(res, ref_model, ropt, ref_losses)


@pytest.mark.parametrize("tail", [0, 1])
def test_weight_flow_with_data_parallelism(launcher, tmp_path, tail):
    """Weight flow over two ranks: each rank streams every layer from its host copy of the whole bf16 weights,
    which the gatherer refreshes from every rank's updated shard; checkpointing on, clipping firing."""
    kw = {"flow": "1", "ckpt": "1", "tail": str(tail)}
    fin = run(launcher, tmp_path, "train", steps=12, **kw)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    res = results(tmp_path, 2)
    assert all(r["peak_units"] is not None and r["peak_units"] <= 3 for r in res), [r["peak_units"] for r in res]
    assert "weights: flow" in res[0]["plan"]
    ref_model, ropt, ref_losses = reference(12, model_kw={"ckpt": "1"})
    assert_matches_reference(res, ref_model, ropt, ref_losses)


def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(launcher, tmp_path):
    fin = run(launcher, tmp_path, "nan", steps=8, nan_step=5)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    res = results(tmp_path, 2)
    assert [r["skipped"] for r in res] == [1, 1]
    ref_model, ropt, ref_losses = reference(8, nan_step=5)
    assert ropt.skipped_steps == 1
    assert_matches_reference(res, ref_model, ropt, ref_losses)


def test_sharded_checkpoint_resumes_bit_exactly_and_merges_for_any_world_size(launcher, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    fin = run(launcher, full, "train", steps=10, save_at=4)  # saves after step index 4 (5 steps done)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    fin = run(launcher, resumed, "train", steps=5, start=5, load=str(full / "opt_rank{rank}.pt"))
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    a, b = results(full, 2), results(resumed, 2)
    assert a[0]["losses"][5:] == b[0]["losses"], "resume must continue bit-exactly"
    for r in range(2):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[r]["state"]["host"][kind], b[r]["state"]["host"][kind])

    # a shard does not load into another world size: clear error naming the way out
    shards = [torch.load(full / f"opt_rank{r}.pt", weights_only=False) for r in range(2)]
    model = tiny_llama(seed=0)
    cfg = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=2, cpu_threads=1)
    opt = SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=1.0, config=cfg)
    with pytest.raises(ValueError, match="consolidate_state_dicts"):
        opt.load_state_dict(shards[0])
    # the merged shards load into one process (another world size) and hold the same masters
    merged = {**shards[0], "superoffload": consolidate_state_dicts([s["superoffload"] for s in shards])}
    opt.load_state_dict(merged)
    got = opt.state_dict()["superoffload"]
    want = masters_by_name(model, merged["superoffload"])
    mine = masters_by_name(model, got)
    for n in want:
        assert torch.equal(want[n], mine[n]), n
    opt.close()


def test_a_failing_rank_makes_every_rank_fail_fast(launcher, tmp_path):
    fin = run(launcher, tmp_path, "fail", steps=6, fail_step=3, timeout=20, deadline=120)
    assert all(rc != 0 for rc in fin.returncodes), fin.outputs
    assert "injected failure" in fin.outputs[1]
    assert fin.seconds < 100, f"the ranks took {fin.seconds:.0f}s to fail"


@pytest.mark.cuda
@pytest.mark.parametrize("delay", [None, "flatten", "scatter"])
def test_two_gpus_over_nccl_match_the_reference(launcher, tmp_path, delay):
    """The CUDA path: reduce-scatter on the D2H stream's behalf, all-gather on the gather stream; delays injected
    before the flatten (backward side) or the scatter (gather side) expose a missing stream wait."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    kw = {"device": "cuda", "steps": 20}
    if delay:
        kw["delay"] = delay
    fin = run(launcher, tmp_path, "train", **kw)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    res = results(tmp_path, 2)
    ref_model, ropt, ref_losses = reference(20, device="cuda")
    assert_matches_reference(res, ref_model, ropt, ref_losses)


def test_a_ddp_wrapped_model_is_refused(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(tiny_llama(seed=0, dtype=torch.float32))
        with pytest.raises(ValueError, match="unwrapped model"):
            SuperOffloadOptimizer(ddp, lr=LR)
        with pytest.raises(ValueError, match="unwrapped model"):  # also when the wrapper sits inside
            SuperOffloadOptimizer(torch.nn.Sequential(ddp), lr=LR)
    finally:
        dist.destroy_process_group()
