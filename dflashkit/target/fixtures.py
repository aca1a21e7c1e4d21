"""Tiny random targets built in-process from configs: unit tests and the CI demo need no download.

Each fixture is a real Hugging Face folder (config, weights, byte-level tokenizer with a chat template),
so every code path that loads a target is exercised exactly as with a real one.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
KINDS = ("llama", "qwen3", "qwen3_5")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = CHAT_TEMPLATE
    return tok  # 259 tokens; the embeddings have 272 rows, so the mask id is the first spare row


def tiny_config(kind: str, num_layers: int = 6):
    common = dict(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=kind == "llama")
    if kind == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(**common)
    if kind == "qwen3":
        from transformers import Qwen3Config
        return Qwen3Config(**common)
    if kind == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        return Qwen3_5TextConfig(**common, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 linear_num_key_heads=2, linear_num_value_heads=4)
    raise ValueError(f"unknown fixture kind {kind!r}; use one of {KINDS}")


def make_tiny_target(kind: str, out: str | Path, seed: int = 0, num_layers: int = 6) -> Path:
    """Write a tiny random target folder of `kind` to `out` (a few hundred KB, well under a second)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, num_layers), dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so greedy outputs vary with the input
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return out
