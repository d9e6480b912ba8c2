"""Named Llama-style model shapes: the CI/tiny ones and the anchor configs of the benchmarks."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "build_on", "llama_config"]

# hidden, intermediate, layers, heads, kv_heads, vocab (None: the tokenizer's), tie
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=None),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=None),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=16, vocab_size=32000),
    "3.6b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                 num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=40, vocab_size=128256),  # the paper's 13B long-context config
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
}


def llama_config(name: str, *, vocab_size: int | None = None, max_position_embeddings: int = 4096) -> Any:
    """A ``LlamaConfig`` for preset ``name`` (untied embeddings, as in the anchor runs)."""
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    kw = dict(PRESETS[name])
    if kw["vocab_size"] is None:
        if vocab_size is None:
            raise ValueError(f"preset {name!r} takes its vocabulary from the tokenizer: pass vocab_size")
        kw["vocab_size"] = vocab_size
    return LlamaConfig(**kw, max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)


def build_on(config: Any, *, device: Any, dtype: Any, seed: int = 0) -> Any:
    """A random-init ``LlamaForCausalLM(config)`` created directly on ``device`` in ``dtype`` (no fp32 copy on
    the host first: an 8B model would need 32 GB and minutes). Same ``seed``, same weights on every rank."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
