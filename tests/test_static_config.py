"""Every config field the static step reads or assumes is honoured (its logits and greedy tokens are transformers'
own) or refused with the field named (issue 54): an activation, a RoPE type or a bias the step does not compute
must never decode silently wrong. Each case is a tiny random Llama-type target built from a config."""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode.speculative import generate
from dflashkit.decode.speculative import generate_ar
from dflashkit.decode.static import StaticBackend, StaticDecoder
from dflashkit.errors import DFlashError
from tiny_targets import make_tiny_target, tiny_config
from dflashkit.targets.model import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


def build(tmp_path, kind="llama", **fields):
    """A tiny target of `kind` with config `fields` changed (random weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflashkit.rng import seeded

    out = tmp_path / kind
    make_tiny_target("llama", out, num_layers=2)  # its tokenizer and folder layout
    common = {k: v for k, v in tiny_config("llama", 2).to_dict().items() if k in SHAPE}
    cfg = AutoConfig.for_model(kind, **{**common, **fields})
    with seeded(0), torch.no_grad():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif p.dim() == 1 and fields.get("attention_bias"):
                p.normal_(0, 0.5)  # biases that change the answer
    model.save_pretrained(out)
    return load_target(out, device="cpu", dtype="float32")


SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
         "pad_token_id")


def equals_reference(t, n_new=24):
    """The step's logits over a prompt and a token at a time equal transformers' forward (1e-5), and greedy
    decoding on it is `ar` token for token."""
    ids = t.chat_ids([{"role": "user", "content": "def add(a, b): return a + b  # and a bit more text, past 32"}])
    want = t.model(torch.tensor([ids])).logits[0]
    d = StaticDecoder(t, 160, compile=False)
    torch.testing.assert_close(d.forward(ids[:-5], 0), want[-6], atol=1e-5, rtol=1e-5)
    for i in range(len(ids) - 5, len(ids)):
        torch.testing.assert_close(d.forward(ids[i:i + 1], i), want[i], atol=1e-5, rtol=1e-5)
    assert generate_ar(StaticBackend(d), ids, n_new).tokens == generate(t, ids, "ar", max_new_tokens=n_new).tokens


def rope(kind, **extra):
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **extra}}


HONOURED = {
    "hidden_act=gelu": dict(hidden_act="gelu"),
    "hidden_act=gelu_pytorch_tanh": dict(hidden_act="gelu_pytorch_tanh"),
    "rope linear": rope("linear", factor=4.0),
    "rope dynamic (within its original length)": rope("dynamic", factor=4.0),
    "rope yarn (attention scaling)": rope("yarn", factor=4.0, original_max_position_embeddings=64),
    "rope llama3": rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64),
    "rope_theta": rope("default", rope_theta=500.0),
    "rms_norm_eps": dict(rms_norm_eps=0.3),
    "head_dim": dict(head_dim=32),
    "tie_word_embeddings=false": dict(tie_word_embeddings=False),
}


@pytest.mark.parametrize("case", list(HONOURED))
def test_a_llama_config_field_is_honoured(tmp_path, case):
    equals_reference(build(tmp_path, **HONOURED[case]))


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_qwen3_norms_and_qwen2_biases_are_honoured(tmp_path, kind):
    fields = {"attention_bias": True} if kind == "qwen2" else {}
    t = build(tmp_path, kind, **fields)
    if kind == "qwen2":
        assert t.decoder.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    equals_reference(t)


REFUSED = {
    "hidden_act": (dict(hidden_act="gelu_new"), "hidden_act = 'gelu_new'"),
    "partial_rotary_factor": (dict(partial_rotary_factor=0.5, **rope("linear", factor=2.0)), "partial_rotary_factor"),
    "attention_bias (o_proj)": (dict(attention_bias=True), "attention_bias.*o_proj"),
    "mlp_bias": (dict(mlp_bias=True), "mlp_bias"),
    "sliding_window": (dict(sliding_window=16), "sliding_window = 16"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_field_the_step_does_not_compute_is_refused_by_name(tmp_path, case):
    fields, named = REFUSED[case]
    t = build(tmp_path, "mistral" if case == "sliding_window" else "llama", **fields)
    with pytest.raises(DFlashError, match=f"config.json field {named}.*--engine hf"):
        StaticDecoder(t, 64, compile=False)


def test_a_length_dependent_rope_is_refused_past_its_switch(tmp_path):
    t = build(tmp_path, **rope("dynamic", factor=4.0), max_position_embeddings=64)
    StaticDecoder(t, 64, compile=False)  # within: the fixed frequencies
    with pytest.raises(DFlashError, match="rope_type = 'dynamic'.*past 64 positions.*needs 128"):
        StaticDecoder(t, 128, compile=False)
