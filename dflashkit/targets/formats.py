"""Weight formats: a float dtype, or GGUF's (q8_0, q4_0, q4_1, bf16, f16 ...) kept for the static backend's kernels and
dequantized into the target's parameters for all else, so every reader computes one model (docs/design.md, "Weight
formats"). `gguf` takes the prepared-from file's own blocks; the others quantize a float target (another model)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dflashkit.errors import DFlashError
from dflashkit.targets.registry import MARKER

if TYPE_CHECKING:  # torch loads with a target, not with the CLI's parser
    import torch

QUANTS = ("q8_0", "q4_0", "q4_1")
HALVES = ("bf16", "f16")  # 16-bit floats, rounded here from float32 as GGUF's converter does, kept at 2 bytes
# what --weights gguf reads from a file (decode/static.py unpacks each into a kernel's kind): llama-quantize's
# Q4_K_M, for one, writes q4_K and q6_K where a row divides into 256s, else q5_0 and q8_0; a converter's --outtype
# f16, bf16 or f32 file, its floats
READ = ("q8_0", "q5_0", "q4_0", "q4_1", "q4_k", "q6_k", "f16", "bf16", "f32")
DOTS = "-int8"  # a quantized format's spelling for activations in 8 bits and integer dots (decode/kernels.h)
WEIGHTS = ("auto", "float", "gguf", *QUANTS, *HALVES, *(f"{w}{DOTS}" for w in ("gguf", *QUANTS)))
# the target's matrices the static step reads, by its names, and llama.cpp's for layer tensors
MATRICES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
            "down": "ffn_down"}


@dataclass(frozen=True)
class Blocks:
    """One matrix [outs, k] in a GGUF format: `raw` [outs, bytes a row], the file's bytes (blocks of 32 or 256 inputs,
    or floats)."""

    format: str
    raw: np.ndarray
    k: int

    def dequantized(self) -> torch.Tensor:
        """The float32 values GGUF's reference dequantizer gives (the prepared copy's, bit for bit)."""
        import torch
        from gguf import dequantize

        return torch.from_numpy(dequantize(self.raw, _qtype(self.format)).astype(np.float32).reshape(-1, self.k))


def is_file(weights: str) -> bool:
    """A spelling that names a GGUF file of the target's matrices (PATH.gguf, or PATH.gguf-int8)."""
    return base(weights).lower().endswith(".gguf")


def parse_weights(value: str) -> str:
    if value in WEIGHTS:
        return value
    if is_file(value):
        path = Path(base(value)).expanduser()
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{path}: no such GGUF file")
        return str(path.resolve()) + (DOTS if value.endswith(DOTS) else "")
    raise argparse.ArgumentTypeError(f"{value!r}: use one of {', '.join(WEIGHTS)}, or a .gguf file of this target")


def add_weights_option(p) -> None:
    p.add_argument("--weights", default="auto", type=parse_weights, metavar="{" + ",".join(WEIGHTS) + ",FILE.gguf}",
                   help="the target's weight format: float (its --dtype), gguf (a GGUF target's own blocks, e.g. the "
                   "default's Q4_1: the same values as its float32 copy), q8_0 | q4_0 | q4_1 | bf16 | f16 (from the "
                   "float32 target here, as llama-quantize or GGUF's converter does: another model), FILE.gguf (this "
                   "target's matrices from that file, e.g. a Q4_K_M llama-quantize wrote: the model served; its drafter "
                   "stays this target's); gguf, FILE.gguf or a quantized one with -int8 (e.g. gguf-int8): activations "
                   "in 8 bits and integer dots on the static backend, as llama.cpp computes (another model, lossless "
                   "against its own plain decoding; a file's float matrices stay float); auto = gguf for a GGUF target "
                   "on a CPU, else float")


def _qtype(fmt: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[fmt.upper()]


def _modules(target) -> dict:
    """name -> the nn.Linear whose weight the static step reads (`L.q` ... `L.down` for layer L, `head`)."""
    out = {"head": target.lm_head}
    for i, layer in enumerate(target.decoder.layers):
        a, p = layer.self_attn, layer.mlp
        for name, m in zip(MATRICES, (a.q_proj, a.k_proj, a.v_proj, a.o_proj, p.gate_proj, p.up_proj, p.down_proj)):
            out[f"{i}.{name}"] = m
    return out


def base(weights: str) -> str:
    """The weights' values: a spelling less its -int8 (the hf backend and extraction compute with these)."""
    return weights.removesuffix(DOTS)


def lossy(weights: str) -> bool:
    """Another model than the float32 one of the same file or target: quantized here or in another file, or integer
    dots."""
    return base(weights) in (*QUANTS, *HALVES) or is_file(weights) or weights.endswith(DOTS)


def resolve(weights: str, target) -> str:
    """`auto`: the file's own formats for a float32 target prepared from a GGUF, else the target's float dtype."""
    if is_file(weights):  # the very file the target was prepared from is its own blocks
        path = Path(base(weights)).expanduser().resolve()
        if not path.is_file():
            raise DFlashError(f"--weights {weights}: no such GGUF file")
        own = gguf_source(target.path)
        return ("gguf" if own is not None and own.resolve() == path else str(path)) + \
            (DOTS if weights.endswith(DOTS) else "")
    if weights not in WEIGHTS:
        raise DFlashError(f"--weights {weights!r}: use one of {', '.join(WEIGHTS)}, or a .gguf file of this target")
    if weights == "auto":
        return "gguf" if str(target.dtype) == "torch.float32" and gguf_source(target.path) is not None else "float"
    return weights


def gguf_source(folder) -> Path | None:
    """The GGUF file a prepared target folder was prepared from (its marker says which), or None."""
    try:
        rec = json.loads((Path(folder) / MARKER).read_text())
        path = Path(rec["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None


def _unpermute(raw: np.ndarray, heads: int) -> np.ndarray:
    """Rows of llama.cpp's q/k back in Hugging Face's order (its converter interleaves each head's rotary halves)."""
    half = raw.shape[0] // heads // 2
    return raw.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(raw.shape)


def read_gguf(path: Path, target) -> dict[str, Blocks]:
    """The matrices of a Llama-type GGUF in their own formats, by the names _modules gives."""
    from gguf import GGUFReader

    cfg, tensors = target.config, {t.name: t for t in GGUFReader(path).tensors}
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    names = {"head": head} | {f"{i}.{m}": f"blk.{i}.{g}.weight" for i in range(len(target.decoder.layers))
                              for m, g in MATRICES.items()}
    out = {}
    for name, gname in names.items():
        t = tensors.get(gname)
        if t is None:
            raise DFlashError(f"{path}: no tensor {gname}; --weights gguf reads Llama-type files (use --weights float)")
        fmt = t.tensor_type.name.lower()
        if fmt not in READ:
            raise DFlashError(f"{path}: tensor {gname} is {t.tensor_type.name}; --weights gguf keeps {', '.join(READ)} "
                              "(use --weights float, or q8_0 to quantize the float copy)")
        raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)  # (F16 and F32 come as their floats)
        if name.endswith((".q", ".k")):
            raw = _unpermute(raw, cfg.num_attention_heads if name.endswith(".q") else cfg.num_key_value_heads)
        out[name] = Blocks(fmt, np.ascontiguousarray(raw), int(t.shape[0]))
    return out


def quantize(w: torch.Tensor, fmt: str) -> Blocks:
    """w [outs, k] in a GGUF format by its reference quantizer (bf16, f16: rounded to nearest, as its converter)."""
    from gguf import quantize as gguf_quantize

    if w.shape[1] % 32:
        raise DFlashError(f"a matrix of {w.shape[1]} inputs does not divide into {fmt}'s blocks of 32; use --weights float")
    raw = gguf_quantize(w.detach().float().numpy(), _qtype(fmt))
    return Blocks(fmt, raw.view(np.uint8).reshape(raw.shape[0], -1), int(w.shape[1]))


def apply(target, weights: str) -> str:
    """Put the target in `weights` (blocks in `target.blocks`, their values in its parameters); returns its name."""
    import torch

    spelled = resolve(weights, target)
    weights = base(spelled)
    target.weights, target.blocks = spelled, {}
    if weights == "float":
        return weights
    if target.dtype != torch.float32:
        raise DFlashError(f"--weights {weights}: quantized weights widen to float32; load the target in float32 "
                          "(--dtype float32) or use --weights float")
    if target.device.type != "cpu":
        raise DFlashError(f"--weights {weights}: quantized weights run on a CPU; target {target.name} is on "
                          f"{target.device} (use --weights float)")
    try:
        modules = _modules(target)
    except AttributeError as e:  # not q/k/v/o and gate/up/down projections in every layer
        raise DFlashError(f"--weights {weights}: target {target.name} ({getattr(target.config, 'model_type', '?')}) "
                          "is not a dense Llama-type model, the layout quantized weights are read in; use --weights "
                          "float") from e
    if weights == "gguf":
        source = gguf_source(target.path)
        if source is None:
            raise DFlashError(f"--weights gguf: target {target.name} was not prepared from a GGUF file; use --weights "
                              f"float or one of {', '.join((*QUANTS, *HALVES))}")
        blocks = read_gguf(source, target)
    elif is_file(weights):
        blocks = read_gguf(Path(weights), target)
    else:
        blocks = {name: quantize(m.weight, weights) for name, m in modules.items()}
    with torch.no_grad():
        for name, b in blocks.items():
            w = modules[name].weight
            if tuple(w.shape) != (b.raw.shape[0], b.k):
                raise DFlashError(f"--weights {weights}: {name} is {b.raw.shape[0]}x{b.k} in the GGUF, {tuple(w.shape)} in "
                                  f"target {target.name}; prepare the target again (dflashkit target prepare --force)")
            w.copy_(b.dequantized().to(w.dtype))
    target.blocks = blocks
    return spelled


def stored(target, size=lambda b: b.raw.nbytes) -> tuple[int, int]:
    """(weights, bytes) a one-token step reads: each storage once, quantized matrices as `size` counts their blocks
    (the file's bytes, or those of the kernel kind they are read in: decode/static.py's kernel_bytes)."""
    blocks = getattr(target, "blocks", None) or {}
    kept = {m.weight.data_ptr() for m in _modules(target).values()} if blocks else set()
    first = {p.data_ptr(): p for p in target.model.parameters()}
    count = sum(p.numel() for p in first.values())
    nbytes = sum(p.numel() * p.element_size() for ptr, p in first.items() if ptr not in kept)
    return count, nbytes + sum(size(b) for b in blocks.values())


def describe(target) -> str:
    """For reports: the weights a target runs in."""
    if not target.blocks:
        return f"{str(target.dtype).removeprefix('torch.')} (float)"
    kinds = sorted({b.format for b in target.blocks.values()})
    how = "activations in 8 bits, integer dots" if target.weights.endswith(DOTS) else "widened to float32"
    if target.weights.endswith(DOTS) and set(kinds) & {"f16", "bf16", "f32"}:
        how += " (float matrices widened)"
    name = Path(target.weights).name if is_file(target.weights) else target.weights
    return f"{name}: {'/'.join(kinds)} (head {target.blocks['head'].format}), {how}"
