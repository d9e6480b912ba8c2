"""Calibrate the memory model's per-layer activations: what a decoder layer saves with and without checkpointing.

    python benchmarks/layer_memory.py --presets 3.6b:8 8b:4 8b:16 --out $OUT/layer_memory.jsonl

For each ``PRESET:BATCH`` a few-layer model of the preset's width (random init, bf16, sdpa, batch x 2048 tokens) runs
one forward and backward with every decoder layer checkpointed, and again with none. The difference of the memory
allocated after the forward, over the layers, is what keeping one layer's activations costs beyond its checkpoint;
the memory model's figure (``ModelShape.layer_activation_bytes_per_token`` less the checkpointed input) is printed
beside it, with the forward and backward times of both (the recompute the kept layers save).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

LAYERS = 4


def measure(preset: str, batch: int, seq: int, device_name: str) -> dict[str, Any]:
    import torch

    from hf_superoffload.demo.presets import build_on
    from hf_superoffload.plan_cli import load_model_config
    from hf_superoffload.planning.memory_model import ModelShape

    device = torch.device(device_name)
    cfg = load_model_config(preset)
    shape = ModelShape.from_config(cfg)
    cfg.num_hidden_layers = LAYERS
    cfg.max_position_embeddings = 4096
    cfg._attn_implementation = "sdpa" if device.type == "cuda" else "eager"
    model = build_on(cfg, device=device, dtype=torch.bfloat16, seed=0)
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    rec: dict[str, Any] = {"preset": preset, "batch": batch, "seq": seq, "layers": LAYERS}
    tokens = batch * seq
    for kept in (False, True):
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        if kept:
            for layer in model.model.layers:
                layer.gradient_checkpointing = False
        fwd, bwd, after_fwd, peak = [], [], [], []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                after_fwd.append(torch.cuda.memory_allocated(device) - base)
            fwd.append(time.perf_counter() - t)
            t = time.perf_counter()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peak.append(torch.cuda.max_memory_allocated(device) - base)
            bwd.append(time.perf_counter() - t)
            del loss
        key = "kept" if kept else "checkpointed"
        rec[key] = {"forward_s": statistics.median(fwd[1:]), "backward_s": statistics.median(bwd[1:]),
                    "after_forward_bytes": after_fwd[-1] if after_fwd else None,
                    "peak_bytes": peak[-1] if peak else None}
    if device.type == "cuda":
        per_layer = (rec["kept"]["after_forward_bytes"] - rec["checkpointed"]["after_forward_bytes"]) / LAYERS
        rec["kept_minus_checkpointed_per_layer_bytes"] = per_layer
        rec["per_token_bytes"] = per_layer / tokens
    model_per_token = shape.layer_activation_bytes_per_token() - 2 * shape.hidden_size
    rec["memory_model_per_token_bytes"] = model_per_token
    rec["recompute_saved_per_layer_s"] = (rec["checkpointed"]["backward_s"] - rec["kept"]["backward_s"]) / LAYERS
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["8b:4"], help="PRESET:BATCH")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for spec in args.presets:
        preset, batch = spec.split(":")
        rec = measure(preset, int(batch), args.seq, args.device)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
