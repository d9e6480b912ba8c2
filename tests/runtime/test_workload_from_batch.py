"""[Note: workload from the first batch]: the bare optimizer plans at its first training forward, from that batch's
shape, exactly as if the shape had been given; everything before it (evaluation, ``no_sync``, ``zero_grad``) leaves
the plan open."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.planning.planner import Workload
from hf_superoffload.testing import pretend_profile, tiny_llama, train_steps, weights_and_state

GiB = 1024**3
MODEL = dict(seed=3, num_hidden_layers=4)


def _batches(n: int, batch: int, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 128, (batch, seq), generator=g) for _ in range(n)]


def _budget_for_half_tail(model: torch.nn.Module, batch: int, seq: int) -> int:
    """A device budget whose workload-aware plan keeps part of the optimizer on the device: between the plan with
    no tail and the plan with everything there."""
    from hf_superoffload.planning.memory_model import PlanLike, estimate

    n = sum(p.numel() for p in model.parameters())
    need = [estimate(model.config, batch_size=batch, seq_len=seq, grad_ckpt=False,
                     plan_like=PlanLike(device_numel=d, host_numel=n - d, bucket_bytes=2 * n // 8)).gpu_required_bytes
            for d in (0, n)]
    return int((need[0] + need[1]) / 2 / (1 - 0.04))


def test_plans_at_the_first_training_forward_like_a_given_workload(device_budget) -> None:
    batch, seq = 2, 24
    model = tiny_llama(**MODEL)
    budget = _budget_for_half_tail(model, batch, seq)
    device_budget(budget)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    assert not opt.planned
    data = _batches(6, batch, seq)
    train_steps(model, opt, data[:1])
    assert opt.planned
    assert opt.workload == Workload(model.config, batch, seq, grad_ckpt=False, chunked_loss=True)
    tail = opt.plan.device_numel
    assert 0 < tail < sum(p.numel() for p in model.parameters()), "the budget should leave a partial tail"

    ref_model = tiny_llama(**MODEL)
    ref = SuperOffloadOptimizer(ref_model, lr=1e-2, max_grad_norm=1.0, log_plan=False,
                                workload=Workload(ref_model.config, batch, seq, grad_ckpt=False))
    assert ref.planned
    assert dataclasses.replace(ref.plan, notes=()) == dataclasses.replace(opt.plan, notes=())
    train_steps(ref_model, ref, data[:1])
    train_steps(model, opt, data[1:])
    train_steps(ref_model, ref, data[1:])
    for a, b in zip(weights_and_state(model, opt), weights_and_state(ref_model, ref), strict=True):
        assert torch.equal(a, b)
    opt.close()
    ref.close()


def test_the_batch_shape_moves_the_tail(device_budget) -> None:
    """The inferred shape reaches the planner: a longer sequence on the same budget leaves less room for the
    optimizer on the device."""
    model = tiny_llama(**MODEL)
    budget = _budget_for_half_tail(model, 2, 24)
    tails = []
    for seq in (8, 24, 40):  # 40: near the longest this budget holds at batch 2 (44 tokens)
        device_budget(budget)
        m = tiny_llama(**MODEL)
        opt = SuperOffloadOptimizer(m, lr=1e-2, log_plan=False)
        train_steps(m, opt, _batches(1, 2, seq))
        tails.append(opt.plan.device_numel)
        opt.close()
    assert tails[0] > tails[1] > tails[2], tails


def test_checkpointing_and_accumulation_from_the_first_micro_batch(device_budget) -> None:
    batch, seq = 2, 24
    model = tiny_llama(**MODEL, checkpointing=True)
    device_budget(_budget_for_half_tail(model, batch, seq))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    with torch.no_grad():  # evaluation first: not the training step's shape
        model.eval()
        model(input_ids=_batches(1, 7, 5)[0])
        model.train()
    assert not opt.planned
    data = _batches(4, batch, seq)
    train_steps(model, opt, data, accumulation=2)  # the first forward runs inside no_sync
    assert opt.workload == Workload(model.config, batch, seq, grad_ckpt=True, accumulation=True, chunked_loss=True)
    assert opt.plan.host_accumulation.value != "off"  # the accumulated gradients of host buckets live on the host

    ref_model = tiny_llama(**MODEL, checkpointing=True)
    ref = SuperOffloadOptimizer(ref_model, lr=1e-2, max_grad_norm=1.0, log_plan=False,
                                workload=Workload(ref_model.config, batch, seq, grad_ckpt=True, accumulation=True))
    train_steps(ref_model, ref, data, accumulation=2)
    for a, b in zip(weights_and_state(model, opt), weights_and_state(ref_model, ref), strict=True):
        assert torch.equal(a, b)
    opt.close()
    ref.close()


def test_use_before_any_batch_plans_without_a_workload(device_budget, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama(**MODEL)
    device_budget(64 * GiB)
    opt = SuperOffloadOptimizer(model, lr=1e-2, log_plan=False)
    provisional = opt.plan
    assert not opt.planned
    with caplog.at_level("INFO", logger="hf_superoffload"):
        opt.state_dict()
    assert opt.planned and opt.workload is None
    assert opt.plan == provisional
    assert "before the first training batch" in caplog.text
    opt.close()


def test_a_given_profile_or_setting_plans_at_construction(device_budget) -> None:
    device_budget(64 * GiB)
    model = tiny_llama(**MODEL)
    assert SuperOffloadOptimizer(model, lr=1e-2, log_plan=False, profile=pretend_profile(64 * GiB)).planned
    from hf_superoffload import SuperOffloadConfig

    assert SuperOffloadOptimizer(tiny_llama(**MODEL), lr=1e-2, log_plan=False,
                                 config=SuperOffloadConfig(weight_placement="flow")).planned
    # an explicit tail waits for the batch: the plan may keep layers' activations beside it ([Note: kept layers])
    assert not SuperOffloadOptimizer(tiny_llama(**MODEL), lr=1e-2, log_plan=False,
                                     config=SuperOffloadConfig(gpu_resident_buckets=0)).planned


def test_a_later_batch_too_large_for_the_plan_is_refused_before_its_forward(device_budget) -> None:
    """The plan fills the device memory the first batch leaves; a longer batch later would run out of it mid-step.
    It is refused before its forward touches anything, in one line naming the fix; shorter batches, and longer
    ones that still fit, train on."""
    batch, seq = 2, 24
    model = tiny_llama(**MODEL)
    device_budget(_budget_for_half_tail(model, batch, seq))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    data = _batches(3, batch, seq)
    train_steps(model, opt, data[:1])
    assert opt.plan.device_numel > 0
    train_steps(model, opt, [data[1][:, :16]])  # fewer tokens: nothing to check
    before = weights_and_state(model, opt)
    long = torch.randint(0, 128, (batch, 40 * seq), generator=torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match=r"2 x 960 tokens\) does not fit the plan made for 2 x 24") as e:
        model(input_ids=long, labels=long)
    assert "\n" not in str(e.value) and "Workload(model.config, batch_size=2, seq_len=960" in str(e.value)
    after = weights_and_state(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    train_steps(model, opt, data[2:3])  # the run goes on
    assert opt.last_step_stats.verdict in ("commit", "redo")
    opt.close()


def test_the_integrations_micro_batch_count_reaches_the_workload(device_budget) -> None:
    """An integration that knows the micro-batches per step (the Trainer's ``gradient_accumulation_steps``) hands
    them over with the sync predicate; the plan made at the first batch prices that many ([Note: one search over
    the plan])."""
    batch, seq = 2, 24
    model = tiny_llama(**MODEL)
    device_budget(_budget_for_half_tail(model, batch, seq))
    opt = SuperOffloadOptimizer(model, lr=1e-2, log_plan=False)
    boundary = {"sync": False}
    opt.set_sync_predicate(lambda: boundary["sync"], micro_batches=3)
    model(input_ids=_batches(1, batch, seq)[0])  # the first micro-batch: not a boundary
    assert opt.workload is not None and opt.workload.accumulation and opt.workload.micro_batches == 3
    opt.close()
    # without accumulation the count says nothing: one micro-batch per step
    model = tiny_llama(**MODEL)
    opt = SuperOffloadOptimizer(model, lr=1e-2, log_plan=False)
    opt.set_sync_predicate(lambda: True, micro_batches=3)
    model(input_ids=_batches(1, batch, seq)[0])
    assert opt.workload is not None and opt.workload.micro_batches is None
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="micro_batches="):
            opt.set_sync_predicate(None, micro_batches=bad)  # type: ignore[arg-type]
    opt.close()


def test_a_first_forward_without_labels_plans_the_loss_outside_the_model(device_budget) -> None:
    """A loop that computes its loss from the logits (no ``labels`` to the model) never runs the chunked loss: the
    plan prices HF's loss over every logit, and with it a smaller device tail than a forward given labels gets."""
    batch, seq = 2, 24
    tails = {}
    for labels in (True, False):
        model = tiny_llama(**MODEL, vocab_size=8192)  # the logits weigh as much as the optimizer state
        device_budget(_budget_for_half_tail(model, batch, seq))
        opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
        ids = _batches(1, batch, seq)[0]
        if labels:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            logits = model(input_ids=ids).logits
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        assert opt.workload == Workload(model.config, batch, seq, grad_ckpt=False, chunked_loss=labels)
        tails[labels] = opt.plan.device_numel
        opt.close()
    assert tails[False] < tails[True]


def test_a_state_loaded_before_the_first_batch_waits_for_the_plan(device_budget, tmp_path) -> None:
    """[Note: a state loaded before the first batch]: a resume loads the optimizer state before any batch; the plan
    still waits for the first batch's shape (the load used to close it without one: another, slower plan than the
    run it resumes) and the resumed run equals the uninterrupted one bit for bit. A damaged state is refused at the
    load, before any batch, and changes nothing."""
    batch, seq = 2, 24
    model = tiny_llama(**MODEL)
    device_budget(_budget_for_half_tail(model, batch, seq))
    data = _batches(6, batch, seq)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    train_steps(model, opt, data[:3])
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train_steps(model, opt, data[3:])  # the uninterrupted run

    resumed_model = tiny_llama(**MODEL)  # its own initial weights: the state's masters replace them
    resumed = SuperOffloadOptimizer(resumed_model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", mmap=True, weights_only=True))
    assert not resumed.planned, "the load closed the plan without the first batch's shape"
    for k, v in resumed_model.state_dict().items():  # what an evaluation before the first batch reads
        assert torch.equal(v, weights[k]), k
    train_steps(resumed_model, resumed, data[3:])
    assert resumed.workload == opt.workload
    tail = opt.plan.device_numel
    assert 0 < tail < sum(p.numel() for p in model.parameters()), "the budget should leave a partial tail"
    assert dataclasses.replace(resumed.plan, notes=()) == dataclasses.replace(opt.plan, notes=())
    for a, b in zip(weights_and_state(model, opt), weights_and_state(resumed_model, resumed), strict=True):
        assert torch.equal(a, b)

    damaged = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    damaged["superoffload"]["host"]["exp_avg"][7] += 1.0
    fresh_model = tiny_llama(**MODEL)
    before = {k: v.clone() for k, v in fresh_model.state_dict().items()}
    fresh = SuperOffloadOptimizer(fresh_model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    with pytest.raises(ValueError, match=r"optimizer checkpoint host/exp_avg fails its checksum"):
        fresh.load_state_dict(damaged)
    assert not fresh.planned and fresh._pending_state is None
    assert all(torch.equal(v, before[k]) for k, v in fresh_model.state_dict().items()), "refused, yet changed"
    fresh.close()
