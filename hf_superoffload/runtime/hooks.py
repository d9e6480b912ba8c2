"""Hooks: where the model talks to the engine. Gradients arrive through post-accumulate-grad hooks; forwards
wait for their buckets' updated weights through forward pre-hooks.

[Note: unhooked reads] in docs/design.md: a host parameter read without calling its module (a fused loss reading
``lm_head.weight``) has no pre-hook to wait for it; the first step finds such parameters and from then on their
buckets are waited for at the start of every forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .bucket import HostBucket
from .layout import BucketLayout
from .upload import Uploads
from .weight_flow import forward_roots

__all__ = ["Hooks"]

logger = logging.getLogger("hf_superoffload")


class Hooks:
    """Owns every hook the engine puts on the model, and what the first step learns about unhooked reads.

    Attributes:
        roots: the model's forward roots (where the early waits hook in).
        hooked: host parameters whose module's forward hook ran in the first step (``None`` once that step is
            over and the lesson is drawn, and with weight flow, whose own hooks own the weights).
        unhooked: host parameters that got a gradient in the first step without their module's hook running.
        early_waits: their buckets, waited for at the start of every later forward.
    """

    layout: BucketLayout
    roots: list[torch.nn.Module]
    hooked: set[int] | None
    unhooked: set[int]
    early_waits: list[HostBucket]
    _handles: list[RemovableHandle]
    """The gradient hooks and the roots' early waits."""
    _forward_handles: list[RemovableHandle]
    """The forward pre-hooks of the modules owning host parameters (rebuilt when buckets move to the host)."""
    _modules: list[torch.nn.Module]
    _track_unhooked: bool
    _early_hooked: bool
    _learned: set[int]
    """``unhooked`` when the early waits were last set up."""
    _host_bucket_of: dict[int, HostBucket]
    """The host bucket of each host parameter, by ``id``."""
    _index_of: dict[int, int]
    _uploads: Uploads
    _wait: Callable[[HostBucket], None]

    def __init__(self, *, layout: BucketLayout, modules: Sequence[torch.nn.Module], uploads: Uploads,
                 on_grad: Callable[[int], None], wait: Callable[[HostBucket], None], track_unhooked: bool) -> None:
        """
        Args:
            on_grad: called with the parameter's index when its gradient has accumulated.
            wait: the forward's wait for a host bucket's final weights.
            track_unhooked: learn the unhooked reads in the first step (stationary weights).
        """
        self.layout, self._uploads, self._wait = layout, uploads, wait
        self._handles = []
        for i, p in enumerate(layout.params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i, on_grad)))
        self._index_of = {id(p): i for i, p in enumerate(layout.params)}
        self._modules, self._forward_handles, self._early_hooked = list(modules), [], False
        self._hook_forwards()
        self._track_unhooked = track_unhooked
        self.hooked = set() if track_unhooked else None
        self.unhooked, self._learned = set(), set()
        self.early_waits = []
        self.roots = forward_roots(modules[0]) if modules else []

    def _hook_forwards(self) -> None:
        """A forward pre-hook on every module that owns host parameters: it waits for their buckets."""
        owner: dict[int, HostBucket] = {id(p): b for b in self.layout.host_buckets for p in b.params}
        self._host_bucket_of = owner
        for m in self._modules:
            mine = [p for p in m.parameters(recurse=False) if id(p) in owner]
            if mine:
                ordered = sorted({owner[id(p)] for p in mine}, key=lambda b: b.index)
                indices = frozenset(self._index_of[id(p)] for p in mine)
                self._forward_handles.append(m.register_forward_pre_hook(self._make_pre_forward(ordered, indices)))

    def relayout(self) -> None:
        """Buckets moved between the device tail and the host ([Note: moving the tail to the host], [Note: moving
        the tail to the device]): the forward hooks wait for the new set of host buckets, what was learned of
        parameters now on the device is forgotten, and the next step learns the unhooked reads of the moved
        parameters as the first step did."""
        for h in self._forward_handles:
            h.remove()
        self._forward_handles = []
        self._hook_forwards()
        on_host = {b.index for b in self.layout.host_buckets}
        self.unhooked = {i for i in self.unhooked if self.layout.bucket_of[i].index in on_host}
        self._learned = {i for i in self._learned if self.layout.bucket_of[i].index in on_host}
        self.early_waits = [b for b in self.early_waits if b.index in on_host]
        if self._track_unhooked:
            self.hooked = set()

    def _make_grad_hook(self, i: int, on_grad: Callable[[int], None]) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.hooked is not None and i not in self.hooked and isinstance(self.layout.bucket_of[i], HostBucket):
                self.unhooked.add(i)
            on_grad(i)

        return hook

    def _make_pre_forward(self, buckets: list[HostBucket], indices: frozenset[int]) -> Callable[..., None]:
        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            if self.hooked is not None:
                self.hooked.update(indices)
            unwaited = self._uploads.unwaited
            if not unwaited:
                return
            if self.early_waits:
                self._wait_early()
            for b in buckets:
                if b.index in unwaited:
                    self._wait(b)

        return pre_forward

    def _wait_early(self, *_: Any) -> None:
        for b in self.early_waits:
            if b.index in self._uploads.unwaited:
                self._wait(b)

    def wait_for(self, module: torch.nn.Module) -> None:
        """The forward pre-hooks' wait, for every parameter of ``module`` (recursively), without calling it."""
        mine = [p for p in module.parameters() if id(p) in self._host_bucket_of]
        if self.hooked is not None:  # [Note: unhooked reads]: a guarded read
            self.hooked.update(self._index_of[id(p)] for p in mine)
        if self.early_waits:
            self._wait_early()
        for b in sorted({self._host_bucket_of[id(p)] for p in mine}, key=lambda b: b.index):
            if b.index in self._uploads.unwaited:
                self._wait(b)

    def learn_unhooked_reads(self) -> None:
        """After the first step, the host parameters that got a gradient although their module's forward hook
        never ran were read some other way (``F.linear(h, model.lm_head.weight)`` in a fused loss): no hook waits
        for their update, so a later forward could read them half updated. From now on their buckets are waited
        for when any root or hooked module starts a forward."""
        if self.hooked is None:
            return
        self.hooked = None
        if not self.unhooked or self.unhooked == self._learned:
            return  # nothing new since the last lesson (a move to the host relearns: [Note: moving the tail to the host])
        self._learned = set(self.unhooked)
        params = self.layout.params
        names = {id(p): n for n, p in self.roots[0].named_parameters()} if self.roots else {}
        unhooked = sorted(self.unhooked)
        self.early_waits = sorted({self.layout.bucket_of[i] for i in unhooked}, key=lambda b: b.index)  # type: ignore[misc]
        if not self._early_hooked:
            self._early_hooked = True
            for r in self.roots:
                self._handles.append(r.register_forward_pre_hook(self._wait_early))
        shown = [names.get(id(params[i]), f"parameter {i}") for i in unhooked]
        logger.warning(
            "hf_superoffload: %d parameter(s) (%s) got gradients although the forward of the module owning them "
            "never ran: code reads them without calling their module. Their %d bucket(s) are now waited for at the "
            "start of every forward, which hides less CPU work; read them inside "
            "`with hf_superoffload.module_weights(module):` to wait only where they are read.",
            len(unhooked), ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else ""), len(self.early_waits))

    def remove(self) -> None:
        for h in self._handles + self._forward_handles:
            h.remove()
