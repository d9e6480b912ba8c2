"""What a Trainer checkpoint costs at scale: save time, the host memory a save and a resume add, size on disk.

    python benchmarks/checkpoint.py --row 3.6b:8 --dir /path/on/disk --out $OUT/checkpoint.jsonl [--steps 6]

Two processes on the row's model (defaults.py's shape: random init, batch x 2048 tokens, checkpointing, clip 1.0):

  save    ``SuperOffloadTrainer`` with no offload settings trains ``--steps`` optimizer steps and saves one
          checkpoint (``save_strategy="steps"``) at the last: its model files, ``superoffload_optimizer.pt`` and the
          Trainer's state.
  resume  a fresh process resumes from that checkpoint (``resume_from_checkpoint``) and trains two more steps.

Each record: seconds of the save (from the last step's end to the Trainer's ``on_save``) and of the resume (from
``train()`` to the first resumed step's end, the load included); peak host RSS before and after the save / resume
(``ru_maxrss``) and the highest RSS and anonymous RSS a 20 ms sampler saw during it, so the bytes a checkpoint adds
beside a plan that fills the host are measured (a resume maps the optimizer file: its pages count in RSS as clean
page cache, not in the anonymous RSS); the checkpoint's bytes on disk per file; what lives on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))


def _rss_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _rss_anon() -> float:
    """Resident anonymous memory: what the process holds. A mapped checkpoint's pages count in RSS as file pages
    (clean page cache the kernel drops under pressure), not here."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 / 1e9 for line in f if line.startswith("RssAnon:"))


def _peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class RssSampler:
    """The highest RSS and anonymous RSS seen while ``active``, sampled every 20 ms on a daemon thread."""

    def __init__(self) -> None:
        self.active = False
        self.high = self.high_anon = 0.0
        threading.Thread(target=self._run, daemon=True).start()

    def start(self) -> None:
        self.high = self.high_anon = 0.0
        self.active = True

    def _run(self) -> None:
        while True:
            if self.active:
                self.high = max(self.high, _rss_now())
                self.high_anon = max(self.high_anon, _rss_anon())
            time.sleep(0.02)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(phase: str, preset: str, batch: int, layers: int | None, steps: int, ckpt_root: Path,
        device_name: str) -> dict[str, Any]:
    import torch
    from defaults import LR, _model  # the benchmark's model and settings, one definition
    from transformers import TrainerCallback

    from hf_superoffload import SuperOffloadArguments, SuperOffloadTrainer

    device = torch.device(device_name)
    model = _model(preset, layers, device, torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1234)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, model.config.vocab_size, (batch, 2048), generator=gen)]
    rec: dict[str, Any] = {"phase": phase, "preset": preset, "batch": batch, "params": n, "steps": steps}
    sampler = RssSampler()
    marks: dict[str, float] = {}

    class Watch(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            marks.setdefault("begin", time.perf_counter())

        def on_step_end(self, _args: Any, state: Any, _control: Any, **__: Any) -> None:
            _sync(device)
            if phase == "save" and state.global_step == steps:  # the save follows this step
                marks["last_step"] = time.perf_counter()
                rec["peak_rss_before_gb"] = _peak_rss()
                rec["rss_before_gb"], rec["anon_before_gb"] = _rss_now(), _rss_anon()
                sampler.start()
            if phase == "resume" and "first_step" not in marks:
                marks["first_step"] = time.perf_counter()
                sampler.active = False
                rec["resumed_at_step"] = state.global_step - 1
            if phase == "resume" and state.global_step == max_steps:  # the resumed run's own steady state
                rec["anon_end_gb"] = _rss_anon()

        def on_save(self, *_: Any, **__: Any) -> None:
            marks["saved"] = time.perf_counter()
            sampler.active = False

    max_steps = steps if phase == "save" else steps + 2
    args = SuperOffloadArguments(output_dir=str(ckpt_root), bf16=True, max_grad_norm=1.0, learning_rate=LR,
                                 weight_decay=0.1, adam_beta2=0.95, per_device_train_batch_size=batch,
                                 max_steps=max_steps, lr_scheduler_type="constant", report_to=[],
                                 save_strategy="steps" if phase == "save" else "no", save_steps=steps,
                                 dataloader_drop_last=True, disable_tqdm=True, logging_steps=1,
                                 use_cpu=device.type != "cuda")
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=rows * (max_steps + 1), callbacks=[Watch()])
    if phase == "save":
        trainer.train()
        rec["save_s"] = marks["saved"] - marks["last_step"]
        rec["rss_during_save_gb"], rec["anon_during_save_gb"] = sampler.high, sampler.high_anon
        rec["peak_rss_after_gb"] = _peak_rss()
        ckpt = ckpt_root / f"checkpoint-{steps}"
        files = {p.name: p.stat().st_size for p in sorted(ckpt.iterdir()) if p.is_file()}
        rec["files_gb"] = {k: round(v / 1e9, 3) for k, v in files.items()}
        rec["checkpoint_gb"] = sum(files.values()) / 1e9
    else:
        ckpt = ckpt_root / f"checkpoint-{steps}"
        rec["peak_rss_before_gb"] = _peak_rss()
        rec["rss_before_gb"] = _rss_now()
        sampler.start()
        marks["call"] = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(ckpt))
        rec["resume_s"] = marks["first_step"] - marks["call"]
        rec["rss_during_resume_gb"], rec["anon_during_resume_gb"] = sampler.high, sampler.high_anon
        rec["peak_rss_after_gb"] = _peak_rss()
    opt = trainer.superoffload_optimizer
    rec["host_params"] = opt.plan.host_numel
    rec["host_state_gb"] = opt.plan.host_bytes() / 1e9
    rec["plan"] = opt.plan.summary()
    if opt.last_step_stats is not None:
        rec["last_loss"] = next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None)
    opt.close()
    return rec


def main(argv: list[str] | None = None) -> int:
    from defaults import parse_row

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="3.6b:8", help="PRESET:BATCH[:1[:LAYERS]] (defaults.py's row spec)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps before the checkpoint")
    ap.add_argument("--dir", required=True, help="where the checkpoint is written (removed afterwards)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    ap.add_argument("--out", required=True, help="a .jsonl file; one record per process")
    ap.add_argument("--worker", choices=("save", "resume"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    preset, batch, accum, layers = parse_row(args.row)
    if accum != 1:
        raise SystemExit(f"--row {args.row!r}: this benchmark runs one micro-batch per step; drop the accumulation")
    root = Path(args.dir)
    if args.worker:
        rec = run(args.worker, preset, batch, layers, args.steps, root, args.device)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    try:
        for phase in ("save", "resume"):
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--worker", phase, "--row", args.row, "--steps", str(args.steps),
                   "--dir", str(root), "--device", args.device, "--out", args.out]
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
            print(f"{args.row} {phase}: rc={proc.returncode} in {time.perf_counter() - t:.0f} s", flush=True)
            if proc.returncode:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"phase": phase, "row": args.row, "status": "failed",
                                        "tail": (proc.stderr or proc.stdout)[-2000:]}) + "\n")
                return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
