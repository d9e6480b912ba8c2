"""Supervised fine-tuning with TRL's ``SFTTrainer`` through SuperOffload (``SuperOffloadSFTTrainer``).

Offline and on the CPU in seconds with the defaults: a small randomly initialised Llama built from a config, a
tokenizer trained on the data, and a conversational dataset (``messages`` with user/assistant turns, rendered by
the tokenizer's chat template) built in code. On a GPU pass a real chat model; then its own chat template is
used::

    python examples/train_with_trl.py                                          # tiny model, CPU or GPU
    python examples/train_with_trl.py --model Qwen/Qwen2.5-0.5B-Instruct --bf16 --max_steps 200
    python examples/train_with_trl.py --superoffload_gpu_resident_buckets 0 --max_length 512

Every ``SFTConfig`` option works (``--help`` lists them: ``--packing``, ``--assistant_only_loss``,
``--max_length``, ...), plus the ``--superoffload_*`` offload settings.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default run needs no network; a real --model must be cached
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from datasets import Dataset
from transformers import HfArgumentParser

from hf_superoffload.demo.local_data import build_tokenizer
from hf_superoffload.integrations.trl import SuperOffloadSFTConfig, SuperOffloadSFTTrainer

# A minimal chat template for the tiny tokenizer (real chat models bring their own). The {% generation %}
# markers let --assistant_only_loss train on the assistant turns only.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eos|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)


@dataclass
class ScriptArguments:
    """What to train (the training itself is configured by ``SuperOffloadSFTConfig``)."""

    model: str = field(default="tiny", metadata={"help": "'tiny' (random init, offline) or a chat model id/path"})
    examples: int = field(default=512, metadata={"help": "conversations to generate"})


_DEFAULTS: dict[str, Any] = dict(
    output_dir="out/train_with_trl", max_steps=30, per_device_train_batch_size=8, gradient_accumulation_steps=2,
    learning_rate=1e-3, weight_decay=0.1, adam_beta2=0.95, warmup_steps=3, lr_scheduler_type="linear",
    max_grad_norm=1.0, logging_steps=5, save_strategy="no", report_to="none", max_length=128, seed=0,
    gradient_checkpointing=False,
)


def conversations(n: int) -> Dataset:
    """``n`` two-turn arithmetic conversations in TRL's conversational format."""
    ops = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b}
    rows = []
    for i in range(n):
        name = list(ops)[i % len(ops)]
        a, b = 2 + (7 * i) % 19, 1 + (3 * i) % 11
        rows.append({"messages": [
            {"role": "user", "content": f"Please {name} {a} and {b}."},
            {"role": "assistant", "content": f"{a} {name} {b} gives {ops[name](a, b)}."},
        ]})
    return Dataset.from_list(rows)


def load_model_and_tokenizer(name: str, data: Dataset) -> tuple[torch.nn.Module, Any]:
    if name == "tiny":
        from transformers import AutoModelForCausalLM, LlamaConfig

        texts = [f"{m['role']}: {m['content']}" for row in data for m in row["messages"]]
        tokenizer = build_tokenizer(texts, vocab_size=256)
        tokenizer.chat_template = CHAT_TEMPLATE
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16), AutoTokenizer.from_pretrained(name)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = HfArgumentParser((ScriptArguments, SuperOffloadSFTConfig))
    # bf16 autocast needs a GPU here; SFTConfig would turn it on everywhere
    parser.set_defaults(**_DEFAULTS, bf16=torch.cuda.is_available(), dataloader_pin_memory=torch.cuda.is_available())
    script, args = parser.parse_args_into_dataclasses(args=list(sys.argv[1:] if argv is None else argv))

    torch.manual_seed(args.seed)
    data = conversations(script.examples)
    model, tokenizer = load_model_and_tokenizer(script.model, data)
    trainer = SuperOffloadSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    opt = trainer.superoffload_optimizer
    assert opt is not None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h] or [result.training_loss]
    print(f"done: {result.global_step} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, skipped "
          f"{opt.skipped_steps}, clipped {opt.clipped_steps}; model saved to {os.path.join(args.output_dir, 'final')}")
    return result.metrics


if __name__ == "__main__":
    main()
