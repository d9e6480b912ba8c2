"""Fine-tune a causal LM with ``SuperOffloadTrainer`` on the project's own instruction data.

Runs on the CPU in seconds with the defaults (a randomly initialised ``tiny`` Llama preset and a tokenizer
trained on the corpus); on a GPU pass a real model::

    python examples/train_with_trainer.py                                  # tiny preset, CPU or GPU
    python examples/train_with_trainer.py --model Qwen/Qwen2.5-0.5B --bf16 --max_steps 200
    python examples/train_with_trainer.py --superoffload_gpu_resident_buckets 0 --superoffload_bucket_size_mb 64
    python examples/train_with_trainer.py run.yaml                         # every argument from one YAML file

Every ``TrainingArguments`` option works (``--help`` lists them); the offload settings are the
``--superoffload_*`` options of ``SuperOffloadArguments``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DataCollatorForLanguageModeling, HfArgumentParser

from hf_superoffload.demo.local_data import build_tokenizer, instruction_dataset
from hf_superoffload.demo.presets import PRESETS, llama_config
from hf_superoffload.integrations.transformers import SuperOffloadArguments, SuperOffloadTrainer


@dataclass
class ScriptArguments:
    """What to train on (the training itself is configured by ``SuperOffloadArguments``)."""

    model: str = field(default="tiny", metadata={"help": f"a preset ({', '.join(PRESETS)}; random init) or a model "
                                                         "id/path for from_pretrained"})
    seq_len: int = field(default=128, metadata={"help": "tokens per example (longer ones are truncated)"})
    examples: int = field(default=2000, metadata={"help": "instruction examples to generate"})
    eval_fraction: float = field(default=0.05, metadata={"help": "share of the examples held out for evaluation"})


_DEFAULTS: dict[str, Any] = dict(
    output_dir="out/train_with_trainer", max_steps=30, per_device_train_batch_size=8, per_device_eval_batch_size=8,
    gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.1, adam_beta2=0.95, warmup_steps=3,
    lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=5, eval_strategy="steps", eval_steps=15,
    save_strategy="no", report_to="none", seed=0,
)


def load_model_and_tokenizer(name: str, seq_len: int) -> tuple[torch.nn.Module, Any]:
    if name in PRESETS:
        from transformers import AutoModelForCausalLM

        tokenizer = build_tokenizer()
        config = llama_config(name, vocab_size=len(tokenizer), max_position_embeddings=max(seq_len, 128))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16), tokenizer


def build_datasets(tokenizer: Any, script: ScriptArguments, seed: int) -> tuple[Any, Any]:
    ds = instruction_dataset(script.examples, seed=seed)

    def tokenize(batch: dict[str, list[str]]) -> dict[str, Any]:
        texts = [t + (tokenizer.eos_token or "") for t in batch["text"]]
        return tokenizer(texts, truncation=True, max_length=script.seq_len)

    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names)
    split = ds.train_test_split(test_size=script.eval_fraction, seed=seed)
    return split["train"], split["test"]


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = HfArgumentParser((ScriptArguments, SuperOffloadArguments))
    parser.set_defaults(**_DEFAULTS)
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        script, args = parser.parse_yaml_file(argv[0])
    elif len(argv) == 1 and argv[0].endswith(".json"):
        script, args = parser.parse_json_file(argv[0])
    else:
        script, args = parser.parse_args_into_dataclasses(args=argv)

    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(script.model, script.seq_len)
    train_ds, eval_ds = build_datasets(tokenizer, script, args.seed)
    trainer = SuperOffloadTrainer(
        model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = {**result.metrics, **trainer.evaluate()}
    trainer.save_model(os.path.join(args.output_dir, "final"))
    opt = trainer.superoffload_optimizer
    assert opt is not None
    print(f"done: {result.global_step} steps, train loss {metrics['train_loss']:.3f}, eval loss "
          f"{metrics['eval_loss']:.3f}, skipped {opt.skipped_steps}, clipped {opt.clipped_steps}; "
          f"model saved to {os.path.join(args.output_dir, 'final')}")
    return metrics


if __name__ == "__main__":
    main()
