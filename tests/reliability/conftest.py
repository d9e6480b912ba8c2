"""Shared helpers for the reliability tests (CPU, tiny models).

Test modules cannot import each other in importlib mode, so the helpers travel in the ``rel`` fixture.
Every optimizer a test builds through ``rel.optimizer`` is closed at teardown, so no test leaves a worker
thread behind in the pytest process.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.testing import master_of, state_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("ACCELERATE_MIXED_PRECISION", None)

# ~2k elements per bucket: a dozen buckets on the tiny Llama, two of them GPU-resident (on the CPU: "device")
CFG = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=2, worker_timeout_s=30)
WORKER_THREAD = "superoffload-cpu"


def batches(n: int, seed: int = 1, bs: int = 2, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (bs, seq), generator=g) for _ in range(n)]


def train(model: torch.nn.Module, opt: Any, data: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    return losses


def snapshot(model: torch.nn.Module, opt: SuperOffloadOptimizer, *, sync: bool = True) -> dict[str, Any]:
    """Copies of the committed optimizer arenas, the per-parameter step counts and the model weights."""
    if sync:
        opt.synchronize()
    flat = opt.engine.flat_state()
    return {
        "arenas": {f"{side}/{k}": v.detach().cpu().clone() for side, d in flat.items() for k, v in d.items()},
        "steps": list(opt.engine.param_steps),
        "weights": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any], *, exact: bool = True, weights: bool = True,
                      atol: float = 1e-6) -> None:
    """Bitwise (``exact``), or within ``atol`` (the inverse rollback's undo is exact to fp32 rounding)."""
    assert a["steps"] == b["steps"], "per-parameter step counts changed"
    for k, x in a["arenas"].items():
        if exact:
            assert torch.equal(x, b["arenas"][k]), f"optimizer arena {k} changed"
        else:
            torch.testing.assert_close(b["arenas"][k], x, rtol=1e-5, atol=atol, msg=f"optimizer arena {k} changed")
    if weights:
        for n, x in a["weights"].items():
            assert torch.equal(x, b["weights"][n]), f"model weight {n} changed"


def worker_threads() -> set[threading.Thread]:
    """The CPU workers' threads: the worker and, with a D2H gate, its gate thread (``superoffload-cpu-gate``)."""
    return {t for t in threading.enumerate() if t.name.startswith(WORKER_THREAD) and t.is_alive()}


def wait_until(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.005)


def child_module() -> ModuleType:
    """``_kill_child.py`` (the subprocess script) as a module: its Trainer set-up is shared with the parent."""
    path = Path(__file__).with_name("_kill_child.py")
    spec = importlib.util.spec_from_file_location("_reliability_kill_child", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def rel() -> Iterator[SimpleNamespace]:
    built: list[SuperOffloadOptimizer] = []

    def optimizer(model: torch.nn.Module, params: Any = None, **kw: Any) -> SuperOffloadOptimizer:
        kw.setdefault("lr", 1e-3)
        kw.setdefault("config", CFG)
        kw.setdefault("log_plan", False)
        opt = SuperOffloadOptimizer(model, params, **kw)
        built.append(opt)
        return opt

    def track(opt: SuperOffloadOptimizer) -> SuperOffloadOptimizer:
        built.append(opt)
        return opt

    yield SimpleNamespace(
        CFG=CFG, optimizer=optimizer, track=track, batches=batches, train=train, snapshot=snapshot,
        assert_same_state=assert_same_state, worker_threads=worker_threads, wait_until=wait_until,
        rss_bytes=rss_bytes, master_of=master_of, state_of=state_of,
    )
    for opt in built:
        opt.close()


@pytest.fixture(scope="session")
def kill_child() -> ModuleType:
    """The subprocess script ``_kill_child.py`` as a module (``make_trainer``, ``ATOMIC_MODEL``, ...)."""
    return child_module()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: Any, kill_child: Any) -> Path:
    """checkpoint-2 of a 2-step SuperOffloadTrainer run."""
    out = tmp_path_factory.mktemp("ckpt")
    trainer = kill_child.make_trainer(str(out), max_steps=2, save_steps=2)
    trainer.train()
    trainer.superoffload_optimizer.close()
    return out / "checkpoint-2"


@pytest.fixture
def fresh(tmp_path: Path, kill_child: Any) -> Any:
    """A SuperOffloadTrainer with its optimizer built (as at the start of a resumed train())."""
    trainer = kill_child.make_trainer(str(tmp_path / "run"), max_steps=2)
    trainer.create_optimizer()
    yield trainer
    trainer.superoffload_optimizer.close()
