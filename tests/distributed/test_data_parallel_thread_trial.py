"""[Note: the thread trial] under data parallel, over gloo on CPU.

Two ranks share a host (three pretended cores each, two planned CPU Adam threads). The trial runs on both: each
step's samples are agreed (the slowest rank's iteration and host pass), so both ranks reach the same verdict at the
same step and run the same count after it. In the ``mixed`` law one more thread makes rank 0's pass much faster
and rank 1's a little slower: the slowest pass gets faster, and so does the step both ranks wait for; a rank that
judged its own pass alone would keep two threads on rank 1 and take three on rank 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_dp_thread_trial_worker.py")


@pytest.mark.parametrize(("law", "chosen"), [("faster", 3), ("slower", 2), ("mixed", 3)])
def test_the_ranks_trial_together_and_agree(law: str, chosen: int, launcher, tmp_path: Path) -> None:
    fin = launcher(WORKER, 2, [str(tmp_path), law], deadline=240.0)
    assert fin.returncodes == [0, 0], "\n".join(fin.outputs)
    res = [torch.load(tmp_path / f"result_rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        record = r["threads"]
        assert record is not None, f"no thread trial ran: {r}"
        assert (record["planned"], record["trial"], record["chosen"]) == (2, 3, chosen), record
        assert r["planned"] == chosen and r["settled"]
        assert any(f"runs {chosen} threads" in t for t in r["told"]), r["told"]
    # the same samples: the same verdict, reached at the same step, and every pass after it at the chosen count
    assert res[0]["threads"] == res[1]["threads"]
    assert res[0]["pass_threads"] == res[1]["pass_threads"]
    assert res[0]["pass_threads"][-1] == chosen
