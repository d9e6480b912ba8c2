"""Small local data the project generates itself: an instruction corpus, a tokenizer trained on it, packing.

Nothing is downloaded. The corpus is synthetic (arithmetic, unit conversions, word games, facts about
this project), deterministic for a seed, and big enough to show a falling loss in a few hundred steps.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["build_tokenizer", "format_example", "instruction_dataset", "instruction_texts", "packed_batches"]

_TOPICS = [
    ("bucket", "a group of parameters whose gradients travel to the host together"),
    ("speculation", "starting the CPU Adam step before the global gradient norm is known"),
    ("rollback", "undoing a speculative step when clipping fires or a gradient is not finite"),
    ("master weight", "the fp32 copy of a parameter that the optimizer updates"),
    ("pinned memory", "host memory the GPU can copy from without a bounce buffer"),
    ("weight decay", "shrinking every weight a little at each step"),
    ("learning rate", "the size of each optimizer step"),
    ("gradient clipping", "scaling all gradients down when their norm is too large"),
]
_UNITS = [("kilometres", "metres", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000), ("days", "hours", 24)]


def instruction_texts(n: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    """``n`` instruction/response pairs (deterministic for ``seed``)."""
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    for _ in range(n):
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            out.append({"instruction": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."})
        elif kind == 1:
            a, b = rng.randrange(2, 13), rng.randrange(2, 13)
            out.append({"instruction": f"Multiply {a} by {b}.", "response": f"{a} times {b} equals {a * b}."})
        elif kind == 2:
            big, small, f = rng.choice(_UNITS)
            x = rng.randrange(1, 20)
            out.append({"instruction": f"How many {small} are in {x} {big}?", "response": f"There are {x * f} {small} in {x} {big}."})
        elif kind == 3:
            word = rng.choice(["offload", "tensor", "stream", "kernel", "adam", "bucket", "planner", "cast"])
            out.append({"instruction": f"Spell '{word}' backwards.", "response": f"'{word}' backwards is '{word[::-1]}'."})
        else:
            term, meaning = rng.choice(_TOPICS)
            out.append({"instruction": f"Explain what a {term} is.", "response": f"A {term} is {meaning}."})
    return out


def format_example(ex: dict[str, str]) -> str:
    return f"### Instruction:\n{ex['instruction']}\n### Response:\n{ex['response']}\n"


def instruction_dataset(n: int = 2000, seed: int = 0) -> Any:
    """The corpus as a ``datasets.Dataset`` with ``instruction``, ``response`` and ``text`` columns."""
    from datasets import Dataset

    rows = instruction_texts(n, seed)
    return Dataset.from_list([{**r, "text": format_example(r)} for r in rows])


def build_tokenizer(texts: list[str] | None = None, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (default: the corpus), as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if texts is None:
        texts = [format_example(r) for r in instruction_texts()]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")


def packed_batches(tokenizer: Any, texts: list[str], *, batch_size: int, seq_len: int, seed: int = 0):
    """Endless iterator of ``[batch_size, seq_len]`` token blocks: texts joined with EOS, packed, shuffled."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t)["input_ids"] + [tokenizer.eos_token_id])
    data = torch.tensor(ids, dtype=torch.long)
    n_blocks = data.numel() // seq_len
    if n_blocks < 1:
        raise ValueError(f"the corpus has {data.numel()} tokens, fewer than one sequence of {seq_len}")
    blocks = data[: n_blocks * seq_len].view(n_blocks, seq_len)
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n_blocks, generator=g)
        for i in range(0, n_blocks - batch_size + 1, batch_size):
            yield blocks[order[i : i + batch_size]]
        if n_blocks < batch_size:
            yield blocks[torch.randint(0, n_blocks, (batch_size,), generator=g)]
