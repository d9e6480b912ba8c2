"""Ulysses sequence parallelism on CPU/gloo: parity with one process on the whole sequence.

The distributed cases run in ``_ulysses_worker.py`` (2 ranks with sp=2; 4 ranks as a dp=2 x sp=2 mesh and as
sp=4); each rank computes the single-process reference itself (same seed, whole sequence, HF's own loss with
its own label shift, SDPA) and reports the differences. fp32 models, so "within rounding" is ~1e-6.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hf_superoffload import sequence_parallel as sp

WORKER = Path(__file__).with_name("_ulysses_worker.py")
LOSS_TOL = 2e-6  # absolute, losses ~4.8
GRAD_TOL = 1e-5  # max |diff| / max |ref| per parameter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp: Path, nproc: int, sp_size: int, cases: list[str], timeout: float = 150) -> list[dict[str, Any]]:
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-P", str(WORKER), "--cases", ",".join(cases), "--sp", str(sp_size), "--out", str(tmp)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"distributed workers hung for {timeout}s")
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:]}"
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]
    for r, res in enumerate(results):
        for case, val in res.items():
            assert "exception" not in val, f"rank {r}, case {case}:\n{val['exception']}"
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory.mktemp("sp2"), 2, 2, ["a2a", "gqa", "kv1", "uneven", "ckpt", "tiled", "keepattn", "padmask", "errors",
                                                            "trainer_step"])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return _launch(tmp_path_factory.mktemp("sp4"), 4, 2, ["mesh", "sp4"])


def _assert_parity(res: dict[str, Any]) -> None:
    assert abs(res["sp_loss"] - res["ref_loss"]) < LOSS_TOL, res
    if "sum_of_local_losses" in res:  # the per-rank losses sum to the full-sequence mean
        assert abs(res["sum_of_local_losses"] - res["ref_loss"]) < LOSS_TOL, res
    assert res["grad_rel_err"] < GRAD_TOL, res


# ---- distributed -----------------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["gqa", "kv1", "uneven", "ckpt", "tiled", "padmask"])
def test_two_rank_parity(two_ranks, case):
    """GQA (2 KV heads over 2 ranks), 1 KV head < P (replicated), 15 tokens (padded), gradient checkpointing,
    tiled MLP with checkpointing, right-padded attention_mask: loss and every parameter gradient (summed over
    the SP ranks) equal the single-process whole-sequence ones."""
    for rank_res in two_ranks:
        _assert_parity(rank_res[case])


@pytest.mark.timeout(240)
def test_checkpointing_that_keeps_attention(two_ranks):
    """enable_checkpointing_keep_attention (with Ulysses and the tiled MLP): the same parity as plain checkpointing,
    and attention's kernels run once fewer per layer (the reference model runs them too: 2 layers, fwd + bwd)."""
    for rank_res in two_ranks:
        plain, keep = rank_res["keepattn"]["plain"], rank_res["keepattn"]["keep"]
        _assert_parity(plain)
        _assert_parity(keep)
        # per layer: the reference fwd + bwd (2), then Ulysses fwd, recompute fwd, bwd (3) or fwd, bwd (2)
        assert plain["attention_calls"] == 2 * (2 + 3), plain
        assert keep["attention_calls"] == 2 * (2 + 2), keep


@pytest.mark.timeout(240)
def test_trainer_sequence_parallel_step(two_ranks):
    """SuperOffloadTrainer's SP step: each rank's own (ragged) batch is trained by the whole group; the SP-summed
    gradients equal the mean of the batches' single-process gradients."""
    for rank_res in two_ranks:
        _assert_parity(rank_res["trainer_step"])


@pytest.mark.timeout(240)
def test_all_to_all_autograd(two_ranks):
    for res in two_ranks:
        a2a = res["a2a"]
        assert a2a["shape"] == [2, 2, 6, 5]  # [B, H/P, S, D]
        assert a2a["fwd_err"] == 0 and a2a["grad_err"] == 0 and a2a["roundtrip_err"] == 0, a2a


@pytest.mark.timeout(240)
def test_distributed_errors(two_ranks):
    for res in two_ranks:
        err = res["errors"]
        assert "use one of [1, 2]" in err["bad_size"]
        assert err["ones_mask_equal"]  # an all-ones mask is the same as none
        assert "right padding" in err["mask"] and "shard_batch" in err["mask"]
        assert "packed sequences" in err["packed"]


@pytest.mark.timeout(240)
def test_dp_sp_mesh_and_sp4(four_ranks):
    """dp=2 x sp=2: SUM over all 4 ranks / dp = mean of the two sequences' full gradients (the optimizer's
    reduction); sp=4 with 2 and 1 KV heads (both replicated)."""
    seen = set()
    for res in four_ranks:
        _assert_parity(res["mesh"])
        seen.add((res["mesh"]["dp_rank"], res["mesh"]["sp_rank"]))
        _assert_parity(res["sp4"]["kv2"])
        _assert_parity(res["sp4"]["kv1"])
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


# ---- single process --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 64, 1000])
def test_chunked_cross_entropy_matches_plain(dtype, chunk):
    torch.manual_seed(0)
    n, d, v = 37, 16, 50
    h = torch.randn(n, d, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, d) * 0.3).to(dtype).requires_grad_(True)
    y = torch.randint(0, v, (n,))
    y[::4] = -100
    got = sp.chunked_cross_entropy(h, w, y, chunk_size=chunk)
    (got * 0.7).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(gh, h.grad, **tol)
    torch.testing.assert_close(gw, w.grad, **tol)
    assert gw.dtype == dtype


def test_chunked_cross_entropy_no_grad_and_errors():
    h, w, y = torch.randn(6, 4), torch.randn(9, 4), torch.randint(0, 9, (6,))
    with torch.no_grad():
        a = sp.chunked_cross_entropy(h, w, y, chunk_size=4)
    torch.testing.assert_close(a, torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="sum"))
    with pytest.raises(ValueError, match="chunk_size=0"):
        sp.chunked_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="6 hidden states but 5 labels"):
        sp.chunked_cross_entropy(h, w, y[:5])


def test_sequence_parallel_loss_single_process_is_hf_loss():
    from hf_superoffload.testing import tiny_llama

    model = tiny_llama(dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids).loss
    shard = sp.shard_batch({"input_ids": ids, "labels": ids}, None)
    out = sp.causal_lm_loss(model, shard, None, chunk_size=3)
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-6)
    assert float(out.num_tokens) == 2 * 10


@pytest.mark.parametrize("heads,kv,p,expect", [
    (4, 2, 2, 1), (4, 2, 1, 1), (4, 1, 2, 2), (8, 2, 4, 2), (32, 8, 8, 1), (32, 8, 16, 2), (40, 40, 8, 1),
])
def test_kv_replication(heads, kv, p, expect):
    assert sp.kv_replication(heads, kv, p) == expect


@pytest.mark.parametrize("heads,kv,p,match", [
    (4, 2, 3, "does not divide num_attention_heads=4.*that works for this model is 2"),
    (12, 6, 4, "cannot split num_key_value_heads=6.*that works for this model is 3"),
    (40, 40, 16, "does not divide num_attention_heads=40.*that works for this model is 10"),
])
def test_kv_replication_errors(heads, kv, p, match):
    with pytest.raises(ValueError, match=match):
        sp.kv_replication(heads, kv, p)


def _fake_groups(p: int, r: int) -> Any:
    return SimpleNamespace(sp_size=p, sp_rank=r)


def test_shard_batch_reassembles_and_shifts_before_sharding():
    ids = torch.arange(2 * 9).view(2, 9)
    labels = ids + 100
    shards = [sp.shard_batch({"input_ids": ids, "labels": labels}, _fake_groups(2, r)) for r in range(2)]
    full_ids = torch.cat([s["input_ids"] for s in shards], 1)
    full_lab = torch.cat([s["shift_labels"] for s in shards], 1)
    full_pos = torch.cat([s["position_ids"] for s in shards], 1)
    assert full_ids.shape == (2, 10)  # 9 tokens padded to 10
    assert torch.equal(full_ids[:, :9], ids) and torch.equal(full_ids[:, 9], torch.zeros(2, dtype=torch.long))
    # rank 0's last label is rank 1's first token: shifted before sharding
    assert torch.equal(full_lab[:, :8], labels[:, 1:]) and (full_lab[:, 8:] == -100).all()
    assert torch.equal(full_pos, torch.arange(10).expand(2, -1))


def test_shard_batch_right_padding_and_refusals():
    ids = torch.arange(8).view(1, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    s0 = sp.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, _fake_groups(2, 0))
    s1 = sp.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, _fake_groups(2, 1))
    assert "attention_mask" not in s0
    assert s0["shift_labels"].tolist() == [[1, 2, 3, 4]] and s1["shift_labels"].tolist() == [[-100] * 4]
    g = _fake_groups(2, 0)
    with pytest.raises(ValueError, match="not right-padded"):
        sp.shard_batch({"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])}, g)
    with pytest.raises(ValueError, match="packed sequences"):
        sp.shard_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])}, g)
    with pytest.raises(ValueError, match="token_type_ids"):
        sp.shard_batch({"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}, g)
    with pytest.raises(ValueError, match="not both"):
        sp.shard_batch({"input_ids": ids, "labels": ids, "shift_labels": ids}, g)


def test_enable_refuses_bad_head_split():
    from hf_superoffload.testing import tiny_llama

    model = tiny_llama(dtype=torch.float32, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"largest sequence_parallel_size <= 3 .* is 2"):
        sp.enable_sequence_parallel(model, _fake_groups(3, 0))
    assert model.config._attn_implementation != sp.ATTN_IMPLEMENTATION  # refused before any change


def test_attention_without_groups_is_refused():
    from hf_superoffload.testing import tiny_llama

    sp.set_active_groups(None)
    model = tiny_llama(dtype=torch.float32, attn_implementation=sp.ATTN_IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="init_sequence_parallel"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_sdpa_cudnn_inner_attention_matches_sdpa():
    """superoffload_sdpa_cudnn is SDPA with cuDNN tried first: on a machine without it (CPU) the next backend runs,
    and the model computes what plain SDPA computes; it is a valid inner attention under Ulysses."""
    from hf_superoffload.testing import tiny_llama

    assert sp.SDPA_CUDNN in sp.INNER_IMPLEMENTATIONS
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for impl in ("sdpa", sp.SDPA_CUDNN):
        model = tiny_llama(seed=0, dtype=torch.float32, attn_implementation=impl)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[impl] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    (l0, g0), (l1, g1) = out["sdpa"], out[sp.SDPA_CUDNN]
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_trainer_arguments_sequence_parallel_size(tmp_path):
    from hf_superoffload.integrations.arguments import SuperOffloadArguments
    from hf_superoffload.integrations.transformers import SuperOffloadTrainer
    from hf_superoffload.testing import tiny_llama

    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no")
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=f"sequence_parallel_size={bad!r} is invalid"):
            SuperOffloadArguments(sequence_parallel_size=bad, **kw)
    args = SuperOffloadArguments(sequence_parallel_size=2, **kw)
    assert "sequence_parallel_size" not in args.superoffload_fields()  # not a SuperOffloadConfig field
    with pytest.raises(ValueError, match="one process per GPU"):
        SuperOffloadTrainer(model=tiny_llama(dtype=torch.float32), args=args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_keep_attention_on_cuda_saves_the_fused_kernel_outputs() -> None:
    """On the GPU (cuDNN or flash SDPA, bf16): attention's forward kernel runs once per layer, not twice, and the
    gradients equal plain checkpointing's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_superoffload.testing import tiny_llama

    class CountForward(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = str(func)
            if "scaled_dot_product" in name and "backward" not in name:
                CountForward.calls += 1
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, 100, (2, 256), device="cuda")
    grads, calls = {}, {}
    for keep in (False, True):
        model = tiny_llama(seed=0, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().train()
        if keep:
            sp.enable_checkpointing_keep_attention(model)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        CountForward.calls = 0
        with CountForward():
            model(input_ids=ids, labels=ids).loss.backward()
        calls[keep] = CountForward.calls
        grads[keep] = {n: p.grad.float() for n, p in model.named_parameters()}
    layers = 2
    assert calls == {False: 2 * layers, True: layers}, calls
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=2e-2, atol=1e-3, msg=n)


def test_keep_attention_keeps_the_users_checkpointing_options() -> None:
    """The user's checkpointing options survive (every_n_layers here); the ones it cannot honour are refused."""
    import inspect

    from hf_superoffload.testing import tiny_llama

    model = tiny_llama(seed=0, attn_implementation="sdpa")
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    if "every_n_layers" not in inspect.signature(enable).parameters:
        pytest.skip("this transformers has no every_n_layers")
    sp.enable_checkpointing_keep_attention(model, {"every_n_layers": 2, "preserve_rng_state": False})
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    func = model.model.layers[0]._gradient_checkpointing_func
    assert func.keywords["preserve_rng_state"] is False and func.keywords["use_reentrant"] is False
    assert "context_fn" in func.keywords
    with pytest.raises(ValueError, match="drop use_reentrant=True"):
        sp.enable_checkpointing_keep_attention(model, {"use_reentrant": True})
    with pytest.raises(ValueError, match="drop context_fn"):
        sp.enable_checkpointing_keep_attention(model, {"context_fn": lambda: None})
