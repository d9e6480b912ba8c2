"""Sequence-tiled MLP (sequence_parallel/tiled_mlp.py): parity with the untiled model, one gradient arrival per
parameter per backward, composition with checkpointing, the offload engine and weight flow.

Odd sizes on purpose: 2 x 13 = 26 tokens, tiles of 1, 5 (the last one holds 1 token), 26 and 100 (one tile).
The untiled reference is the same model without ``enable_tiled_mlp``; fp32 models agree to rounding (the tiles'
weight gradients are summed in another order), bf16 ones to bf16 rounding.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload import sequence_parallel as sp
from hf_superoffload.planning.plan import WeightMode
from hf_superoffload.sequence_parallel.tiled_mlp import _TiledForward
from hf_superoffload.testing import ReferenceAdamW, master_of, tiny_llama

LR = 1e-3
SEQ = 13
INTERMEDIATE = 64  # tiny_llama's intermediate_size
CKPT = [None, "non_reentrant", "reentrant"]


def _ids(seed: int = 0, b: int = 2, s: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def _model(tile: int | None, *, ckpt: str | None = None, dtype: torch.dtype = torch.float32,
           device: str = "cpu", **kw) -> torch.nn.Module:
    model = tiny_llama(seed=0, dtype=dtype, device=device, attn_implementation="sdpa", **kw)
    model.train()
    if ckpt is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    if tile is not None:
        sp.enable_tiled_mlp(model, tile_tokens=tile)
    return model


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward/backward; asserts every parameter's post-accumulate-grad hook fired exactly once."""
    arrivals: dict[str, int] = {}
    handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: arrivals.__setitem__(n, arrivals.get(n, 0) + 1))
               for n, p in model.named_parameters()]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for h in handles:
        h.remove()
    names = [n for n, _ in model.named_parameters()]
    assert arrivals == dict.fromkeys(names, 1), {n: arrivals.get(n) for n in names if arrivals.get(n) != 1}
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[n].float() - r.float()).abs().max() / r.float().abs().max().clamp(min=1e-12))
               for n, r in ref.items())


# ---- parity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ckpt", CKPT)
@pytest.mark.parametrize("tile", [1, 5, 26, 100])
def test_fp32_loss_and_gradients_equal_untiled(ckpt, tile):
    ids = _ids()
    ref_loss, ref = _loss_and_grads(_model(None, ckpt=ckpt), ids)
    loss, got = _loss_and_grads(_model(tile, ckpt=ckpt), ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert _rel_err(got, ref) < 1e-5
    if tile >= 2 * SEQ:  # one tile: the module's own forward and backward, nothing reordered
        assert _rel_err(got, ref) == 0.0


@pytest.mark.parametrize("ckpt", [None, "non_reentrant"])
def test_bf16_loss_and_gradients_equal_untiled(ckpt):
    ids = _ids(1)
    ref_loss, ref = _loss_and_grads(_model(None, ckpt=ckpt, dtype=torch.bfloat16), ids)
    loss, got = _loss_and_grads(_model(5, ckpt=ckpt, dtype=torch.bfloat16), ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    assert _rel_err(got, ref) < 3e-2  # a few bf16 ulps of the largest element
    assert all(g.dtype == torch.bfloat16 for g in got.values())


def test_cpu_autocast_recompute_sees_the_forward_autocast():
    ids = _ids(2)
    out = []
    for tile in (None, 5):
        model = _model(tile)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out.append(_loss_and_grads(model, ids))
    (ref_loss, ref), (loss, got) = out
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    assert _rel_err(got, ref) < 3e-2


def test_frozen_mlp_weights_and_input_without_grad():
    """Only some inputs need gradients: the others get none, and nothing is computed for them."""
    ids = _ids(3)
    grads = []
    for tile in (None, 4):
        model = _model(tile)
        for n, p in model.named_parameters():
            p.requires_grad_("up_proj" not in n and "embed" not in n)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    ref, got = grads
    assert all(got[n] is None for n in got if "up_proj" in n)
    assert _rel_err({n: g for n, g in got.items() if g is not None}, {n: g for n, g in ref.items() if g is not None}) < 1e-5


def test_mlp_function_alone_input_gradient_and_3d_tiles():
    """The Function directly on one MLP, including a batch whose tokens straddle tiles across rows."""
    torch.manual_seed(0)
    model = tiny_llama(seed=0, dtype=torch.float64)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 7, 32, dtype=torch.float64, requires_grad=True)
    ref_y = mlp(x)
    (ref_y * torch.arange(32)).sum().backward()
    ref_gx, ref_gw = x.grad.clone(), {n: p.grad.clone() for n, p in mlp.named_parameters()}
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    sp.enable_tiled_mlp(model, tile_tokens=4)
    y = mlp(x)
    (y * torch.arange(32)).sum().backward()
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_gx, rtol=1e-12, atol=1e-12)
    for n, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, ref_gw[n], rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # inference: tiled, no graph
        torch.testing.assert_close(mlp(x), ref_y.detach(), rtol=1e-12, atol=1e-12)


# ---- what is saved for backward --------------------------------------------------------------------
def _saved_shapes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Shapes of the activations (not the weights) autograd saves in forward and in backward (the recompute)."""
    phase = ["forward"]
    shapes: dict[str, list[tuple[int, ...]]] = {"forward": [], "backward": []}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            shapes[phase[0]].append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
        phase[0] = "backward"
        loss.backward()
    return shapes["forward"], shapes["backward"]


def test_forward_saves_no_mlp_intermediate_and_backward_recomputes_one_tile_at_a_time():
    ids = _ids(4)
    fwd, _ = _saved_shapes(_model(None), ids)
    untiled = [s for s in fwd if s and s[-1] == INTERMEDIATE]
    assert len(untiled) >= 2 * 2  # the untiled MLPs save [B, S, f] tensors (this check can fail)
    fwd, bwd = _saved_shapes(_model(5), ids)
    assert not [s for s in fwd if s and s[-1] == INTERMEDIATE]
    inter = [s for s in bwd if s and s[-1] == INTERMEDIATE]
    assert inter and max(math.prod(s[:-1]) for s in inter) <= 5  # one tile of tokens at a time
    assert len(inter) >= 2 * math.ceil(2 * SEQ / 5)  # every tile of both layers


# ---- API -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8k", None])
def test_tile_tokens_validation(bad):
    model = _model(None)
    with pytest.raises(ValueError, match=f"tile_tokens={bad!r} is invalid: use an integer >= 1"):
        sp.enable_tiled_mlp(model, tile_tokens=bad)
    assert not any(isinstance(m.__dict__.get("forward"), _TiledForward) for m in model.modules())


def test_enable_is_idempotent_disable_restores_and_state_dict_is_unchanged():
    model = _model(None)
    keys = list(model.state_dict())
    names = sp.enable_tiled_mlp(model, tile_tokens=5)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    mlp = model.model.layers[0].mlp
    first = mlp.__dict__["forward"]
    assert sp.enable_tiled_mlp(model, tile_tokens=3) == names
    assert mlp.__dict__["forward"] is first and first.tile_tokens == 3  # not wrapped twice
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)  # rebinds to the copy's own modules
    assert twin.model.layers[0].mlp.forward.original().__self__ is twin.model.layers[0].mlp
    clone = pickle.loads(pickle.dumps(model))
    assert clone.model.layers[1].mlp.forward.tile_tokens == 3
    ids = _ids(5)
    torch.testing.assert_close(clone(input_ids=ids).logits, model(input_ids=ids).logits)
    assert sp.disable_tiled_mlp(model) == 2
    assert "forward" not in mlp.__dict__ and sp.disable_tiled_mlp(model) == 0


def test_disable_restores_a_previous_instance_forward():
    model = _model(None)
    mlp = model.model.layers[0].mlp
    calls = []

    def mine(x):
        calls.append(x.shape)
        return type(mlp).forward(mlp, x)

    mlp.forward = mine
    sp.enable_tiled_mlp(model, tile_tokens=4)
    with torch.no_grad():
        model(input_ids=_ids(6, 1, 9))
    assert calls == [(1, 4, 32), (1, 4, 32), (1, 1, 32)]  # the previous forward ran per tile
    sp.disable_tiled_mlp(model)
    assert mlp.forward is mine


def test_refusals_name_the_module_and_the_fix():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    moe = Qwen2MoeForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"cannot tile model\.layers\.0\.mlp .*mixture-of-experts"):
        sp.enable_tiled_mlp(moe, tile_tokens=8)
    model = _model(None)
    model.model.layers[1].mlp.drop = torch.nn.Dropout(0.1)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp .*dropout"):
        sp.enable_tiled_mlp(model, tile_tokens=8)
    assert "forward" not in model.model.layers[0].mlp.__dict__  # refused before any change
    with pytest.raises(ValueError, match="no decoder layers with an `mlp`"):
        sp.enable_tiled_mlp(torch.nn.Sequential(torch.nn.Linear(2, 2)), tile_tokens=8)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_llama_shaped_families(family):
    import transformers

    cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    cfg = getattr(transformers, cls[0])(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ids = _ids(7) % 64
    out = []
    for tile in (None, 3):
        torch.manual_seed(0)
        model = getattr(transformers, cls[1])(cfg).float()
        if tile:
            assert len(sp.enable_tiled_mlp(model, tile_tokens=tile)) == 2
        out.append(_loss_and_grads(model, ids))
    (ref_loss, ref), (loss, got) = out
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert _rel_err(got, ref) < 1e-5


# ---- with the offload engine -----------------------------------------------------------------------
SMALL = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=2)  # a dozen buckets on the tiny model
FLOW = SuperOffloadConfig(bucket_size_mb=0.004, weight_placement="flow", gpu_resident_buckets=0)


def _batches(n: int, device: str = "cpu") -> list[torch.Tensor]:
    return [_ids(100 + k).to(device) for k in range(n)]


def _train(tile: int | None, data: list[torch.Tensor], *, config: SuperOffloadConfig | None,
           ckpt: str | None = "non_reentrant", accum: int = 1) -> tuple[list[float], dict[str, torch.Tensor], object]:
    """bf16 tiny Llama, our optimizer (``config``) or the reference (``None``): losses and final fp32 masters."""
    model = _model(tile, ckpt=ckpt, dtype=torch.bfloat16, device=str(data[0].device))
    opt = (SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=1.0, config=config)
           if config is not None else ReferenceAdamW(model, max_grad_norm=1.0, lr=LR, weight_decay=0.1))
    losses = []
    for step in range(len(data) // accum):
        total = 0.0
        for k in range(accum):
            ids = data[step * accum + k]
            ctx = opt.no_sync() if config is not None and k < accum - 1 else contextlib.nullcontext()
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss / accum
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    names = {id(p): n for n, p in model.named_parameters()}
    if config is None:
        return losses, {names[id(p)]: m.detach().clone() for p, m in opt.pairs}, opt
    opt.synchronize()
    return losses, {names[id(p)]: master_of(opt, p) for p in opt.engine.params}, opt


def _assert_same_training(a, b, *, loss_tol: float, weight_tol: float) -> None:
    (la, wa, _), (lb, wb, _) = a, b
    for k, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert math.isclose(x, y, rel_tol=loss_tol, abs_tol=loss_tol), f"step {k}: {x} vs {y}"
    # host masters are CPU tensors, GPU-resident ones and the reference's CUDA tensors: compare on the CPU
    worst = max(float((wa[n].cpu() - wb[n].cpu()).abs().max()) for n in wa)
    assert worst < weight_tol, worst


def test_superoffload_tiled_equals_reference_and_untiled():
    """The engine offloads a bucket when its last parameter's gradient arrives: a second arrival per tile would
    raise there. Tiled + SuperOffload equals tiled + the reference optimizer to fp32 rounding, and the untiled
    run to bf16 rounding of the weight gradients."""
    data = _batches(4)
    ours = _train(5, data, config=SMALL)
    assert len(ours[2].engine.host_buckets) >= 4
    _assert_same_training(ours, _train(5, data, config=None), loss_tol=2e-5, weight_tol=1e-6 + 2 * LR / 256)
    _assert_same_training(ours, _train(None, data, config=SMALL), loss_tol=5e-3, weight_tol=4 * LR)


def test_superoffload_gradient_accumulation_with_tiles():
    data = _batches(4)
    _assert_same_training(_train(3, data, config=SMALL, accum=2), _train(3, data, config=None, accum=2),
                          loss_tol=2e-5, weight_tol=1e-6 + 2 * LR / 256)


@pytest.mark.parametrize("ckpt", CKPT)
def test_weight_flow_with_tiles_is_bitwise_stationary_and_matches_reference(ckpt):
    """Weight flow streams whole decoder layers: the backward recompute of the tiles runs while the layer is
    materialized (after its pre-backward fetch, before its last gradient releases it)."""
    data = _batches(4)
    flow = _train(5, data, config=FLOW, ckpt=ckpt)
    opt = flow[2]
    assert opt.plan.weight_mode is WeightMode.FLOW
    stationary = _train(5, data, config=FLOW.replace(weight_placement="stationary"), ckpt=ckpt)
    assert flow[0] == stationary[0]
    assert all(torch.equal(flow[1][n], stationary[1][n]) for n in flow[1])
    _assert_same_training(flow, _train(5, data, config=None, ckpt=ckpt), loss_tol=2e-5,
                          weight_tol=1e-6 + 2 * LR / 256)
    n = len(opt.engine._flow.units)
    assert opt.engine._flow.stats.fetches == 4 * 2 * n  # each unit once in forward and once in backward


# ---- CUDA ------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["stationary", "flow"])
def test_cuda_tiles_with_the_engine_match_the_reference(placement):
    """On CUDA (weights stream on their own stream in flow mode; the engine's upload waits run in the tiles'
    projections): tiled + SuperOffload equals tiled + the reference optimizer to kernel nondeterminism."""
    data = _batches(4, "cuda")
    ours = _train(5, data, config=FLOW.replace(weight_placement=placement))
    assert ours[2].plan.weight_mode is (WeightMode.FLOW if placement == "flow" else WeightMode.STATIONARY)
    _assert_same_training(ours, _train(5, data, config=None), loss_tol=1e-3, weight_tol=4 * LR)
