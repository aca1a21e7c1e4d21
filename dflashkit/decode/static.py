"""Plain and speculative decoding in the shape of gpt-fast: a static KV cache sized to the run, the Llama step written
out over the target's weights, compiled once per width; why it beats `ar` and why its kernels are our own:
docs/design.md, "The static decoder in detail"."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import gc
import time
import types
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from dflashkit import levels
from dflashkit.decode import native
from dflashkit.errors import DFlashError
from dflashkit.targets.formats import DOTS
from dflashkit.tree import Tree

PREFILL = 32  # prompts go in chunks of 32 tokens
# a tree verify runs on the smallest width that holds it (padded; 24: hybrid-8 with its n-gram branch), never cut
TREE_WIDTHS = (4, 8, 16, 24)
# CPU: inductor's C++ wrapper runs the kernels without Python between them; CUDA: one graph replay a step (the KV and
# weights are marked static addresses so that their in-place writes keep the step in the graph)
COMPILE_OPTIONS = {"cpu": {"cpp_wrapper": True}, "cuda": {"triton.cudagraphs": True}}
LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ALIGN = 64  # elements: every weight in the arena starts on a cache line (and a vector load) boundary
HUGE_PAGE = 2 << 20


def linear_mm(x, w):
    return (x.to(w.dtype) @ w.t()).float()


def linear_reduce(x, w):
    """x @ w.T as one reduction per output, summed in float32 (compiled: one fused kernel per weight)."""
    return (w.float() * x.float()[..., None, :]).sum(-1)


class Geometry(NamedTuple):
    """What a compiled step is specialised on, besides its inputs' sizes: two targets of one geometry share it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    bias: bool  # q, k and v biases (Qwen2)
    qk_norm: bool  # per-head RMS norms of q and k (Qwen3)
    eps: float
    act: str = "silu"  # the MLP's activation (ACTIVATIONS)

    def slots(self) -> list[tuple[str, tuple[int, ...]]]:
        """One layer's weights, in arena order."""
        m = self.matrices()
        s = [("n1", (self.hidden,)), ("n2", (self.hidden,)), ("qkv", m["qkv"])]
        s += [("qkv_bias", (m["qkv"][0],))] if self.bias else []
        s += [("q_norm", (self.head_dim,)), ("k_norm", (self.head_dim,))] if self.qk_norm else []
        return s + [(name, m[name]) for name in ("o", "gu", "down")]

    def layout(self, formats: tuple = ()) -> tuple[dict, int, dict, int]:
        """Offsets in the arena: one layer's {name: (offset, shape)}, the distance between layers, the final
        norm's and head's, and the arena's size. Matrices in `formats` (quantized) live in the other arena."""
        quantized = dict(formats)

        def place(entries, off):
            out = {}
            for name, shape in entries:
                if name not in quantized:
                    out[name] = (off, shape)
                    off += -(-torch.Size(shape).numel() // ALIGN) * ALIGN
            return out, off
        layer, stride = place(self.slots(), 0)
        tail, end = place([("norm", (self.hidden,)), ("head", (self.vocab, self.hidden))], stride * self.layers)
        return layer, stride, tail, end

    def matrices(self) -> dict[str, tuple[int, int]]:
        """The step's matrices: name -> (outputs, inputs)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q),
                "gu": (2 * self.inter, self.hidden), "down": (self.hidden, self.inter), "head": (self.vocab, self.hidden)}

    def parts(self) -> dict[str, tuple[int, int]]:
        """The target's matrices the step fuses (targets/formats.py names): name -> (outputs, inputs)."""
        q, kv, m = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.matrices()
        return {"q": (q, self.hidden), "k": (kv, self.hidden), "v": (kv, self.hidden), "o": m["o"],
                "gate": (self.inter, self.hidden), "up": (self.inter, self.hidden), "down": m["down"],
                "head": m["head"]}

    def quant_layout(self, formats: tuple) -> tuple[dict, int]:
        """The quantized arena: {(matrix, layer; the head's -1): ((byte offset, outs, bytes, kind), ...) one per run
        of formats_of}, layer by layer, then the head; and its size."""
        dims, per = self.parts(), dict(formats)
        offs, off = {}, 0
        for i in [*range(self.layers), -1]:
            for name in [n for n in per if (n == "head") == (i < 0)]:
                entries = []
                for parts, kind in per[name][max(i, 0)]:
                    outs, k = sum(dims[m][0] for m in parts), dims[parts[0]][1]
                    size = outs // 16 * (k // 32) * BLOCK_BYTES[kind.removesuffix(DOTS)]
                    entries.append((off, outs, size, kind))
                    off += -(-size // ALIGN) * ALIGN
                offs[name, i] = tuple(entries)
        return offs, off


def _view(arena, off, shape):
    return arena[off: off + torch.Size(shape).numel()].view(shape)


# the MLP activations the step computes (transformers' ACT2FN names); any other is refused by name
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}
# RoPE types whose frequencies transformers changes past original_max_position_embeddings (per forward): below it
# they are the fixed ones the step is built with, so a run that stays below it is exact and a longer one refused
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _refuse(target, field: str, value, why: str):
    raise DFlashError(f"target {target.name}: config.json field {field} = {value!r}: {why} in the static step; use "
                      "--engine hf for this target")


def geometry_of(target, max_len: int | None = None) -> Geometry:
    """The target's geometry, or a refusal naming the config field the static step does not compute (each held
    against transformers' forward or its refusal in tests/test_static_config.py)."""
    cfg = target.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in LLAMA_TYPES:
        _refuse(target, "model_type", kind, f"only dense-attention Llama-type targets ({', '.join(LLAMA_TYPES)}) run")
    window = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    if window or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        _refuse(target, "sliding_window", cfg.sliding_window, "sliding-window attention is not")
    if target.device.type != "cpu" and not torch.cuda.is_available():
        raise DFlashError(f"target {target.name} is on {target.device}: the static decoder runs on cpu or cuda")
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        _refuse(target, "hidden_act", act, f"the MLP activations are {', '.join(ACTIVATIONS)}; this one is not")
    a, p = target.decoder.layers[0].self_attn, target.decoder.layers[0].mlp
    if getattr(cfg, "mlp_bias", False) or any(x.bias is not None for x in (p.gate_proj, p.up_proj, p.down_proj)):
        _refuse(target, "mlp_bias", True, "MLP biases are not")
    biases = [x.bias is not None for x in (a.q_proj, a.k_proj, a.v_proj)]
    if a.o_proj.bias is not None or len(set(biases)) > 1:
        _refuse(target, "attention_bias", True, "biases on o_proj (or on only some of q, k, v) are not")
    nh = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    if abs(getattr(a, "scaling", head_dim ** -0.5) - head_dim ** -0.5) > 1e-12:
        _refuse(target, "attention scaling", a.scaling, f"scores are scaled by head_dim ** -0.5 = {head_dim ** -0.5:g}")
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope = params.get("rope_type", params.get("type", "default"))
    inv_freq = target.decoder.rotary_emb.inv_freq
    if 2 * inv_freq.numel() != head_dim:
        _refuse(target, "partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None),
                f"RoPE rotates {2 * inv_freq.numel()} of {head_dim} head dimensions, the step all of them; "
                "partial rotation is not")
    if rope in LENGTH_DEPENDENT_ROPE:
        limit = (getattr(cfg, "rope_parameters", None) or {}).get("original_max_position_embeddings") \
            or cfg.max_position_embeddings
        if max_len is not None and max_len > limit:
            _refuse(target, "rope_parameters.rope_type", rope, f"frequencies that change past {limit} positions "
                    f"(original_max_position_embeddings) are not, and this run needs {max_len}")
    return Geometry(len(target.decoder.layers), cfg.hidden_size, nh, cfg.num_key_value_heads, head_dim,
                    cfg.intermediate_size, target.lm_head.weight.shape[0], all(biases),
                    getattr(a, "q_norm", None) is not None, float(cfg.rms_norm_eps), act)


def rope_tables(target, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_len, head_dim] in float32 from the model's own rotary embedding: its frequencies for any RoPE
    type (dynamic and longrope below their switch) and its attention scaling (yarn's)."""
    rot = target.decoder.rotary_emb
    inv = getattr(rot, "original_inv_freq", rot.inv_freq).float()
    f = torch.outer(torch.arange(max_len, device=inv.device).float(), inv)
    emb = torch.cat([f, f], -1)
    scale = float(getattr(rot, "attention_scaling", 1.0))
    return emb.cos() * scale, emb.sin() * scale


def _layer_weights(layer) -> dict:
    a, p = layer.self_attn, layer.mlp
    return dict(
        n1=layer.input_layernorm.weight, n2=layer.post_attention_layernorm.weight,
        qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
        qkv_bias=torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None,
        q_norm=getattr(getattr(a, "q_norm", None), "weight", None),
        k_norm=getattr(getattr(a, "k_norm", None), "weight", None),
        o=a.o_proj.weight, gu=torch.cat([p.gate_proj.weight, p.up_proj.weight]), down=p.down_proj.weight)


def tile_order(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] with its elements in the order linear_tiles reads them (native.cpp): per block of 16 outputs and
    32 inputs, a tile of 16 input pairs x 16 outputs x 2."""
    o, k = w.shape
    return w.reshape(o // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(o, k)


def panel_order(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] in dflashkit::linear's order (native.cpp): panels [in][16] of 16 outputs, the rest as [in][rest]."""
    full = w.shape[0] // 16 * 16
    panels = w[:full].reshape(-1, 16, w.shape[1]).transpose(1, 2)
    return torch.cat([panels.reshape(-1), w[full:].t().reshape(-1)]).reshape(w.shape)


def _empty_arena(numel: int, dtype, device) -> torch.Tensor:
    """An untouched buffer, on a Linux CPU backed by 2 MiB pages where madvise allows (a step streams every weight
    once, and on 4 KiB pages the TLB misses cost a measurable share of it)."""
    nbytes = numel * dtype.itemsize
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    raw = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)  # big enough that malloc maps it fresh
    start = -raw.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError):  # raised where the C library is not glibc
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(-(-nbytes // HUGE_PAGE) * HUGE_PAGE), 14)
    return raw[start: start + nbytes].view(dtype)


# kernel kinds as linear_quant numbers them, and the bytes of a panel's block of 32 inputs (kernels.h); the floats
# (GGUF's F16, BF16 and F32 tensors) are in panel order and have no integer dots (FLOATS)
QUANT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q6_k": 3, "q5_0": 4, "f16": 5, "bf16": 6, "f32": 7}
BLOCK_BYTES = {"q8_0": 64 + 512, "q4_0": 64 + 256, "q4_1": 128 + 256, "q6_k": 128 + 512, "q5_0": 128 + 256,
               "f16": 1024, "bf16": 1024, "f32": 2048}
FLOATS = ("f16", "bf16", "f32")
# a GGUF format's kernel kind (unpack: the same values) and its block's bytes in the file (K-quants: 256 inputs)
KINDS = {"q8_0": "q8_0", "q5_0": "q5_0", "q4_0": "q4_0", "q4_1": "q4_1", "q4_k": "q4_1", "q6_k": "q6_k",
         "f16": "f16", "bf16": "bf16", "f32": "f32"}
GGUF_BYTES = {"q8_0": 34, "q5_0": 22, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q6_k": 210, "f16": 64, "bf16": 64,
              "f32": 128}


def kernel_bytes(blocks) -> int:
    """The bytes the kernels read of a matrix in a GGUF format (targets/formats.py's Blocks): its kind's, which for
    q4_K (read as q4_1) and q6_K are more than the file's."""
    return blocks.raw.shape[0] // 16 * (blocks.k // 32) * BLOCK_BYTES[KINDS[blocks.format]]


@torch.compiler.assume_constant_result  # a fact of the process: the compiled step bakes it in, reading no file
def _vnni() -> bool:
    return levels.vnni()


def quant_op(lib, kind: str):
    """(operator, format code) of a quantized matrix's kind: -int8 the integer dots (through VNNI where the level and
    CPU have it: the same bits), else widened to float32."""
    dots = lib.linear_vnni if _vnni() else lib.linear_int8
    return (dots if kind.endswith(DOTS) else lib.linear_quant), QUANT_CODES[kind.removesuffix(DOTS)]


def _halves(b: np.ndarray) -> np.ndarray:
    """Float16 pairs of bytes [..., 2] as float32 [...]."""
    return b.copy().view(np.float16).astype(np.float32)[..., 0]


def unpack(fmt: str, raw: np.ndarray) -> tuple[str, list[np.ndarray], np.ndarray]:
    """GGUF blocks [outs, bytes] -> (kernel kind, scales [outs, k / 32] each, quants [outs, k]) holding the values
    GGUF's reference dequantizer gives, each weight computed by the kind's kernel as that dequantizer does: q8_0
    d * q; q4_0 d * (q - 8); q5_0 d * (q - 16); q4_1 d * q + m; q4_K d * q - dm as q4_1 with m = -dm (d * q is exact there, so
    one rounding either way); q6_K d * q with d per 16 inputs (scales: inputs 0-15's, then 16-31's); f16, bf16 and
    f32 as they are."""
    outs = raw.shape[0]
    if fmt in FLOATS:  # no scales: each weight's bits as they are
        return fmt, [], raw.view(np.float32 if fmt == "f32" else np.uint16).reshape(outs, -1)
    b = raw.reshape(outs, -1, GGUF_BYTES[fmt])  # [output, block, bytes]
    if fmt == "q8_0":
        return "q8_0", [_halves(b[..., :2])], b[..., 2:].view(np.int8).reshape(outs, -1)
    if fmt in ("q4_0", "q4_1"):
        n = 2 if fmt == "q4_1" else 1
        qs = b[..., 2 * n:]
        return fmt, [_halves(b[..., 2 * i: 2 * i + 2]) for i in range(n)], np.concatenate([qs & 15, qs >> 4], -1).reshape(outs, -1)
    if fmt == "q5_0":  # the fifth bits of a block's 32 quants in one little-endian word, input i's at bit i
        high = (b[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
        qs = b[..., 6:]
        q = np.concatenate([qs & 15, qs >> 4], -1) | (high.astype(np.uint8) << 4)
        return "q5_0", [_halves(b[..., :2])], q.reshape(outs, -1)
    if fmt == "q4_k":  # per 256 inputs d, dmin, 6-bit scales and mins of 8 blocks of 32, then 4 groups of 32 bytes:
        from gguf.quants import Q4_K  # a group's low nibbles block 2g, its high ones 2g + 1

        sc, m = (x.reshape(outs, -1, 8).astype(np.float32) for x in Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12)))
        d = (_halves(b[..., 0:2])[..., None] * sc).reshape(outs, -1)
        dm = (_halves(b[..., 2:4])[..., None] * m).reshape(outs, -1)
        qs = b[..., 16:].reshape(outs, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        return "q4_1", [d, -dm], (qs & 15).reshape(outs, -1)
    if fmt == "q6_k":  # per 256 inputs low nibbles, 2 high bits, 16 int8 scales, d
        n = outs * b.shape[1]
        ql = b[..., :128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[..., 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((ql & 15).reshape(n, -1, 32) | ((qh & 3).reshape(n, -1, 32) << 4)).astype(np.int8) - np.int8(32)
        d = (_halves(b[..., 208:210]).reshape(n, 1) * b[..., 192:208].reshape(n, 16).view(np.int8).astype(np.float32))
        d = d.reshape(outs, -1)  # [output, block of 16]
        return "q6_k", [d[:, 0::2], d[:, 1::2]], q.reshape(outs, -1)
    raise DFlashError(f"GGUF format {fmt}: the static backend reads {', '.join(KINDS)}; use --weights float")


def pack(kind: str, scales: list[np.ndarray], q: np.ndarray, dots: bool = False) -> np.ndarray:
    """A kind's scales and quants in the kernels' order (kernels.h): per panel of 16 outputs and block of 32 inputs,
    the float32 scales, then the quants. linear_quant's: [32 inputs][16 outputs], two 4-bit ones a byte (even low);
    linear_int8's (`dots`): by fours of inputs per output, 8-bit [8][16][4], 4-bit [4][16][4] with byte t of group g
    holding input 8g + t low and 8g + 4 + t high. The floats (FLOATS): panel_order's."""
    outs = q.shape[0]
    if kind in FLOATS:  # the float kernel's panel order
        bits = torch.from_numpy(q.view(np.int32 if q.itemsize == 4 else np.int16))
        return np.ascontiguousarray(panel_order(bits).numpy()).reshape(-1).view(np.uint8)
    parts = [x.reshape(outs // 16, 16, -1).transpose(0, 2, 1) for x in scales]  # each [panel, block, 16]
    q = q.view(np.uint8).reshape(outs // 16, 16, -1, 32)  # [panel, output, block, 32 inputs]
    if kind == "q5_0":  # the fifth bits, a 32-bit word per output: input i's at bit i, or (dots) byte t holding
        high = (q >> 4).astype(np.uint32)  # input 8g + t's at bit 2g and 8g + 4 + t's at bit 2g + 1
        if dots:
            g = high.reshape(*high.shape[:3], 4, 2, 4) << (2 * np.arange(4, dtype=np.uint32)[:, None, None] +
                                                          np.arange(2, dtype=np.uint32)[:, None])
            words = g.sum((3, 4)) << (8 * np.arange(4, dtype=np.uint32))
        else:
            words = high << np.arange(32, dtype=np.uint32)
        parts.append(words.sum(-1, dtype=np.uint32).transpose(0, 2, 1))
        q = q & 15
    wide = kind in ("q8_0", "q6_k")  # a byte a quant
    if dots and wide:
        q = q.reshape(*q.shape[:3], 8, 4)
    elif dots:
        q = q.reshape(*q.shape[:3], 4, 2, 4)
        q = q[..., 0, :] | (q[..., 1, :] << 4)
    elif not wide:
        q = q[..., 0::2] | (q[..., 1::2] << 4)  # pairs of inputs: the even one low
    q = q.transpose(0, 2, 3, 1, 4) if dots else q.transpose(0, 2, 3, 1)  # [panel, block, ..., 16 outputs, ...]
    flat = [np.ascontiguousarray(x, dtype=x.dtype).reshape(*x.shape[:2], -1).view(np.uint8) for x in (*parts, q)]
    return np.concatenate(flat, -1).reshape(-1)


def quant_order(fmt: str, raw: np.ndarray, dots: bool = False) -> np.ndarray:
    """GGUF blocks [outs, bytes] of format `fmt` in its kernel kind's order (unpack, then pack)."""
    return pack(*unpack(fmt, raw), dots=dots)


# the step's fused matrices and the target's matrices (targets/formats.py names) each concatenates
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gu": ("gate", "up"), "down": ("down",)}


def formats_of(target) -> tuple:
    """((matrix, per layer), ...) of a target whose matrices are quantized (targets/formats.py), () for float ones:
    for each of the step's matrices (the head: one entry) and layer, its parts in runs that share a kernel kind,
    ((parts, kind), ...), each run one call of its kernel (a Q4_K_M file mixes q5_0 and q8_0 in q, k, v, and q4_K
    and q6_K in down across layers). -int8 kinds for integer dots."""
    blocks = getattr(target, "blocks", None)
    if not blocks:
        return ()
    dots = DOTS if target.weights.endswith(DOTS) else ""  # integer dots: another kernel, and the bytes in its order

    def runs(names: tuple, prefix: str) -> tuple:
        out = []
        for m in names:
            kind = KINDS[blocks[prefix + m].format]
            kind += "" if kind in FLOATS else dots  # a float matrix has no integer dots: the float kernel's sums
            out = out[:-1] + [(out[-1][0] + (m,), kind)] if out and out[-1][1] == kind else out + [((m,), kind)]
        return tuple(out)
    layers = range(len(target.decoder.layers))
    return tuple((name, tuple(runs(parts, f"{i}.") for i in layers)) for name, parts in FUSED.items()) + \
        (("head", (runs(("head",), ""),)),)


def pack_quant(target, geo: Geometry, formats: tuple) -> torch.Tensor:
    """The quantized matrices in their kernel's order, one byte buffer (quant_layout; empty without any)."""
    if not formats:
        return torch.zeros(0, dtype=torch.uint8)
    offs, size = geo.quant_layout(formats)
    arena = _empty_arena(size, torch.uint8, target.device)
    per = dict(formats)
    for (name, i), entries in offs.items():
        for (parts, kind), (off, _, nbytes, _) in zip(per[name][max(i, 0)], entries):
            unpacked = [unpack(target.blocks[m if i < 0 else f"{i}.{m}"].format,
                               target.blocks[m if i < 0 else f"{i}.{m}"].raw) for m in parts]
            scales = [np.concatenate(x) for x in zip(*(u[1] for u in unpacked))]
            packed = pack(kind.removesuffix(DOTS), scales, np.concatenate([u[2] for u in unpacked]),
                          dots=kind.endswith(DOTS))
            arena[off: off + nbytes].copy_(torch.from_numpy(packed))
    return arena


def pack_weights(target, geo: Geometry, kernels: str = "mm", formats: tuple = ()) -> torch.Tensor:
    """The target's weights in the step's layout, one buffer (q, k, v and gate, up concatenated; for our kernels each
    matrix in the order they read it). Matrices in `formats` are left to pack_quant."""
    layer, stride, tail, size = geo.layout(formats)
    arena = _empty_arena(size, target.dtype, target.device)
    order = {"tiles": tile_order, "native": panel_order}.get(kernels)

    def put(off, shape, w):
        _view(arena, off, shape).copy_(order(w) if order and len(shape) == 2 else w)
    for i, lw in enumerate(_layer_weights(m) for m in target.decoder.layers):
        for name, (off, shape) in layer.items():
            put(i * stride + off, shape, lw[name])
    for name, w in (("norm", target.final_norm.weight), ("head", target.lm_head.weight)):
        if name in tail:
            put(*tail[name], w)
    return arena


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def attend_reduce(q, k, v, mask, kvh):
    """Softmax attention over the whole static cache (grouped heads, float32), its products as reductions: a query's
    output then does not depend on how many share the step (SDPA's CPU kernel is slow on a long static cache)."""
    (_, nh, n, hd), g = q.shape, q.shape[1] // kvh
    qg = q.reshape(1, kvh, g * n, 1, hd)
    s = (qg * k[:, :, None]).sum(-1) * hd ** -0.5  # [1, kvh, g*n, L]
    s = s.view(1, kvh, g, n, -1).masked_fill(~mask, float("-inf"))
    o = (s.softmax(-1).view(1, kvh, g * n, -1, 1) * v[:, :, None]).sum(-2)
    return o.reshape(1, nh, n, hd)


def attend_mm(q, k, v, mask, kvh):
    """The same attention with batched matrix products: for a prompt's 32-token chunk."""
    (_, nh, n, hd), g = q.shape, q.shape[1] // kvh
    s = (q.reshape(1, kvh, g * n, hd) @ k.transpose(-1, -2)) * hd ** -0.5
    s = s.view(1, kvh, g, n, -1).masked_fill(~mask, float("-inf"))
    return (s.softmax(-1).view(1, kvh, g * n, -1) @ v).reshape(1, nh, n, hd)


def native_op(name: str):
    """`name` of the chosen level's build of native.cpp. Each row's sums have one order whatever rows share the call,
    so a verify row is the one-token step's bit for bit; attend reads slots 0..start-1, then the row's own path."""
    return lambda *args: getattr(native.ops(), name)(*args)


linear_native, linear_tiles, attend_native = native_op("linear"), native_op("linear_tiles"), native_op("attend")


# a step's kernels by name: (linear, attention); ours (BY_PATH, on a CPU) attend by path, the others by mask
KERNELS = {"mm": (linear_mm, attend_mm), "reduce": (linear_reduce, attend_reduce)}
BY_PATH = ("native", "tiles")


def cpu_kernels(target, geo: Geometry) -> str:
    """`tiles` where they run and pay (bf16 weights whose shapes tile, a CPU with AMX at level v4), else `native`."""
    tiled = all(o % 16 == 0 and k % 32 == 0 for o, k in geo.matrices().values())  # inputs in 32s, outputs in 16s
    return "tiles" if native.tiles_run_here() and target.dtype == torch.bfloat16 and tiled else "native"


def step(arena, quants, embed, rope, kv, ids, pos, slots, path, keep, span, *, geo: Geometry, kernels: str,
         ops: str | None, layer_ids, formats: tuple = ()):
    """The Llama step as a pure function of its inputs (decoders of one geometry share its compile): ids [n] at pos [n],
    K and V written to `kv` at `slots` [n] -> logits [k, V] of the `keep` rows (and `layer_ids`' states [1, n, F]). A
    row attends, on our kernels, to slots 0..pos[0]-1 then its `path` [n, W]; else to the `span` slots up to it."""
    layout, stride, tail, _ = geo.layout(formats)
    qlayout = geo.quant_layout(formats)[0] if formats else {}
    lib = getattr(torch.ops, ops) if kernels in BY_PATH else None  # ours: the build under torch.ops.`ops`
    linear, attend = KERNELS.get(kernels) or (lib.linear_tiles if kernels == "tiles" else lib.linear, lib.attend)

    def lin(x, i, name, w):  # a float matrix from the arena, or a quantized one's runs of bytes (layer i; -1: the head)
        if (name, i) not in qlayout:
            return linear(x, w[name])
        ys = []
        for off, outs, size, kind in qlayout[name, i]:
            op, code = quant_op(lib, kind)
            ys.append(op(x, quants[off: off + size], code, outs))
        return ys[0] if len(ys) == 1 else torch.cat(ys, -1)
    n, eps, nh, kvh, hd = ids.shape[0], geo.eps, geo.heads, geo.kv_heads, geo.head_dim
    x = F.embedding(ids, embed)[None].float()
    cos, sin = rope[0][pos][None, None], rope[1][pos][None, None]
    S = span.shape[0]
    mask = span[None, :] <= pos[:, None]
    captured = {}
    for i in range(geo.layers):
        w = {name: _view(arena, i * stride + off, shape) for name, (off, shape) in layout.items()}
        qkv = lin(_rms(x, w["n1"], eps), i, "qkv", w)
        if geo.bias:
            qkv = qkv + w["qkv_bias"].float()
        q, k, v = qkv.split([nh * hd, kvh * hd, kvh * hd], -1)
        q, k = q.view(1, n, nh, hd), k.view(1, n, kvh, hd)
        if geo.qk_norm:
            q, k = _rms(q, w["q_norm"], eps), _rms(k, w["k_norm"], eps)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        kv[0][i].index_copy_(2, slots, k)
        kv[1][i].index_copy_(2, slots, v.view(1, n, kvh, hd).transpose(1, 2))
        o = attend(q, kv[0][i], kv[1][i], pos[:1], path) if kernels in BY_PATH else \
            attend(q, kv[0][i][:, :, :S], kv[1][i][:, :, :S], mask, kvh)
        x = x + lin(o.transpose(1, 2).reshape(1, n, nh * hd), i, "o", w)
        g, u = lin(_rms(x, w["n2"], eps), i, "gu", w).chunk(2, -1)
        x = x + lin(ACTIVATIONS[geo.act](g) * u, i, "down", w)
        if layer_ids is not None and i in layer_ids:
            captured[i] = x
    ends = {k: _view(arena, *tail[k]) for k in tail}
    logits = lin(_rms(x.index_select(1, keep), ends["norm"], eps), -1, "head", ends)[0]
    return (logits, torch.cat([captured[i] for i in layer_ids], -1)) if layer_ids is not None else logits


@functools.cache
def compiled_step(geo: Geometry, kernels: str, layer_ids: tuple | None, device_type: str = "cpu", width: int = 0,
                  ops: str | None = None, formats: tuple = ()):
    """`step` for one geometry and width, compiled on its first call and shared by every decoder of it; each width is
    its own code object, as dynamo keeps 8 compiled entries per code."""
    code = step.__code__.replace(co_name=f"step_{width}")  # its own code object: dynamo counts entries per code
    f = types.FunctionType(code, step.__globals__, f"step_{width}")
    f.__kwdefaults__ = {"geo": geo, "kernels": kernels, "ops": ops, "layer_ids": layer_ids, "formats": formats}
    return torch.compile(f, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS[device_type])


def chain_path(pos: torch.Tensor) -> torch.Tensor:
    """[n, n] paths of a chain at positions pos: row i reads pos[0..i] (then -1)."""
    n = pos.shape[0]
    return torch.where(torch.ones(n, n, dtype=torch.bool, device=pos.device).tril(), pos[None, :], -1)


class StaticDecoder:
    """One target, one run length: `forward`, `prefill`, `verify`, `verify_tree` write the KV of the tokens given and
    return logits. Rejected positions need no crop: a row sees only the slots before it and its own path."""

    def __init__(self, target, max_len: int, kernels: str = "auto", compile: bool = True,
                 layer_ids: list[int] | None = None, verify_width: int | None = None, trees: bool = False,
                 level: str | None = None, tune: str | None = None):
        geo = geometry_of(target, max_len)
        if verify_width is not None and not 1 < verify_width < PREFILL:
            raise DFlashError(f"verify width {verify_width}: the static decoder verifies 2..{PREFILL - 1} tokens")
        if verify_width is not None and layer_ids is None:
            raise DFlashError("static decoder: a verify step returns the drafter's features; give layer_ids with it")
        if kernels == "auto":  # our C++ kernels on a CPU (native.cpp), inductor's reductions elsewhere
            kernels = cpu_kernels(target, geo) if target.device.type == "cpu" else "reduce"
        if kernels not in (*KERNELS, *BY_PATH):
            raise DFlashError(f"kernels {kernels!r}: use auto or one of {', '.join((*KERNELS, *BY_PATH))}")
        if trees and kernels not in BY_PATH:
            raise DFlashError(f"static decoder: tree verify needs kernels 'native' or 'tiles' (a CPU target), not "
                              f"{kernels!r}")
        if kernels == "tiles" and cpu_kernels(target, geo) != "tiles":
            raise DFlashError(f"kernels 'tiles' need bf16 weights whose shapes divide into tiles (inputs in 32s, "
                              f"outputs in 16s) and a CPU with AMX (amx_bf16 in /proc/cpuinfo); target "
                              f"{target.name} ({target.dtype}) here: use kernels='native' (or auto)")
        if kernels in BY_PATH and target.device.type != "cpu":
            raise DFlashError(f"kernels {kernels!r} run on a CPU; target {target.name} is on {target.device}: "
                              "use kernels='reduce' (or auto)")
        ops = native.load(level, tune) if kernels in BY_PATH else None  # the chosen level, or `level` (tests)
        dev = target.device
        self.target, self.max_len, self.kernels, self.ops, self.geo = target, max_len, kernels, ops, geo
        self.formats = formats_of(target) if kernels == "native" else ()  # quantized: in their blocks (kernels.h)
        self.arena, self.embed = pack_weights(target, geo, kernels, self.formats), target.embed_tokens.weight
        self.quants = pack_quant(target, geo, self.formats)
        self.rope = tuple(t.to(dev) for t in rope_tables(target, max_len))
        # activations and KV in float32 (a bf16 rounding that inductor keeps or fuses away per width would part verify
        # rows from the one-token step); one buffer per layer (a stacked one is copied whole); one slot spare, so a
        # prompt chunk's symbolic span never equals the buffer
        self.kv = tuple([torch.zeros(1, geo.kv_heads, max_len + 1, geo.head_dim, device=dev)
                         for _ in range(geo.layers)] for _ in "kv")
        self.full_span = torch.arange(max_len, device=dev)
        self.first = torch.zeros(1, dtype=torch.long, device=dev)  # a one-token step keeps its only row
        # per width, its kernels and whether it returns features: a prompt's chunks use matrix products; a verify the
        # one-token step's kernels, so each of its rows is bit for bit what plain decoding computes
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        ids = tuple(self.layer_ids) if self.layer_ids is not None else None
        kinds = {1: (kernels, ids if trees else None), PREFILL: (kernels if kernels in BY_PATH else "mm", ids)}
        widths = ((verify_width,) if verify_width is not None else ()) + (TREE_WIDTHS if trees else ())
        kinds |= {w: (kernels, ids) for w in widths}
        self.verify_width, self.trees = verify_width, trees
        self.tree_widths = (1,) + TREE_WIDTHS if trees else ()
        if dev.type == "cuda":
            for t in [self.arena, *self.kv[0], *self.kv[1]]:
                torch._dynamo.mark_static_address(t)
        self.steps = {w: compiled_step(geo, k, f, dev.type, w, ops, self.formats) if compile
                      else functools.partial(step, geo=geo, kernels=k, ops=ops, layer_ids=f, formats=self.formats)
                      for w, (k, f) in kinds.items()}
        self.compile_s, self.step_s = {}, {}  # seconds per width: the first call's; a step's median, by warm()
        self.drafter_call = (None, None)  # (drafter, its compiled call), set by decoder_for
        self.drafter_copy = (None, None)  # (a copy of it in blocks, their linear): drafter_in_blocks

    def head_linear(self):
        """The head in its blocks, for a drafter's few rows of logits over the full vocabulary: its float32 copy reads
        113 MB a call for SmolLM2's 49k tokens, the q8_0 blocks 30 (a draft's rounding only moves the drafts, which
        the verify checks). None where the head is float."""
        if not self.formats:
            return None
        [(off, outs, size, kind)] = self.geo.quant_layout(self.formats)[0]["head", -1]
        (op, code), w = quant_op(getattr(torch.ops, self.ops), kind), self.quants[off: off + size]
        return lambda x, _: op(x.float(), w, code, outs)

    def drafter_in_blocks(self, drafter):
        """On a quantized target, a copy of a DFlash drafter whose matrices (fc and its layers' projections) are q8_0
        blocks for these kernels (-int8 where the target's are), and the linear that reads them: its float32 matrices
        are a third of a one-token step's bytes on a 135M target, read at every draft. Another drafter numerically
        (its drafts move by rounding; the verify keeps the output exact). (None, None) on a float target."""
        if not self.formats or drafter.config.arch != "dflash":
            return None, None
        from dflashkit.drafter.head import few_rows_linear
        from dflashkit.targets.formats import quantize

        kind = "q8_0" + (DOTS if self.target.weights.endswith(DOTS) else "")
        op, code = quant_op(getattr(torch.ops, self.ops), kind)
        module = copy.deepcopy(drafter)
        for name, m in module.named_modules():
            last = name.rsplit(".", 1)[-1]
            if isinstance(m, torch.nn.Linear) and (name == "fc" or last.endswith("_proj")) and m.bias is None and \
                    m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 32 == 0:
                packed = quant_order("q8_0", quantize(m.weight, "q8_0").raw, dots=kind.endswith(DOTS))
                m.weight = torch.nn.Parameter(torch.from_numpy(packed).view(m.weight.shape[0], -1), requires_grad=False)

        def linear(x, w, bias=None):  # a matrix in blocks holds its outputs as its rows
            if w.dtype != torch.uint8:
                return few_rows_linear(x, w, bias)
            return op(x.float(), w, code, w.shape[0]).to(x.dtype)
        return module, linear

    def _check_room(self, pos: int, n: int) -> None:
        if pos + n > self.max_len:
            raise DFlashError(f"static decoder: position {pos + n} is past its length {self.max_len}; "
                              "build it with a larger max_len (prompt + new tokens + a verify)")

    @torch.no_grad()
    def forward(self, ids: list[int], pos: int) -> torch.Tensor:
        """Logits [V] of the last of `ids` placed at pos..pos+len-1 (a prompt, or one token)."""
        if len(ids) == 1:
            self._check_room(pos, 1)
            dev = self.embed.device
            p = torch.tensor([pos], device=dev)
            out = self._call(1, torch.tensor(ids, device=dev), p, self.first, path=p[:, None].clone())
            return (out[0] if self.layer_ids is not None and self.trees else out)[0]  # features with tree widths
        out = self.prefill(ids, pos)
        return out[0] if self.layer_ids is not None else out

    @torch.no_grad()
    def prefill(self, ids: list[int], pos: int = 0):
        """A prompt in chunks of PREFILL, the last one padded (the next write replaces those slots): the last token's
        logits [V] (and with layer_ids, every position's features [1, len(ids), F])."""
        self._check_room(pos, len(ids))
        dev, feats = self.embed.device, []
        for s in range(0, len(ids), PREFILL):
            chunk = ids[s:s + PREFILL]
            padded = torch.tensor(chunk + [0] * (PREFILL - len(chunk)), device=dev)
            p = torch.arange(pos + s, pos + s + PREFILL, device=dev).clamp(max=self.max_len - 1)
            out = self._call(PREFILL, padded, p, torch.tensor([len(chunk) - 1], device=dev),
                             min(self.max_len, pos + s + PREFILL))
            if self.layer_ids is not None:
                out, f = out
                feats.append(f[:, :len(chunk)])
        return (out[0], torch.cat(feats, 1)) if self.layer_ids is not None else out[0]

    @torch.no_grad()
    def verify(self, block: torch.Tensor, pos: int):
        """A block of verify_width tokens at pos..: logits of every row [B, V] and their features [1, B, F]."""
        B = self.verify_width
        if B is None or block.shape[0] != B:
            raise DFlashError(f"static decoder: built to verify {B} tokens, given {block.shape[0]}")
        self._check_room(pos, B)
        p = torch.arange(pos, pos + B, device=block.device)
        return self._call(B, block, p, torch.arange(B, device=block.device), path=chain_path(p))

    def tree_width(self, nodes: int) -> int:
        """The compiled width a tree of `nodes` (root included) is verified on."""
        w = next((w for w in self.tree_widths if w >= nodes), None)
        if w is None:
            raise DFlashError(f"static decoder: a tree of {nodes} nodes is past its widest verify "
                              f"({max(self.tree_widths, default=0)}); cut it (tree_cost) or build with trees=True")
        return w

    @torch.no_grad()
    def verify_tree(self, tree, start: int):
        """Every node of `tree` (root at `start`) in one flat step: node i at slot start + i, position start + depth,
        sees the committed slots then its ancestors', as a one-token step. Returns (logits [n, V], features or None)."""
        n = len(tree)
        w = self.tree_width(n)
        self._check_room(start, w)
        dev = self.embed.device
        path = torch.full((w, w), -1, dtype=torch.long)
        path[:, 0] = start  # pad rows see the root only
        for i, seen in enumerate(tree.ancestor_mask()):  # parents precede children: index order is depth order
            nodes = seen.nonzero()[:, 0]
            path[i, : len(nodes)] = start + nodes
        ids, pos = F.pad(tree.tokens, (0, w - n)), start + F.pad(tree.depths, (0, w - n))  # pad rows: token 0 at start
        out = self._call(w, ids.to(dev), pos.to(dev), torch.arange(w, device=dev), None,
                         torch.arange(start, start + w, device=dev), path.to(dev))
        return (out[:n], None) if self.layer_ids is None else (out[0][:n], out[1][:, :n])

    @torch.no_grad()
    def commit(self, start: int, accepted: list[int]) -> None:
        """After a tree verify: the accepted nodes (depth order, root excluded) move to where plain decoding writes them."""
        moved = [(start + node, start + depth) for depth, node in enumerate(accepted, start=1) if node != depth]
        if not moved:
            return
        src, dst = (torch.tensor(x, device=self.embed.device) for x in zip(*moved))
        for cache in self.kv[0] + self.kv[1]:
            cache.index_copy_(2, dst, cache.index_select(2, src))

    def tree_cost(self, nodes: int) -> float:
        """Seconds of a verify of `nodes` (its width's measured step); infinite past the widest width."""
        fits = self.tree_widths and nodes <= self.tree_widths[-1]
        return self.step_s[self.tree_width(nodes)] if fits else float("inf")

    @torch.no_grad()  # as every call after it: grad mode is in dynamo's guards, so a warm-up with it on compiles twice
    def warm(self, timed: int = 5) -> None:
        """Compile every width now, then time each `timed` times after up to 200 slots of context (a wide tree costs
        more at a real context than at none): the medians are `step_s`, what tree_cost reads."""
        for w in self.steps:
            if w not in self.compile_s:
                self._call(w, *self._probe_args(w, 0))
        self.step_s.update(self.time_widths(200, timed))

    def _probe_args(self, w: int, depth: int) -> tuple:
        dev = self.embed.device
        p = torch.arange(depth, depth + w, device=dev)
        return (torch.zeros(w, dtype=torch.long, device=dev), p,
                torch.zeros(1 if w in (1, PREFILL) else w, dtype=torch.long, device=dev), depth + w, None, chain_path(p))

    @torch.no_grad()
    def time_widths(self, depth: int = 0, timed: int = 5) -> dict[int, float]:
        """Median seconds of each verify width's step with up to `depth` slots before it (writes slots from there on).
        The widths take turns, so that a shared host's drift falls on all alike."""
        depth = max(0, min(depth, self.max_len - 2 * max(self.steps)))
        args = {w: self._probe_args(w, depth) for w in self.steps if w != PREFILL and timed}
        times = {w: [] for w in args}
        with collector_paused():  # as the loops run it
            for _ in range(timed):
                for w in args:
                    t0 = time.perf_counter()
                    self._call(w, *args[w])
                    times[w].append(time.perf_counter() - t0)
        return {w: sorted(t)[len(t) // 2] for w, t in times.items()}

    def _call(self, width: int, ids, pos, keep, span: int | None = None, slots=None, path=None):
        """One step of `width` tokens. A prompt's chunk reads `span` slots (compiled symbolic), the other steps the whole
        cache (reduce) or their `path` after pos[0] (ours); `slots`: where K and V go (default: their positions)."""
        slots = pos.clone() if slots is None else slots  # never the same tensor as pos: dynamo guards on aliasing
        span_slots = self.full_span
        if width == PREFILL:
            span_slots = torch.arange(span, device=ids.device)
            torch._dynamo.mark_dynamic(span_slots, 0, min=2, max=self.max_len)
            # a prompt chunk attends by mask, or on our kernels (which read weights mm cannot) as a chain
            path = chain_path(pos) if self.kernels in BY_PATH else pos[:, None]
        args = (self.arena, self.quants, self.embed, self.rope, self.kv, ids, pos, slots, path, keep, span_slots)
        if width in self.compile_s:  # the hot path: nothing timed
            return self.steps[width](*args)
        t0 = time.perf_counter()
        out = self.steps[width](*args)  # the first call compiles (inductor's cache makes a later process quick)
        self.compile_s[width] = time.perf_counter() - t0
        return out


def decoder_for(session, length: int, proposer=None, trees: bool = False) -> StaticDecoder:
    """The session's decoder, shared by every method and compiled (with the drafter's call) before it is returned;
    rebuilt when a turn needs more slots, rounded up to 512 (2048 for our CPU kernels: fewer dynamo entries)."""
    target, log = session.target, session.log or (lambda message: None)
    length += max(proposer.block_size if proposer is not None else 0, TREE_WIDTHS[-1] if trees else 0)
    d = session.static
    if d is None or d.max_len < length or trees and not d.trees or proposer is not None and (
            d.layer_ids != proposer.layer_ids or d.verify_width != proposer.block_size):  # or another drafter
        trees = trees or (d is not None and d.trees)
        drafting = {} if proposer is None else {"layer_ids": proposer.layer_ids, "verify_width": proposer.block_size}
        unit = 2048 if target.device.type == "cpu" else 512  # native kernels on a CPU
        d = session.static = StaticDecoder(target, max(unit, -(-length // unit) * unit), trees=trees, **drafting)
        log(f"compiling the static decoder for {d.max_len} positions (about 1.5 min the first time on 2 cores "
            "with native kernels, 3 without; seconds once inductor's cache holds it)")
        d.warm()
        t0 = time.perf_counter()
        if hasattr(proposer, "compiled"):  # a test's oracle proposer has no drafter to compile
            d.drafter_copy = d.drafter_in_blocks(proposer.drafter)
            d.drafter_call = (proposer.drafter, proposer.compiled(*d.drafter_copy) if d.drafter_copy[0] is not None
                              else proposer.compiled())  # this backend's, run in its session
        log(f"compiled in {sum(d.compile_s.values()) + time.perf_counter() - t0:.0f} s")
    return d


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off for one decode loop: a loaded target is ~500k tracked objects, collections
    cost a visible share of a step, and the loop makes no cyclic garbage."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


class StaticBackend:
    """Our compiled step as a decode/session.Backend; in its session the drafter runs as compiled with the decoder."""

    engine = "static"
    path_cost = None  # trees are verified flat

    def __init__(self, decoder: StaticDecoder, proposer=None):
        self.d, self.target, self.proposer = decoder, decoder.target, proposer
        self.widest, self.cost = max(decoder.tree_widths, default=decoder.verify_width or 1), decoder.tree_cost

    def session(self, timer):
        stack = contextlib.ExitStack()
        stack.enter_context(collector_paused())
        drafter, call = self.d.drafter_call
        if call is not None and getattr(self.proposer, "drafter", None) is drafter:  # compiled with the decoder
            full = self.proposer.head.vocab_ids is None  # a draft vocabulary's head is its own rows, float
            stack.enter_context(self.proposer.calling(call, self.d.head_linear() if full else None,
                                                      *self.d.drafter_copy))
        return stack

    def verified_tokens(self, tree) -> int:
        return len(tree)

    def prefill(self, ids: list[int], layer_ids):
        d = self.d
        if layer_ids is not None and list(layer_ids) != d.layer_ids:
            raise DFlashError(f"static decoder built for layers {d.layer_ids}; the drafter needs {list(layer_ids)}")
        out = d.prefill(ids)
        logits, feats = out if d.layer_ids is not None else (out, None)
        self.start = len(ids)
        return logits[None], feats

    def verify(self, tokens: torch.Tensor, tree=None) -> torch.Tensor:
        d, n = self.d, len(tokens)
        self.tree, self.feats = tree, None
        if tree is None and n == 1:
            return d.forward(tokens.tolist(), self.start)[None]
        if tree is None and n == d.verify_width:
            logits, self.feats = d.verify(tokens.to(d.embed.device), self.start)
            return logits
        if not d.trees:
            raise DFlashError(f"static decoder built for block {d.verify_width}; the drafter needs block {n}"
                              if tree is None else "static decoder: built without tree widths; build it with trees=True")
        if tree is None:  # a chain of another width runs as a tree
            tree = self.tree = Tree.chain(tokens)
        logits, self.feats = d.verify_tree(tree, self.start)
        return logits

    def commit(self, keep: list[int]):
        if self.tree is not None:
            self.d.commit(self.start, keep[1:])
        self.start += len(keep)
        return self.feats[:, keep] if self.feats is not None else None

