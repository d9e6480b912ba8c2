"""Predicted seconds of one optimizer step: the roofline the planner minimises and ``plan`` prints.

[Note: step-time roofline]
T = batch x seq tokens, N parameters, L layers, d attention width, S sequence length.

* GPU: forward ``2 (N T + L d S T)`` FLOPs, backward ``4 (N T + L d S T)`` plus the recompute of the checkpointed
  decoder layers, ``2 r (N_L T + L d S T)`` (r: the share of layers recomputed, 1 with checkpointing less the
  plan's kept layers, 0 without; N_L: the decoder layers' parameters: embeddings, LM head and loss are never
  recomputed); the ``L d S T`` terms are causal attention. GEMM FLOPs run at ``matmul_tflops x g(h)``,
  ``g = 0.68 x min(1, h / 4096)^0.4``, attention at ``matmul_tflops x 0.6``. Fitted on H200 with bf16 weights
  (802 TFLOP/s GEMM rate): 3.6B (h 3072) batch 8 measures 0.959 s with every layer recomputed and 0.800 s with
  every layer kept, 8B batch 4 1.018 s and 0.964 s with 9 of 32 kept (less the device tail's AdamW, these
  ask g of 0.63, 0.60, 0.68 and 0.67); counting model FLOPs (6N), as MFU does, gives 0.43-0.47. ``W_b`` is the
  backward's share, the forward ``W_f`` the rest. Ulysses over P GPUs: one rank does F / P (its tokens; 1/P of the heads in
  attention; 8B at 256k on 2 H200: 92 s predicted, 95.9 measured), and the P ranks of the host split its CPU
  Adam rate and memory bandwidth. A tiled MLP adds one MLP forward, ``2 x 3 h f L T``.
* link: e = 2 B/param each way (CPU cast) or 4 (GPU cast); ``d2h_s = e H / d2h``, ``h2d_s = e H / h2d`` for
  the H host parameters.
* CPU: the Adam rate R shares host memory with the gradient DMA landing during backward:
  ``R_eff = R (1 - (e H / W_b) / host_memory_gbps)`` (``host_memory_gbps`` defaults to 28 B x R: the kernel
  is bandwidth bound). Buckets are stepped speculatively as they land, at ``R_eff``: of the whole pass at that
  rate, ``H / R_eff``, the share ``done = min(1, (W_b - one bucket) / (H / R_eff))`` is stepped by the verdict
  (``spec``; that share of snapshot pages gets written); the rest of the buckets run after the backward, free of
  its DMA, as a verdict-known pass (below): ``rem = (1 - done) x verdict pass``, ``cpu_s = spec + rem``. Pricing
  the whole pass at ``R_eff`` over-predicts a short backward beside a long pass: 3.6B all-host at batch 2, its
  timed steps committing, measured 0.860 s a step on the H100 box; the whole pass at ``R_eff`` said 1.198 s,
  this split says 0.879. Every pass also costs ``BUCKET_TASK_S`` per host bucket beyond its bytes, outside the
  Adam calls (``cpu_s`` and the clipped pass below include it; [Note: bucket size] in
  docs/design.md): 0.49 ms, fitted on the H100 box's all-host 3.6B row over 16-128 MB buckets, which is why
  larger buckets pay where the pass is exposed.
* exposed: D2H beyond backward, ``max(0, d2h_s - W_b)``, or all of it, ``d2h_s``, with no D2H lead (each host
  bucket's hook waits for its own copy, so the copies run beside an idle GPU: [Note: D2H lead] in docs/design.md;
  the lead's measured gain against the predicted: 3.6B all-host 74 ms (131 ms predicted), 8B 0.50 s (0.29 s));
  the remainder and the uploads beyond the next forward, ``max(0, max(rem, h2d_s) - W_f)`` plus one bucket's
  latency when ``rem > 0``; the device tail's AdamW, 28 B/param at ``device_memory_gbps``, runs after validation
  and is fully exposed.
* weight flow: the streamed weights cross the link twice per step, 2 B/param before their forward and again
  before their backward. ``h2d_s`` is then the forward's fetch (the step's uploads are gone: staging is the
  weights' home), and the backward's fetch shares the backward window with the gradients' D2H, each at the
  concurrent rate: ``max(0, max(d2h_s', fetch_s') - W_b)`` replaces the D2H term.
* data parallel (ZeRO): the engine shards every bucket over all W = D x P ranks (D data-parallel replicas, P
  Ulysses ranks each), so a rank's ``H`` is its 1/W shard, and the W ranks of the host split its Adam rate and
  memory bandwidth as above; each rank computes its own batch (D leaves ``gpu_s`` alone). Per step every bucket's
  bf16 gradients are reduce-scattered and its updated bf16 weights all-gathered: a ring moves ``(W - 1) / W`` of
  the 2 B/param of all ``W (H + G)`` parameters (G: the rank's device-tail shard) each way, at the profile's
  ``peer_gbps`` (NCCL bus bandwidth between the host's GPUs) or, without one, ``PEER_GBPS_ASSUMED`` = 350 GB/s
  (NVLink 4 on H100/H200 HGX: 450 GB/s per direction nominal, nccl-tests report 350-370 GB/s bus bandwidth for
  both collectives; assumed, not measured here). ``rs_s = ag_s = (W - 1) / W x 2 W (H + G) / peer``. Overlap
  follows the mechanism ([Note: data parallel sharding]): a bucket's D2H waits for its reduce-scatter, so the
  two pipeline through the backward, ``max(d2h_s, rs_s)`` replacing ``d2h_s`` above; the last bucket's
  reduce-scatter lands after the backward (one bucket's ``rs``, exposed); a bucket's all-gather waits for its
  upload, so ``ag_s`` joins ``max(rem, h2d_s, ag_s)`` against the next forward, and the first bucket's all-gather
  is exposed before the forward's first layer. ``collectives_s = rs_s + ag_s``, ``collectives_exposed_s`` the
  share of ``exposed`` that only the collectives cause. Not modelled: NCCL's SMs slowing the backward's GEMMs,
  and Ulysses' all-to-alls (inside ``gpu_s``' efficiency). Modelled from the mechanism, not yet calibrated.
* gradient accumulation over M micro-batches: the M - 1 before the last run ``micro_batch_s`` each, and the
  optimizer step is ``step_s = (M - 1) micro_batch_s + gpu_s + tail_s + exposed`` (the last micro-batch carries
  the step's own terms above; its CPU pass overlaps the next step's first forward). A non-final micro-batch is
  its forward, ``max(W_f, fetch)`` under weight flow, plus its backward ``max(W_b, link, adds)``: with host
  accumulation ([Note: host accumulation] in docs/weight_flow.md) every micro-batch's host gradients cross the
  link (2 B/param, beside the flow's backward fetch at the concurrent rates), and the worker sums them into the
  accumulator while the DMA writes the next ones and the fetch reads the weights, all in host memory: per
  parameter 6 B for the bf16 landing add (read slot and sum, write sum) or 10 B for the fp32 arena, plus the
  gradient's 2 B landing and, under flow, the weights' 2 B read, at ``ACCUMULATE_DRAM_EFFICIENCY`` of
  ``host_memory_gbps``. Fitted on one row: 8B batch 4 x 8 under a 24 GiB cap (weight flow, landing adds, 7.26B
  host parameters) moved 72.6 GB per backward in 0.98 s, 0.60 of the box's 123.2 GB/s STREAM rate (the adds'
  own share ran at ~65 GB/s in the profile); its step measured 11.05 s against 9.17 predicted without this term
  (on device accumulation, a micro-batch is ``gpu_s``: gradients stay in ``.grad``).
* deferred speculation (``OffloadPlan.deferred_speculation``: the inverse rollback with deferred stores): a
  speculative pass writes the bf16 weights only, 16 of the 28 B/param (``cpu_s`` scales by 16/28), and each
  committed speculative step owes its whole step again, ``commit_s = 26/28 x H / R``, stored by the worker after
  the pass. It is off the critical path while it fits the worker's idle time, ``idle = W_f + W_b - cpu_s``; what
  does not fit, ``max(0, commit_s - idle)``, delays the next pass and joins ``exposed``. Not measured on the GPU
  box yet: the rates are the deferred stores' (the same kernels).
* ``step_s = gpu_s + tail_s + exposed`` for one micro-batch. While clipping fires on every step, speculation pauses: nothing is
  stepped in the backward, and the whole pass is ``rem``, overlapping only the next forward: ``H / R`` for the
  fused step's 28 B/param (20 with deferred moment stores, 16 where the master is deferred too), plus the memory
  time of the uploads it issues beside it, ``e H / host_memory_gbps`` (``verdict_pass_seconds``; the rate
  calibration inverts the same split).
* deferred moment stores under clipping: each verdict-known pass leaves a commit (18 B/param, 26 where the master
  is deferred) that the worker stores in its idle time beside the backward's landing DMA, ``commit_s = H (18 / 28
  / R + 2 / host_memory_gbps)``; the idle time is the step less the worker's passes, and what does not fit,
  ``max(0, commit_s - idle)``, delays the next pass (a bucket's next CPU task stores its pending commit first)
  and joins ``exposed``. So the deferral pays where the backward is long beside the pass and costs where it is
  short (a small batch, a slow host), and the planner prices it ([Note: deferred moments] in docs/design.md).
  Measured on the H100 box, 3.6B all-host batch 8: 1.088 s with it, 1.240 s storing m and v in the pass (commits
  0.52-0.58 s per step in a 1.09 s step). The adaptive master share is priced from where it starts, none (its
  gain measured there: 1.088 against 1.099 s with it off). Without clipping the remainder is priced as a
  verdict-known pass and its commits as hidden (the H200 box's 3.6B all-host row measured 0.978 s, predicted
  0.919; its commits ran inside the forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import HardwareProfile
from .memory_model import ModelShape, PlanLike

__all__ = ["ACCUMULATE_ADD_BYTES", "ACCUMULATE_DRAM_EFFICIENCY", "ATTENTION_EFFICIENCY", "BUCKET_TASK_S",
           "COMMIT_FULL_BYTES", "FULL_STEP_BYTES", "GEMM_EFFICIENCY", "MASTER_DEFERRED_BYTES", "MOMENT_COMMIT_BYTES",
           "PEER_GBPS_ASSUMED", "SPECULATIVE_BF16_BYTES", "VERDICT_PASS_BYTES", "StepTime", "bucket_task_seconds",
           "collective_seconds", "predict_step_time", "verdict_pass_bytes", "verdict_pass_rate_factor",
           "verdict_pass_seconds"]

SPECULATIVE_BF16_BYTES, FULL_STEP_BYTES, COMMIT_FULL_BYTES = 16, 28, 26
"""Host bytes per parameter: a pass writing the bf16 weights only, the fused step, a commit of the whole step
([Note: deferred moments] in docs/design.md)."""
VERDICT_PASS_BYTES, MOMENT_COMMIT_BYTES, MASTER_DEFERRED_BYTES = 20, 18, 4
"""Deferred moment stores: the verdict-known pass (m and v not stored), its moment commit; a deferred master takes
4 B/param more off the pass and puts 8 on the commit (16 and 26)."""
BUCKET_TASK_S = 0.49e-3
"""Seconds the CPU worker's pass spends per host bucket beyond its bytes, outside the Adam calls ([Note: bucket
size] in docs/design.md): fitted on the H100 box's all-host 3.6B row, 16/32/64/128 MB buckets (198/143/114/58 host
buckets) measuring 1.074/1.062/1.034/1.009 s, each within 1% of the fit."""
GEMM_EFFICIENCY = 0.68  # [Note: step-time roofline]: the default plans' measured share of the GEMM rate ...
GEMM_EFFICIENCY_WIDTH = 4096  # ... at this hidden size and above; narrower models' GEMMs reach less


def gemm_efficiency(hidden_size: int) -> float:
    """The share of the profile's GEMM rate a training step reaches ([Note: step-time roofline])."""
    return GEMM_EFFICIENCY * min(1.0, hidden_size / GEMM_EFFICIENCY_WIDTH) ** 0.4
ATTENTION_EFFICIENCY = 0.6  # ... and of the causal attention term (fitted where it dominates: 8B at 256k tokens)
# [Note: step-time roofline]: host accumulation's adds, the gradient DMA landing and the flow's weight reads share
# host memory at this fraction of the STREAM rate (fitted on the 24 GiB-cap 8B row's profile).
ACCUMULATE_DRAM_EFFICIENCY = 0.6
ACCUMULATE_ADD_BYTES = {"landing": 6, "fp32": 10}
"""Host-memory bytes per parameter of one micro-batch's accumulation add: read the landed gradient and the sum,
write the sum (bf16 landing buffer, or the fp32 arena)."""
# NCCL bus bandwidth between GPUs of one host when the profile has no ``peer_gbps``: NVLink 4 (H100/H200 HGX),
# 450 GB/s per direction nominal, 350-370 GB/s reached by nccl-tests' reduce-scatter and all-gather. Assumed.
PEER_GBPS_ASSUMED = 350.0


@dataclass(frozen=True, slots=True)
class StepTime:
    """Predicted seconds of one optimizer step (see [Note: step-time roofline])."""

    gpu_s: float
    backward_window_s: float
    forward_window_s: float
    cpu_s: float
    d2h_s: float
    h2d_s: float
    tail_s: float
    exposed_s: float
    step_s: float
    speculated_fraction: float
    collectives_s: float = 0.0
    collectives_exposed_s: float = 0.0
    micro_batch_s: float = 0.0
    """A non-final micro-batch of gradient accumulation (``gpu_s`` when gradients accumulate on the device)."""
    micro_batches: int = 1
    commit_s: float = 0.0
    """The worker's seconds per step storing what passes deferred: the whole-step commits of committed speculative
    passes (deferred speculation), or with clipping the moment (and master) commits of the verdict-known pass; off
    the critical path while they fit its idle time, the rest is in ``exposed_s``."""


def verdict_pass_bytes(plan_like: PlanLike) -> tuple[float, float]:
    """Host bytes per parameter of a verdict-known pass and of the commit it leaves (0 without deferred stores):
    28 and 0 for the fused step; with deferred moment stores 20 and 18, the master's share moving 4 more from the
    pass to the commit twice over ([Note: deferred moments])."""
    if not plan_like.deferred_landing_bytes:
        return float(FULL_STEP_BYTES), 0.0
    master = plan_like.master_share
    return VERDICT_PASS_BYTES - MASTER_DEFERRED_BYTES * master, MOMENT_COMMIT_BYTES + 2 * MASTER_DEFERRED_BYTES * master


def verdict_pass_seconds(plan_like: PlanLike, profile: HardwareProfile, ranks: int = 1) -> tuple[float, float]:
    """The whole host pass after a verdict (clipping every step), as ``(adam_s, dma_s)``: the CPU Adam over the host
    parameters at the profile's rate for this pass's bytes, and the memory time of the uploads it issues beside
    it (``e`` B/param read from host memory, the kernel being bandwidth bound). ``ranks`` on this host split its
    rate and bandwidth. The rate calibration inverts it ([Note: calibrating the rates])."""
    assert profile.cpu_adam_gparams is not None
    host = plan_like.host_numel
    e = 4 if plan_like.cast_side == "gpu" else 2
    host_bw = _host_bandwidth(profile, ranks)
    adam = host / (profile.cpu_adam_gparams * 1e9 / ranks) * verdict_pass_bytes(plan_like)[0] / FULL_STEP_BYTES
    return adam, e * host / host_bw


def verdict_pass_rate_factor(plan_like: PlanLike, profile: HardwareProfile, measured_s: float, *,
                             floor_s: float) -> float:
    """The inverse of :func:`verdict_pass_seconds`: the factor on the profile's CPU Adam rate with which the Adam
    calls of the whole pass after a verdict take ``measured_s`` ([Note: calibrating the rates]; the buckets' fixed
    cost lies outside those calls, [Note: bucket size]). Where the profile has no measured bandwidth (28 B x the
    rate), the uploads' memory time scales with the rate too, else it stays and the Adam share fills what it
    leaves. What the rate must fill is at least ``floor_s`` (one noisy pass cannot ask for an unbounded rate)."""
    adam_s, dma_s = verdict_pass_seconds(plan_like, profile)
    if profile.host_memory_gbps is None:
        return (adam_s + dma_s) / max(measured_s, floor_s)
    return adam_s / max(measured_s - dma_s, floor_s)


def _host_bandwidth(profile: HardwareProfile, ranks: int) -> float:
    """Bytes per second of host memory one of ``ranks`` ranks on this host gets: the profile's measured bandwidth,
    or without one 28 B x the CPU Adam rate (the kernel is bandwidth bound: [Note: step-time roofline])."""
    assert profile.cpu_adam_gparams is not None
    return (profile.host_memory_gbps or 28 * profile.cpu_adam_gparams) * 1e9 / ranks


def bucket_task_seconds(plan_like: PlanLike) -> float:
    """The CPU worker's fixed cost of one pass over the plan's host buckets (``BUCKET_TASK_S`` each)."""
    return plan_like.host_buckets * BUCKET_TASK_S


def collective_seconds(numel: int, world_size: int, peer_gbps: float) -> float:
    """Seconds of one ring reduce-scatter (or all-gather) of ``numel`` bf16 elements over ``world_size`` ranks:
    each rank sends and receives ``(W - 1) / W`` of the buffer at the bus bandwidth ``peer_gbps``."""
    if world_size <= 1:
        return 0.0
    return (world_size - 1) / world_size * 2 * numel / (peer_gbps * 1e9)


def predict_step_time(shape: ModelShape, plan_like: PlanLike, profile: HardwareProfile, *, batch_size: int,
                      seq_len: int, grad_ckpt: bool, sequence_parallel: int = 1, data_parallel: int = 1,
                      mlp_tile_tokens: int | None = None, keep_attention: bool = False,
                      clipping_every_step: bool = False, micro_batches: int = 1) -> StepTime | None:
    """The roofline of [Note: step-time roofline] for one rank; ``None`` when the profile lacks a rate it needs.

    ``sequence_parallel`` P: each of the P ranks on this host computes 1/P of every layer (its tokens outside
    attention, 1/P of the heads inside), and they share the host's cores and memory bandwidth; ``plan_like`` is
    one rank's plan (its shard of the optimizer state). ``data_parallel`` D: D replicas of the P ranks, all on this
    host: each computes its own ``batch_size``, the D x P ranks split the host, and the step adds the reduce-scatter
    and all-gather over all D x P ranks (the engine's shards). ``mlp_tile_tokens`` below the tokens per rank: the tiled
    MLP's backward runs one more MLP forward (2 FLOPs per MLP weight and token). ``keep_attention``: checkpointing
    keeps attention's outputs, so attention runs forward once (6 instead of 8 FLOPs per attention "parameter").
    ``clipping_every_step``: speculation pauses (every verdict is a redo), so the whole CPU pass starts at the
    verdict, free of the backward's DMA, and with deferred moment stores moves 20 of 28 B/param.
    ``micro_batches`` M: micro-batches per optimizer step; ``step_s`` is then the whole optimizer step."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}: use the number of micro-batches per optimizer step (>= 1)")
    p, host = profile, plan_like.host_numel
    need = (p.matmul_tflops, p.cpu_adam_gparams, p.h2d_gbps, p.d2h_gbps, p.device_memory_gbps)
    if any(x is None for x in need):
        return None
    tokens = batch_size * seq_len
    # the share of decoder layers recomputed in backward (the plan's kept layers are not): 2 more FLOPs per
    # decoder-layer parameter (the embeddings, LM head and loss are never recomputed)
    recomputed = (1 - min(plan_like.kept_layers, shape.num_layers) / max(shape.num_layers, 1)) if grad_ckpt else 0.0
    layer_params = shape.num_layers * shape.layer_numel
    attn_unit = shape.num_layers * shape.num_heads * shape.head_dim * seq_len * tokens
    gemm_f, gemm_b = 2 * shape.numel * tokens, (4 * shape.numel + 2 * recomputed * layer_params) * tokens
    attn_f, attn_b = 2 * attn_unit, (4 + (0 if keep_attention else 2 * recomputed)) * attn_unit
    if mlp_tile_tokens is not None and mlp_tile_tokens < -(-tokens // sequence_parallel):
        gemm_b += 2 * 3 * shape.hidden_size * shape.intermediate_size * shape.num_layers * tokens
    rate_flops = p.matmul_tflops * 1e12 * sequence_parallel
    gemm_rate = rate_flops * gemm_efficiency(shape.hidden_size)
    w_f = gemm_f / gemm_rate + attn_f / (rate_flops * ATTENTION_EFFICIENCY)
    w_b = gemm_b / gemm_rate + attn_b / (rate_flops * ATTENTION_EFFICIENCY)
    gpu_s = w_f + w_b
    e = 4 if plan_like.cast_side == "gpu" else 2  # bytes per parameter up (the fp32 master or bf16); down: always 2
    ranks = sequence_parallel * data_parallel  # all on this host: they split its cores and memory bandwidth
    rate = p.cpu_adam_gparams * 1e9 / ranks
    host_bw = _host_bandwidth(p, ranks)
    rate_eff = rate * max(0.2, 1 - (e * host / w_b) / host_bw)
    tasks = bucket_task_seconds(plan_like)
    beside = host / rate_eff  # every host bucket stepped speculatively beside the backward's landing DMA
    deferred = plan_like.deferred_speculation and not clipping_every_step  # clipping every step pauses speculation
    commit_s = COMMIT_FULL_BYTES / FULL_STEP_BYTES * host / rate if deferred else 0.0
    if deferred:
        beside *= SPECULATIVE_BF16_BYTES / FULL_STEP_BYTES
    beside += tasks
    d2h_s, h2d_s = 2 * host / (p.d2h_gbps * 1e9), e * host / (p.h2d_gbps * 1e9)
    bucket = plan_like.bucket_bytes / e  # a whole bucket's elements (what the collectives move) ...
    shard = bucket / ranks  # ... of which a rank steps and uploads its 1/W
    latency = shard / rate_eff + BUCKET_TASK_S + e * shard / (p.h2d_gbps * 1e9) if host else 0.0
    # the share of the buckets stepped by the verdict; the rest, a verdict-known pass after the backward, free of
    # its landing DMA (a short backward beside a long pass: 3.6B all-host at batch 2 measured 0.860 s a step, the
    # whole pass priced beside the DMA said 1.198)
    done = min(1.0, max(0.0, w_b - latency) / beside) if beside > 0 else 1.0
    after = sum(verdict_pass_seconds(plan_like, p, ranks)) + tasks  # the whole pass, verdict known
    spec = done * beside
    rem = (1.0 - done) * after
    cpu_s = spec + rem
    if clipping_every_step:  # the whole pass after the verdict, and the commits its deferred stores leave
        spec, rem = 0.0, after
        if plan_like.deferred_landing_bytes:  # stored in the worker's idle time, beside the backward's landing DMA
            commit_s = host * (verdict_pass_bytes(plan_like)[1] / (FULL_STEP_BYTES * rate) + 2 / host_bw)
    peer = p.peer_gbps or PEER_GBPS_ASSUMED
    rs_s = ag_s = collective_seconds(ranks * (host + plan_like.device_numel), ranks, peer)
    one_bucket = collective_seconds(int(bucket), ranks, peer)  # the last reduce-scatter, the first all-gather
    down = d2h_s
    if plan_like.weight_mode == "flow":
        h2d_s = 2 * host / (p.h2d_gbps * 1e9)  # the forward's fetch
        d2h_c, h2d_c = (p.d2h_concurrent_gbps or p.d2h_gbps) * 1e9, (p.h2d_concurrent_gbps or p.h2d_gbps) * 1e9
        down = max(2 * host / d2h_c, 2 * host / h2d_c)

    # [Note: D2H lead] with no lead: each host bucket's hook waits for its own copy, the GPU's queue drains, and the
    # copies run one after another beside an idle GPU instead of under the backward (host accumulation's summed
    # flush has ring slots instead of the limiter)
    summed = plan_like.host_accumulation in ACCUMULATE_ADD_BYTES and micro_batches > 1
    drains = host > 0 and plan_like.d2h_lead_buckets == 0 and not summed

    def exposed_s(rs: float, ag: float, edge: float) -> float:
        backward_link = max(down, rs) if drains else max(0.0, max(down, rs) - w_b)
        return backward_link + max(0.0, max(rem, h2d_s, ag) - w_f) + (latency if rem > 0 else 0.0) + edge

    with_collectives = exposed_s(rs_s, ag_s, 2 * one_bucket)
    tail_s = 28 * plan_like.device_numel / (p.device_memory_gbps * 1e9)
    micro = _micro_batch_s(plan_like, p, w_f, w_b, host_bw)
    # the worker's idle time in the step (and its earlier micro-batches); the commits it cannot hold delay the next
    # pass: a bucket's next CPU task stores its pending commit first
    idle = (micro_batches - 1) * micro + gpu_s + tail_s + with_collectives - (spec + rem)
    spill = max(0.0, commit_s - max(0.0, idle))
    exposed = with_collectives + spill
    return StepTime(gpu_s, w_b, w_f, cpu_s, d2h_s, h2d_s, tail_s, exposed,
                    (micro_batches - 1) * micro + gpu_s + tail_s + exposed,
                    done if not clipping_every_step else 0.0, rs_s + ag_s,
                    with_collectives - exposed_s(0.0, 0.0, 0.0),
                    micro, micro_batches, commit_s)


def _micro_batch_s(plan_like: PlanLike, p: HardwareProfile, w_f: float, w_b: float, host_bw: float) -> float:
    """A non-final micro-batch of gradient accumulation ([Note: step-time roofline]): its forward and backward,
    each bound by the GPU, the link or, with host accumulation, host memory."""
    host, flow = plan_like.host_numel, plan_like.weight_mode == "flow"
    assert p.h2d_gbps is not None and p.d2h_gbps is not None
    h2d_c, d2h_c = (p.h2d_concurrent_gbps or p.h2d_gbps) * 1e9, (p.d2h_concurrent_gbps or p.d2h_gbps) * 1e9
    forward = max(w_f, 2 * host / (p.h2d_gbps * 1e9)) if flow else w_f
    adds = ACCUMULATE_ADD_BYTES.get(plan_like.host_accumulation)
    fetch = 2 * host / h2d_c if flow else 0.0
    down = 0.0 if adds is None else 2 * host / (d2h_c if flow else p.d2h_gbps * 1e9)
    dram = 0.0 if adds is None else host * (adds + 2 + (2 if flow else 0)) / (host_bw * ACCUMULATE_DRAM_EFFICIENCY)
    return forward + max(w_b, fetch, down, dram)
