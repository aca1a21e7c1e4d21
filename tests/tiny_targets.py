"""Tiny random targets built in-process from configs: unit tests and the CI demo need no download.

Each fixture is a real Hugging Face folder (config, weights, byte-level tokenizer with a chat template),
so every code path that loads a target is exercised exactly as with a real one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflashkit.rng import seeded

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
KINDS = ("llama", "qwen3", "qwen3_5")
# issue 37's families: MoE, a vision-language wrapper, hybrids, sliding windows, MLA; 5 layers, the fewest with which
# one feature's default layer (the middle one) is not one of the last two
FAMILIES = ("qwen3_moe", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma4", "gemma4_e", "deepseek_v3",
            "glm4_moe", "minimax_m2")
ALL_KINDS = KINDS + FAMILIES


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


def tiny_config(kind: str, num_layers: int | None = None):
    num_layers = num_layers or (5 if kind in FAMILIES else 6)
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
    return _family_config(kind, {**common, "tie_word_embeddings": False})


def _family_config(kind: str, common: dict):
    """The nine further families (issue 37): four experts, two routed per token, the family's own layer layout."""
    import transformers as tf

    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2)
    linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **moe, num_experts=4)
    if kind == "qwen3_5_vl":
        text = {k: v for k, v in common.items() if k != "tie_word_embeddings"}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
        return tf.Qwen3_5Config(text_config={**text, **linear}, vision_config=vision, tie_word_embeddings=False)
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**{k: v for k, v in common.items() if k != "intermediate_size"}, **linear, **moe,
                                       num_experts=4, shared_expert_intermediate_size=32)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**common, **linear, **moe, num_experts=4, shared_expert_intermediate_size=32)
    if kind == "gpt_oss":
        return tf.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                               rope_parameters=dict(rope_type="default", rope_theta=150000.0))
    if kind == "gemma4":
        g = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        return tf.Gemma4TextConfig(**g, sliding_window=8, hidden_size_per_layer_input=0, vocab_size_per_layer_input=272,
                                   enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                   attention_k_eq_v=True)  # the 26B-A4B shape
    if kind == "gemma4_e":  # the E2B/E4B shape: per-layer input embeddings, the last layers reuse earlier layers' KV
        g = {k: v for k, v in common.items() if k != "rms_norm_eps"}
        return tf.Gemma4TextConfig(**g, sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=272,
                                   num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention",
                                   "sliding_attention", "sliding_attention", "full_attention"])
    if kind == "deepseek_v3":
        mla = {k: v for k, v in common.items() if k != "head_dim"} | {"num_key_value_heads": 4}  # MLA: one per head
        return tf.DeepseekV3Config(**mla, **moe, n_routed_experts=4, n_shared_experts=1,
                                   n_group=1, topk_group=1, first_k_dense_replace=1,
                                   kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    if kind == "glm4_moe":
        return tf.Glm4MoeConfig(**{k: v for k, v in common.items() if k != "head_dim"}, **moe, n_routed_experts=4,
                                n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
    if kind == "minimax_m2":
        return tf.MiniMaxM2Config(**common, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"unknown fixture kind {kind!r}; use one of {ALL_KINDS}")


def make_tiny_target(kind: str, out: str | Path, seed: int = 0, num_layers: int | None = None) -> Path:
    """Write a tiny random target folder of `kind` to `out` (a few hundred KB, well under a second). The VL kind is
    saved as the full image-text wrapper, vision tower included, as such checkpoints are published."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    cfg = tiny_config(kind, num_layers)
    with seeded(seed), torch.no_grad():
        if kind == "qwen3_5_vl":
            model = Qwen3_5ForConditionalGeneration(cfg).float()
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        for p in model.parameters():  # larger weights than the default init, so greedy outputs vary with the input
            if p.dim() == 2 or (p.dim() == 3 and kind in FAMILIES):  # (and the families' fused [experts, out, in])
                p.normal_(0, 0.08)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return out
