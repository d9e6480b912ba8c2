"""The pieces of ``hf-superoffload train`` that are about the demo, not the optimizer: which model and data to
use (the Hub when it is reachable, the bundled tiny model and local data otherwise), eval loss, sample
generations, and the files the run leaves behind (model, loss curve, metrics).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["HUB_DATASET", "HUB_MODELS", "Sources", "eval_blocks", "eval_loss", "generate_samples", "hub_offline", "hub_unreachable",
           "load_texts", "resolve_model", "save_outputs"]

HUB_MODELS = {"cpu": "HuggingFaceTB/SmolLM2-135M-Instruct", "cuda": "Qwen/Qwen2.5-0.5B-Instruct"}
HUB_DATASET = ("HuggingFaceTB/smoltalk", "everyday-conversations")  # small, chat-formatted, public
FALLBACK_LINE = "hub not reachable: training the bundled tiny model on the local instruction data instead"
PROMPTS = ["What is 12 plus 30?", "Explain what a learning rate is."]


@dataclass
class Sources:
    """Where the model and the data came from, for the log and the metrics file."""

    model: str
    data: str
    pretrained: bool
    notes: list[str] = field(default_factory=list)


def hub_offline() -> bool:
    """Whether the Hub must not be tried: the usual environment switches (read now, not at import)."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return constants.HF_HUB_OFFLINE or any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def hub_unreachable() -> bool:
    """Offline by switch, or the Hub's host does not answer a TCP connect within a few seconds. Probing first
    spares the fallback the HTTP client's retries (a minute of warnings on a machine without network). Behind a
    proxy a direct connect says nothing, so there the download itself decides."""
    if hub_offline():
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError:
        return True
    return False


def _network_errors() -> tuple[type[BaseException], ...]:
    """What resolving a hub name raises when the Hub cannot be reached: transformers wraps most failures in
    ``OSError``; a connection error of the HTTP client can still come through as itself."""
    errors: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError, ValueError]
    try:
        import httpx

        errors.append(httpx.HTTPError)
    except ImportError:
        pass
    try:
        import requests

        errors.append(requests.RequestException)
    except ImportError:
        pass
    return tuple(errors)


def _load_pretrained(name: str, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).to(device)
    if tokenizer.pad_token is None:  # generation pads; most instruct tokenizers have one, a bare BPE may not
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def resolve_model(spec: str, device: torch.device) -> tuple[Any, Any] | None:
    """The pretrained model and tokenizer for ``spec`` (``auto``: the default instruct model for this device), or
    None when ``auto`` cannot reach the Hub (the caller falls back). An explicit model that cannot be loaded
    raises ``OSError``: the user asked for it, so it is an error, not a fallback."""
    if spec != "auto":
        return _load_pretrained(spec, device)
    if hub_unreachable():
        return None
    try:
        return _load_pretrained(HUB_MODELS[device.type], device)
    except _network_errors():  # no network, DNS, proxy, rate limit, partial cache
        return None


def _messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """A dataset row as chat messages: a ``messages`` column (smoltalk), Alpaca's instruction/input/output, or the
    local instruction/response pairs."""
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row.get("output") or row["response"]}]


def format_row(tokenizer: Any, row: dict[str, Any]) -> str:
    """One training text: the tokenizer's chat template when it has one, the local ``### Instruction`` layout
    otherwise (the bundled tokenizer has no template)."""
    from .local_data import format_example

    msgs = _messages(row)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    return format_example({"instruction": msgs[0]["content"], "response": msgs[-1]["content"]})


def prompt_text(tokenizer: Any, question: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    return f"### Instruction:\n{question}\n### Response:\n"


def load_rows(spec: str, n: int, seed: int) -> tuple[list[dict[str, Any]], str]:
    """``n`` rows of instruction data and where they came from. ``auto`` tries the Hub's small chat set and falls
    back to the local data; ``local`` is the local data; anything else is a hub dataset id (``id`` or
    ``id:subset``) and must load."""
    from .local_data import instruction_texts

    local = (instruction_texts(n, seed=seed), "local synthetic instruction data (hf_superoffload.demo.local_data)")
    if spec == "local" or (spec == "auto" and hub_unreachable()):
        return local
    name, subset = HUB_DATASET if spec == "auto" else [*spec.split(":", 1), None][:2]
    try:
        from datasets import load_dataset

        ds = load_dataset(name, subset, split=f"train[:{n}]")
    except _network_errors():
        if spec != "auto":
            raise
        return local
    return [dict(r) for r in ds], f"{name}" + (f" ({subset})" if subset else "") + f", first {len(ds)} rows"


def load_texts(tokenizer: Any, spec: str, n: int, seed: int) -> tuple[list[str], list[str], str]:
    """Training texts, held-out eval texts and the data source."""
    rows, source = load_rows(spec, n, seed)
    return (*split_eval([format_row(tokenizer, r) for r in rows]), source)


def split_eval(texts: list[str]) -> tuple[list[str], list[str]]:
    """The last ~5% (at least one, at most 200) held out for eval."""
    if len(texts) < 2:  # nothing to hold out: eval on the training text
        return texts, texts
    n_eval = max(1, min(200, len(texts) // 20))
    return texts[:-n_eval], texts[-n_eval:]


def eval_blocks(tokenizer: Any, texts: list[str], seq_len: int, max_blocks: int = 8) -> torch.Tensor:
    """The eval texts packed like the training data, in order, at most ``max_blocks`` rows (one shorter row
    when they hold fewer than ``seq_len`` tokens)."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t)["input_ids"] + [tokenizer.eos_token_id])
    data = torch.tensor(ids, dtype=torch.long)
    n = min(max_blocks, data.numel() // seq_len)
    if n == 0:
        return data[None, :]
    return data[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def eval_loss(model: Any, blocks: torch.Tensor, device: torch.device) -> float:
    """Mean next-token loss over ``blocks``, one row at a time (eval mode, no grad: the optimizer does not plan
    on it)."""
    was_training = model.training
    model.eval()
    try:
        losses = [model(input_ids=row[None].to(device), labels=row[None].to(device)).loss.float().item()
                  for row in blocks]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


@torch.no_grad()
def generate_samples(model: Any, tokenizer: Any, device: torch.device, max_new_tokens: int) -> list[dict[str, str]]:
    """Greedy completions of the fixed prompts."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for q in PROMPTS:
            enc = tokenizer(prompt_text(tokenizer, q), return_tensors="pt", add_special_tokens=False).to(device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            text = tokenizer.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            out.append({"prompt": q, "completion": text})
    finally:
        model.train(was_training)
    return out


def _plot(losses: list[float], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no loss-curve PNG (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set(xlabel="step", ylabel="training loss", title="hf-superoffload train")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"loss curve: {path}"


def save_outputs(out_dir: str, model: Any, tokenizer: Any, opt: Any, metrics: dict[str, Any]) -> list[str]:
    """The fine-tuned model (safetensors) and tokenizer, ``loss_curve.png`` and ``metrics.json``; returns the
    lines to print."""
    path = Path(out_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    from ..integrations._common import MODEL_SHARD_SIZE
    from ..integrations._streamed_save import streamed_model_files

    opt.synchronize()
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a shard bar in a non-terminal log is noise (\r); the lines below say it
    try:
        with opt.materialized(), streamed_model_files():  # in weight flow the weights live on the host between uses
            model.save_pretrained(path, max_shard_size=MODEL_SHARD_SIZE)  # [Note: bounded model shards]
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    lines = [f"model and tokenizer: {path}"]
    lines.append(_plot(metrics["losses"], path / "loss_curve.png"))
    (path / "metrics.json").write_text(json.dumps(metrics, indent=2))
    lines.append(f"metrics: {path / 'metrics.json'}")
    return lines
