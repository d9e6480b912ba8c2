"""HostBuffer: exact size, page-locked on whole pages of its own, registered as long as the object lives; the
engine's small pinned buffers really are pinned (a pageable destination makes a non-blocking D2H synchronous)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from hf_superoffload.runtime import host_memory
from hf_superoffload.runtime.host_memory import HostBuffer


class _FakeCudart:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, nbytes))
        for p, n in self.registered.items():
            if ptr < p + n and p < ptr + nbytes:
                return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        return 0 if self.registered.pop(ptr, None) is not None else 713


@pytest.fixture
def fake_cudart(monkeypatch: pytest.MonkeyPatch) -> _FakeCudart:
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.mark.parametrize("numel", [1, 3, 452, 1023, 1024, 4097, 300_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pinned_buffer_registers_whole_pages_of_its_own(fake_cudart: _FakeCudart, numel: int,
                                                         dtype: torch.dtype) -> None:
    page = host_memory._PAGE
    bufs = [HostBuffer(numel, dtype, pin=True, name=f"b{i}") for i in range(3)]  # neighbours on the heap
    for buf in bufs:
        t = buf.tensor
        assert buf.pinned and t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
        assert buf.nbytes == numel * t.element_size()
        start = t.data_ptr()
        assert start % page == 0
        assert fake_cudart.registered[start] >= buf.nbytes and fake_cudart.registered[start] % page == 0
        t.fill_(1)  # the whole range is usable memory
    assert len(fake_cudart.registered) == 3  # no page shared: no registration refused


def test_registration_ends_with_the_buffer_object(fake_cudart: _FakeCudart) -> None:
    buf = HostBuffer(100, torch.float32, pin=True, name="stats")
    ptr = buf.tensor.data_ptr()
    keep = buf.tensor.view(-1, 2)  # what a user of the rows holds
    assert ptr in fake_cudart.registered
    del buf
    gc.collect()
    assert ptr not in fake_cudart.registered  # so the owner must be kept: the engine keeps it (next test)
    assert keep.shape == (50, 2)


def test_unpinned_buffer_is_plain_exact_memory() -> None:
    buf = HostBuffer(7, torch.bfloat16, pin=False, name="x")
    assert not buf.pinned and buf.tensor.shape == (7,) and buf.tensor.dtype == torch.bfloat16
    assert HostBuffer(0, torch.float32, pin=True, name="empty").tensor.numel() == 0


def test_reserved_room_grows_in_place_with_the_contents_kept() -> None:
    """[Note: reserved room in the host arenas]: ``grow`` takes the reserved room in place; past it, it refuses and
    changes nothing (the caller regrows)."""
    buf = HostBuffer(5, torch.float32, pin=False, name="a", reserve=7)
    buf.tensor.copy_(torch.arange(5.0))
    ptr = buf.tensor.data_ptr()
    assert buf.capacity == 12 and buf.tensor.shape == (5,)
    assert buf.grow(3) and buf.tensor.shape == (5,)  # a smaller share: nothing to do
    assert buf.grow(12) and buf.tensor.data_ptr() == ptr and buf.tensor.shape == (12,)
    assert buf.tensor[:5].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert not buf.grow(13) and buf.tensor.shape == (12,) and buf.tensor.data_ptr() == ptr
    assert not HostBuffer(5, torch.float32, pin=False, name="exact").grow(6)


def test_no_room_is_reserved_where_address_space_is_charged_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under strict overcommit the room would take from the commit limit, and a host that refuses the address space
    gets the exact share: either way an exact buffer that a move regrows."""
    monkeypatch.setattr(host_memory, "_strict_overcommit", lambda: True)
    buf = HostBuffer(5, torch.float32, pin=False, name="strict", reserve=7)
    assert buf.capacity == 5 and buf.tensor.shape == (5,) and not buf.grow(6)
    monkeypatch.setattr(host_memory, "_strict_overcommit", lambda: False)

    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(host_memory, "_untouched_bytes", refuse)
    buf = HostBuffer(5, torch.float32, pin=False, name="refused", reserve=7)
    assert buf.capacity == 5 and buf.tensor.shape == (5,) and not buf.grow(6)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * host_memory._PAGE


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
@pytest.mark.parametrize("deterministic", [False, True])
def test_reserved_room_is_address_space_not_resident_memory(deterministic: bool) -> None:
    """A GiB reserved past a small buffer leaves the resident memory as it was, also where deterministic algorithms
    make ``torch.empty`` fill what it allocates; the pages the buffer grows into become resident when written."""
    before_flag = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        rss = _resident_bytes()
        buf = HostBuffer(1024, torch.float32, pin=False, name="big room", reserve=2**28)
        assert _resident_bytes() - rss < 64 * 2**20
        assert buf.grow(2**26)
        buf.tensor.fill_(1.0)  # 256 MiB written
        assert _resident_bytes() - rss > 200 * 2**20
    finally:
        torch.use_deterministic_algorithms(before_flag)


def test_a_pinned_buffer_grows_under_one_registration_of_the_whole_range(fake_cudart: _FakeCudart) -> None:
    """Growing a page-locked buffer registers its whole grown range once (a copy across the old end would span two
    registrations otherwise), only the used pages, and the registration still ends with the object."""
    page = host_memory._PAGE
    buf = HostBuffer(1000, torch.float32, pin=True, name="landing", reserve=5000)
    ptr = buf.tensor.data_ptr()
    assert buf.pinned and fake_cudart.registered == {ptr: -(-4000 // page) * page}
    assert buf.grow(6000) and buf.pinned and buf.tensor.data_ptr() == ptr
    assert fake_cudart.registered == {ptr: -(-24000 // page) * page}
    assert [c[0] for c in fake_cudart.calls] == ["register", "unregister", "register"]
    del buf
    gc.collect()
    assert fake_cudart.registered == {}


def test_a_pinned_buffer_that_cannot_lock_its_grown_range_stays_as_it_was(fake_cudart: _FakeCudart,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The host refuses to lock the grown range (``ulimit -l``): the error names the fix, and the buffer keeps its
    size, its contents and its registration."""
    page = host_memory._PAGE
    buf = HostBuffer(1000, torch.float32, pin=True, name="landing", reserve=5000)
    buf.tensor.copy_(torch.arange(1000.0))
    ptr, locked = buf.tensor.data_ptr(), fake_cudart.cudaHostRegister

    def limited(p: int, nbytes: int, flags: int) -> int:
        return 2 if nbytes > 4 * page else locked(p, nbytes, flags)  # cudaErrorMemoryAllocation

    monkeypatch.setattr(fake_cudart, "cudaHostRegister", limited)
    with pytest.raises(RuntimeError, match="pin_memory=False"):
        buf.grow(6000)
    assert buf.pinned and buf.tensor.shape == (1000,) and buf.tensor.data_ptr() == ptr
    assert torch.equal(buf.tensor, torch.arange(1000.0))
    assert fake_cudart.registered == {ptr: -(-4000 // page) * page}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_statistics_copy_does_not_block_the_host() -> None:
    """A non-blocking D2H into the engine's statistics rows returns before the stream gets there."""
    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload.testing import tiny_llama

    model = tiny_llama().to("cuda", torch.bfloat16)
    opt = SuperOffloadOptimizer(model, lr=1e-3, config=SuperOffloadConfig(gpu_resident_buckets=0))
    try:
        rows = opt.engine.layout.grad_stats_host
        # (``rows.is_pinned()`` is False: torch asks about the storage's first byte, and the registered pages
        # start after it; the copy below is what matters)
        assert opt.engine.layout.grad_stats_buf.pinned
        src = torch.ones(rows.shape[1:], device="cuda")  # one bucket's spread statistics rows
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # src is written on the current stream
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the copy
            rows[0].copy_(src, non_blocking=True)
            done = stream.record_event()
        assert not done.query(), "the copy waited for the stream: its destination is pageable"
        done.synchronize()
        assert rows[0].sum(dim=0).tolist() == [rows.shape[1]] * 2
    finally:
        opt.close()
