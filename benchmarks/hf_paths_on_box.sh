#!/usr/bin/env bash
# One call on the GPU box: each Hugging Face user path once, a few steps on a small model built from a config and
# saved locally (no network; HF_HUB_OFFLINE=1). Each path writes one JSON line to $OUT/hf_paths.jsonl (path, ok,
# seconds, first/last loss, whether the plan summary appeared, the error tail) and keeps its log in $OUT/logs/.
#
#   OUT=/tmp/out bash benchmarks/hf_paths_on_box.sh
#   WHEELS=/path/to/wheels OUT=/tmp/out bash benchmarks/hf_paths_on_box.sh   # trl, datasets and what they need
#
# Paths: trainer (SuperOffloadTrainer + SuperOffloadArguments, gradient accumulation, a checkpoint), accelerate
# (examples/train_with_accelerate.py through `accelerate launch --config_file <our config>`), trl
# (examples/train_with_trl.py; skipped with a line when trl is not importable), cli_train (`hf-superoffload train`
# offline: the bundled model on local data, with --save-state), export (`hf-superoffload export` of that run, then
# from_pretrained, compared with the masters), resume (the trainer run continued from its newest complete
# checkpoint). Without a GPU it runs on the CPU with a tiny config and fewer steps (a check of the script).
#
# WHEELS: every wheel in that folder is installed without dependencies into /tmp/site (appended to PYTHONPATH, so
# the box's own torch/transformers win): put trl, datasets and the dependencies the box lacks there
# (pyarrow, dill, xxhash, multiprocess, ...). Knobs: STEPS, PATH_TIMEOUT (seconds per path), TOTAL_S (the whole
# script's deadline: 340 s, inside the box call's 6 minutes), MODEL_SIZE (tiny|small).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
source benchmarks/_stage.sh
export TOKENIZERS_PARALLELISM=false
WORK=${WORK:-/tmp/hf_paths}; rm -rf "$WORK"; mkdir -p "$WORK"
T0=$(date +%s)
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install --no-index --find-links "$WHEELS" --no-deps --target /tmp/site "$WHEELS"/*.whl \
    > "$OUT/logs/wheels.log" 2>&1; echo "wheels from $WHEELS: rc=$? ($(tail -1 "$OUT/logs/wheels.log"))"
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DEV=cuda; STEPS=${STEPS:-6}; MODEL_SIZE=${MODEL_SIZE:-small}; ACC_CONFIG=configs/single_gpu.yaml
else
  DEV=cpu; STEPS=${STEPS:-3}; MODEL_SIZE=${MODEL_SIZE:-tiny}; ACC_CONFIG=configs/single_cpu.yaml
fi
PATH_TIMEOUT=${PATH_TIMEOUT:-150}; TOTAL_S=${TOTAL_S:-340}; DEADLINE=$(( T0 + TOTAL_S ))
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; nproc; free -g | head -2
  python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'accelerate', accelerate.__version__)"
  python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" 2>&1 | tail -1
} > "$OUT/hw.txt" 2>&1
echo "device $DEV, $STEPS steps per path, model $MODEL_SIZE; $(tail -1 "$OUT/hw.txt")"
: > "$OUT/hf_paths.jsonl"

# ---- helpers written once ----------------------------------------------------------------------------------
cat > "$WORK/record.py" <<'PY'
"""Append one JSON line for a path from its log: losses, whether the plan summary appeared, the error tail."""
import json, re, sys

path, rc, seconds, log, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) / 1e3, sys.argv[4], sys.argv[5]
text = open(log, errors="replace").read()
# Trainer logs ('loss': 1.23) and the example/CLI step lines (step 3  loss 1.2345)
number = r"(-?[0-9]+\.?[0-9]*(?:e[-+]?[0-9]+)?)"
losses = [float(a or b) for a, b in re.findall(rf"'loss': '?{number}|^step +[0-9]+ +loss {number}", text, re.M)]
row = {"path": path, "ok": rc == 0, "rc": rc, "seconds": round(seconds, 1),
       "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
       "plan_summary": "hf_superoffload plan:" in text, "plan_summaries": text.count("hf_superoffload plan:"),
       "log": log.rsplit("/", 2)[-2] + "/" + log.rsplit("/", 1)[-1]}
for line in text.splitlines():
    if line.startswith("HF_PATHS "):  # facts a driver states itself
        row.update(json.loads(line[len("HF_PATHS "):]))
if row.get("skipped"):
    row["ok"] = None  # not run: neither a pass nor a failure
if rc == 124:
    row["error"] = "timed out"
if rc != 0:
    row["tail"] = "\n".join(text.rstrip().splitlines()[-12:])[-1500:]
open(out, "a").write(json.dumps(row) + "\n")
if row.get("skipped"):
    print(f"{path:>10}: skipped: {row['why']}")
else:
    print(f"{path:>10}: {'ok' if rc == 0 else 'FAILED rc=' + str(rc)} in {seconds:.0f} s, loss {row['first_loss']} -> "
          f"{row['last_loss']}, plan summary x{row['plan_summaries']}")
PY
cat > "$WORK/build_model.py" <<'PY'
"""A small Qwen2 (tied embeddings, as Qwen2.5-0.5B) built from a config, with a tokenizer trained on the local
data and a chat template (for TRL), saved to a folder."""
import sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from hf_superoffload.demo.local_data import build_tokenizer, format_example, instruction_texts

out, size = sys.argv[1], sys.argv[2]
tok = build_tokenizer([format_example(r) for r in instruction_texts(2000)] +
                      [f"{r}: Please add 3 and 4. 3 add 4 gives 7." for r in ("user", "assistant")])
tok.chat_template = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
                     "{{ m['content'] }}<|eos|>{% endgeneration %}{% else %}{{ m['content'] }}<|eos|>{% endif %}"
                     "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant: {% endif %}")
shape = {"tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2),
         # 0.36B: Qwen2.5-0.5B's depth without its 152k vocabulary (the local tokenizer has 512 tokens)
         "small": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=2)}[size]
cfg = Qwen2Config(**shape, vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
model = Qwen2ForCausalLM(cfg)
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"HF_PATHS {{\"params_m\": {sum(p.numel() for p in model.parameters()) / 1e6:.1f}}}")
PY
cat > "$WORK/trainer_path.py" <<'PY'
"""SuperOffloadTrainer(args=SuperOffloadArguments(...)) on the saved model: packed local instruction data (a torch
Dataset: no `datasets` needed), gradient accumulation 2, a checkpoint at the last step. With `resume`, the run
continues to twice the steps from the newest complete checkpoint (resume_from_checkpoint=True)."""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_superoffload import SuperOffloadArguments, SuperOffloadTrainer
from hf_superoffload.integrations.accelerate import last_complete_checkpoint
from hf_superoffload.demo.local_data import format_example, instruction_texts, packed_batches

model_dir, out, steps, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["resume"]
cuda = torch.cuda.is_available()
tok = AutoTokenizer.from_pretrained(model_dir)
blocks = packed_batches(tok, [format_example(r) for r in instruction_texts(600)], batch_size=1, seq_len=128)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n):
        self.rows = [next(blocks)[0] for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


args = SuperOffloadArguments(
    output_dir=out, max_steps=2 * steps if resume else steps, per_device_train_batch_size=4,
    gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0, logging_steps=1,
    save_strategy="steps", save_steps=steps, report_to="none", disable_tqdm=True, bf16=cuda, use_cpu=not cuda,
    dataloader_pin_memory=cuda, seed=0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=Blocks(8 * 4 * 2 * steps))
resumed_from = last_complete_checkpoint(out, marker="trainer_state.json") if resume else None  # what True takes
result = trainer.train(resume_from_checkpoint=True if resume else None)
logs = trainer.state.log_history
plan_logged = any("plan" in k for h in logs for k in h)  # the plan summary stored in the Trainer's logs
print("HF_PATHS " + json.dumps({"global_step": result.global_step, "plan_in_trainer_logs": plan_logged,
                                "resumed_from": resumed_from and resumed_from.rsplit("/", 1)[-1],
                                "skipped_steps": trainer.superoffload_optimizer.skipped_steps}))
PY
cat > "$WORK/check_export.py" <<'PY'
"""The exported folder loads with from_pretrained and equals the fp32 masters of the state file bit for bit
(the masters read straight from the arenas by name, not through the exporter)."""
import json, sys
import torch
from transformers import AutoModelForCausalLM

from hf_superoffload.state import _read

state_file, exported = sys.argv[1], sys.argv[2]
sd = torch.load(state_file, map_location="cpu", weights_only=False)["superoffload"]
model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
params = dict(model.named_parameters())
bad, not_bf16 = [], 0
for name, numel, shape, (side, off) in zip(sd["names"], sd["numels"], sd["shapes"], sd["locations"]):
    master = _read(sd["host" if side == "host" else "device"]["master"], off, off + numel).view(shape)
    if not torch.equal(params[name].detach(), master):
        bad.append(name)
    not_bf16 += int(not torch.equal(master, master.to(torch.bfloat16).float()))
print("HF_PATHS " + json.dumps({"params_checked": len(sd["names"]), "unequal": bad[:5],
                                "masters_not_bf16_representable": not_bf16}))
sys.exit(1 if bad else 0)
PY

# ---- one path: timed, logged, recorded ----------------------------------------------------------------------
run_path() {  # NAME COMMAND...: at most PATH_TIMEOUT, and never past the script's deadline
  local name=$1 t rc left; shift
  left=$(( DEADLINE - $(date +%s) )); [ "$left" -lt "$PATH_TIMEOUT" ] || left=$PATH_TIMEOUT
  if [ "$left" -lt 10 ]; then skip_path "$name" "no time left before the ${TOTAL_S} s deadline"; return; fi
  t=$(date +%s%N)
  timeout "$left" "$@" > "$OUT/logs/$name.log" 2>&1; rc=$?
  python3 "$WORK/record.py" "$name" "$rc" $(( ($(date +%s%N) - t) / 1000000 )) "$OUT/logs/$name.log" \
    "$OUT/hf_paths.jsonl"
}
skip_path() {  # NAME WHY
  echo "HF_PATHS {\"skipped\": true, \"why\": \"$2\"}" > "$OUT/logs/$1.log"
  python3 "$WORK/record.py" "$1" 0 0 "$OUT/logs/$1.log" "$OUT/hf_paths.jsonl"
}

M=$WORK/model
run_path build_model python3 -P "$WORK/build_model.py" "$M" "$MODEL_SIZE"
# the CPU Adam extension builds on first use: once here, so the paths below time training, not the compiler
run_path cpu_ext python3 -P -c "from hf_superoffload import ops; print('HF_PATHS {\"backend\": \"%s\"}' % ops.backend())"

run_path trainer python3 -P "$WORK/trainer_path.py" "$M" "$WORK/trainer" "$STEPS"

run_path accelerate python3 -P -m accelerate.commands.launch --config_file "$ACC_CONFIG" \
  examples/train_with_accelerate.py --model "$M" --max-steps "$STEPS" --save-every 0 --examples 400 \
  --output-dir "$WORK/accelerate"

if python3 -c "import trl, datasets" 2>/dev/null; then
  run_path trl python3 -P examples/train_with_trl.py --model "$M" --max_steps "$STEPS" --logging_steps 1 \
    --examples 256 --output_dir "$WORK/trl" --disable_tqdm true
else
  skip_path trl "trl or datasets is not importable here (give their wheels with WHEELS=<dir>)"
fi

run_path cli_train python3 -P -m hf_superoffload.cli train --steps "$STEPS" --log-every 1 --examples 400 \
  --new-tokens 8 --save-state --output-dir "$WORK/cli"
run_path export bash -c "python3 -P -m hf_superoffload.cli export '$WORK/cli' '$WORK/cli-fp32' && python3 -P \
  '$WORK/check_export.py' '$WORK/cli/superoffload_optimizer.pt' '$WORK/cli-fp32'"

run_path resume python3 -P "$WORK/trainer_path.py" "$M" "$WORK/trainer" "$STEPS" resume

echo "all paths in $(( $(date +%s) - T0 )) s; $OUT/hf_paths.jsonl"
pack_out hf_paths.jsonl hw.txt
