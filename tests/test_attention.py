"""forward_blocks' block-sparse attention paths (chunked, flex) against the dense masked path, and padding blocks
that stay finite in forward and backward (float32 and bfloat16)."""

import pytest
import torch

import dflashkit.drafter.model as drafter_model
from dflashkit.drafter import DFlashDrafter, DrafterConfig, build_block_mask
from dflashkit.drafter.model import ChunkedBlocks, FlexBlocks, pick_attention
from dflashkit.errors import DFlashError
from dflashkit.train.config import load_config
from helpers import perturb

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

H, K, B = 64, 3, 8


def make_drafter(layers=2, sliding=None, seed=0, **extra):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=H // 4,
                        intermediate_size=2 * H, num_hidden_layers=layers, target_layer_ids=list(range(1, K + 1)),
                        num_target_layers=6, mask_token_id=259, vocab_size=272, block_size=B, rope_theta=10000.0,
                        layer_types=["full_attention", "sliding_attention"][:layers] if sliding else None,
                        sliding_window=sliding, **extra)
    return perturb(DFlashDrafter(cfg), conv_std=0.1)


# Attention kinds x architectures that the three paths must compute alike (sliding 11 > B: context windowed;
# sliding 5 < B: the window also cuts inside the block)
KINDS = {"full": {}, "sliding 11 causal": {"sliding": 11}, "sliding 5 causal": {"sliding": 5},
         "sliding 5 non-causal": {"sliding": 5, "sliding_window_non_causal": True}, "is_causal": {"is_causal": True},
         "dflash2 sliding 5": {"sliding": 5, "arch": "dflash2", "conv_kernel_size": 3, "conv_group_size": 16,
                               "selector_rank": 8, "selector_top_k": 4}}


def uneven_batch(T=45, seed=1):
    """Two sequences, unsorted anchors, 5 vs 3 real blocks (padding blocks at odd places and odd anchors)."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.tensor([[30, 3, 9, 43, 20, 17, 0], [5, 12, 40, 0, 2, 25, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 1, 0]], dtype=torch.bool)
    feats = torch.randn(2, T, K * H, generator=g)
    emb = torch.randn(2, anchors.shape[1] * B, H, generator=g)
    return feats, emb, anchors, valid


def run_path(d, kind, feats, emb, anchors, valid, dtype=torch.float32):
    """(output, grads of the drafter's weights, of the features, of the block inputs) for a loss on valid rows."""
    d.zero_grad(set_to_none=True)
    f, e = feats.clone().requires_grad_(), emb.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = d.forward_blocks(f, e, anchors, valid, attention=kind)
    rows = valid.repeat_interleave(B, 1)
    w = torch.linspace(-1, 1, out.shape[-1])
    (out.float()[rows] * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}  # selector: not in the backbone
    return out, grads, f.grad, e.grad


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chunk", [1, 2, 32])
def test_chunked_equals_dense_outputs_and_gradients(monkeypatch, kind, chunk):
    monkeypatch.setattr(drafter_model, "CHUNK_BLOCKS", chunk)
    d = make_drafter(**KINDS[kind])
    batch = uneven_batch()
    out_d, g_d, f_d, e_d = run_path(d, "dense", *batch)
    out_c, g_c, f_c, e_c = run_path(d, "chunked", *batch)
    torch.testing.assert_close(out_c, out_d, atol=1e-5, rtol=1e-5)  # every row, padding rows included
    for name in g_d:
        torch.testing.assert_close(g_c[name], g_d[name], atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(f_c, f_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e_c, e_d, atol=1e-5, rtol=1e-5)
    assert f_d[0, 44].abs().max() == 0  # nothing after the last anchor (43) is seen: the strict mask holds


@pytest.mark.parametrize("kind", list(KINDS))
def test_flex_equals_dense_forward(kind):
    """CPU runs flex forward only (eager, no backward on CPU); gradients are checked on CUDA by gpu_check."""
    d = make_drafter(**KINDS[kind])
    feats, emb, anchors, valid = uneven_batch()
    with torch.no_grad():
        dense = d.forward_blocks(feats, emb, anchors, valid, attention="dense")
        flex = d.forward_blocks(feats, emb, anchors, valid, attention="flex")
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_flex_mask_mod_is_build_block_mask():
    feats, emb, anchors, valid = uneven_batch()
    T, n = feats.shape[1], anchors.shape[1]
    plan = FlexBlocks(anchors, valid, T, B)
    q, kv = torch.arange(n * B)[:, None], torch.arange(T + n * B)[None, :]
    for b in range(2):
        got = plan.mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
        assert torch.equal(got, build_block_mask(anchors, T, B, valid)[b, 0])


def test_mask_rows_padding_sees_only_its_own_slot():
    anchors = torch.tensor([[4, 2]])
    m = build_block_mask(anchors, 6, 3, torch.tensor([[True, False]]))[0, 0].int()
    assert m.tolist() == [
        [1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0],  # block 0: context < 4, its own 3 slots
        [1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],  # padding block 1: each row its own slot only
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["dense", "chunked"])
def test_padding_blocks_are_finite_forward_and_backward(kind, dtype):
    """Padding rows (and an anchor at 0, whose block sees no context) give finite values and gradients; the loss
    here covers EVERY row, padding included, so a NaN anywhere in backward would show."""
    d = make_drafter().to(dtype)
    feats, emb, anchors, valid = uneven_batch()
    anchors[1, 0] = 0  # a real block with an empty context
    f, e = feats.to(dtype).requires_grad_(), emb.to(dtype).requires_grad_()
    out = d.forward_blocks(f, e, anchors, valid, attention=kind)
    assert out.dtype == dtype
    out.float().square().mean().backward()
    assert torch.isfinite(out.float()).all()
    assert torch.isfinite(f.grad).all() and torch.isfinite(e.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in d.parameters())


def test_padding_block_is_inert_for_real_blocks():
    d = make_drafter()
    feats, emb, anchors, valid = uneven_batch()
    with torch.no_grad():
        base = d.forward_blocks(feats, emb, anchors, valid, attention="chunked")
        emb2, anchors2 = emb.clone(), anchors.clone()
        emb2[0, 5 * B:] += 3.0  # padding blocks' inputs and anchors change
        anchors2[0, 5:] = 40
        got = d.forward_blocks(feats, emb2, anchors2, valid, attention="chunked")
    rows = valid.repeat_interleave(B, 1)
    torch.testing.assert_close(got[rows], base[rows], atol=1e-6, rtol=0)


def test_chunk_context_ends_at_its_last_anchor():
    anchors = torch.tensor([[3, 9, 20, 41]])
    plan = ChunkedBlocks(anchors, torch.ones_like(anchors, dtype=torch.bool), 45, B, chunk=2)
    assert [(r0, r1, L) for r0, r1, L, _ in plan.parts] == [(0, 16, 10), (16, 32, 42)]


def test_auto_choice_and_bad_input():
    assert pick_attention("auto", torch.device("cpu")) == "chunked"
    assert pick_attention("dense", torch.device("cpu")) == "dense"
    with pytest.raises(DFlashError, match="attention='sparse' is not one of"):
        pick_attention("sparse", torch.device("cpu"))
    d = make_drafter()
    feats, emb, anchors, valid = uneven_batch()
    with pytest.raises(DFlashError, match="does not hold 7 blocks of 8 rows"):
        d.forward_blocks(feats, emb[:, :-1], anchors, valid)
    with pytest.raises(DFlashError, match="no backward on CPU"):
        d.forward_blocks(feats, emb.requires_grad_(), anchors, valid, attention="flex")


def test_train_config_attention_setting():
    assert load_config(None, {"attention": "chunked"}).attention == "chunked"
    assert load_config(None, {}).to_dict()["attention"] == "auto"
    with pytest.raises(DFlashError, match="attention='sparse' is not one of: auto, flex, chunked, dense"):
        load_config(None, {"attention": "sparse"})


@pytest.mark.slow
def test_training_losses_equal_across_paths_and_the_setting_is_recorded(tiny_targets, tmp_path):
    import json

    from dflashkit.train.data import MemorySource, Sequence
    from dflashkit.train.loop import train

    llama = tiny_targets["llama"]
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(f"s{i}", torch.randint(3, 250, (30 + 7 * i,), generator=g), 6) for i in range(4)]
    feats = [torch.randn(s.length, llama.hidden_size, generator=g) for s in seqs]
    losses = {}
    for kind in ("dense", "chunked"):
        cfg = load_config(None, dict(out=str(tmp_path / kind), num_layers=1, target_layer_ids=[1], block_size=4,
                                     batch_size=2, anchors_per_seq=9, steps=3, progress=False, dtype="float32",
                                     attention=kind))
        out = train(cfg, target=llama, source=MemorySource(seqs, feats, [1]))
        losses[kind] = out["losses"]
        assert json.loads((tmp_path / kind / "summary.json").read_text())["config"]["attention"] == kind
    torch.testing.assert_close(torch.tensor(losses["chunked"]), torch.tensor(losses["dense"]), atol=1e-5, rtol=1e-5)
