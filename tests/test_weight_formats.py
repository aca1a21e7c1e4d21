"""Weight formats (issue 69): GGUF's q8_0, q4_0 and q4_1 (and llama-quantize's q5_0, q4_K, q6_K, the converter's
f16, bf16, f32) kept in their blocks for the static backend's kernels and widened in registers; the outputs are the
float32 kernels' over the dequantized copy, bit for bit, on every ISA level; a GGUF target's file is read as its own
blocks; what cannot run is refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize

from dflashkit import levels
from dflashkit.decode import native
from dflashkit.decode.speculative import generate_ar, generate_tree
from dflashkit.decode.static import GGUF_BYTES, KINDS, StaticBackend, StaticDecoder, panel_order, quant_order
from dflashkit.errors import DFlashError
from dflashkit.targets import formats
from dflashkit.targets.model import load_target
from dflashkit.targets.registry import MARKER
from helpers import exercised_levels

BUILDS = [pytest.param((lv, None), id=lv) for lv in exercised_levels()] + \
    ([pytest.param(("v3", "znver3"), id="v3-znver3")] if "v3" in exercised_levels() else [])
CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q6_k": 3, "q5_0": 4, "f16": 5, "bf16": 6, "f32": 7}


def kinds(formats: tuple) -> dict[str, set[str]]:
    """formats_of's kernel kinds per matrix of the step, over its layers and runs."""
    return {name: {kind for runs in layers for _, kind in runs} for name, layers in formats}


def dequantized(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """What GGUF's reference quantizer and dequantizer make of w: the test's own straightforward copy."""
    q = GGMLQuantizationType[fmt.upper()]
    return torch.from_numpy(dequantize(quantize(w.numpy(), q), q).reshape(w.shape).copy())


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", formats.QUANTS)
def test_each_format_is_the_float_kernel_over_its_dequantized_copy(fmt, build):
    """linear_quant over a matrix in GGUF's blocks against the float32 linear over their dequantized values: equal bit
    for bit, and each row of a call equal to that row alone, from 1 row (widened in registers) to 30 (widened once a
    pass for two blocks of rows or more), over passes of 128 inputs (k = 576)."""
    ops = native.ops(*build)
    for outs, k in ((48, 64), (160, 576)):
        w = torch.randn(outs, k) * 0.05
        raw = quantize(w.numpy(), GGMLQuantizationType[fmt.upper()])
        packed = torch.from_numpy(quant_order(fmt, raw))
        x = torch.randn(30, k)
        y = ops.linear_quant(x, packed, CODES[fmt], outs)
        assert torch.equal(y, ops.linear(x, panel_order(dequantized(w, fmt)).contiguous()))
        for n in (1, 2, 5, 12, 24, 29):
            assert torch.equal(ops.linear_quant(x[:n], packed, CODES[fmt], outs), y[:n]), (fmt, n)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
def test_a_files_float_matrices_are_the_float_kernel_over_their_values(fmt, build):
    """GGUF's F16, BF16 and F32 tensors kept at their own bytes and widened in registers (f16 by F16C, or on the
    portable path in integer steps): bit for bit the float32 kernel over their values, subnormal halves, the largest
    ones and negative zero included, each row of a call that row alone; and no integer dots for them."""
    ops = native.ops(*build)
    outs, k = 48, 576
    w = torch.randn(outs, k) * 0.05
    w[:4] *= 1e-5  # f16's subnormals (below 6.1e-5)
    w[4, :8] = torch.tensor([65504.0, -65504.0, 6e-8, -6e-8, 0.0, -0.0, 2.0 ** -24, 1.0])
    raw = w.numpy() if fmt == "f32" else quantize(w.numpy(), GGMLQuantizationType[fmt.upper()])
    raw = raw.view(np.uint8).reshape(outs, -1)
    values = torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt.upper()]).astype(np.float32).reshape(outs, k))
    assert fmt != "f16" or ((values[:4] != 0) & (values[:4].abs() < 6.1e-5)).any()
    packed = torch.from_numpy(quant_order(fmt, raw))
    assert packed.numel() == outs * k * (4 if fmt == "f32" else 2)
    x = torch.randn(30, k)
    y = ops.linear_quant(x, packed, CODES[fmt], outs)
    assert torch.equal(y, ops.linear(x, panel_order(values).contiguous()))
    for n in (1, 2, 5, 12, 24, 29):
        assert torch.equal(ops.linear_quant(x[:n], packed, CODES[fmt], outs), y[:n]), (fmt, n)
    with pytest.raises(RuntimeError, match=f"format {CODES[fmt]} is a float one, with no integer dots"):
        ops.linear_int8(x, packed, CODES[fmt], outs)


def integer_dots(x: torch.Tensor, raw: np.ndarray, fmt: str, k: int) -> torch.Tensor:
    """The -int8 model written out plainly: each row's blocks of 32 in 8 bits (xd = max|x| / 127, xq = nearest(x *
    127 / max|x|)), integer dots with the file's quants, then per block acc = fma(wd * xd, dot, acc) (q4_1: then
    fma(wm, xd * sum xq, acc)); each fused multiply-add rounded once (long double holds it exactly enough)."""
    f32, ld = np.float32, np.longdouble
    blocks = raw.reshape(raw.shape[0], k // 32, -1)
    wd = blocks[..., :2].copy().view(np.float16)[..., 0].astype(f32)
    wm = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(f32)
    q = blocks[..., 2:].view(np.int8).astype(np.int64) if fmt == "q8_0" else np.concatenate(
        [blocks[..., 4 if fmt == "q4_1" else 2:] & 15, blocks[..., 4 if fmt == "q4_1" else 2:] >> 4], -1).astype(np.int64)
    q = q - 8 if fmt == "q4_0" else q
    xb = x.numpy().reshape(x.shape[0], k // 32, 32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, f32(1)), f32(0)).astype(f32)
    xq = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    xd = (amax / f32(127)).astype(f32)
    dots = np.einsum("rbi,obi->rob", xq, q)  # [row, output, block], exact
    acc = np.zeros((x.shape[0], raw.shape[0]), f32)
    for b in range(k // 32):
        scale = (wd[None, :, b] * xd[:, None, b]).astype(f32)
        acc = (scale.astype(ld) * dots[..., b].astype(f32).astype(ld) + acc.astype(ld)).astype(f32)
        if fmt == "q4_1":
            m = (xd[:, b] * xq[:, b].sum(-1).astype(f32)).astype(f32)
            acc = (wm[None, :, b].astype(ld) * m[:, None].astype(ld) + acc.astype(ld)).astype(f32)
    return torch.from_numpy(acc)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", formats.QUANTS)
def test_integer_dots_are_the_plain_int8_model_and_each_row_its_own(fmt, build):
    """linear_int8 against the -int8 model written out in the test, bit for bit, and each row of a call equal to that
    row alone, 1 to 30 rows (the kernel takes them 2 or 8 at a time), with a zero row and large inputs; through VNNI
    too where this CPU has the level's kind of it (levels.VNNI)."""
    ops = native.ops(*build)
    dots = [ops.linear_int8] + ([ops.linear_vnni] if levels.VNNI.get(build[0]) in levels.cpu()[1] else [])
    for outs, k in ((48, 64), (160, 576)):
        w = torch.randn(outs, k) * 0.05
        raw = quantize(w.numpy(), GGMLQuantizationType[fmt.upper()])
        packed = torch.from_numpy(quant_order(fmt, raw, dots=True))
        x = torch.randn(30, k) * torch.logspace(-3, 3, 30)[:, None]
        x[3] = 0
        y = integer_dots(x, raw, fmt, k)
        for op in dots:
            assert torch.equal(op(x, packed, CODES[fmt], outs), y), (fmt, op)
            for n in (1, 2, 3, 9, 16, 29):
                assert torch.equal(op(x[:n], packed, CODES[fmt], outs), y[:n]), (fmt, op, n)
            assert torch.equal(op(x[17:18], packed, CODES[fmt], outs), y[17:18])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # what torch.compile traces the step with, either kernel
        for op in (*dots, ops.linear_quant):
            assert op(mode.from_tensor(x), mode.from_tensor(packed), CODES[fmt], outs).shape == y.shape


def random_blocks(fmt: str, outs: int, k: int, rng) -> np.ndarray:
    """Random GGUF blocks of `fmt` (llama-quantize's kinds, which GGUF's Python quantizer does not write), their
    float16 scales set within a plain range."""
    raw = rng.integers(0, 256, size=(outs, k // (256 if fmt.endswith("_k") else 32), GGUF_BYTES[fmt]), dtype=np.uint8)
    at = {"q6_k": [208], "q4_k": [0, 2], "q5_0": [0], "q8_0": [0]}[fmt]
    for i in at:
        raw[..., i: i + 2] = (rng.random(raw.shape[:2] + (1,)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(outs, -1)


def int8_reference(x: torch.Tensor, values: np.ndarray, d: np.ndarray, m: np.ndarray | None, k: int) -> torch.Tensor:
    """The -int8 model of weights `values` = d * q (+ m), d and m per run of inputs (16 or 32): each row's blocks of
    32 in 8 bits, integer dots with q per run, acc = fma(d * xd, dot, acc) run by run (then fma(m, xd * sum xq))."""
    f32, ld = np.float32, np.longdouble
    run = k // d.shape[1]
    dd, shifted = np.repeat(d, run, 1).astype(np.float64), values - (0 if m is None else np.repeat(m, run, 1))
    q = np.rint(np.divide(shifted, dd, out=np.zeros_like(dd), where=dd != 0)).astype(np.int64)  # d = 0: any q adds 0
    xb = x.numpy().reshape(x.shape[0], k // 32, 32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, f32(1)), f32(0)).astype(f32)
    xq = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64).reshape(x.shape[0], -1)
    xd = (amax / f32(127)).astype(f32)
    acc = np.zeros((x.shape[0], values.shape[0]), f32)
    for j in range(d.shape[1]):
        b = j * run // 32
        dots = xq[:, j * run: (j + 1) * run] @ q[:, j * run: (j + 1) * run].T
        acc = ((d[None, :, j] * xd[:, None, b]).astype(f32).astype(ld) * dots.astype(f32).astype(ld) +
               acc.astype(ld)).astype(f32)
        if m is not None:
            s = (xd[:, b] * xq[:, b * 32: b * 32 + 32].sum(-1).astype(f32)).astype(f32)
            acc = (m[None, :, j].astype(ld) * s[:, None].astype(ld) + acc.astype(ld)).astype(f32)
    return torch.from_numpy(acc)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", ["q5_0", "q4_k", "q6_k"])
def test_llama_quantizes_formats_are_their_dequantized_values_and_their_int8_model(fmt, build):
    """q5_0, q4_K and q6_K (what a Q4_K_M file holds beside q8_0) unpacked into the kernels' kinds: widened, the float
    kernel over GGUF's dequantized values bit for bit; through integer dots, the -int8 model written out here over
    the file's own scales (q6_K: one per 16 inputs); each row of a call that row alone."""
    from gguf.quants import Q4_K

    ops, rng = native.ops(*build), np.random.default_rng(0)
    outs, k = 48, 512
    raw = random_blocks(fmt, outs, k, rng)
    if fmt == "q5_0":  # the largest sums the integer path holds: every quant 31 against a positive row
        raw.reshape(outs, k // 32, -1)[:16, :, 2:] = 255
    values = dequantize(raw, GGMLQuantizationType[fmt.upper()]).reshape(outs, k)
    b = raw.reshape(outs, k // 256 if fmt.endswith("_k") else k // 32, -1)
    half = lambda at: b[..., at: at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    m = None
    if fmt == "q5_0":
        d = half(0)
    elif fmt == "q6_k":  # d times each 16's int8 scale
        d = (half(208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(outs, -1)
    else:
        sc, mins = (x.reshape(outs, -1, 8).astype(np.float32) for x in Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12)))
        d, m = (half(0)[..., None] * sc).reshape(outs, -1), -(half(2)[..., None] * mins).reshape(outs, -1)
    kind = KINDS[fmt]
    x = torch.randn(30, k) * torch.logspace(-2, 2, 30)[:, None]
    x[0] = x[0].abs()
    y = ops.linear_quant(x, torch.from_numpy(quant_order(fmt, raw)), CODES[kind], outs)
    assert torch.equal(y, ops.linear(x, panel_order(torch.from_numpy(values.copy())).contiguous()))
    packed = torch.from_numpy(quant_order(fmt, raw, dots=True))
    z = ops.linear_int8(x, packed, CODES[kind], outs)
    assert torch.equal(z, int8_reference(x, values, d, m, k))
    for n in (1, 3, 9, 17):
        assert torch.equal(ops.linear_quant(x[:n], torch.from_numpy(quant_order(fmt, raw)), CODES[kind], outs), y[:n])
        assert torch.equal(ops.linear_int8(x[:n], packed, CODES[kind], outs), z[:n])


def test_every_format_read_from_a_file_has_a_kernel_kind():
    """targets/formats.py's list of what --weights gguf reads and decode/static.py's kinds for them name the same
    formats, each with its file bytes and a kernel code."""
    assert set(formats.READ) == set(KINDS) == set(GGUF_BYTES)
    assert set(KINDS.values()) <= set(CODES) and set(formats.HALVES) <= set(formats.READ)


def test_the_memory_floor_counts_the_bytes_the_kernels_read(tiny_dirs):
    """A q8_0 block is 34 bytes in the file and 36 where the kernels read it (its scale widened to float32 once):
    the cost report's floor counts the kernels' bytes, float matrices as they are stored."""
    from dflashkit.decode.static import kernel_bytes
    from dflashkit.measure.curve import CostCurve, cost_report

    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="q8_0")
    blocks = sum(b.raw.shape[0] * b.k // 32 for b in t.blocks.values())
    (count, file), (_, read) = formats.stored(t), formats.stored(t, kernel_bytes)
    assert read - file == 2 * blocks and count == sum(p.numel() for p in t.model.parameters())
    assert cost_report(t, CostCurve([1], [0.01]))["weight_bytes"] == read


def test_a_packed_matrix_of_the_wrong_size_or_format_is_refused():
    ops = native.ops()
    raw = quantize(np.ones((16, 64), np.float32), GGMLQuantizationType.Q8_0)
    packed = torch.from_numpy(quant_order("q8_0", raw))
    with pytest.raises(RuntimeError, match="not a packed 32x64 matrix"):
        ops.linear_quant(torch.randn(1, 64), packed, 0, 32)
    with pytest.raises(RuntimeError, match="format 8 is not"):
        ops.linear_quant(torch.randn(1, 64), packed, 8, 16)


def decoders(folder, weights: str) -> tuple:
    """(target in `weights`, its step, the float32 target holding the same values, its step): a verify of 4 with
    features from layers 1 and 2 each."""
    q = load_target(folder, device="cpu", dtype="float32", weights=weights)
    f = load_target(folder, device="cpu", dtype="float32")
    with torch.no_grad():
        for a, b in zip(q.model.parameters(), f.model.parameters()):
            b.copy_(a)
    return tuple(x for t in (q, f) for x in (t, StaticDecoder(t, 128, kernels="native", compile=False,
                                                                 layer_ids=[1, 2], verify_width=4)))


@pytest.mark.parametrize("fmt", [*formats.QUANTS, *formats.HALVES])
def test_a_quantized_target_decodes_as_its_dequantized_float_copy(tiny_dirs, fmt):
    """The whole step: a target in `fmt` (its blocks in the kernels) against the float32 target holding the same
    values (its own parameters, dequantized): prompt, verify rows and one-token steps bit for bit; and each verify row
    is the quantized step's own one-token step (what speculation's exactness rests on)."""
    from test_static_decoder import prompt, verify_against_steps

    q, dq, f, df = decoders(tiny_dirs["llama"], fmt)
    assert kinds(dq.formats) == {n: {fmt} for n in ("qkv", "o", "gu", "down", "head")} and df.formats == ()
    assert dq.arena.numel() < df.arena.numel() and dq.quants.numel() > 0
    (lq, sq), (lf, sf) = verify_against_steps(dq, prompt(q)), verify_against_steps(df, prompt(f))
    assert torch.equal(lq, lf) and torch.equal(sq, sf) and torch.equal(lq, sq)
    hf = q.model(torch.tensor([prompt(q)])).logits[0, -1]  # every other reader sees the same values
    torch.testing.assert_close(sq[-1], hf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_1-int8", "q4_0-int8", "q8_0-int8"])
def test_an_int8_target_verifies_as_its_own_steps_and_near_its_widened_model(tiny_dirs, fmt):
    """-int8: every matrix through the integer dots, each verify row bit for bit its own one-token step (row
    invariance by construction), and the logits near the same weights widened to float32 (another model, close)."""
    from test_static_decoder import prompt, verify_against_steps

    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights=fmt)
    w = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights=formats.base(fmt))
    d = StaticDecoder(t, 128, kernels="native", compile=False, layer_ids=[1, 2], verify_width=4)
    assert kinds(d.formats) == {n: {fmt} for n in ("qkv", "o", "gu", "down", "head")}
    logits, steps = verify_against_steps(d, prompt(t))
    assert torch.equal(logits, steps)
    widened, _ = verify_against_steps(StaticDecoder(w, 128, kernels="native", compile=False, layer_ids=[1, 2],
                                                    verify_width=4), prompt(w))
    assert not torch.equal(logits, widened)
    torch.testing.assert_close(logits, widened, atol=0.05 * widened.abs().max().item(), rtol=0)
    assert "integer dots" in formats.describe(t) and t.identity()["weights"] == formats.base(fmt)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_1-int8"])
def test_speculation_on_a_quantized_target_is_its_plain_greedy_output(tiny_dirs, fmt):
    """Trees on the quantized steps equal their own plain decoding, token for token, with an oracle drafter whose
    planted mistakes the trees recover."""
    from dflashkit.decode.speculative import tree_drafts
    from helpers import Oracle
    from test_static_decoder import prompt

    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights=fmt)
    ids, layers, B = prompt(t), [1, 2], 4
    plain = generate_ar(StaticBackend(StaticDecoder(t, 128, compile=False)), ids, 40).tokens
    d = StaticDecoder(t, 128, compile=False, layer_ids=layers, trees=True)
    d.warm(timed=1)
    oracle = Oracle(ids + plain + [0] * B, B, t.vocab_size, {len(ids) + k for k in (3, 8, 13)}, layers)
    g = generate_tree(StaticBackend(d), tree_drafts("ddtree-8", oracle, cost=d.tree_cost), ids, 40, method="ddtree-8")
    assert g.tokens == plain and max(g.accepted) >= B


def write_gguf(target, path, types: dict[str, str]):
    """The target's matrices as llama.cpp's converter writes them (q and k rows interleaved per head for its RoPE),
    each in the format `types` names for it (by its name less '.weight', else its kind: 'attn_q', 'token_embd', ...)."""
    cfg, w = target.config, GGUFWriter(str(path), "llama")

    def permute(m, heads):
        return m.reshape(heads, 2, m.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(m.shape)
    tensors = {"token_embd.weight": target.embed_tokens.weight}
    for i, layer in enumerate(target.decoder.layers):
        a, p = layer.self_attn, layer.mlp
        for kind, m in zip(formats.MATRICES.values(), (a.q_proj, a.k_proj, a.v_proj, a.o_proj, p.gate_proj,
                                                       p.up_proj, p.down_proj)):
            tensors[f"blk.{i}.{kind}.weight"] = m.weight
    for name, t in tensors.items():
        m = t.detach().float().numpy()
        if ".attn_q." in name or ".attn_k." in name:
            m = permute(m, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        kind = GGMLQuantizationType[types.get(name.removesuffix(".weight"), types.get(name.split(".")[-2], "q8_0")).upper()]
        data = np.ascontiguousarray(m) if kind == GGMLQuantizationType.F32 else quantize(np.ascontiguousarray(m), kind)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_target(tiny_dirs, tmp_path, types: dict[str, str]):
    """A copy of the tiny llama folder marked as prepared from a GGUF of its own weights."""
    folder = tmp_path / "prepared"
    shutil.copytree(tiny_dirs["llama"], folder)
    source = tmp_path / "tiny.gguf"
    write_gguf(load_target(folder, device="cpu", dtype="float32"), source, types)
    (folder / MARKER).write_text(json.dumps({"name": "tiny", "source": str(source)}))
    return folder


def test_gguf_weights_are_the_files_own_blocks_in_the_targets_order(tiny_dirs, tmp_path):
    """--weights gguf reads each matrix's blocks from the file the target was prepared from, q and k rows put back in
    the order transformers loads them: the values are GGUF's dequantized ones of the target's own weights, and the
    target holds them (auto picks gguf for such a float32 target; a float target stays float)."""
    folder = gguf_target(tiny_dirs, tmp_path, {"attn_q": "q4_1", "attn_k": "q4_1", "attn_v": "q4_1"})
    original = load_target(folder, device="cpu", dtype="float32")
    t = load_target(folder, device="cpu", dtype="float32", weights="auto")
    assert t.weights == "gguf" and t.blocks["0.q"].format == "q4_1" and t.blocks["0.o"].format == "q8_0"
    a = original.decoder.layers[1].self_attn
    for name, fmt, w in (("1.q", "q4_1", a.q_proj.weight), ("1.k", "q4_1", a.k_proj.weight),
                         ("1.o", "q8_0", a.o_proj.weight), ("head", "q8_0", original.lm_head.weight)):
        assert torch.equal(t.blocks[name].dequantized(), dequantized(w, fmt)), name
    assert torch.equal(t.decoder.layers[1].self_attn.k_proj.weight, dequantized(a.k_proj.weight, "q4_1"))
    assert load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="auto").weights == "float"


def test_what_the_formats_cannot_run_is_refused_by_name(tiny_dirs, tmp_path):
    with pytest.raises(DFlashError, match="--weights gguf: target llama was not prepared from a GGUF file"):
        load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="gguf")
    with pytest.raises(DFlashError, match="quantized weights widen to float32.*--dtype float32"):
        load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16", weights="q8_0")
    with pytest.raises(DFlashError, match="--weights 'q5_0': use one of auto, float, gguf, q8_0, q4_0, q4_1"):
        load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="q5_0")
    with pytest.raises(DFlashError, match=r"--weights q8_0: target qwen3_5 \(qwen3_5_text\) is not a dense Llama-type"):
        load_target(tiny_dirs["qwen3_5"], device="cpu", dtype="float32", weights="q8_0")
    with pytest.raises(DFlashError, match="--weights 'bf16-int8': use one of"):
        load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="bf16-int8")
    folder = gguf_target(tiny_dirs, tmp_path, {"ffn_down": "q5_1"})
    with pytest.raises(DFlashError, match=r"tensor blk.0.ffn_down.weight is Q5_1; --weights gguf keeps q8_0"):
        load_target(folder, device="cpu", dtype="float32", weights="gguf")



def test_a_file_mixing_formats_by_layer_and_within_qkv_decodes_as_its_float_copy(tiny_dirs, tmp_path):
    """As llama-quantize's Q4_K_M writes them: q and k in q5_0 with v in q8_0, layer 0's v in q4_0, down in q4_1 in
    one layer and q5_0 in the next (kinds per layer; q, k, v in two runs). Each run is one kernel call; the whole
    step equals the float32 target holding the file's values bit for bit, and through integer dots each verify row
    is its own one-token step."""
    from test_static_decoder import prompt, verify_against_steps

    types = {"attn_q": "q5_0", "attn_k": "q5_0", "attn_v": "q8_0", "blk.0.attn_v": "q4_0", "ffn_down": "q4_1",
             "blk.1.ffn_down": "q5_0"}
    folder = gguf_target(tiny_dirs, tmp_path, types)
    q, dq, f, df = decoders(folder, "gguf")
    runs = dict(dq.formats)
    assert runs["qkv"][0] == ((("q", "k"), "q5_0"), (("v",), "q4_0"))
    assert runs["qkv"][1] == ((("q", "k"), "q5_0"), (("v",), "q8_0"))
    assert runs["down"][0] == ((("down",), "q4_1"),) and runs["down"][1] == ((("down",), "q5_0"),)
    (lq, sq), (lf, sf) = verify_against_steps(dq, prompt(q)), verify_against_steps(df, prompt(f))
    assert torch.equal(lq, lf) and torch.equal(sq, sf) and torch.equal(lq, sq)
    t = load_target(folder, device="cpu", dtype="float32", weights="gguf-int8")
    di = StaticDecoder(t, 128, kernels="native", compile=False, layer_ids=[1, 2], verify_width=4)
    assert dict(di.formats)["qkv"][1] == ((("q", "k"), "q5_0-int8"), (("v",), "q8_0-int8"))
    logits, steps = verify_against_steps(di, prompt(t))
    assert torch.equal(logits, steps)
    torch.testing.assert_close(logits, lq, atol=0.05 * lq.abs().max().item(), rtol=0)


def test_a_files_float_matrices_run_as_floats_beside_its_blocks(tiny_dirs, tmp_path):
    """A converter's f16, bf16 and f32 matrices beside quantized blocks (q and k in f16 with v in q8_0, gate and up in
    bf16, down in f32 then q4_0, the tied head in bf16): each kept at its own bytes, a run of its own; the whole step
    equals the float32 target holding the file's values bit for bit; through -int8 the float matrices stay in the
    float kernel and each verify row is its own one-token step."""
    from test_static_decoder import prompt, verify_against_steps

    types = {"attn_q": "f16", "attn_k": "f16", "attn_v": "q8_0", "attn_output": "f16", "ffn_gate": "bf16",
             "ffn_up": "bf16", "ffn_down": "f32", "blk.1.ffn_down": "q4_0", "token_embd": "bf16"}
    folder = gguf_target(tiny_dirs, tmp_path, types)
    q, dq, f, df = decoders(folder, "gguf")
    runs = dict(dq.formats)
    assert runs["qkv"][0] == ((("q", "k"), "f16"), (("v",), "q8_0")) and runs["gu"][1] == ((("gate", "up"), "bf16"),)
    assert runs["down"][0] == ((("down",), "f32"),) and runs["down"][1] == ((("down",), "q4_0"),)
    assert runs["head"] == (((("head",), "bf16"),),)
    (lq, sq), (lf, sf) = verify_against_steps(dq, prompt(q)), verify_against_steps(df, prompt(f))
    assert torch.equal(lq, lf) and torch.equal(sq, sf) and torch.equal(lq, sq)
    t = load_target(folder, device="cpu", dtype="float32", weights="gguf-int8")
    di = StaticDecoder(t, 128, kernels="native", compile=False, layer_ids=[1, 2], verify_width=4)
    assert dict(di.formats)["qkv"][1] == ((("q", "k"), "f16"), (("v",), "q8_0-int8"))
    logits, steps = verify_against_steps(di, prompt(t))
    assert torch.equal(logits, steps)
    assert "(float matrices widened)" in formats.describe(t)


def test_weights_from_another_gguf_file_are_the_model_served_and_keep_the_targets_drafter(tiny_dirs, tmp_path):
    """--weights FILE.gguf: the target's matrices from a file of it (llama-quantize's Q4_K_M, say): its blocks in
    the kernels, its values in the parameters, another model to caches (lossy) and the same target to a drafter;
    the file the target was prepared from is its own gguf; a missing file is refused by name."""
    import argparse

    from dflashkit.drafter.checkpoint import new_drafter

    folder = gguf_target(tiny_dirs, tmp_path, {"attn_q": "q5_0", "attn_k": "q5_0", "ffn_down": "q4_1"})
    source = tmp_path / "tiny.gguf"
    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights=str(source))
    assert t.weights == str(source.resolve()) and t.blocks["0.q"].format == "q5_0" and formats.lossy(t.weights)
    assert formats.describe(t).startswith("tiny.gguf: q4_1/q5_0/q8_0 (head q8_0)")
    assert torch.equal(t.decoder.layers[0].self_attn.q_proj.weight, t.blocks["0.q"].dequantized())
    f = load_target(tiny_dirs["llama"], device="cpu", dtype="float32")
    assert t.identity()["weights"] == f"file {source.resolve()}" and f.identity()["weights"] == "float"
    assert {k: v for k, v in t.identity().items() if k != "weights"} == {k: v for k, v in f.identity().items() if k != "weights"}
    from dflashkit.drafter.checkpoint import load_drafter, save_drafter

    save_drafter(new_drafter(f, num_layers=1, block_size=4), tmp_path / "drafter", target_identity=f.identity())
    load_drafter(tmp_path / "drafter", target=t)  # a drafter of the float target runs on the file's model
    own = load_target(folder, device="cpu", dtype="float32", weights=str(source) + "-int8")
    assert own.weights == "gguf-int8"
    ap = argparse.ArgumentParser()
    formats.add_weights_option(ap)
    assert ap.parse_args(["--weights", str(source)]).weights == str(source.resolve())
    with pytest.raises(SystemExit):
        ap.parse_args(["--weights", str(tmp_path / "missing.gguf")])
    with pytest.raises(DFlashError, match="no such GGUF file"):
        load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights=str(tmp_path / "missing.gguf"))


@pytest.mark.e2e
@pytest.mark.slow
def test_the_shipped_files_blocks_are_the_prepared_float32_copy(smollm2):
    """The embedded default ships as Q4_1 (its head Q8_0): its blocks, read as they are, hold exactly the values of
    the float32 copy `target prepare` wrote, so --weights gguf decodes the same model."""
    t = load_target("smollm2-135m", device="cpu", dtype="float32", weights="gguf")
    assert {b.format for b in t.blocks.values()} == {"q4_1", "q8_0"}
    for name, m in formats._modules(smollm2).items():
        assert torch.equal(t.blocks[name].dequantized(), m.weight), name


def test_a_quantized_target_is_another_target_to_caches_and_the_same_to_its_drafter(tiny_dirs):
    """A cache extracted at q8_0 records it (its features are another model's) and is refused for the float target;
    a GGUF target's own blocks are its float copy's values, so its identity is the float one's."""
    from dflashkit.targets.model import check_same_target

    f = load_target(tiny_dirs["llama"], device="cpu", dtype="float32")
    q = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="q8_0")
    assert f.identity()["weights"] == "float" and q.identity()["weights"] == "q8_0"
    with pytest.raises(DFlashError, match=r"made with target llama in q8_0 .* \(they differ in weights\)"):
        check_same_target(q.identity(), f.identity(), "cache c", "extract it again")
    check_same_target(f.identity(), {**q.identity(), "weights": None}, "drafter d", "")  # what load_drafter checks


@pytest.mark.parametrize("fmt", ["q8_0", "q8_0-int8"])
def test_a_drafter_on_the_static_backend_reads_the_heads_blocks(tiny_dirs, fmt):
    """In a static session the drafter's full-vocabulary head is the target's head in its blocks (the same kernel as
    the target's head: 30 MB where the float32 copy is 113 for SmolLM2) and its own matrices q8_0 blocks (a copy, its
    call compiled as decoder_for compiles it), restored after; and speculation with the real drafter stays its plain
    greedy output."""
    from dflashkit.decode.speculative import DFlashProposer, generate_chain
    from dflashkit.decode.session import Timer
    from dflashkit.drafter.checkpoint import new_drafter
    from dflashkit.drafter.head import few_rows_linear
    from test_static_decoder import prompt

    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights=fmt)
    torch.manual_seed(0)
    p = DFlashProposer(t, new_drafter(t, num_layers=1, target_layer_ids=[1, 2], block_size=4).eval())
    d = StaticDecoder(t, 128, kernels="native", compile=False, layer_ids=[1, 2], verify_width=4)
    d.drafter_copy = d.drafter_in_blocks(p.drafter)
    d.drafter_call = (p.drafter, p.compiled(*d.drafter_copy))  # what decoder_for sets
    b = StaticBackend(d, p)
    raw = t.blocks["head"].raw
    packed = torch.from_numpy(quant_order(formats.base(fmt), raw, dots=fmt.endswith("-int8")))
    op = native.ops().linear_int8 if fmt.endswith("-int8") else native.ops().linear_quant
    x = torch.randn(3, t.hidden_size)
    feats, block = torch.randn(1, 5, p.drafter.fc.weight.shape[1]), torch.randn(1, 4, t.hidden_size)
    pos = torch.arange(9)[None]
    with b.session(Timer(torch.device("cpu"))):
        assert torch.equal(p.head_linear(x, None), op(x, packed, CODES[formats.base(fmt)], raw.shape[0]))
        copy = p.module  # its matrices in q8_0 blocks (-int8: in the integer dots' order), the float drafter's near
        assert copy is not p.drafter and copy.layers[0].self_attn.q_proj.weight.dtype == torch.uint8
        blocks = copy(feats, block, pos, past_key_values=copy.new_context_kv(), linear=p.linear)
        floats = p.drafter(feats, block, pos, past_key_values=p.drafter.new_context_kv())
        assert not torch.equal(blocks, floats)
        torch.testing.assert_close(blocks, floats, atol=0.05 * floats.abs().max().item(), rtol=0)
        out = generate_chain(b, p, prompt(t), max_new_tokens=24)
    assert p.head_linear is few_rows_linear and p.module is p.drafter
    assert out.tokens == generate_ar(b, prompt(t), max_new_tokens=24).tokens
    assert StaticDecoder(load_target(tiny_dirs["llama"], device="cpu", dtype="float32"), 128, kernels="native",
                         compile=False).drafter_in_blocks(p.drafter) == (None, None)  # a float target's stays float


def test_extraction_at_integer_dots_is_refused_with_the_format_to_extract_at(tiny_dirs, tmp_path, capsys):
    from dflashkit.cli import main

    assert main(["extract", "--target", str(tiny_dirs["llama"]), "--weights", "gguf-int8", "--prompts", "coding-10",
                 "--out", str(tmp_path / "c")]) != 0
    assert "Extract at --weights gguf" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_agreement_is_float32s_top1_along_our_output_teacher_forced(tiny_dirs):
    """bench's agreement for a format quantized here: the float32 target (loaded afresh: the quantized target's own
    parameters hold the quantized values, scrambled here so that reading them shows) predicts each next token of
    our output; the test's own count of its hits and first misses."""
    from dflashkit.measure.bench import float_agreement

    t = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="q4_1-int8")
    f = load_target(tiny_dirs["llama"], device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(0)
    runs = []
    for i in range(3):
        ids = torch.randint(0, 200, (9,), generator=gen).tolist()
        out = f.model(torch.tensor([ids])).logits[0, -1].argmax().item()
        tokens = [out] + torch.randint(0, 200, (7,), generator=gen).tolist()  # the first a float32 hit
        runs.append({"method": "ar", "prompt": f"p{i}", "prompt_ids": ids, "tokens": tokens, "turn_prompts": [ids]})
    with torch.no_grad():
        for w in t.model.parameters():
            w.normal_()
    a = float_agreement(t, runs, {"ar": ("ar", "static")})
    hits, parting = [], {}
    for r in runs:
        seq = r["prompt_ids"] + r["tokens"]
        same = [f.model(torch.tensor([seq[:j]])).logits[0, -1].argmax().item() == seq[j] for j in range(9, len(seq))]
        hits += same
        parting[r["prompt"]] = None if all(same) else same.index(False)
    assert a["against"] == "the float32 target" and a["tokens"] == 24 and a["first_parting"] == parting
    assert a["top1"] == pytest.approx(sum(hits) / 24) and 3 / 24 <= a["top1"] < 1
    assert float_agreement(f, runs, {"ar": ("ar", "static")}) is None  # float32 itself: nothing to state


@pytest.mark.e2e
def test_generate_and_bench_take_weights_and_say_which_ran(tiny_dirs, tmp_path, capsys):
    """--weights on the CLI: the static backend (compiled, as users run it) decodes the quantized blocks through the
    integer dots, bench's header names them, and bench states their agreement with the float32 target: float32's
    top-1 along our plain output, as the test computes it."""
    from dflashkit.cli import main

    base = ["--target", str(tiny_dirs["llama"]), "--dtype", "float32", "--weights", "q4_1-int8", "--engine", "static",
            "--max-new-tokens", "12", "--prompts", "coding-10", "--num-prompts", "2"]
    assert main(["generate", *base, "--method", "ar", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["engine"] == "static"
    assert main(["bench", *base, "--methods", "ar,ngram", "--no-predict", "--out", str(tmp_path / "b")]) == 0
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    said = "q4_1-int8: q4_1 (head q4_1), activations in 8 bits, integer dots"
    assert res["config"]["weights"] == said and res["mismatches"] == []
    report = (tmp_path / "b" / "report.md").read_text()
    assert f"weights {said}" in report and "Agreement with float32 (q4_1-int8 against the float32 target" in report
    f = load_target(tiny_dirs["llama"], device="cpu", dtype="float32")
    hits, parting = [], {}
    for r in [r for r in res["runs"] if r["method"] == "ar"]:
        logits = f.model(torch.tensor([r["prompt_ids"] + r["tokens"]])).logits[0, len(r["prompt_ids"]) - 1: -1]
        same = (logits.argmax(-1) == torch.tensor(r["tokens"])).tolist()
        hits += same
        parting[r["prompt"]] = None if all(same) else same.index(False)
    a = res["agreement"]
    assert (a["top1"], a["tokens"], a["first_parting"]) == (pytest.approx(sum(hits) / len(hits)), len(hits), parting)
    with pytest.raises(SystemExit):
        main(["generate", *base[:4], "--weights", "q5_0", "--prompt", "hi"])
    assert "'q5_0': use one of auto, float, gguf" in capsys.readouterr().err  # quantized here: q8_0, q4_0, q4_1
