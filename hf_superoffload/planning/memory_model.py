"""Peak GPU and host memory of a training step, from the model's shape alone (nothing is allocated).

[Note: memory model]
T = batch x seq tokens, h hidden, f intermediate, L layers, a/kv attention/KV heads of width d, V vocabulary,
N parameters. Bytes of the tensors autograd saves in an HF Llama-style decoder (SDPA, bf16):

* per layer and token, A = 16h + 4ad + 4kv*d + 8f: each RMSNorm saves its fp32 upcast input (4h), the
  normalised bf16 value (2h) and its output (2h); attention saves q, k, v and its output (SDPA returns it
  contiguous: it is also the o_proj input); the MLP saves gate, up, silu(gate) and their product. fp32-weight
  autocast makes the residual stream fp32: +10h.
* checkpointing keeps one hidden state per layer (2hT; 4hT under autocast); backward recomputes one layer at
  a time (1.5 A T: its activations and their gradients).
* logits: bf16 from ``lm_head``, upcast to fp32 by the HF loss; ``log_softmax`` saves its fp32 output and
  its backward also holds the incoming and outgoing fp32 gradients: 12 TV. The final norm saves 8hT (14hT).

Peak allocated bytes are the largest of three phases:

* ``loss``: start of backward. Resident weights and optimizer state, every saved activation, the logits
  peak. Gradients do not exist yet (``zero_grad(set_to_none=True)``), except in the fwd+bwd probe, taken
  to keep its bf16 gradients (2N) between iterations (inferred: the prediction is 4% low without them).
* ``backward``: the last decoder layer's backward: resident state, its recompute and activation gradients,
  and the gradients still on the GPU (GPU AdamW: every fp32 gradient but the input embedding's, which comes
  last; SuperOffload: the device tail's flat bf16 gradients and a few in-flight buckets).
* ``step``: the optimizer step: resident state and every gradient still on the GPU.
* ``backward_start`` (checkpointing): the first recomputed layer, with every layer's checkpointed input still
  alive. Negligible next to the logits at short sequences; the peak of long ones, where the sequence-parallel
  loss chunks the logits (``loss_chunk_tokens``).

Ulysses sequence parallelism over P ranks (``sequence_parallel``): every per-token activation is 1/P per GPU
(attention holds all tokens of 1/P of the heads: the same bytes), plus one all-to-all input beside its output.

Tiled MLP (``mlp_tile_tokens`` = t, sequence_parallel/tiled_mlp.py): the MLP saves only its input (already
counted: the norm's output), so a layer saves ``A - 8f`` per token; its backward recomputes the 8f of one tile
at a time: ``1.5 ((A - 8f) T + 8f min(t, T))``, plus the tiles' summed weight gradients (fp32, 4 B per MLP
parameter) and one tile's own (2 B; 4 B with fp32 weights) when there is more than one tile. Modelled from the
mechanism, not yet calibrated against a measurement.

Kept attention (``keep_attention``, sequence_parallel/checkpointing.py): checkpointing that recomputes every layer
but attention also keeps each layer's attention output (bf16, 2ad per token) and log-sum-exp (fp32, 4a) from the
forward to that layer's backward: ``L T (2ad + 4a)`` in the ``loss`` and ``backward_start`` phases.

The GPU coefficients follow from this accounting; checked against ``torch.cuda.max_memory_allocated`` on the
team's H200 box (torch 2.11, HF Llama, SDPA, bf16; GB = 1e9) they need no fitted scale:

================================================================  ========  =========  ========
case                                                              measured  predicted  residual
================================================================  ========  =========  ========
3.6B GPU AdamW (fp32 + autocast), ckpt, 8x2048                        77.1       75.6     -1.9%
3.6B SuperOffload, all on host, ckpt, 8x2048                          35.7       35.7     -0.1%
3.6B SuperOffload, 2.08B-param device tail, ckpt, 8x2048              60.7       60.6     -0.1%
8B GPU AdamW, ckpt, 4x2048                                           128.8      129.8     +0.8%
0.95B fwd+bwd only, no ckpt, 8x2048                                   35.2       35.1     -0.4%
8B SuperOffload, 2 ranks, Ulysses sp=2, 1x262144, chunked loss       126.5      131.5     +4.0%
8B SuperOffload default plan (3.30B tail), ckpt, 4x2048, chunked       66.7       64.9     -2.6%
8B SuperOffload data parallel, per rank (3.33B tail shard)             67.2       65.2     -3.0%
8B weight flow, 0.53B tail, 24 GiB cap, ckpt, 4x2048                   22.5       23.9     +6.5%
1.88B fwd+bwd only, no ckpt, 4x2048                                   23.2       23.2     -0.2%
15.0B SuperOffload, GPU cast, 6.97B tail, ckpt, 4x2048, chunked     130.0      139.7     +7.4%
3.6B host RSS, inverse (16 B/param)                                   64.3       61.6     -4.2%
3.6B host RSS, snapshot (+12 B/param), 0.89 speculated            94.4-96.2      100.1  +4.1..+6.0%
15.0B host RSS, inverse, GPU cast (14 B/param), 8.08B on host        115.7      119.6     +3.3%
8B weight flow host RSS, 7.50B on host, landing accumulation          125.9      see test  (within 10%)
================================================================  ========  =========  ========

Host: 12 B/param fp32 p/m/v, 4 B/param pinned landing + staging (2: the GPU cast has no staging), 12 B/param for the rollback's second copy
(a double buffer writes all of it every step; the older snapshot rollback only for speculated buckets:
``PlanLike.speculated_fraction``), nothing more in weight-flow mode (the staging arena is the weights' home),
1.7 GB runtime (the GPU-only run's RSS) and 0.6 B per host parameter (fitted between the 3.6B, 8B and 15B runs; not
attributed). The 15B GPU row over-predicts: it counts the GPU cast's in-flight buckets as fp32, but at the backward
peak only bf16 gradients are in flight (the fp32 uploads run in the next forward). The snapshot
row was measured with the snapshot engine, its fraction 0.89 comes from the step-time roofline
(``plan_cli``); with every page written it predicts 107.6 GB (+13%), which is what fit checks use.
[Note: the allocator's slack]
What the caching allocator holds beyond the allocated peak (fragmentation, workspaces, the process's CUDA context)
is assumed: 1 GiB plus the larger of 5% of the peak and the step's largest single allocation
(``MemoryEstimate.largest_block_bytes``). The block term matters only on small budgets: a fragmented pool may have
to reserve a fresh segment for it, and at a 24 GiB cap 5% is less than one bf16 logit gradient of 4 x 2048 tokens of
Llama-3's vocabulary (1.96 GiB). Measured there with 5% alone, on the H200 box: the loss backward asked for that
block while 3.9 GiB were reserved but unallocated, and ran out of memory at the first micro-batch; the H100 box
held the same plan after one allocator retry (24.98 GB reserved at the peak of the 25.8 GB cap).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..causal_lm_loss import CHUNK_TOKENS  # the fp32 chunk of logits alive at a time
from .hardware import HardwareProfile
from .plan import CastSide, MasterDeferral, OffloadPlan, PlanError, Rollback, WeightMode

__all__ = ["MemoryEstimate", "ModelShape", "PlanLike", "bisect_largest", "check_fits", "estimate", "fits",
           "largest_model_that_fits"]

GiB = 1024**3
RUNTIME_HOST_BYTES = int(1.7e9)  # host RSS of a GPU-only training process (measured at 3.6B)
ENGINE_HOST_BYTES_PER_PARAM = 0.6  # host RSS per host parameter beyond the arenas (fitted; see the table)
LOGITS_BYTES_PER_ELEMENT = 12  # transformers' ForCausalLMLoss at its peak: fp32 log_softmax, its gradient, the logits'
CHUNKED_LOGITS_BYTES_PER_ELEMENT = 4  # causal_lm_loss.py's backward: the bf16 logits it saves and their bf16 gradient
INFLIGHT_BUCKETS = 3  # on the GPU at once: one filling, one waiting for its D2H, one upload buffer
FLOW_RESIDENT_LAYERS = 2  # weight-flow keeps the layer being computed and the one being prefetched


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes of a Llama-style decoder that memory depends on."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    name: str = "model"

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (Llama/Qwen2/Qwen3/Mistral-like), a dict of its fields, or a preset name."""
        if isinstance(config, ModelShape):
            return config
        if isinstance(config, str):
            from ..demo.presets import PRESETS, llama_config

            if config not in PRESETS:
                raise ValueError(f"unknown model preset {config!r}; choose one of {sorted(PRESETS)}")
            vocab = None if PRESETS[config]["vocab_size"] else 32000
            return dataclasses.replace(cls.from_config(llama_config(config, vocab_size=vocab)), name=config)
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        if get("num_local_experts") or get("num_experts"):
            raise ValueError("mixture-of-experts models are not covered by the memory model")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if get(k) is None]
        if missing:
            raise ValueError(f"the model config lacks {missing}: not a Llama-style decoder config")
        h, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        model_type = str(get("model_type") or "")
        return cls(h, int(get("intermediate_size")), int(get("num_hidden_layers")), heads,
                   int(get("num_key_value_heads") or heads), int(get("head_dim") or h // heads), int(get("vocab_size")),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                   qkv_bias=bool(get("attention_bias", False)) or model_type == "qwen2",  # Qwen2: q/k/v biases
                   mlp_bias=bool(get("mlp_bias", False)), qk_norm=model_type == "qwen3",
                   name=str(get("_name_or_path") or model_type or "model"))

    def with_layers(self, num_layers: int) -> ModelShape:
        return dataclasses.replace(self, num_layers=num_layers, name=f"{self.name} x{num_layers} layers")

    @property
    def layer_numel(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * f + ((2 * f + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def embedding_numel(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def non_layer_numel(self) -> int:
        """Embedding, final norm and (untied) LM head."""
        return self.embedding_numel * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def numel(self) -> int:
        return self.non_layer_numel + self.num_layers * self.layer_numel

    def layer_activation_bytes_per_token(self, *, autocast: bool = False) -> int:
        """Bytes one decoder layer saves for backward, per token (see [Note: memory model])."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 16 * h + 4 * q + 4 * kv + 8 * self.intermediate_size + (10 * h if autocast else 0)

    @property
    def mlp_activation_bytes_per_token(self) -> int:
        """The MLP's share of :meth:`layer_activation_bytes_per_token`: gate, up, act(gate) and their product."""
        return 8 * self.intermediate_size

    @property
    def mlp_numel(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        return 3 * h * f + ((2 * f + h) if self.mlp_bias else 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanLike:
    """What the memory model needs of a plan (an :class:`OffloadPlan` or a hypothetical one).

    Attributes:
        device_numel: parameters whose fp32 master and Adam state live on the GPU (the tail).
        host_numel: parameters whose fp32 master and Adam state live on the host.
        host_bytes_per_param: 16 (p/m/v + landing + staging; inverse rollback) or 28 (+ a second p/m/v copy:
            double-buffer or snapshot rollback).
        weight_mode: ``"stationary"`` (bf16 weights on the GPU) or ``"flow"`` (streamed from the host).
        bucket_bytes: gradient bytes of the largest bucket (on the GPU while in flight).
        cast_side: ``"cpu"`` (bf16 crosses the link both ways) or ``"gpu"`` (bf16 gradients down, the fp32 master
            up: upload buffers are fp32 on the GPU, and the host has no bf16 staging arena).
        optimizer: ``"superoffload"``; ``"gpu_adamw"`` (fp32 weights, gradients and AdamW on the GPU with
            bf16 autocast: the baseline); ``"none"`` (bf16 forward+backward whose gradients persist).
        accumulation_bytes: host RAM of the gradient accumulation buffers (``OffloadPlan.accumulation_bytes``:
            4 B/param for the fp32 arena of host accumulation, a few buckets for its landing mode, else 0).
        speculated_fraction: share of the rollback copy ever written. 1.0 for a double buffer (every step
            writes the other copy) and the conservative default; for a snapshot rollback, the share of host
            parameters stepped speculatively (only those write their snapshot).
        deferred_landing_bytes: the second (pinned) gradient landing arena of deferred moment stores
            (``OffloadPlan.deferred_landing_bytes``: 2 B/param when on, else 0).
        d2h_lead_buckets: ``OffloadPlan.d2h_lead_buckets``: flattened gradient buckets that may wait for their D2H
            on the GPU ([Note: D2H lead]); one is already in ``INFLIGHT_BUCKETS``.
        kept_layers: ``OffloadPlan.kept_layers``: under checkpointing, decoder layers that keep their activations.
        host_accumulation: ``OffloadPlan.host_accumulation``: ``"off"`` (micro-batches sum on the device),
            ``"fp32"`` or ``"landing"`` (the host sums them: the step-time roofline's micro-batch adds).
        deferred_speculation: ``OffloadPlan.deferred_speculation``: a speculative pass writes the bf16 weights only
            and each committed speculative step owes a whole-step commit in the worker's idle time (the step-time
            roofline counts it).
        master_share: with deferred moment stores, the share of host parameters whose verdict-known pass also
            leaves the fp32 master to the commit (16 instead of 20 B/param in the pass, 26 instead of 18 in the
            commit): 1 for ``MasterDeferral.ALL``, the fixed share's parameters for ``SHARE``, 0 otherwise
            (``ADAPTIVE`` starts at 0 and adds buckets only while their commits fit the worker's idle time).
        host_buckets: how many buckets the CPU worker steps (the step-time roofline's per-bucket cost, [Note: bucket
            size] in docs/design.md); 0 prices none.
    """

    device_numel: int = 0
    host_numel: int = 0
    host_bytes_per_param: int = 16
    weight_mode: Literal["stationary", "flow"] = "stationary"
    bucket_bytes: int = 32 * 1024 * 1024
    cast_side: Literal["cpu", "gpu"] = "cpu"
    optimizer: Literal["superoffload", "gpu_adamw", "none"] = "superoffload"
    speculated_fraction: float = 1.0
    accumulation_bytes: int = 0
    deferred_landing_bytes: int = 0
    d2h_lead_buckets: int = 0
    kept_layers: int = 0
    host_accumulation: Literal["off", "fp32", "landing"] = "off"
    deferred_speculation: bool = False
    master_share: float = 0.0
    host_buckets: int = 0

    def __post_init__(self) -> None:
        if self.host_buckets < 0:
            raise ValueError(f"host_buckets={self.host_buckets}: use a number of buckets >= 0")
        if not 0.0 <= self.master_share <= 1.0:
            raise ValueError(f"master_share={self.master_share}: use a fraction in [0, 1]")
        if self.kept_layers < 0:
            raise ValueError(f"kept_layers={self.kept_layers}: use a number of decoder layers >= 0")
        if self.host_bytes_per_param not in (16, 28):
            raise ValueError(f"host_bytes_per_param={self.host_bytes_per_param}: use 16 (inverse) or 28 (snapshot)")
        if not 0.0 <= self.speculated_fraction <= 1.0:
            raise ValueError(f"speculated_fraction={self.speculated_fraction}: use a fraction in [0, 1]")

    @classmethod
    def from_plan(cls, plan: OffloadPlan, *, bucket_bytes: int | None = None) -> PlanLike:
        gpu_cast = plan.cast_side is CastSide.GPU
        # the buckets in flight at once are at most the few largest (a bucket per embedding matrix is far larger
        # than the rest, and the two are never in flight together: one arrives first, the other last)
        inflight = INFLIGHT_BUCKETS + max(0, plan.d2h_lead_buckets - 1)
        top = sorted((b.numel for b in plan.host_buckets), reverse=True)[:inflight]
        largest = (sum(top) // len(top) if top else 0) * (4 if gpu_cast else 2)
        if plan.defer_master is MasterDeferral.ALL:
            master = 1.0
        elif plan.defer_master is MasterDeferral.SHARE and plan.host_numel:
            master = min(1.0, sum(b.shard for b in plan.host_buckets[: plan.master_buckets]) / plan.host_numel)
        else:
            master = 0.0
        return cls(device_numel=plan.device_numel, host_numel=plan.host_numel,
                   host_bytes_per_param=28 if plan.rollback is Rollback.DOUBLE_BUFFER else 16,
                   accumulation_bytes=plan.accumulation_bytes(),
                   deferred_landing_bytes=plan.deferred_landing_bytes(),
                   weight_mode="flow" if plan.weight_mode is WeightMode.FLOW else "stationary",
                   bucket_bytes=largest if bucket_bytes is None else bucket_bytes, cast_side="gpu" if gpu_cast else "cpu",
                   d2h_lead_buckets=plan.d2h_lead_buckets, kept_layers=plan.kept_layers,
                   host_accumulation=plan.host_accumulation.value, deferred_speculation=plan.deferred_speculation,
                   master_share=master if plan.defer_moments else 0.0, host_buckets=len(plan.host_buckets))

    @classmethod
    def all_host(cls, numel: int, **kw: Any) -> PlanLike:  # every optimizer state on the host, no device tail
        return cls(host_numel=numel, **kw)


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted peaks with their breakdowns (bytes) and the inputs that produced them."""

    shape: ModelShape
    batch_size: int
    seq_len: int
    grad_ckpt: bool
    plan_like: PlanLike
    gpu_phases: dict[str, dict[str, int]]  # phase (loss, backward, step) -> component -> bytes allocated
    host: dict[str, int]  # component -> bytes, every page of the rollback copy resident (conservative)
    host_snapshot_untouched: int = 0  # bytes of a snapshot rollback copy that are never written
    notes: tuple[str, ...] = field(default=())
    sequence_parallel: int = 1
    loss_chunk_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    keep_attention: bool = False
    accumulation: bool = False
    chunked_loss: bool = False

    @property
    def gpu_peak_phase(self) -> str:
        return max(self.gpu_phases, key=lambda k: sum(self.gpu_phases[k].values()))

    @property
    def gpu(self) -> dict[str, int]:  # the peak phase's breakdown
        return self.gpu_phases[self.gpu_peak_phase]

    @property
    def gpu_peak_bytes(self) -> int:
        """Predicted ``torch.cuda.max_memory_allocated``."""
        return sum(self.gpu.values())

    @property
    def largest_block_bytes(self) -> int:
        """The largest single allocation of a step: the loss's logits or their gradient (bf16 with the chunked loss,
        or its fp32 chunk at short batches; fp32 with HF's upcast; one fp32 chunk with the sequence-parallel loss), or
        the LM head's weight."""
        s = self.shape
        tokens = -(-self.batch_size * self.seq_len // self.sequence_parallel)
        if self.loss_chunk_tokens is not None:
            logits = 4 * min(tokens, self.loss_chunk_tokens)
        elif self.chunked_loss:  # the bf16 logits (or their gradient), or one fp32 chunk where that is larger
            logits = max(2 * tokens, 4 * min(tokens, CHUNK_TOKENS))
        else:
            logits = 4 * tokens
        return max(logits * s.vocab_size, 2 * s.embedding_numel)

    @property
    def gpu_required_bytes(self) -> int:
        """What must be free on the device: the allocated peak plus the allocator's slack, 1 GiB and the larger of 5%
        of the peak and the largest single allocation ([Note: the allocator's slack])."""
        return self.gpu_peak_bytes + max(int(0.05 * self.gpu_peak_bytes), self.largest_block_bytes) + GiB

    @property
    def host_peak_bytes(self) -> int:
        """Host RSS with every allocated page resident (what fit checks use)."""
        return sum(self.host.values())

    @property
    def host_expected_bytes(self) -> int:
        """Host RSS when only ``speculated_fraction`` of the rollback copy is written."""
        return self.host_peak_bytes - self.host_snapshot_untouched


def estimate(model_config: Any, *, batch_size: int, seq_len: int, grad_ckpt: bool,
             plan_like: PlanLike | None = None, sequence_parallel: int = 1,
             loss_chunk_tokens: int | None = None, mlp_tile_tokens: int | None = None,
             keep_attention: bool = False, accumulation: bool = False,
             chunked_loss: bool = False) -> MemoryEstimate:
    """Predict the peak GPU and host memory of one training step (see [Note: memory model]).

    Args:
        model_config: a transformers config, a dict of its fields, a preset name or a :class:`ModelShape`.
        plan_like: placement of the optimizer state (per rank); default: everything on the host, inverse rollback.
        sequence_parallel: Ulysses ranks per sequence: each holds ``seq_len / sequence_parallel`` tokens of every
            activation (attention holds all tokens of ``1/sequence_parallel`` of the heads: the same bytes).
        loss_chunk_tokens: the LM head and loss run over chunks of this many tokens (the sequence-parallel loss
            does), so only one chunk of logits exists at a time; ``None``: HF's loss over all logits at once.
        mlp_tile_tokens: every decoder layer's MLP runs this many tokens at a time (``enable_tiled_mlp``); ``None``:
            untiled.
        keep_attention: checkpointing keeps each layer's attention output and log-sum-exp
            (``enable_checkpointing_keep_attention``); only with ``grad_ckpt``.
        accumulation: micro-batches accumulate gradients between optimizer steps. From the second micro-batch on,
            the gradients summed on the device (the tail's; every bucket's unless the plan sums host buckets on the
            host) are alive through the forward and the loss too, not only from the backward on (a 15B run at
            batch 4 x 2048 ran out of memory at the second micro-batch's loss, 5 GiB past the prediction without
            this term).
        chunked_loss: transformers' causal-LM loss is the chunked one of ``causal_lm_loss.py`` (the optimizer
            installs it by default): 4 B per logit element and one fp32 chunk (its forward: 2 B and two fp32
            chunks) instead of 12 B per element.
    """
    if batch_size < 1 or seq_len < 1 or sequence_parallel < 1:
        raise ValueError(f"batch_size, seq_len and sequence_parallel must be >= 1, got {batch_size}, {seq_len} "
                         f"and {sequence_parallel}")
    if keep_attention and not grad_ckpt:
        raise ValueError("keep_attention=True keeps attention's outputs under gradient checkpointing: set "
                         "grad_ckpt=True too (without checkpointing every activation is kept anyway)")
    if mlp_tile_tokens is not None and mlp_tile_tokens < 1:
        raise ValueError(f"mlp_tile_tokens={mlp_tile_tokens}: use a positive number of tokens, or None (untiled)")
    s = ModelShape.from_config(model_config)
    p = plan_like or PlanLike.all_host(s.numel)
    n, tokens, h = s.numel, -(-batch_size * seq_len // sequence_parallel), s.hidden_size
    autocast, flow = p.optimizer == "gpu_adamw", p.weight_mode == "flow" and p.optimizer == "superoffload"
    notes: list[str] = []
    if flow:
        # runtime/weight_flow.py: the unit in use and the one prefetched. The largest pair is two layers, or the
        # LM head (or, tied, the shared embedding, resident from the LM head's backward to the embedding's)
        # with a layer; the device tail's weights stay resident.
        streamed = min(FLOW_RESIDENT_LAYERS, s.num_layers) * s.layer_numel
        streamed = max(streamed, s.embedding_numel + (s.layer_numel if s.num_layers else 0))
        resident = {"weights": 2 * (min(streamed, n) + p.device_numel)}
        notes.append(f"weight-flow: {2 * streamed / GiB:.2f} GiB of streamed bf16 weights resident at most "
                     "(modelled, not calibrated)")
    else:
        resident = {"weights": (4 if autocast else 2) * n}
    if p.optimizer != "none":
        resident["optimizer_state"] = 8 * n if autocast else 12 * p.device_numel
    else:  # the fwd+bwd probe's gradients persist
        resident["gradients"] = 2 * n

    layer_act = s.layer_activation_bytes_per_token(autocast=autocast) * tokens  # what one layer saves
    layer_bwd = int(1.5 * layer_act)  # one layer's recompute and activation gradients
    tile_sums = 0
    if mlp_tile_tokens is not None:  # the MLP saves nothing of its own; backward recomputes one tile at a time
        layer_act -= s.mlp_activation_bytes_per_token * tokens
        layer_bwd = int(1.5 * (layer_act + s.mlp_activation_bytes_per_token * min(mlp_tile_tokens, tokens)))
        tile_sums = (4 + (4 if autocast else 2)) * s.mlp_numel if tokens > mlp_tile_tokens else 0
    ckpt_bytes = tokens * h * (4 if autocast else 2)  # a checkpointed layer's saved input
    # under checkpointing, the plan's kept layers save everything (their activations die first in backward)
    kept = min(p.kept_layers, s.num_layers) if grad_ckpt else 0
    checkpointed = s.num_layers - kept if grad_ckpt else 0
    loss = dict(resident, activations=checkpointed * ckpt_bytes + (s.num_layers - checkpointed) * layer_act)
    loss["final_norm"] = (14 if autocast else 8) * h * tokens
    if loss_chunk_tokens is None and chunked_loss:
        # [Note: chunked causal-LM loss]: its backward holds the saved bf16 logits, their bf16 gradient and one fp32
        # chunk; its forward the bf16 logits, an fp32 chunk and logsumexp's fp32 temporary of it (the larger at
        # sequences under two chunks)
        chunk = min(tokens, CHUNK_TOKENS)
        backward_peak = CHUNKED_LOGITS_BYTES_PER_ELEMENT * tokens + 4 * chunk
        loss["logits"] = max(backward_peak, 2 * tokens + 8 * chunk) * s.vocab_size
    else:
        loss["logits"] = LOGITS_BYTES_PER_ELEMENT * min(tokens, loss_chunk_tokens or tokens) * s.vocab_size
    if autocast:
        loss["autocast_weight_copies"] = 2 * s.embedding_numel  # the LM head's bf16 copy, saved for backward

    # the last decoder layer's backward (its recompute and activation gradients), then the optimizer step
    backward = dict(resident, activations=layer_bwd)
    phases = {"loss": loss, "backward": backward}
    if grad_ckpt:
        # the first recomputed layer (the last one): every layer's checkpointed input is still alive. Negligible
        # next to the logits at short sequences; the peak at long ones (the logits are chunked or freed by then).
        phases["backward_start"] = dict(resident, activations=layer_bwd + kept * layer_act,
                                        checkpoints=checkpointed * ckpt_bytes)
    if keep_attention:  # every layer's attention output (bf16) and log-sum-exp (fp32) live until its backward
        kept = s.num_layers * tokens * (2 * s.num_heads * s.head_dim + 4 * s.num_heads)
        loss["kept_attention"] = phases["backward_start"]["kept_attention"] = kept
    if tile_sums:
        for d in phases.values():
            if d is not loss:
                d["mlp_tile_grad_sums"] = tile_sums
    if sequence_parallel > 1:  # an all-to-all's input beside its output (q, k, v; KV heads replicated to P)
        kv = max(s.num_kv_heads, sequence_parallel)
        for d in phases.values():
            if d is not loss:
                d["all_to_all"] = 2 * tokens * s.head_dim * (s.num_heads + 2 * kv)
    step = dict(resident)
    if p.optimizer == "gpu_adamw":
        backward["gradients"] = 4 * (n - s.embedding_numel)  # the input embedding's gradient comes last
        backward["autocast_weight_copies"] = 2 * s.layer_numel
        step["gradients"] = 4 * n
    elif p.optimizer == "superoffload":
        summed = 2 * p.device_numel + (0 if p.accumulation_bytes else 2 * p.host_numel)  # on the device, bf16
        for name, d in (*phases.items(), ("step", step)):
            if accumulation and name in ("loss", "backward_start"):
                d["accumulated_gradients"] = summed  # the previous micro-batches' sum
            elif accumulation and not p.accumulation_bytes and p.host_numel:
                d["accumulated_gradients"] = 2 * p.host_numel  # host buckets summed in param.grad as well
            if name == "loss":
                continue
            if name != "backward_start":  # the tail holds the first layers: its gradients come last
                d["tail_gradients"] = 2 * p.device_numel
            inflight = INFLIGHT_BUCKETS + max(0, p.d2h_lead_buckets - 1)  # [Note: D2H lead]: k waiting for the D2H
            per = p.bucket_bytes
            if p.cast_side == "gpu" and name != "step":
                per //= 2  # in backward only bf16 gradients are in flight; the fp32 uploads run in the next forward
            d["bucket_buffers"] = inflight * per if p.host_numel else 0

    host: dict[str, int] = {"runtime_baseline": RUNTIME_HOST_BYTES}
    untouched = 0
    if p.optimizer == "superoffload" and p.host_numel:  # the arenas (runtime/layout.py::BucketLayout)
        host["fp32_master_adam"] = 12 * p.host_numel
        host["pinned_landing_staging"] = (4 if p.cast_side == "cpu" else 2) * p.host_numel  # GPU cast: no staging
        if p.host_bytes_per_param == 28:
            host["rollback_copy"] = 12 * p.host_numel
            untouched = int(12 * p.host_numel * (1.0 - p.speculated_fraction))
        if p.accumulation_bytes:
            host["grad_accumulation"] = p.accumulation_bytes
        if p.deferred_landing_bytes:
            host["deferred_landing"] = p.deferred_landing_bytes
        host["engine_overhead"] = int(ENGINE_HOST_BYTES_PER_PARAM * p.host_numel)

    return MemoryEstimate(s, batch_size, seq_len, grad_ckpt, p, {**phases, "step": step},
                          host, untouched, tuple(notes), sequence_parallel, loss_chunk_tokens, mlp_tile_tokens,
                          keep_attention, accumulation, chunked_loss)


# ---------------------------------------------------------------------------------------------- fit checks
def _overruns(est: MemoryEstimate, profile: HardwareProfile) -> tuple[int, int]:
    """Bytes by which the GPU and the host budgets are exceeded (0: fits or unknown)."""
    gpu = 0 if profile.device_free_bytes is None else max(0, est.gpu_required_bytes - profile.device_free_bytes)
    host = 0 if profile.host_available_bytes is None else max(0, est.host_peak_bytes - profile.host_available_bytes)
    return gpu, host


def fits(est: MemoryEstimate, profile: HardwareProfile) -> bool:
    """True when the estimate fits the profile's free device memory and available host RAM."""
    return _overruns(est, profile) == (0, 0)


def _again(est: MemoryEstimate, **changes: Any) -> MemoryEstimate:
    """``est``'s run estimated again with ``changes`` (every other input as ``est`` had it)."""
    kw = dict(batch_size=est.batch_size, seq_len=est.seq_len, grad_ckpt=est.grad_ckpt, plan_like=est.plan_like,
              sequence_parallel=est.sequence_parallel, loss_chunk_tokens=est.loss_chunk_tokens,
              mlp_tile_tokens=est.mlp_tile_tokens, keep_attention=est.keep_attention,
              accumulation=est.accumulation, chunked_loss=est.chunked_loss)
    return estimate(est.shape, **(kw | changes))


def bisect_largest(lo: int, hi: int, ok: Any) -> int | None:
    """Largest x in [lo, hi] with ok(x), for a monotone ok; None if none."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _items(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / GiB:.1f}" for k, v in d.items() if v)


def check_fits(est: MemoryEstimate, profile: HardwareProfile, *, frontier: tuple[int | None, int | None] | None = None,
               searched: frozenset[str] = frozenset()) -> None:
    """Raise :class:`~hf_superoffload.planning.planner.PlanError` with the numbers and what to change
    when ``est`` does not fit ``profile`` (unknown budgets are not checked).

    ``frontier``: the largest batch and the longest sequence below ``est``'s whose planned run fits
    (``planner.fit_frontier``: the plan search's own answer, which replaces this plan's memory model bisection);
    ``searched``: the config fields the plan search weighed (``weight_placement``, ``gpu_resident_buckets``): what it
    found not to fit is not offered as an option."""

    gpu_over, host_over = _overruns(est, profile)
    if not gpu_over and not host_over:
        return
    p, out = est.plan_like, []

    def gpu_ok(e: MemoryEstimate) -> bool:
        return _overruns(e, profile)[0] == 0

    if gpu_over:
        out.append(f"GPU: needs {est.gpu_required_bytes / GiB:.1f} GiB ({est.gpu_peak_bytes / GiB:.1f} GiB allocated "
                   f"at the {est.gpu_peak_phase} phase: {_items(est.gpu)}; plus allocator slack) but "
                   f"{(profile.device_free_bytes or 0) / GiB:.1f} GiB is free. Options:")
        if not est.grad_ckpt and gpu_ok(_again(est, grad_ckpt=True)):
            out.append("  - enable gradient checkpointing (--grad-ckpt): it then fits")
        if frontier is not None:
            b, sq = frontier
            if b:
                out.append(f"  - batch size {b} fits (same sequence length; accumulate gradients for the same tokens)")
            if sq:
                out.append(f"  - at batch size {est.batch_size}, sequences up to {sq} tokens fit")
        else:
            b = bisect_largest(1, est.batch_size - 1, lambda x: gpu_ok(_again(est, batch_size=x))) if est.batch_size > 1 else None
            sq = None if b else bisect_largest(1, est.seq_len - 1, lambda x: gpu_ok(_again(est, batch_size=1, seq_len=x)))
            if b:
                out.append(f"  - batch size {b} fits (same sequence length; accumulate gradients for the same tokens)")
            elif sq:
                out.append(f"  - at batch size 1, sequences up to {sq} tokens fit")
        full_logits = est.loss_chunk_tokens is None and not est.chunked_loss  # HF's loss over all logits
        if full_logits and est.gpu.get("logits", 0) > 0.25 * est.gpu_peak_bytes:
            out.append(f"  - the logits take {est.gpu['logits'] / GiB:.1f} GiB (12 B per token and vocabulary entry): "
                       "a chunked cross-entropy would remove most of it")
        if p.optimizer == "superoffload" and p.device_numel and "gpu_resident_buckets" not in searched:
            out.append(f"  - the device tail holds {14 * p.device_numel / GiB:.1f} GiB: lower gpu_resident_buckets")
        if p.optimizer == "superoffload" and p.weight_mode == "stationary" and "weight_placement" not in searched:
            flow = _again(est, plan_like=dataclasses.replace(p, weight_mode="flow"))
            out.append(f"  - weight_placement='flow' would free {(est.gpu_peak_bytes - flow.gpu_peak_bytes) / GiB:.1f} "
                       f"GiB of resident weights ({'fits' if gpu_ok(flow) else 'does not fit'})")
        if searched:
            out.append(f"  - (the plan search already weighed {', '.join(sorted(searched))}: no value of them fits)")
        out.append("  - more GPUs: data parallel splits the batch, sequence parallel (Ulysses) the activations")
    if host_over:
        out.append(f"host: needs {est.host_peak_bytes / GiB:.1f} GiB ({_items(est.host)}) but "
                   f"{(profile.host_available_bytes or 0) / GiB:.1f} GiB is available. Options:")
        if "rollback_copy" in est.host:
            out.append(f"  - rollback='inverse' saves {est.host['rollback_copy'] / GiB:.1f} GiB")
        if p.host_numel and est.host.get("grad_accumulation", 0) >= 4 * p.host_numel:  # the fp32 arena
            out.append(f"  - host_accumulation_dtype='landing' saves most of the {est.host['grad_accumulation'] / GiB:.1f} "
                       "GiB fp32 gradient accumulator")
        if "deferred_landing" in est.host:
            out.append(f"  - PlannerOverrides(defer_moments=False) saves {est.host['deferred_landing'] / GiB:.1f} GiB")
        per = (p.host_bytes_per_param + ENGINE_HOST_BYTES_PER_PARAM
               + (p.accumulation_bytes + p.deferred_landing_bytes) / max(p.host_numel, 1))
        move = min(p.host_numel, int(host_over / per) + 1)
        moved = _again(est, plan_like=dataclasses.replace(p, device_numel=p.device_numel + move,
                                                          host_numel=p.host_numel - move))
        out.append(f"  - keep {move / 1e9:.2f}B more parameters' optimizer state on the GPU (gpu_resident_buckets): "
                   f"the GPU then needs {moved.gpu_required_bytes / GiB:.1f} GiB "
                   f"({'fits' if gpu_ok(moved) else 'does not fit'})")
        out.append("  - more host RAM, or more nodes: data parallel shards the host state across nodes")
    raise PlanError("the run does not fit.\n" + "\n".join(out))


def largest_model_that_fits(family_config: Any, *, batch_size: int, seq_len: int, grad_ckpt: bool,
                            profile: HardwareProfile, host_bytes_per_param: int = 16,
                            bucket_bytes: int = 32 * 1024 * 1024, max_layers: int = 1024,
                            weight_mode: Literal["stationary", "flow"] = "stationary",
                            ) -> tuple[int, MemoryEstimate] | None:
    """The most decoder layers of ``family_config``'s width that fit ``profile`` (``None``: not even one), with
    the estimate. Optimizer state stays on the host, less the smallest device tail that makes host RAM fit."""
    shape, avail = ModelShape.from_config(family_config), profile.host_available_bytes
    if avail is None and profile.device_free_bytes is None:
        raise ValueError("the profile knows neither free device memory nor available host RAM: nothing bounds the size")
    per = host_bytes_per_param + ENGINE_HOST_BYTES_PER_PARAM

    def est_for(layers: int) -> MemoryEstimate:
        n = shape.with_layers(layers).numel
        tail = 0 if avail is None else min(n, max(0, math.ceil(n - (avail - RUNTIME_HOST_BYTES) / per)))
        plan_like = PlanLike(device_numel=tail, host_numel=n - tail, host_bytes_per_param=host_bytes_per_param,
                             bucket_bytes=bucket_bytes, weight_mode=weight_mode)
        return estimate(shape.with_layers(layers), batch_size=batch_size, seq_len=seq_len, grad_ckpt=grad_ckpt,
                        plan_like=plan_like)

    best = bisect_largest(1, max_layers, lambda layers: fits(est_for(layers), profile))
    return None if best is None else (best, est_for(best))
