"""``Preemption`` as a context manager (the hand-written Accelerate loop's form): its SIGTERM handler exists only
inside the block and never replaces one of the user's; entered before torch.distributed, it refuses to decide alone.
The signal itself is sent in tests/distributed/test_accelerate_preemption.py (a process of its own)."""

from __future__ import annotations

import signal

import pytest

from hf_superoffload.integrations import _preemption
from hf_superoffload.integrations.accelerate import Preemption


def test_the_handler_lives_inside_the_block_only() -> None:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with Preemption() as preemption:
        assert signal.getsignal(signal.SIGTERM) == preemption._on_sigterm
        assert preemption.should_stop() is False and preemption.stopping is False
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_of_the_user_is_left_alone() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with Preemption() as preemption:
            assert signal.getsignal(signal.SIGTERM) is mine
            assert preemption.should_stop() is False
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_entered_before_the_process_group_it_refuses_to_decide_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    with Preemption() as preemption:  # one process: no group
        monkeypatch.setattr(_preemption, "_distributed", lambda: True)  # ... then several ranks appear
        with pytest.raises(RuntimeError, match="create the Accelerator before entering Preemption"):
            preemption.should_stop()
