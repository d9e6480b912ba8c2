"""Non-finite steps are skipped bit-exactly; state round-trips; worker errors surface at once."""

from __future__ import annotations

import gc
import io
import time
import weakref

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload import ops as ops_module
from hf_superoffload import state as st
from hf_superoffload.runtime.cpu_worker import WorkerError
from hf_superoffload.testing import tiny_llama

CFG = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=2)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def train(model, opt, batches, poison=None):
    for k, ids in enumerate(batches):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def snapshot(model, opt):
    opt.synchronize()
    flat = opt.engine.flat_state()
    return (
        {side: {k: v.detach().clone().cpu() for k, v in d.items()} for side, d in flat.items()},
        list(opt.engine.param_steps),
        [p.detach().clone() for p in model.parameters()],
    )


def assert_bitwise_equal(a, b):
    (fa, sa, pa), (fb, sb, pb) = a, b
    assert sa == sb
    for side in fa:
        for k in fa[side]:
            assert torch.equal(fa[side][k], fb[side][k]), f"{side}/{k} changed"
    for x, y in zip(pa, pb):
        assert torch.equal(x, y), "model weights changed"


@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
@pytest.mark.parametrize("where", ["loss", "one_param_late"])
def test_nan_step_is_skipped_bit_exactly(rollback, where):
    model = tiny_llama()
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1.0,
                                config=CFG.replace(rollback=rollback))
    train(model, opt, data(3))
    before = snapshot(model, opt)
    ids = data(1, seed=7)[0]
    if where == "loss":
        loss = model(input_ids=ids, labels=ids).loss * float("nan")
        handle = None
    else:
        # only the first layer's q_proj gradient is NaN: it arrives late, after other buckets were speculated
        target = model.model.layers[0].self_attn.q_proj.weight
        handle = target.register_hook(lambda g: torch.full_like(g, float("nan")))
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if handle is not None:
        handle.remove()
    after = snapshot(model, opt)
    assert opt.skipped_steps == 1
    assert opt.step_was_skipped
    if rollback == "double_buffer" or where == "loss":
        assert_bitwise_equal(before, after)
    else:
        # inverse rollback: buckets speculated before the NaN arrived are restored to fp32 rounding
        for side in before[0]:
            for k in before[0][side]:
                torch.testing.assert_close(after[0][side][k], before[0][side][k], rtol=1e-5, atol=1e-6)
        assert before[1] == after[1]
    # training goes on normally afterwards
    train(model, opt, data(2, seed=3))
    assert not opt.step_was_skipped


def test_saved_arenas_carry_their_own_bytes_only(monkeypatch):
    """``torch.save`` writes a view's whole storage. A host arena is a view of a buffer that also holds page padding
    (whatever the heap left there) and the room reserved for a tail move; a device arena is saved in pieces so that
    ``torch.save`` copies one to the host at a time (not the whole device state beside the host state). Each saved
    arena or piece sits on a storage of exactly its bytes aliasing the live arena (no copy), keeps that memory
    alive past the optimizer, and the file is the state plus a few KiB of layout."""
    monkeypatch.setattr(st, "_PIECE_ELEMS", 1000)
    model = tiny_llama()
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1.0, config=CFG)
    assert opt.plan.host_arena_room > 0 and opt.plan.device_numel > 2000  # the premises: room, several pieces
    train(model, opt, data(2))
    live = opt.engine.flat_state()
    sd = opt.state_dict()["superoffload"]
    for k, t in sd["host"].items():
        assert live["host"][k].untyped_storage().nbytes() > t.numel() * t.element_size()
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"host/{k} carries extra bytes"
        assert t.data_ptr() == live["host"][k].data_ptr()
    for k, pieces in sd["device"].items():
        assert [t.numel() for t in pieces] == [min(1000, opt.plan.device_numel - at)
                                               for at in range(0, opt.plan.device_numel, 1000)]
        for j, t in enumerate(pieces):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"device/{k} piece {j}"
            assert t.data_ptr() == live["device"][k][1000 * j :].data_ptr()
    buf = io.BytesIO()
    torch.save(sd, buf)
    state = sum(st._numel(x) * 4 for side in ("host", "device") for x in sd[side].values())
    assert len(buf.getvalue()) - state < min(3 * opt.plan.host_arena_room * 4, 64 << 10)
    expected = {side: {k: torch.cat(st._pieces(x)).clone() for k, x in sd[side].items()} for side in ("host", "device")}
    storages = [weakref.ref(t.untyped_storage()) for d in live.values() for t in d.values()]
    opt.close()
    del opt, live
    gc.collect()
    assert all(s() is not None for s in storages), "the state dict does not keep the arenas' memory alive"
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    for side in ("host", "device"):
        for k, x in back[side].items():
            assert torch.equal(torch.cat(st._pieces(sd[side][k])), expected[side][k])
            assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in st._pieces(x))
            assert torch.equal(torch.cat(st._pieces(x)), expected[side][k])


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("same_plan", [True, False])
def test_state_dict_round_trip_resumes_bit_identically(same_plan, pieces, monkeypatch):
    """With ``pieces``, the device arenas are saved in pieces of 777 elements (boundaries inside parameters) and
    checksummed in windows of 300 elements (windows straddling pieces)."""
    if pieces:
        monkeypatch.setattr(st, "_PIECE_ELEMS", 777)
        monkeypatch.setattr(st, "_CRC_BYTES", 4 * 300)
    batches = data(8)
    model_a = tiny_llama()
    opt_a = SuperOffloadOptimizer(model_a, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, config=CFG)
    train(model_a, opt_a, batches)  # uninterrupted

    model_b = tiny_llama()
    opt_b = SuperOffloadOptimizer(model_b, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, config=CFG)
    train(model_b, opt_b, batches[:4])
    buf = io.BytesIO()
    saved = opt_b.state_dict()
    for side in ("host", "device"):  # the windows run across the pieces: the arena's own checksums
        for k, x in saved["superoffload"][side].items():
            whole = torch.cat(st._pieces(x)).clone()
            assert st._checksum(whole) == saved["superoffload"]["manifest"][f"{side}/{k}"]["checksum"]
    assert len(saved["superoffload"]["device"]["master"]) == (-(-opt_b.plan.device_numel // 777) if pieces else 1)
    torch.save({"model": model_b.state_dict(), "opt": saved}, buf)
    opt_b.close()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    model_c = tiny_llama(seed=123)  # different init: everything must come from the checkpoint
    model_c.load_state_dict(ckpt["model"])
    # resume into the same plan (bit-identical), or into another one (no device tail): converted parameter by
    # parameter; the host kernel and the device kernel may round differently, so that one is fp32-close
    opt_c = SuperOffloadOptimizer(model_c, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0,
                                  config=CFG if same_plan else CFG.replace(gpu_resident_buckets=0))
    opt_c.load_state_dict(ckpt["opt"])
    assert opt_c.skipped_steps == opt_b.skipped_steps and opt_c.clipped_steps == opt_b.clipped_steps
    assert opt_c.engine.governor.state_dict() == opt_b.engine.governor.state_dict()
    train(model_c, opt_c, batches[4:])
    same = torch.equal if same_plan else (lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-4))
    for x, y in zip(model_a.parameters(), model_c.parameters()):
        assert same(x, y)
    assert opt_a.engine.param_steps == opt_c.engine.param_steps
    fa, fc = opt_a.engine.flat_state(), opt_c.engine.flat_state()
    for i in range(len(opt_a.engine.params)):
        (pa, oa), (pc, oc) = opt_a.engine.param_location(i), opt_c.engine.param_location(i)
        n = opt_a.engine.params[i].numel()
        for k in ("master", "exp_avg", "exp_avg_sq"):
            a = fa["host" if pa.value == "host" else "device"][k][oa : oa + n]
            c = fc["host" if pc.value == "host" else "device"][k][oc : oc + n]
            assert same(a, c), f"param {i} {k} differs after resume"


def test_load_refuses_other_model():
    model = tiny_llama()
    opt = SuperOffloadOptimizer(model, lr=1e-3, config=CFG)
    other = tiny_llama(hidden_size=48, intermediate_size=96)
    opt2 = SuperOffloadOptimizer(other, lr=1e-3, config=CFG)
    with pytest.raises(ValueError, match="different set of trainable parameters"):
        opt2.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="not saved by SuperOffloadOptimizer"):
        opt2.load_state_dict(torch.optim.AdamW(other.parameters()).state_dict())


def test_worker_exception_surfaces_quickly_and_state_is_unchanged(monkeypatch):
    model = tiny_llama()
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=None, config=CFG.replace(worker_timeout_s=30))
    train(model, opt, data(2))
    assert opt.engine.governor.speculate_next()
    before = snapshot(model, opt)

    calls = {"n": 0}
    real = ops_module.cpu_adamw_step_

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected CPU Adam failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(ops_module, "cpu_adamw_step_", flaky)
    ids = data(1, seed=9)[0]
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="injected CPU Adam failure") as info:
        model(input_ids=ids, labels=ids).loss.backward()
        # this test is about a failure *before* validation (a speculative step); on a loaded machine the worker
        # may otherwise reach its third bucket only after step() validated: a failure after the verdict marks the
        # state inconsistent instead (checkpoints are refused), a different promise
        while calls["n"] < 3 and time.perf_counter() - t0 < 10:
            time.sleep(0.005)
        opt.step()
    assert time.perf_counter() - t0 < 10
    assert isinstance(info.value.__cause__, RuntimeError)
    # the failed step left masters and Adam state as they were (speculated buckets undone)
    flat_before, steps_before, _ = before
    flat_now = {side: {k: v.detach().clone().cpu() for k, v in d.items()} for side, d in opt.engine.flat_state().items()}
    assert opt.engine.param_steps == steps_before
    for side in ("host", "device"):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(flat_now[side][k], flat_before[side][k]), f"{side}/{k} changed by the failed step"
    # the optimizer refuses to go on with a dead worker, with the original cause
    with pytest.raises(WorkerError):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def test_worker_exception_after_validation_surfaces_and_blocks_checkpoints(monkeypatch):
    model = tiny_llama()
    opt = SuperOffloadOptimizer(model, lr=1e-3, config=CFG.replace(speculation=False, worker_timeout_s=30))
    train(model, opt, data(1))

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure while applying the step")

    monkeypatch.setattr(ops_module, "cpu_adamw_step_", broken)
    ids = data(1, seed=9)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # validated; the CPU work runs after this returns
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="injected failure"):
        model(input_ids=ids, labels=ids)  # the next forward waits for its buckets and sees the failure
    assert time.perf_counter() - t0 < 10
    with pytest.raises((WorkerError, RuntimeError)):
        opt.state_dict()
