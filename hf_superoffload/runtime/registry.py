"""Which live engine drives each parameter: one engine per parameter, and :func:`module_weights` for readers
that find their engine through the parameters of a module."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["claim", "close_earlier", "module_weights", "release"]

logger = logging.getLogger("hf_superoffload")


class _Engine(Protocol):
    params: list[torch.nn.Parameter]
    _closed: bool

    def close(self) -> None: ...

    def module_weights(self, module: torch.nn.Module) -> contextlib.AbstractContextManager[None]: ...


# The live engine whose hooks drive each parameter (by id; the value is checked with `is` before use).
_ENGINE_OF_PARAM: weakref.WeakValueDictionary[int, _Engine] = weakref.WeakValueDictionary()


def module_weights(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """A context in which ``module``'s parameters hold their final weights on the device, for code that reads
    them without calling the module (a chunked LM-head loss): what the module's forward hooks would do. Weight
    flow streams them in; stationary weights wait for their buckets' update (its upload, on the current stream).
    A no-op for modules no engine owns."""
    for p in module.parameters():
        engine = _ENGINE_OF_PARAM.get(id(p))
        if engine is not None and not engine._closed:
            return engine.module_weights(module)
    return contextlib.nullcontext()


def close_earlier(params: Sequence[torch.nn.Parameter]) -> None:
    """Close an engine that still drives any of ``params`` (its hooks would fire next to the new one's)."""
    for p in params:
        other = _ENGINE_OF_PARAM.get(id(p))
        if other is not None and not other._closed and any(q is p for q in other.params):
            logger.warning("hf_superoffload: these parameters are still driven by an earlier SuperOffloadOptimizer "
                           "that was not closed; closing it now (call opt.close() before building a new one)")
            other.close()


def claim(engine: _Engine) -> None:
    for p in engine.params:
        _ENGINE_OF_PARAM[id(p)] = engine


def release(engine: _Engine) -> None:
    for p in engine.params:
        if _ENGINE_OF_PARAM.get(id(p)) is engine:
            del _ENGINE_OF_PARAM[id(p)]
