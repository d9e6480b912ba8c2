"""One rank of a custom Accelerate loop with prepare_superoffload (launched by test_accelerate_data_parallel.py).

argv: out_dir steps [load_dir] [save_at]. gloo on CPU (accelerate's MULTI_CPU from RANK/WORLD_SIZE).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from hf_superoffload import sequence_parallel as sp
from hf_superoffload.integrations.accelerate import SuperOffloadPlugin, prepare_superoffload
from hf_superoffload.testing import tiny_llama


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    load = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    save_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    sp_size = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    acc = Accelerator(cpu=True)
    plugin = SuperOffloadPlugin(bucket_size_mb=0.004, gpu_resident_buckets=2, cpu_threads=1)
    model, opt = prepare_superoffload(acc, tiny_llama(seed=0), dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0),
                                      plugin=plugin, sequence_parallel_size=sp_size)
    start = 0
    if load:
        acc.load_state(load)
        start = json.loads((Path(load) / "step.json").read_text())["step"]
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 128, (4, 16), generator=g) for _ in range(start + steps)]
    replicas = acc.num_processes // sp_size
    per = 4 // replicas
    losses = []
    for step in range(start, start + steps):
        r = acc.process_index // sp_size  # the ranks of a sequence group share their samples
        ids = data[step][r * per : (r + 1) * per]
        if sp_size > 1:  # this rank's chunk of every sequence; chunked loss over the group's tokens
            groups = sp.active_groups()
            res = sp.causal_lm_loss(acc.unwrap_model(model), sp.shard_batch({"input_ids": ids, "labels": ids}, groups),
                                    groups)
            acc.backward(res.loss)
            loss = res.global_loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
        if step == save_at:
            acc.save_state(str(out / "ckpt"))
            if acc.is_main_process:
                (out / "ckpt" / "step.json").write_text(json.dumps({"step": step + 1}))
            acc.wait_for_everyone()
    opt.superoffload.synchronize()
    if acc.is_main_process:
        (out / "losses.json").write_text(json.dumps(losses))
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / "weights.pt")
    opt.superoffload.close()
    if torch.distributed.is_initialized():  # tear down while the interpreter is alive (see _ulysses_worker.py)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
