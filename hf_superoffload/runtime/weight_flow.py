"""Weight flow: the bf16 weights live on the host and visit the device one unit at a time.

[Note: weight flow] in docs/weight_flow.md. In ``WeightMode.FLOW`` the home of a host bucket's bf16 weights is
its pinned ``staging`` slice (the CPU Adam writes the new weights there in the same pass). A *unit* is a
transformer block (a child of an ``nn.ModuleList``) or, outside the blocks, the parameters a module owns
directly (embeddings, final norm, LM head). Each parameter keeps its own storage; a released unit's
parameters keep their shape, dtype and device but their storage is resized to 0 bytes, so every tensor that
aliases a parameter (the weight views autograd saves for backward) sees the data again as soon as the unit is
materialized into the same storage (the technique of FSDP's unsharded parameters).

When what happens (``WeightUnit.state``: RELEASED <-> MATERIALIZED):

* forward pre-hook of a unit's module: wait until its buckets' staging is final, allocate, copy host -> device
  on the ``weights`` stream, make the compute stream wait on the copy's event; prefetch the next unit of
  the recorded forward order if its staging is already final (never blocks before this unit's kernels are
  queued).
* forward post-hook: release (also with grad enabled: saved weights alias the released storage and are
  refilled before backward), hook the outputs' gradients (pre-backward), prefetch the next unit (may block on
  the CPU Adam: this unit's kernels are queued by then).
* pre-backward (the first gradient of the unit's outputs; under gradient checkpointing this precedes the
  recompute): materialize again, prefetch the previous unit of the forward order.
* post-accumulate-grad of the unit's last parameter: release. The end of every backward releases whatever is
  left (parameters that got no gradient).

A recompute that runs the module's hooks (``torch.utils.checkpoint`` around ``module.__call__``) finds the
unit materialized by its pre-backward hook and leaves it so: the backward that follows needs it.

Device memory: the unit in use plus the one prefetched; with tied input/output embeddings the shared unit
stays resident from the LM head's backward to the embedding's. Host-to-device traffic: twice the weights per
step (forward and backward), with or without checkpointing.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .host_memory import exact_storage

__all__ = ["FlowStats", "UnitState", "WeightStreamer", "WeightUnit", "forward_roots"]

logger = logging.getLogger("hf_superoffload")


class UnitState(enum.Enum):
    RELEASED = "released"
    """Parameters' storages are 0 bytes; the weights exist only in host staging."""
    MATERIALIZED = "materialized"
    """Storages allocated and filled (or being filled: the copy's ``event``) from staging."""


@dataclass(eq=False, repr=False)
class WeightUnit:
    """Parameters that visit the device together.

    Attributes:
        sources: per parameter, its flat bf16 slice of host staging (the weights' home).
        buckets: host buckets whose staging the unit reads (each must be final before a fetch).
        event: recorded on the weights stream after the copy (``None`` on CPU); consumers wait on it.
        active: forwards of the unit's modules in progress (nested uses of a shared unit).
        grads: parameters whose gradient was accumulated in the current backward.
    """

    index: int
    name: str
    params: list[torch.nn.Parameter]
    sources: list[torch.Tensor]
    buckets: list[Any]
    nbytes: int
    state: UnitState = UnitState.MATERIALIZED
    event: Any = None
    active: int = 0
    grads: set[int] = field(default_factory=set)

    def __repr__(self) -> str:  # never print the parameters: a released one has no data to show
        return f"WeightUnit({self.index}, {self.name!r}, {len(self.params)} params, {self.nbytes} B, {self.state.name})"


@dataclass(eq=False, repr=False)
class _Site:
    """A module whose forward needs ``units`` (a block, or a module outside the blocks owning parameters)."""

    index: int
    name: str
    module: torch.nn.Module
    units: list[WeightUnit]
    last_pos: int = -1


@dataclass
class FlowStats:
    """Observable residency and traffic of the streamer (bytes of weights on the device, not the allocator's)."""

    fetches: int = 0
    h2d_bytes: int = 0
    materialized_bytes: int = 0
    materialized_units: int = 0
    peak_bytes: int = 0
    peak_units: int = 0

    def reset_peak(self) -> None:
        self.peak_bytes, self.peak_units = self.materialized_bytes, self.materialized_units


class _Restore:
    """A removable handle that deletes an instance attribute (the class attribute shows through again)."""

    def __init__(self, obj: Any, name: str) -> None:
        self._obj, self._name = obj, name

    def remove(self) -> None:
        self._obj.__dict__.pop(self._name, None)


def forward_roots(root: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward starts a pass: the model and, for a transformers model, its decoder (a chunked
    LM-head loss calls the decoder, not the model)."""
    roots = [root]
    get_decoder = getattr(root, "get_decoder", None)
    with contextlib.suppress(Exception):  # not a transformers model, or one without a decoder
        decoder = get_decoder() if callable(get_decoder) else None
        if isinstance(decoder, torch.nn.Module) and decoder is not root:
            roots.append(decoder)
    return roots


def _in_backward() -> bool:
    """True inside an autograd graph task (a recompute under checkpointing runs there)."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - very old torch
        return False


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _no_data_functions() -> frozenset[Any]:
    """Torch functions that read a tensor's metadata, autograd fields or hooks, never its elements."""
    T = torch.Tensor
    getters = ("shape", "dtype", "device", "layout", "requires_grad", "grad", "_grad", "is_leaf", "grad_fn",
               "_grad_fn", "_version", "ndim", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
               "is_mkldnn", "is_nested", "is_xpu", "is_mps", "itemsize", "nbytes", "names", "retains_grad",
               "_backward_hooks", "_post_accumulate_grad_hooks", "output_nr", "_base", "_cdata")
    setters = ("requires_grad", "grad", "_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
               "element_size", "is_floating_point", "is_complex", "is_signed", "untyped_storage", "storage",
               "_typed_storage", "data_ptr", "get_device", "register_hook", "register_post_accumulate_grad_hook",
               "requires_grad_", "retain_grad", "__hash__", "__len__", "is_pinned", "is_shared", "_is_view",
               "is_inference")
    found: set[Any] = set()
    for name in getters:
        if (d := getattr(T, name, None)) is not None and hasattr(d, "__get__"):
            found.add(d.__get__)
    for name in setters:
        if (d := getattr(T, name, None)) is not None and hasattr(d, "__set__"):
            found.add(d.__set__)
    if hasattr(T.grad, "__delete__"):
        found.add(T.grad.__delete__)
    found.update(f for name in methods if (f := getattr(T, name, None)) is not None)
    found.add(torch._C._VariableFunctions._has_compatible_shallow_copy_type)
    return frozenset(found)


_NO_DATA = _no_data_functions()


class _StreamedParameter(torch.nn.Parameter):
    """The class of a streamed parameter while its streamer is open (``torch.nn.Parameter`` again after ``close``).

    Between uses a streamed parameter's storage is 0 bytes: reading it would read freed memory (a segfault on the
    CPU, a sticky illegal-address error that ends the process on CUDA). Any torch function that would read a
    released one raises with the fix instead; metadata, ``.grad`` and hooks read as usual (``_NO_DATA``), and
    ``detach`` while a state dict is taken (its entries are then replaced by the staging, ``_state_dict_hook``).
    A materialized parameter behaves exactly as a ``Parameter``. The check costs about 3 us per torch call that
    takes a streamed parameter, a few hundred calls per forward (F.linear on the CPU: 3.4 -> 6.5 us, most of it
    Python's dispatch to ``__torch_function__``), against milliseconds of the kernels they launch.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                           ) -> Any:
        if func not in _NO_DATA:
            # one level of lists (torch.cat, the foreach functions); not _tensors(): this runs on every torch call
            # that takes a streamed parameter, and its recursion costs microseconds more per call
            for a in (*args, *kwargs.values()) if kwargs else args:
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if (check := getattr(t, "_superoffload_check", None)) is not None:
                        check(t, func)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


class WeightStreamer:
    """Executes weight flow for the host-bucket parameters of one model (see the module docstring).

    Args:
        root: the model. Its forward, or its decoder's (``root.get_decoder()``, which a chunked LM-head loss calls
            directly), marks the start and end of a pass, for the recorded order: the outermost one of them
            running counts (a nesting depth).
        sources: ``id(param) -> (param, flat staging view, bucket)`` for every parameter to stream.
        staging_final: ``(bucket, block) -> bool``: whether the bucket's staging holds the final weights for
            the current step; with ``block`` it waits for them (and raises where they cannot become final).
        stream: the copy stream (``StreamSet.weights``), ``None`` on CPU.
        on_h2d: called with the bytes of each fetch (engine telemetry).
        synchronize: makes every bucket final (used before reading staging for a state dict).
    """

    def __init__(
        self,
        *,
        root: torch.nn.Module,
        sources: dict[int, tuple[torch.nn.Parameter, torch.Tensor, Any]],
        staging_final: Callable[[Any, bool], bool],
        stream: torch.cuda.Stream | None,
        on_h2d: Callable[[int], None],
        synchronize: Callable[[], None],
    ) -> None:
        self._staging_final = staging_final
        self._stream = stream
        self._on_h2d = on_h2d
        self._synchronize = synchronize
        self.stats = FlowStats()
        self._pinned = 0
        self._closed = False
        self._cursor = 0
        self._trace: list[int] = []
        self._order: list[int] | None = None
        self._callback_queued = False
        self._root_depth = 0
        self._handles: list[Any] = []
        self._loaded_home: dict[int, list[str]] = {}  # per module: entries loaded into staging, not the parameter
        self._saving = 0  # state dicts being taken (nesting depth): detach() of a released parameter is theirs
        self._normalize_storages([p for p, _, _ in sources.values()])
        self.units, self._sites = self._build_units(root, sources)
        self._unit_of: dict[int, WeightUnit] = {id(p): u for u in self.units for p in u.params}
        self._names = {id(p): n for n, p in reversed(list(root.named_parameters(remove_duplicate=False)))}
        self._guard_reads()
        self._install_hooks(root)
        self.stats.materialized_bytes = sum(u.nbytes for u in self.units)  # they start on the device
        self.stats.materialized_units = len(self.units)
        for u in self.units:
            self._release(u)
        self.stats.reset_peak()

    # ------------------------------------------------------------------------------------------------
    # construction
    @staticmethod
    def _normalize_storages(params: Sequence[torch.nn.Parameter]) -> None:
        """Every streamed parameter must own exactly its storage (resizing it must touch nothing else)."""
        seen: set[int] = set()
        for p in params:
            st = p.untyped_storage()
            own = (p.is_contiguous() and p.storage_offset() == 0 and st.nbytes() == p.numel() * p.element_size()
                   and st.resizable() and st.data_ptr() not in seen)
            if not own:
                with torch.no_grad():
                    p.data = p.data.clone(memory_format=torch.contiguous_format)
            seen.add(p.untyped_storage().data_ptr())

    def _build_units(self, root: torch.nn.Module, sources: dict[int, tuple[torch.nn.Parameter, torch.Tensor, Any]],
                     ) -> tuple[list[WeightUnit], list[_Site]]:
        units: list[WeightUnit] = []
        unit_of: dict[int, WeightUnit] = {}

        def new_unit(name: str, params: list[torch.nn.Parameter]) -> None:
            srcs = [sources[id(p)][1] for p in params]
            buckets = list({id(b): b for b in (sources[id(p)][2] for p in params)}.values())
            u = WeightUnit(len(units), name, params, srcs, buckets, sum(p.numel() * p.element_size() for p in params))
            units.append(u)
            for p in params:
                unit_of[id(p)] = u

        blocks: list[tuple[str, torch.nn.Module]] = []
        inside: set[int] = set()  # modules inside a block (hooked through the block)
        for name, m in root.named_modules():
            if isinstance(m, torch.nn.ModuleList) and id(m) not in inside:
                for k, child in enumerate(m):
                    ps = [p for p in child.parameters() if id(p) in sources and id(p) not in unit_of]
                    if not ps:
                        continue
                    new_unit(f"{name}.{k}", ps)
                    blocks.append((f"{name}.{k}", child))
                    inside.update(id(x) for x in child.modules())
        leaves: list[tuple[str, torch.nn.Module]] = []
        for name, m in root.named_modules(remove_duplicate=False):
            if id(m) in inside:
                continue
            direct = [p for p in m._parameters.values() if p is not None and id(p) in sources]
            if not direct:
                continue
            fresh = [p for p in direct if id(p) not in unit_of]
            if fresh:
                new_unit(name or "<root>", fresh)
            leaves.append((name or "<root>", m))
        sites: list[_Site] = []
        for name, m in blocks:
            us = list({id(u): u for u in (unit_of[id(p)] for p in m.parameters() if id(p) in unit_of)}.values())
            sites.append(_Site(len(sites), name, m, us))
        seen_modules: set[int] = set()
        for name, m in leaves:
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            us = list({id(u): u for u in (unit_of[id(p)] for p in m._parameters.values()
                                           if p is not None and id(p) in unit_of)}.values())
            sites.append(_Site(len(sites), name, m, us))
        return units, sites

    def _guard_reads(self) -> None:
        """Make reading a released parameter raise (``_StreamedParameter``); only exact ``Parameter`` objects: another
        subclass keeps its own ``__torch_function__``."""
        for u in self.units:
            for p in u.params:
                if type(p) is torch.nn.Parameter:
                    p.__class__ = _StreamedParameter
                    p._superoffload_check = self._check_read  # type: ignore[attr-defined]

    def _check_read(self, p: torch.Tensor, func: Any) -> None:
        u = self._unit_of.get(id(p))
        if u is None or u.state is UnitState.MATERIALIZED:
            return
        if self._saving and func is torch.Tensor.detach:
            return
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        if self._closed:
            raise RuntimeError(
                f"hf_superoffload weight flow: {self._names.get(id(p), 'this parameter')} holds no weights ({what}): "
                "they could not be brought back to the device when the optimizer closed after a failed step; load "
                "the last checkpoint instead")
        raise RuntimeError(
            f"hf_superoffload weight flow: {self._names.get(id(p), 'this parameter')} holds no data between uses "
            f"({what}): its weights live on the host and stream in per layer. Read it inside `with "
            "optimizer.materialized():`, or take model.state_dict() (its entries are the host weights)")

    def _saving_starts(self, *args: Any) -> None:
        self._saving += 1

    def _install_hooks(self, root: torch.nn.Module) -> None:
        h = self._handles
        for r in forward_roots(root):
            h.append(r.register_forward_pre_hook(self._root_pre_forward))
            # always_call: an exception inside the pass must not leave the depth raised
            h.append(r.register_forward_hook(self._root_post_forward, always_call=True))
        for site in self._sites:
            h.append(site.module.register_forward_pre_hook(lambda m, a, site=site: self._pre_forward(site)))
            h.append(site.module.register_forward_hook(lambda m, a, out, site=site: self._post_forward(site, out)))
        for m in root.modules():
            if any(p is not None and id(p) in self._unit_of for p in m._parameters.values()):
                h.append(m.register_state_dict_pre_hook(self._saving_starts))
                h.append(m.register_state_dict_post_hook(lambda *a: self._state_dict_hook(*a)))
                h.append(m.register_load_state_dict_pre_hook(lambda *a: self._load_pre_hook(*a)))
                h.append(m.register_load_state_dict_post_hook(lambda *a: self._load_post_hook(*a)))
        for u in self.units:
            for p in u.params:
                h.append(p.register_post_accumulate_grad_hook(lambda p, u=u: self._on_grad(u, p)))
        self._guard_apply(root)

    def _guard_apply(self, root: torch.nn.Module) -> None:
        """``model.to()``/``.half()``/... on released parameters would read storage that is not there (a
        segfault): refuse it with the fix instead, unless every unit is materialized."""
        original = root._apply
        streamer = self

        def _apply(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if not streamer._closed and any(u.state is UnitState.RELEASED for u in streamer.units):
                raise RuntimeError(
                    "hf_superoffload weight flow: the model's weights live on the host and stream in per layer, so "
                    "it cannot be moved or cast now (model.to / .half / .cuda ...). Place and cast the model before "
                    "building SuperOffloadOptimizer, or do it inside `with optimizer.materialized():`."
                )
            return original(fn, *args, **kwargs)

        root._apply = _apply  # instance attribute: this model only; removed by close()
        self._handles.append(_Restore(root, "_apply"))

    # ------------------------------------------------------------------------------------------------
    # mechanism
    def _current(self) -> Any:
        return None if self._stream is None else torch.cuda.current_stream(self._stream.device)

    def _fetch(self, u: WeightUnit, *, block: bool) -> bool:
        """Materialize ``u`` (no-op when it is). False when ``block`` is off and its staging is not final yet."""
        if u.state is UnitState.MATERIALIZED:
            return True
        for b in u.buckets:
            if not self._staging_final(b, block):
                return False
        with torch.profiler.record_function("superoffload::weight_fetch"):
            for p in u.params:  # allocated on the compute stream: freed memory is reused in its order
                p.untyped_storage().resize_(p.numel() * p.element_size())
            u.state = UnitState.MATERIALIZED  # its parameters may be read from here on (the copy below)
            if self._stream is None:
                for p, src in zip(u.params, u.sources):
                    p.data.copy_(src.view(p.shape))  # .data: a new version counter, saved tensors stay valid
                u.event = None
            else:
                self._stream.wait_stream(self._current())
                with torch.cuda.stream(self._stream):
                    for p, src in zip(u.params, u.sources):
                        p.data.copy_(src.view(p.shape), non_blocking=True)
                    u.event = torch.cuda.Event()
                    u.event.record(self._stream)
        s = self.stats
        s.fetches += 1
        s.h2d_bytes += u.nbytes
        s.materialized_bytes += u.nbytes
        s.materialized_units += 1
        s.peak_bytes = max(s.peak_bytes, s.materialized_bytes)
        s.peak_units = max(s.peak_units, s.materialized_units)
        self._on_h2d(u.nbytes)
        return True

    def _use(self, u: WeightUnit) -> None:
        """Order the current stream after ``u``'s copy."""
        if u.event is not None:
            self._current().wait_event(u.event)

    def _release(self, u: WeightUnit) -> None:
        if u.state is UnitState.RELEASED or u.active or self._pinned or self._closed:
            return
        self._use(u)  # the storage returns to the compute stream's pool: after the copy into it is done
        u.event = None
        for p in u.params:
            p.untyped_storage().resize_(0)
        u.state = UnitState.RELEASED
        u.grads.clear()
        self.stats.materialized_bytes -= u.nbytes
        self.stats.materialized_units -= 1

    def release_all(self) -> None:
        """Release every unit not in use (e.g. after staging was rewritten by loading a state)."""
        for u in self.units:
            self._release(u)

    def _prefetch(self, pos: int, *, block: bool) -> None:
        order = self._order
        if order is None or not 0 <= pos < len(order):
            return
        for u in self._sites[order[pos]].units:
            self._fetch(u, block=block)

    # ------------------------------------------------------------------------------------------------
    # hooks
    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if _in_backward():
            return
        self._root_depth += 1
        if self._root_depth > 1:  # the decoder inside the model's forward: the pass started already
            return
        self._saving = 0  # a state dict that raised never ran its post hooks
        for u in self.units:
            u.active = 0  # a forward that raised never ran its post-forward hooks
        self.release_all()  # left over by an interrupted pass: never carry weights across a step
        self._cursor, self._trace = 0, []

    def _root_post_forward(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if _in_backward():
            return
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth == 0 and self._trace and self._trace != self._order:
            self._order = list(self._trace)

    def _matches(self, site: _Site, pos: int) -> bool:
        order = self._order
        return order is not None and pos < len(order) and order[pos] == site.index

    def _pre_forward(self, site: _Site) -> None:
        if self._closed:
            return
        if _in_backward():
            # a recompute: the pre-backward hook materialized the unit already. Not counted as active: torch's
            # non-reentrant checkpoint stops the recompute early, without running the post-forward hook.
            for u in site.units:
                self._fetch(u, block=True)
                self._use(u)
            return
        pos = self._cursor
        self._cursor += 1
        self._trace.append(site.index)
        site.last_pos = pos
        for u in site.units:
            u.active += 1
            self._fetch(u, block=True)
            self._use(u)
        if self._matches(site, pos):
            self._prefetch(pos + 1, block=False)

    def _post_forward(self, site: _Site, out: Any) -> None:
        if self._closed or _in_backward():
            return  # recompute: the backward of these weights follows; released when their gradients arrive
        for u in site.units:
            u.active -= 1
        pos = site.last_pos
        outs = [t for t in _tensors(out) if t.requires_grad]
        if outs and torch.is_grad_enabled():
            order = self._order if self._matches(site, pos) else None
            torch.autograd.graph.register_multi_grad_hook(
                outs, lambda grad, site=site, pos=pos, order=order: self._pre_backward(site, pos, order), mode="any")
        for u in site.units:
            self._release(u)
        if self._matches(site, pos):
            self._prefetch(pos + 1, block=True)

    def _pre_backward(self, site: _Site, pos: int, order: list[int] | None) -> None:
        if self._closed:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for u in site.units:
            self._fetch(u, block=True)
            self._use(u)
        if order is not None and order is self._order:
            self._prefetch(pos - 1, block=False)

    def _on_grad(self, u: WeightUnit, p: torch.Tensor) -> None:
        u.grads.add(id(p))
        if len(u.grads) == len(u.params):
            self._release(u)

    def _end_backward(self) -> None:
        self._callback_queued = False
        self.release_all()

    @contextlib.contextmanager
    def using(self, module: torch.nn.Module) -> Iterator[None]:
        """``module``'s streamed weights are on the device inside the block, for code that reads ``.weight``
        without calling the module (a chunked LM-head loss); released after it."""
        units = list({id(u): u for p in module.parameters() if (u := self._unit_of.get(id(p))) is not None}.values())
        for u in units:
            u.active += 1
            self._fetch(u, block=True)
            self._use(u)
        try:
            yield
        finally:
            for u in units:
                u.active -= 1
                self._release(u)

    # ------------------------------------------------------------------------------------------------
    # reading the weights outside training
    @contextlib.contextmanager
    def materialized(self) -> Iterator[None]:
        """Every streamed parameter holds its weights on the device inside the block (evaluation, saving)."""
        self._pinned += 1
        try:
            for u in self.units:
                self._fetch(u, block=True)
                self._use(u)
            yield
        finally:
            self._pinned -= 1
            if not self._pinned:
                self.release_all()

    def _state_dict_hook(self, module: torch.nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """A released parameter's state-dict entry becomes its weights' home, the host staging (its exact bytes, no
        copy: a save of the whole model would otherwise hold a host copy of every released weight at once)."""
        self._saving = max(0, self._saving - 1)
        for name, p in module._parameters.items():
            u = None if p is None else self._unit_of.get(id(p))
            if u is None or u.state is UnitState.MATERIALIZED or prefix + name not in sd:
                continue
            self._synchronize()
            i = next(k for k, q in enumerate(u.params) if q is p)
            for b in u.buckets:
                self._staging_final(b, True)
            sd[prefix + name] = exact_storage(u.sources[i]).view(p.shape)

    def _load_pre_hook(self, module: torch.nn.Module, sd: dict[str, Any], prefix: str, local_metadata: Any,
                       strict: bool, missing: list[str], unexpected: list[str], errors: list[str]) -> None:
        """``load_state_dict`` writes a streamed parameter's entry into its weights' home, the host staging. A
        released parameter has no storage to copy into (torch's copy would write through a 0-byte storage): its
        entry is taken out of this module's view of the state dict here and out of the missing keys after
        (``_load_post_hook``). A materialized one is copied into by torch as usual, and its staging here, so the
        next fetch brings back what was loaded. An entry of another shape is left to torch, which reports it."""
        taken: list[str] = []
        entries: list[tuple[str, torch.nn.Parameter, WeightUnit, torch.Tensor]] = []
        for name, p in module._parameters.items():
            u = None if p is None else self._unit_of.get(id(p))
            key = prefix + name
            value = sd.get(key)
            if u is None or not isinstance(value, torch.Tensor) or value.shape != p.shape:
                continue
            if local_metadata.get("assign_to_params_buffers", False):
                raise ValueError(f"{key}: weight flow streams this model's weights from the host, so "
                                 "load_state_dict(assign=True) cannot replace them; load without assign=True")
            entries.append((key, p, u, value))
        if entries:
            self._synchronize()  # once per module: no CPU pass writes the staging behind these copies
        for key, p, u, value in entries:
            for b in u.buckets:
                self._staging_final(b, True)
            i = next(k for k, q in enumerate(u.params) if q is p)
            with torch.no_grad():
                u.sources[i].view(p.shape).copy_(value)
            if u.state is UnitState.RELEASED:
                del sd[key]
                taken.append(key)
        if taken:
            self._loaded_home[id(module)] = taken

    def _load_post_hook(self, module: torch.nn.Module, incompatible: Any) -> None:
        taken = set(self._loaded_home.pop(id(module), ()))
        if taken:  # loaded into staging: not missing
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in taken]

    def close(self, *, materialize: bool = True) -> None:
        """Remove the hooks; with ``materialize`` every parameter gets its weights back on the device for good."""
        if self._closed:
            return
        try:
            if materialize:
                for u in self.units:
                    self._fetch(u, block=True)
                    self._use(u)
        finally:
            self._closed = True
            for h in self._handles:
                h.remove()
            self._handles.clear()
            for u in self.units:  # a unit left released (a failed step) keeps refusing reads
                if u.state is UnitState.MATERIALIZED:
                    for p in u.params:
                        if type(p) is _StreamedParameter:
                            p.__class__ = torch.nn.Parameter
                            del p._superoffload_check
