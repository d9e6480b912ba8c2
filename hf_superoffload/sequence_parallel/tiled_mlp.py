"""Sequence-tiled MLP: every decoder layer's MLP runs ``tile_tokens`` tokens at a time, forward and backward.

[Note: tiled MLP] At long context the largest transient of a decoder layer's backward is its MLP: gate, up,
``act(gate)`` and their product are ``[tokens, intermediate_size]`` each (at 128k tokens per rank and f = 14336,
3.8 GB apiece in bf16), saved by autograd and joined by their gradients. A gated MLP is token-wise, so it can
run on any split of the tokens. :func:`enable_tiled_mlp` replaces each decoder layer's ``mlp.forward`` by a call
of ``_TiledMLP``, an ``autograd.Function`` that

* forward: runs the module's own forward on one tile after the other under ``no_grad`` and saves only its input
  (which autograd saved untiled too: it is the input of ``gate_proj`` and ``up_proj``);
* backward: recomputes each tile with grad enabled and backpropagates it with ``torch.autograd.grad``, writing
  the tile's input gradient into one ``[tokens, hidden]`` buffer and summing the tiles' parameter gradients
  (in fp32 for bf16/fp16 parameters, rounded once at the end, as the untiled matmul does).

The MLP's parameters are explicit inputs of the Function and their summed gradients its outputs of backward, so
autograd accumulates each parameter's ``.grad`` once per backward: ``register_post_accumulate_grad_hook`` fires
once per parameter, as the offload engine requires (it offloads a bucket when all of its parameters' gradients
arrived; one accumulation per tile would flush it after the first tile).

Cost: one more MLP forward per layer and backward (the backward recompute). With gradient checkpointing the
layer's recompute also runs the tiled (no-grad) forward, so the MLP runs forward three times instead of two.

Memory, per layer and rank (T tokens, t = ``tile_tokens``, h hidden, f intermediate; bf16): the MLP
intermediates saved for backward go from ``8 f T`` bytes (four ``[T, f]`` tensors) to ``8 f min(t, T)`` for the
tile in flight, plus ``4 B`` per MLP parameter for the fp32 gradient sums (``12 h f`` bytes: 0.7 GB at 8B) when
there is more than one tile. See docs/long_context.md.

What is tiled: for every child of an ``nn.ModuleList`` of ``model.get_decoder()`` (the decoder layers) that has
a submodule ``mlp``, that ``mlp`` when it is a gated MLP of the LlamaMLP shape: submodules ``gate_proj``,
``up_proj``, ``down_proj`` (LlamaMLP, Qwen2/3, Mistral, Gemma, ...; LoRA-wrapped projections too), no
parameters outside them and no dropout. Anything else (a mixture of experts: its routing and load balancing
see all tokens; an MLP with dropout: its recompute would draw a different mask) is refused before any change.
The module's own forward runs on each tile (called directly, not through ``__call__``: the hooks of the
``mlp`` module itself do not run per tile; hooks of its submodules, e.g. the offload engine's upload waits on
the projections, do). Weight flow (runtime/weight_flow.py) streams whole decoder layers, whose hooks are
outside the ``mlp``; the backward recompute runs after the layer's pre-backward fetch and before its last
gradient releases it, so flow composes (tested).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["disable_tiled_mlp", "enable_tiled_mlp", "find_decoder_mlps"]

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MOE_CHILDREN = ("experts", "router", "shared_expert", "shared_experts", "gate")


def _check_tile(tile_tokens: Any) -> int:
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r} is invalid: use an integer >= 1, the tokens per MLP tile "
                         "(e.g. 8192; a value >= the tokens per rank gives one tile)")
    return tile_tokens


# ---- the computation -------------------------------------------------------------------------------
def _tiles(n: int, tile: int) -> list[tuple[int, int]]:
    return [(s, min(s + tile, n)) for s in range(0, n, tile)]


def _forward_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn(x)`` computed ``tile`` tokens at a time; one tile: ``fn(x)`` itself. Tiles are ``[1, t, hidden]``."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n <= tile:
        return fn(x)
    out: torch.Tensor | None = None
    for s, e in _tiles(n, tile):
        y = fn(flat[s:e].unsqueeze(0)).squeeze(0)
        if out is None:
            out = y.new_empty((n, y.shape[-1]))
        out[s:e] = y
        del y
    assert out is not None
    return out.view(*x.shape[:-1], out.shape[-1])


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype, bool] | None:
    try:
        return (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
                torch.is_autocast_cache_enabled())
    except RuntimeError:  # a device type without autocast
        return None


class _TiledMLP(torch.autograd.Function):
    """``fn(x)`` in tiles; ``params`` are ``fn``'s parameters, inputs here so that their gradients are returned
    (accumulated once by autograd) rather than accumulated by each tile's backward. See [Note: tiled MLP]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], tile: int,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tile, ctx.params = fn, tile, params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        return _forward_tiles(fn, x, tile)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        fn, tile, params = ctx.fn, ctx.tile, ctx.params
        need_x = ctx.needs_input_grad[0]
        want = [k for k, need in enumerate(ctx.needs_input_grad[3:]) if need]
        one_tile = x.numel() // max(x.shape[-1], 1) <= tile
        xs = x if one_tile else x.reshape(-1, x.shape[-1])
        gs = grad_out if one_tile else grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = None if not need_x or one_tile else torch.empty_like(xs)
        sums: list[torch.Tensor | None] = [None] * len(want)
        spans = [(0, xs.shape[0])] if one_tile else _tiles(xs.shape[0], tile)
        autocast = ctx.autocast
        amp = (torch.autocast(x.device.type, dtype=autocast[1], enabled=autocast[0], cache_enabled=autocast[2])
               if autocast is not None else torch.autocast(x.device.type, enabled=False))
        with torch.enable_grad(), amp:
            for s, e in spans:
                xt = (xs if one_tile else xs[s:e].unsqueeze(0)).detach().requires_grad_(need_x)
                gt = gs if one_tile else gs[s:e].unsqueeze(0)
                yt = fn(xt)
                inputs = ([xt] if need_x else []) + [params[k] for k in want]
                grads = list(torch.autograd.grad(yt, inputs, gt, allow_unused=True))
                del yt
                if need_x:
                    gx = grads.pop(0)
                    if one_tile:
                        grad_x = gx
                    else:
                        grad_x[s:e] = gx.squeeze(0)
                for j, g in enumerate(grads):
                    if g is None:
                        continue
                    if one_tile:
                        sums[j] = g
                    elif sums[j] is None:  # sum low-precision tiles in fp32, round once
                        sums[j] = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g.clone()
                    else:
                        sums[j].add_(g)
                del grads
        out: list[torch.Tensor | None] = [None] * len(params)
        for j, k in enumerate(want):
            g = sums[j]
            out[k] = None if g is None else g.to(params[k].dtype)
        if grad_x is not None and not one_tile:
            grad_x = grad_x.view_as(x)
        return (grad_x, None, None, *out)


class _TiledForward:
    """What :func:`enable_tiled_mlp` installs as ``mlp.forward`` (an instance attribute: the class is untouched,
    parameter names and the state dict do not change). Holds its module weakly (no reference cycle that would
    keep a model's memory alive until the garbage collector runs); ``copy.deepcopy`` rebinds it to the copy."""

    def __init__(self, module: torch.nn.Module, tile_tokens: int, previous: Any) -> None:
        self._module = weakref.ref(module)
        self.tile_tokens = tile_tokens
        self.previous = previous  # an instance-level forward that was there before (restored by disable)

    def original(self) -> Callable[[torch.Tensor], torch.Tensor]:
        module = self._module()
        if module is None:
            raise RuntimeError("the tiled MLP's module no longer exists")
        return self.previous if self.previous is not None else type(module).forward.__get__(module)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise TypeError("a tiled MLP takes only the hidden states (disable_tiled_mlp to call it otherwise)")
        fn = self.original()
        module = self._module()
        params = [p for p in module.parameters()] if module is not None else []
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _TiledMLP.apply(x, fn, self.tile_tokens, *params)
        return _forward_tiles(fn, x, self.tile_tokens)  # inference: tiles bound the transient as well

    def __deepcopy__(self, memo: dict[int, Any]) -> _TiledForward:
        module = self._module()
        new = memo.get(id(module), module)
        return _TiledForward(new, self.tile_tokens, copy.deepcopy(self.previous, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_TiledForward, (self._module(), self.tile_tokens, self.previous))


# ---- finding and patching the MLPs -----------------------------------------------------------------
def find_decoder_mlps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every decoder layer's ``mlp``: the ``mlp`` submodule of each child of an
    ``nn.ModuleList`` of ``model.get_decoder()`` (the model itself when it has no decoder accessor)."""
    root = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            root = get_decoder() or model
        except (AttributeError, NotImplementedError, ValueError):
            root = model
    prefix = next((n for n, m in model.named_modules() if m is root), "")
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    for name, m in root.named_modules():
        if not isinstance(m, torch.nn.ModuleList):
            continue
        for k, layer in enumerate(m):
            mlp = layer._modules.get("mlp")
            if mlp is not None and id(mlp) not in seen:
                seen.add(id(mlp))
                found.append((".".join(x for x in (prefix, name, str(k), "mlp") if x), mlp))
    return found


def _why_not_tileable(mlp: torch.nn.Module) -> str | None:
    """Why ``mlp`` cannot be tiled along the tokens, or ``None`` when it is a gated MLP of the LlamaMLP shape."""
    kids = mlp._modules
    if [k for k in _MOE_CHILDREN if k in kids] or hasattr(mlp, "num_experts"):
        return ("it is a mixture-of-experts block (routing and load balancing see all tokens of the batch); "
                "tiled MLP supports dense gated MLPs only")
    missing = [k for k in _PROJECTIONS if kids.get(k) is None]
    if missing:
        return f"it has no {missing} submodule(s): not a gated MLP of the LlamaMLP shape (gate_proj, up_proj, down_proj)"
    if any(p is not None for p in mlp._parameters.values()):
        return "it owns parameters outside gate_proj/up_proj/down_proj"
    extra = [k for k, m in kids.items() if k not in _PROJECTIONS and m is not None and any(True for _ in m.parameters())]
    if extra:
        return f"its submodule(s) {extra} hold parameters: only gate_proj/up_proj/down_proj may"
    drop = [n for n, m in mlp.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if drop:
        return f"it applies dropout ({drop}): the backward recompute would draw a different mask"
    gate, up, down = (kids[k] for k in _PROJECTIONS)
    dims = [(getattr(m, "in_features", None), getattr(m, "out_features", None)) for m in (gate, up, down)]
    if all(d is not None for pair in dims for d in pair):
        (gi, go), (ui, uo), (di, do) = dims
        if not (gi == ui == do and go == uo == di):
            return (f"its projections' shapes do not chain as hidden -> intermediate -> hidden (gate {gi}->{go}, "
                    f"up {ui}->{uo}, down {di}->{do})")
    return None


def enable_tiled_mlp(model: torch.nn.Module, *, tile_tokens: int) -> list[str]:
    """Make every decoder layer's MLP run ``tile_tokens`` tokens at a time (see [Note: tiled MLP]).

    Validates everything before changing anything: ``ValueError`` for a bad ``tile_tokens``, a model without
    decoder-layer MLPs, or an MLP that is not a dense gated MLP (mixture of experts, dropout). Idempotent:
    enabling again sets the new tile size. Composes with gradient checkpointing, Ulysses sequence parallelism,
    weight flow and the offload engine. Returns the qualified names of the tiled modules.
    """
    tile = _check_tile(tile_tokens)
    mlps = find_decoder_mlps(model)
    if not mlps:
        raise ValueError(f"enable_tiled_mlp: {type(model).__name__} has no decoder layers with an `mlp` submodule "
                         "(children of an nn.ModuleList of model.get_decoder()); tiled MLP supports Llama-style "
                         "decoders (Llama, Qwen2/3, Mistral)")
    for name, mlp in mlps:
        why = _why_not_tileable(mlp)
        if why is not None:
            raise ValueError(f"enable_tiled_mlp: cannot tile {name} ({type(mlp).__name__}): {why}. Leave "
                             "tile_tokens unset (0) for this model")
    for _, mlp in mlps:
        current = mlp.__dict__.get("forward")
        if isinstance(current, _TiledForward):
            current.tile_tokens = tile
        else:
            mlp.forward = _TiledForward(mlp, tile, current)
    return [name for name, _ in mlps]


def disable_tiled_mlp(model: torch.nn.Module) -> int:
    """Undo :func:`enable_tiled_mlp` (each MLP gets back the forward it had); returns how many were restored."""
    restored = 0
    for _, mlp in find_decoder_mlps(model):
        current = mlp.__dict__.get("forward")
        if isinstance(current, _TiledForward):
            if current.previous is None:
                del mlp.__dict__["forward"]
            else:
                mlp.forward = current.previous
            restored += 1
    return restored

