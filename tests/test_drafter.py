"""The drafter against a plain-loop reference, its context KV, masks and checkpoint formats."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.drafter import DFlashDrafter, DrafterConfig
from dflashkit.drafter.checkpoint import check_feature_layers, load_drafter, new_drafter, save_drafter
from dflashkit.errors import DFlashError
from helpers import edit_folder, perturb


def make_drafter(layers=2, K=3, H=64, heads=4, kv=2, B=8, sliding=None, seed=0, **extra):
    torch.manual_seed(seed)
    types = ["full_attention"] * layers
    if sliding:
        types = ["sliding_attention"] * layers
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv, head_dim=H // heads,
                        intermediate_size=2 * H, num_hidden_layers=layers, target_layer_ids=list(range(1, K + 1)),
                        num_target_layers=6, mask_token_id=259, vocab_size=272, block_size=B, rope_theta=10000.0,
                        layer_types=types, sliding_window=sliding, **extra)
    return perturb(DFlashDrafter(cfg))


VARIANTS = {  # make_drafter keywords: every attention kind and both architectures must batch exactly
    "dflash": {},
    "sliding causal": {"sliding": 6},
    "sliding non-causal": {"sliding": 6, "sliding_window_non_causal": True},
    "dflash2": {"arch": "dflash2", "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
                "selector_top_k": 4},
    "dflash2 sliding": {"arch": "dflash2", "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8,
                        "selector_top_k": 4, "sliding": 6},
}


# ---- a straightforward reference: plain loops over heads and positions ------------------------------
def ref_rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        ang = pos * theta ** (-2 * i / d)
        c, s = math.cos(ang), math.sin(ang)
        out[i] = x[i] * c - x[i + d // 2] * s
        out[i + d // 2] = x[i + d // 2] * c + x[i] * s
    return out


def reference_forward(d, target_hidden, noise, ctx_pos, blk_pos, visible):
    """target_hidden [T, K*H], noise [B, H]; visible(q, key_index) -> bool over keys [ctx..., block...]."""
    c = d.config
    eps, hd = c.rms_norm_eps, c.head_dim
    ctx = ref_rms(target_hidden @ d.fc.weight.T, d.hidden_norm.weight, eps)
    h = noise.clone()
    keys_pos = list(ctx_pos) + list(blk_pos)
    for layer in d.layers:
        a = layer.self_attn
        x = ref_rms(h, layer.input_layernorm.weight, eps)
        src = torch.cat([ctx, x])  # keys/values come from context AND block; queries from the block only
        out = torch.zeros(len(blk_pos), c.num_attention_heads * hd)
        for head in range(c.num_attention_heads):
            kvh = head // (c.num_attention_heads // c.num_key_value_heads)
            for qi in range(len(blk_pos)):
                q = (x[qi] @ a.q_proj.weight.T)[head * hd:(head + 1) * hd]
                q = ref_rope(ref_rms(q, a.q_norm.weight, eps), blk_pos[qi], c.rope_theta)
                scores, vals = [], []
                for ki in range(len(src)):
                    if not visible(qi, ki):
                        continue
                    k = (src[ki] @ a.k_proj.weight.T)[kvh * hd:(kvh + 1) * hd]
                    k = ref_rope(ref_rms(k, a.k_norm.weight, eps), keys_pos[ki], c.rope_theta)
                    scores.append(float(q @ k) / math.sqrt(hd))
                    vals.append((src[ki] @ a.v_proj.weight.T)[kvh * hd:(kvh + 1) * hd])
                w = torch.softmax(torch.tensor(scores), 0)
                out[qi, head * hd:(head + 1) * hd] = sum(wi * v for wi, v in zip(w, vals))
        h = h + out @ a.o_proj.weight.T
        m = layer.mlp
        y = ref_rms(h, layer.post_attention_layernorm.weight, eps)
        h = h + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return ref_rms(h, d.norm.weight, eps)


ATTENTION_CASES = {  # (sliding window, extra config) -> who sees whom by absolute position, as dflash 0.1.0 computes
    "full": (None, {}, lambda q, k: True),
    "sliding causal (default)": (12, {}, lambda q, k: 0 <= q - k < 12),
    "sliding non-causal": (5, {"sliding_window_non_causal": True}, lambda q, k: abs(q - k) < 5),
    "full, is_causal": (None, {"is_causal": True}, lambda q, k: k <= q),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_module_matches_plain_loop_reference(case):
    sliding, extra, rule = ATTENTION_CASES[case]
    d = make_drafter(sliding=sliding, **extra)
    T, B, H = 9, 8, 64
    feats = torch.randn(1, T, 3 * H)
    noise = torch.randn(1, B, H)
    pos = torch.arange(T + B)[None]
    keys = list(range(T)) + list(range(T, T + B))

    with torch.no_grad():
        got = d(feats, noise, pos)[0]
        want = reference_forward(d, feats[0], noise[0], list(range(T)), list(range(T, T + B)),
                                 lambda qi, ki: rule(T + qi, keys[ki]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if case != "full":
        full = make_drafter(sliding=None)
        full.load_state_dict(d.state_dict())
        with torch.no_grad():
            assert not torch.allclose(full(feats, noise, pos)[0], got, atol=1e-4)


def test_multi_block_mask_matches_reference_with_strict_context():
    d = make_drafter()
    T, B, H = 20, 8, 64
    feats = torch.randn(1, T, 3 * H)
    anchors = torch.tensor([[4, 11, 17]])
    emb = torch.randn(1, 3 * B, H)
    with torch.no_grad():
        got = d.forward_blocks(feats, emb, anchors)
        for j, a in enumerate(anchors[0].tolist()):
            blk = list(range(a, a + B))
            want = reference_forward(d, feats[0, :a], emb[0, j * B:(j + 1) * B], list(range(a)), blk, lambda q, k: True)
            torch.testing.assert_close(got[0, j * B:(j + 1) * B], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_blocks_equal_each_block_alone_and_padding_is_inert(variant):
    d = make_drafter(**VARIANTS[variant])
    T, B, H = 30, 8, 64
    feats = torch.randn(2, T, 3 * H)
    anchors = torch.tensor([[3, 9, 20, 0], [5, 12, 22, 25]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    emb = torch.randn(2, 4 * B, H)
    with torch.no_grad():
        got = d.forward_blocks(feats, emb, anchors, valid)
        for b in range(2):
            for j in range(4):
                if not valid[b, j]:
                    continue
                a = int(anchors[b, j])
                alone = d(feats[b:b + 1, :a], emb[b:b + 1, j * B:(j + 1) * B], torch.arange(a + B)[None])
                torch.testing.assert_close(got[b:b + 1, j * B:(j + 1) * B], alone, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(got).all()
        # changing the padding block's inputs changes nothing else
        emb2 = emb.clone()
        emb2[0, 3 * B:] += 5
        got2 = d.forward_blocks(feats, emb2, anchors, valid)
        torch.testing.assert_close(got2[0, :3 * B], got[0, :3 * B], atol=0, rtol=0)


def test_mask_is_applied_and_no_dependence_after_anchor():
    d = make_drafter()
    T, B, H = 24, 8, 64
    feats = torch.randn(1, T, 3 * H)
    anchors = torch.tensor([[10]])
    emb = torch.randn(1, B, H)
    with torch.no_grad():
        base = d.forward_blocks(feats, emb, anchors)
        later = feats.clone()
        later[:, 10:] = torch.randn_like(later[:, 10:])  # the anchor's own position and everything after it
        torch.testing.assert_close(d.forward_blocks(later, emb, anchors), base, atol=0, rtol=0)
        earlier = feats.clone()
        earlier[:, 9] += 1.0  # the last visible context position must matter
        assert not torch.allclose(d.forward_blocks(earlier, emb, anchors), base)
        # an inclusive mask (<= anchor) would see position 10: check that a different anchor does see it
        assert not torch.allclose(d.forward_blocks(later, emb, torch.tensor([[11]])), d.forward_blocks(feats, emb, torch.tensor([[11]])))


def test_forward_with_context_kv_equals_full_context():
    d = make_drafter()
    B, H = 8, 64
    feats = torch.randn(1, 40, 3 * H)
    context_kv = d.new_context_kv()
    seen = 0
    with torch.no_grad():
        for end in (7, 8, 19, 23, 40):  # context grows by uneven chunks, as accepted tokens do online
            emb = torch.randn(1, B, H)
            new = feats[:, seen:end]
            pos = torch.cat([torch.arange(seen, end), torch.arange(end, end + B)])[None]
            step = d(new, emb, pos, past_key_values=context_kv)
            full = d(feats[:, :end], emb, torch.arange(end + B)[None])
            torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
            seen = end
            assert context_kv.get_seq_length() == end  # block K/V never stay in the context KV


def test_save_load_round_trip_both_formats(tmp_path, tiny_targets):
    t = tiny_targets["qwen3"]
    d = new_drafter(t, num_layers=2, target_layer_ids=[1, 2, 3])
    feats, emb = torch.randn(1, 6, 3 * 64), torch.randn(1, 16, 64)
    pos = torch.arange(22)[None]
    for fmt in ("zlab", "dflashkit"):
        out = save_drafter(d, tmp_path / fmt, format=fmt, target_identity=t.identity())
        back = load_drafter(out, target=t)
        with torch.no_grad():
            torch.testing.assert_close(back(feats, emb, pos), d(feats, emb, pos))
        assert back.load_report[0] == "Detected fc input: 192 = 3 target layers x 64"
        assert back.load_report[-1] == "Loaded 25 tensors"
        assert back.load_report[-2].startswith("Architecture: DFlashDraftModel (2 layers [non-causal, non-causal]")
        assert (back.contract is not None) == (fmt == "dflashkit")
    cfg = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    names = set(load_file(tmp_path / "zlab" / "model.safetensors"))
    assert "fc.weight" in names and "layers.0.self_attn.q_norm.weight" in names and not any("embed" in n for n in names)


def test_zlab_variants_block_size_location_rope_parameters_and_skipped_tensors(tmp_path, tiny_targets):
    t = tiny_targets["qwen3"]
    d = new_drafter(t, num_layers=2, target_layer_ids=[1, 2, 3], block_size=10)
    path = save_drafter(d, tmp_path / "z", format="zlab")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["block_size"]  # newer checkpoints keep it only inside dflash_config
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    (path / "config.json").write_text(json.dumps(cfg))
    state = load_file(path / "model.safetensors")
    state["verifier_norm.weight"] = torch.ones(64)
    save_file(state, path / "model.safetensors")
    with pytest.raises(DFlashError, match=r"1 tensor\(s\) the DFlashDraftModel .* no place for: verifier_norm.weight"):
        load_drafter(path, target=t)  # skipping needs an explicit opt-in
    back = load_drafter(path, target=t, allow_skipped=True)
    assert back.config.block_size == 10 and back.config.rope_theta == d.config.rope_theta
    assert back.load_report[-1].startswith("Loaded 25 tensors, SKIPPED 1 (allow_skipped: the model run is the "
                                           "DFlashDraftModel of config.json without them): verifier_norm.weight")


def test_bad_checkpoints_fail_with_one_clear_error(tmp_path, tiny_targets):
    t = tiny_targets["qwen3"]
    d = new_drafter(t, num_layers=2, target_layer_ids=[1, 2, 3])
    good = save_drafter(d, tmp_path / "good", format="zlab")

    def variant(name, edit_cfg=None, edit_state=None):
        return edit_folder(save_drafter(d, tmp_path / name, format="zlab"), edit_cfg, edit_state)

    with pytest.raises(DFlashError, match="hidden size 64"):
        load_drafter(variant("h", edit_cfg=lambda c: c.update(hidden_size=96),
                             edit_state=lambda s: s.update({"fc.weight": torch.zeros(96, 288)})), target=t)
    with pytest.raises(DFlashError, match=r"fc.weight expects 3"):
        load_drafter(variant("ids", edit_cfg=lambda c: c["dflash_config"].update(target_layer_ids=[1, 2])))
    with pytest.raises(DFlashError, match=r"layers.0.self_attn.q_proj.weight has shape"):
        load_drafter(variant("shape", edit_state=lambda s: s.update({"layers.0.self_attn.q_proj.weight": torch.zeros(8, 64)})))
    with pytest.raises(DFlashError, match="NaN"):
        load_drafter(variant("nan", edit_state=lambda s: s["norm.weight"].__setitem__(0, float("nan"))))
    with pytest.raises(DFlashError, match="outside target"):
        load_drafter(variant("mask", edit_cfg=lambda c: c["dflash_config"].update(mask_token_id=5000)), target=t)
    with pytest.raises(DFlashError, match="missing tensors"):
        load_drafter(variant("miss", edit_state=lambda s: s.pop("norm.weight")))
    assert load_drafter(tmp_path / "miss", allow_missing=True).load_report[-1].startswith("Loaded 24 tensors, MISSING 1")
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "config.json").write_text((good / "config.json").read_text())
    (tmp_path / "trunc" / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(DFlashError, match="truncated or corrupt"):
        load_drafter(tmp_path / "trunc")
    with pytest.raises(DFlashError, match="config.json: missing"):
        load_drafter(tmp_path / "h" / "..")


def test_fc_expecting_five_layers_against_three_offered():
    d = make_drafter(K=5)
    with pytest.raises(DFlashError, match=r"drafter expects 5 target layers .* offers 3 layers"):
        check_feature_layers(d.config, [1, 2, 3], "cache runs/x")
    assert check_feature_layers(d.config, [5, 4, 3, 2, 1], "cache") == [4, 3, 2, 1, 0]


def test_new_drafter_refuses_shortcut_layers(tiny_targets):
    with pytest.raises(DFlashError, match="last two decoder layers"):
        new_drafter(tiny_targets["llama"], num_layers=1, target_layer_ids=[5])


def test_few_rows_linear_is_the_linear_in_decoding_and_exactly_it_elsewhere():
    """Decoding's few-row products (weight @ x.T) equal F.linear up to float rounding and are F.linear itself past
    FEW_ROWS; the drafter's `linear` reaches every product it computes (the fused context, each layer's seven
    projections over the block and two over the context), and its output does not depend on which ran."""
    from dflashkit.drafter.head import FEW_ROWS, few_rows_linear

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    for shape in [(1, 24), (3, 24), (2, 5, 24), (FEW_ROWS, 24), (FEW_ROWS + 1, 24)]:
        x = torch.randn(*shape, generator=g)
        want = torch.nn.functional.linear(x, w, b)
        got = few_rows_linear(x, w, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got, want) or shape[0] <= FEW_ROWS  # past FEW_ROWS: F.linear itself
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                        num_hidden_layers=2, target_layer_ids=[0, 1], num_target_layers=3, block_size=4,
                        mask_token_id=0, vocab_size=50)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    feats, block = torch.randn(1, 3, 64), torch.randn(1, 4, 32)
    pos = torch.arange(7)[None]
    train_path = drafter(feats, block, pos)
    calls = []
    spy = lambda x, weight: calls.append(weight) or few_rows_linear(x, weight)
    with torch.no_grad():
        torch.testing.assert_close(drafter.run(feats, block, pos[:, :3], pos[:, 3:], linear=spy), train_path,
                                   atol=1e-5, rtol=1e-4)
    assert len(calls) == 1 + 2 * 9 and {id(p) for p in drafter.parameters() if p.dim() == 2} == set(map(id, calls))
