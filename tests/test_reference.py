"""Parity with z-lab's reference package (`dflash==0.1.0`, installed by `make test` with --no-deps).

Drafters are written by the reference's own classes (random weights, `save_pretrained`), as a user gets them,
then loaded by dflashkit: every variant must compute what the reference computes (1e-5 in float32) or be
refused with an error naming the field. Our exports must load in the reference with no missing or unexpected
keys and the same outputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflashkit.drafter import load_drafter, save_drafter
from dflashkit.errors import DFlashError
from helpers import edit_folder

ref = pytest.importorskip("dflash.model", reason="make test installs dflash==0.1.0 (--no-deps)")

H, V, B = 64, 272, 8
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 12, "selector_top_k": 5}
SLIDING = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 4,
           "use_sliding_window": True}
VARIANTS = {  # name -> (architecture, top-level config fields, dflash_config fields)
    "plain": ("DFlashDraftModel", {}, {}),
    "sliding": ("DFlashDraftModel", SLIDING, {}),
    "sliding, no use_sliding_window": ("DFlashDraftModel", {**SLIDING, "use_sliding_window": False}, {}),
    "is_causal": ("DFlashDraftModel", {"is_causal": True}, {}),
    "input_embedding_scale": ("DFlashDraftModel", {}, {"input_embedding_scale": 3.5}),
    "output_multiplier": ("DFlashDraftModel", {}, {"output_multiplier": 0.25}),
    "final_logit_softcapping": ("DFlashDraftModel", {}, {"final_logit_softcapping": 0.3}),
    "dflash2": ("DFlash2DraftModel", {}, DFLASH2),
    "dflash2 sliding, scaled": ("DFlash2DraftModel", SLIDING, {**DFLASH2, "input_embedding_scale": 2.0,
                                                               "output_multiplier": 1.5, "final_logit_softcapping": 2.0}),
}


def reference_drafter(arch: str, top: dict, dfc: dict, seed: int = 0):
    """A drafter built by the reference's class, weights randomised (norms near 1, convolutions off identity)."""
    cfg = Qwen3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=2 * H,
                      num_hidden_layers=3, vocab_size=V, rms_norm_eps=1e-6, max_position_embeddings=512,
                      num_target_layers=6, block_size=B, **top,
                      dflash_config={"mask_token_id": 259, "target_layer_ids": [1, 2, 3], **dfc})
    cls = getattr(ref, arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if p.dim() == 1 else torch.randn_like(p) * 0.1)
            if "candidate_selector" in name:  # strong enough that the selector's path differs from the argmax
                p.mul_(10)
    return model


def inputs(seed=1, T=11):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, T, 3 * H, generator=g)
    noise = torch.randn(1, B, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) / H ** 0.5)  # logits of order 1, as a real head gives
    return feats, noise, torch.arange(T + B)[None], head


def reference_outputs(model, feats, noise, pos, head):
    """The reference's drafting step as its loop runs it: scaled block inputs, forward, logits (DFlash2: path)."""
    scale = float(ref._draft_value(model.config, "input_embedding_scale", 1.0))
    with torch.no_grad():
        h = model(position_ids=pos, noise_embedding=noise * scale, target_hidden=feats)
        logits = model.compute_logits(h, head)
        path = model.propose(h[:, 1:], torch.tensor([7]), head, 0.0) if hasattr(model, "propose") else None
    return h, logits, path


def our_outputs(d, feats, noise, pos, head):
    with torch.no_grad():
        h = d(feats, d.embed_block(lambda x: x, noise), pos)
        logits = d.compute_logits(h, head)
        path = d.propose(h[:, 1:], torch.tensor([7]), head, 0.0) if d.config.arch == "dflash2" else None
    return h, logits, path


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_written_drafters_load_and_match(tmp_path, variant):
    model = reference_drafter(*VARIANTS[variant])
    model.save_pretrained(tmp_path)
    d = load_drafter(tmp_path)  # no opt-in: nothing may be skipped
    assert "SKIPPED" not in d.load_report[-1] and "MISSING" not in d.load_report[-1]
    feats, noise, pos, head = inputs()
    want_h, want_logits, want_path = reference_outputs(model, feats, noise, pos, head)
    got_h, got_logits, got_path = our_outputs(d, feats, noise, pos, head)
    torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    if want_path is not None:
        assert not torch.equal(want_path[0], want_logits[:, 1:].argmax(-1))  # the selector matters here
        assert torch.equal(got_path[0], want_path[0])  # the selector's path
        assert torch.equal(got_path[1], want_path[1])  # its candidates, in the same order
    plain = reference_drafter(*VARIANTS["plain"])  # the variant's fields really change the outputs
    if variant != "plain" and VARIANTS[variant][0] == "DFlashDraftModel":
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(reference_outputs(plain, feats, noise, pos, head)[1], want_logits, atol=1e-3)


@pytest.mark.parametrize("variant", ["plain", "sliding", "is_causal", "output_multiplier", "dflash2 sliding, scaled"])
def test_our_export_loads_in_the_reference_with_equal_outputs(tmp_path, variant):
    model = reference_drafter(*VARIANTS[variant])
    model.save_pretrained(tmp_path / "ref")
    d = load_drafter(tmp_path / "ref")
    save_drafter(d, tmp_path / "ours", format="zlab", dtype=torch.float32)
    cls = getattr(ref, VARIANTS[variant][0])
    back, info = cls.from_pretrained(tmp_path / "ours", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    feats, noise, pos, head = inputs()
    for got, want in zip(reference_outputs(back.eval(), feats, noise, pos, head),
                         reference_outputs(model, feats, noise, pos, head)):
        if isinstance(want, tuple):
            assert torch.equal(got[0], want[0])
        elif want is not None:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if VARIANTS[variant][0] == "DFlash2DraftModel":  # codebooks under the released checkpoints' bare names
        assert "candidate_selector.predecessor_codebook" in load_file(tmp_path / "ours" / "model.safetensors")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]


def test_what_cannot_be_honoured_is_refused_with_the_field_named(tmp_path):
    reference_drafter(*VARIANTS["dflash2"]).save_pretrained(tmp_path / "d2")
    reference_drafter(*VARIANTS["plain"]).save_pretrained(tmp_path / "d1")
    # DFlash2 tensors under a DFlash config: the seeds' failure (another model runs) is refused
    as_dflash = edit_folder(tmp_path / "d2", lambda c: (c.update(architectures=["DFlashDraftModel"]),
                                                  [c["dflash_config"].pop(k) for k in DFLASH2]))
    with pytest.raises(DFlashError, match=r"no place for: .*DFlash2 tensors"):
        load_drafter(as_dflash)
    assert "SKIPPED" in load_drafter(as_dflash, allow_skipped=True).load_report[-1]
    with pytest.raises(DFlashError, match=r"architectures \['DFlash3DraftModel'\] is not one of"):
        load_drafter(edit_folder(tmp_path / "d1", lambda c: c.update(architectures=["DFlash3DraftModel"])))
    edit_folder(tmp_path / "d1", lambda c: c.update(architectures=["DFlashDraftModel"]))
    with pytest.raises(DFlashError, match=r"dflash_config has unknown key\(s\) \['logit_bias'\]"):
        load_drafter(edit_folder(tmp_path / "d1", lambda c: c["dflash_config"].update(logit_bias=1.0)))
    edit_folder(tmp_path / "d1", lambda c: c["dflash_config"].pop("logit_bias"))
    with pytest.raises(DFlashError, match=r"unknown key\(s\) \['conv_kernel_size'\] \(DFlash2 fields"):
        load_drafter(edit_folder(tmp_path / "d1", lambda c: c["dflash_config"].update(conv_kernel_size=2)))
    edit_folder(tmp_path / "d1", lambda c: c["dflash_config"].pop("conv_kernel_size"))
    with pytest.raises(DFlashError, match=r"dflash_config.is_causal is not read"):
        load_drafter(edit_folder(tmp_path / "d1", lambda c: c["dflash_config"].update(is_causal=True)))
    edit_folder(tmp_path / "d1", lambda c: c["dflash_config"].pop("is_causal"))
    with pytest.raises(DFlashError, match=r"eagle_aux_hidden_state_layer_ids \[1, 2, 3\] disagrees"):
        load_drafter(edit_folder(tmp_path / "d1", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3])))
    assert load_drafter(edit_folder(tmp_path / "d1", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 4])))
    with pytest.raises(DFlashError, match=r"hidden_act 'gelu'"):
        load_drafter(edit_folder(tmp_path / "d1", lambda c: c.update(hidden_act="gelu")))


@pytest.mark.parametrize("where", ["dflash_config", "top level"])
def test_sliding_window_non_causal_is_refused_because_the_reference_runs_causal(tmp_path, where):
    model = reference_drafter(*VARIANTS["sliding"])
    model.save_pretrained(tmp_path)
    feats, noise, pos, head = inputs()
    want = reference_outputs(model, feats, noise, pos, head)[1]
    flag = (lambda c: c["dflash_config"].update(sliding_window_non_causal=True)) if where == "dflash_config" else (
        lambda c: c.update(sliding_window_non_causal=True))
    edit_folder(tmp_path, flag)
    back = getattr(ref, "DFlashDraftModel").from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(reference_outputs(back, feats, noise, pos, head)[1], want)  # the reference ignores it
    with pytest.raises(DFlashError, match=r"config\.json: (dflash_config\.)?sliding_window_non_causal is true, but "
                                          r"z-lab's dflash 0\.1\.0 never reads it .* Remove sliding_window_non_causal"):
        load_drafter(tmp_path)
    edit_folder(tmp_path, lambda c: (c.pop("sliding_window_non_causal", None),
                                     c["dflash_config"].update(sliding_window_non_causal=False)))
    torch.testing.assert_close(our_outputs(load_drafter(tmp_path), feats, noise, pos, head)[1], want)  # false: loads


def test_a_sliding_non_causal_drafter_cannot_be_exported(tmp_path):
    reference_drafter(*VARIANTS["sliding"]).save_pretrained(tmp_path / "ref")
    d = load_drafter(tmp_path / "ref")
    d.config.sliding_window_non_causal = True
    with pytest.raises(DFlashError, match=r"sliding_window_non_causal is true: .* no drafter folder can carry it"):
        save_drafter(d, tmp_path / "ours", format="zlab")


def test_a_config_without_rope_theta_runs_the_references_default(tmp_path):
    model = reference_drafter(*VARIANTS["plain"])
    model.save_pretrained(tmp_path)
    edit_folder(tmp_path, lambda c: (c.pop("rope_parameters", None), c.pop("rope_theta", None)))
    back = getattr(ref, "DFlashDraftModel").from_pretrained(tmp_path, dtype=torch.float32).eval()
    d = load_drafter(tmp_path)
    assert d.config.rope_theta == back.config.rope_parameters["rope_theta"] == 10000.0
    assert any("rope_theta missing" in line for line in d.load_report)
    feats, noise, pos, head = inputs()
    pos = pos + 300  # far positions: a wrong theta shows in the logits
    torch.testing.assert_close(our_outputs(d, feats, noise, pos, head)[1],
                               reference_outputs(back, feats, noise, pos, head)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "sliding", "dflash2", "dflash2 sliding, scaled"])
def test_greedy_generation_equals_the_reference_loop(tmp_path, tiny_targets, monkeypatch, variant):
    """T=0: our chain loop and the reference's `dflash_generate`, each running its own class loaded from the same
    folder against the same target, give the same tokens, the same drafts and the same acceptance per round (the
    last rounds aside: the reference shortens its block to the tokens left, which changes a non-causal draft)."""
    from dflashkit.decode.speculative import DFlashProposer, generate

    import time

    target = tiny_targets["qwen3"]
    reference_drafter(*VARIANTS[variant], seed=3).save_pretrained(tmp_path)
    theirs = getattr(ref, VARIANTS[variant][0]).from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_drafter(tmp_path, target=target)
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # the reference times with CUDA syncs only
    drafted_theirs, drafted_ours = [], []
    if hasattr(theirs, "propose"):  # record every round's drafts on both sides
        real_propose = theirs.propose
        monkeypatch.setattr(theirs, "propose", lambda *a: _record(drafted_theirs, real_propose(*a), lambda r: r[0][0]))
    else:
        real_logits = theirs.compute_logits
        monkeypatch.setattr(theirs, "compute_logits", lambda *a: _record(drafted_theirs, real_logits(*a),
                                                                         lambda r: r[0].argmax(-1)))
    for text in ("def add(a, b):", "Write a haiku about the sea."):
        ids = target.chat_ids([{"role": "user", "content": text}])
        drafted_theirs.clear()
        want = ref.dflash_generate(theirs, target.model, torch.tensor([ids]), 24, None, return_stats=True)
        proposer = DFlashProposer(target, ours)
        real_draft = proposer.draft
        proposer.draft = lambda *a: _record(drafted_ours, real_draft(*a), lambda r: r[0])
        drafted_ours.clear()
        got = generate(target, ids, "chain", proposer, max_new_tokens=24, stop_ids=[])
        assert got.tokens == want.output_ids[0, len(ids):].tolist()
        full = next(i for i, d in enumerate(drafted_theirs + [[]]) if len(d) < ours.config.block_size - 1)
        assert full > 10 and len(drafted_ours) >= full
        assert got.accepted[:full] == want.acceptance_lengths[:full]
        for a, b in zip(drafted_ours[:full], drafted_theirs[:full]):
            assert a.tolist() == b.tolist()


def _record(log, result, pick):
    log.append(pick(result).clone())
    return result


def test_cli_init_info_export_dflash2_round_trip(tmp_path, tiny_dirs, capsys):
    """drafter init --arch dflash2 (block 8 by default) -> info -> export -> the reference's from_pretrained."""
    from dflashkit.cli import main

    assert main(["drafter", "init", "--target", str(tiny_dirs["qwen3"]), "--arch", "dflash2", "--num-layers", "2",
                 "--out", str(tmp_path / "d")]) == 0
    assert "dflash2, 2 layers, block 8" in capsys.readouterr().out
    assert main(["drafter", "info", str(tmp_path / "d"), "--target", str(tiny_dirs["qwen3"])]) == 0
    out = capsys.readouterr().out
    assert "Architecture: DFlash2DraftModel" in out and "selector rank 256, top-16" in out
    assert main(["drafter", "export", "--drafter", str(tmp_path / "d"), "--out", str(tmp_path / "z"),
                 "--dtype", "float32"]) == 0
    back, info = ref.DFlash2DraftModel.from_pretrained(tmp_path / "z", output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and back.block_size == 8
