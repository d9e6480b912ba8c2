"""Train a Llama-style model on one GPU with one system per process; print one JSON line.

Usage: python benchmarks/anchor.py MODE
MODE: gpu | ours | ours_host | ours_nospec | ours_noclip | ours_host_noclip
Shape from env (as in the team's anchor configs): CFG=hidden,intermediate,layers,heads,kv_heads,vocab (default 3.6B),
BS, SEQ, STEPS, WARM. OFFLOAD_JSON adds SuperOffloadConfig fields (planner switches under "overrides").

MFU convention (docs/benchmarks.md): model FLOPs per token = 6N + 6*L*d*s (causal attention, all parameters
counted, recompute not counted), against 989 TFLOP/s.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def main() -> None:
    import torch

    mode = sys.argv[1]
    h, inter, layers, heads, kv, vocab = (int(x) for x in os.environ.get("CFG", "3072,8192,28,24,8,128256").split(","))
    bs, seq = int(os.environ.get("BS", 8)), int(os.environ.get("SEQ", 2048))
    warm, steps = int(os.environ.get("WARM", 3)), int(os.environ.get("STEPS", 5))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    dtype = torch.float32 if mode == "gpu" else torch.bfloat16
    t_init = time.perf_counter()
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, vocab, (bs, seq), device=dev)
    extra: dict = {}

    if mode == "gpu":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    elif mode.startswith("ours"):
        from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer

        kw = json.loads(os.environ.get("OFFLOAD_JSON", "{}"))
        if "host" in mode:
            kw.setdefault("gpu_resident_buckets", 0)
        if "nospec" in mode:
            kw.setdefault("speculation", False)
        clip = None if "noclip" in mode else 1.0
        opt = SuperOffloadOptimizer(model, lr=1e-5, weight_decay=0.0, max_grad_norm=clip,
                                    config=SuperOffloadConfig.from_dict(kw))
        extra["plan"] = opt.plan.summary()
        from hf_superoffload import ops

        extra["cpu_adam_backend"] = ops.backend()

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
    else:
        raise SystemExit(f"unknown mode {mode}")
    t_init = time.perf_counter() - t_init

    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    times, stats = [], []
    t_all = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if mode.startswith("ours"):
            st = opt.last_step_stats
            stats.append({"cpu_s": round(st.cpu_s, 3), "wait_s": round(st.wait_s, 3), "verdict": st.verdict,
                          "norm": round(st.grad_norm, 3)})
    if mode.startswith("ours"):
        opt.synchronize()
    torch.cuda.synchronize()
    t_all = (time.perf_counter() - t_all) / steps
    srt = sorted(times)
    dt = srt[len(srt) // 2]
    tok = bs * seq / dt
    flops = (6 * n + 6 * layers * h * seq) * tok
    out = {
        "mode": mode, "params_B": round(n / 1e9, 3), "bs": bs, "seq": seq, "step_s_median": round(dt, 3),
        "step_s_mean_window": round(t_all, 3), "step_s_all": [round(x, 3) for x in times],
        "tokens_per_s": round(tok), "model_TFLOPs": round(flops / 1e12, 1), "MFU_vs_989": round(flops / 989e12, 3),
        "loss": round(float(loss.detach()), 3), "peak_gpu_GB": round(torch.cuda.max_memory_allocated() / 1e9, 1),
        "peak_host_rss_GB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 1),
        "init_s": round(t_init, 1), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "offload_stats": stats, **extra,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
