"""What llama.cpp's converter does not write in a DFlash GGUF (docs/design.md, "The draft vocabulary in a GGUF")."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_path

SKIP_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


def _value(field):
    """A reader field as the value GGUFWriter.add_key_value takes (lists element by element)."""
    array = field.types[0] == gguf.GGUFValueType.ARRAY
    kind = field.types[1] if array else field.types[0]
    text = kind == gguf.GGUFValueType.STRING
    one = lambda i: bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") if text else field.parts[i].tolist()[0]
    return ([one(i) for i in field.data], kind) if array else (one(field.data[0]), None)


def add_token_map(src: Path, dst: Path, vocab: list[int], head: np.ndarray) -> Path:
    """Copy `src`, a DFlash GGUF, to `dst` with `d2t` (absolute ids, I64) and the head rows of `vocab` as output.weight."""
    reader = gguf.GGUFReader(str(src))
    arch_name = _value(reader.fields["general.architecture"])[0]
    if arch_name != "dflash":
        raise DFlashError(f"{src}: general.architecture is {arch_name!r}, not dflash; pass a DFlash drafter's GGUF")
    if any(t.name == "d2t" for t in reader.tensors):
        raise DFlashError(f"{src}: already holds a d2t token map")
    if len(set(vocab)) != len(vocab) or min(vocab) < 0:
        raise DFlashError("draft vocabulary: token ids must be distinct and non-negative")
    weight_type = next(t.tensor_type for t in reader.tensors if t.name == "fc.weight")
    with atomic_path(dst) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch_name)
        for key, field in reader.fields.items():
            if key not in SKIP_KEYS:
                value, sub = _value(field)
                w.add_key_value(key, value, field.types[0], sub_type=sub)
        for t in reader.tensors:
            if t.name != "output.weight":  # a full-vocabulary head: replaced by the draft rows below
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # bytes of packed types: shape follows
        rows = np.ascontiguousarray(head[np.asarray(vocab)], dtype=np.float32)
        if weight_type == gguf.GGMLQuantizationType.BF16:
            w.add_tensor("output.weight", gguf.quants.quantize(rows, weight_type), raw_dtype=weight_type)
        else:
            f16 = weight_type == gguf.GGMLQuantizationType.F16
            w.add_tensor("output.weight", rows.astype(np.float16) if f16 else rows)
        w.add_tensor("d2t", np.asarray(vocab, dtype=np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return dst


def read_token_map(path: Path) -> list[int] | None:
    """The `d2t` ids of a DFlash GGUF, or None (it drafts over the full vocabulary)."""
    t = next((t for t in gguf.GGUFReader(str(path)).tensors if t.name == "d2t"), None)
    return None if t is None else np.asarray(t.data).astype(np.int64).tolist()


def gguf_keys(path: Path) -> dict:
    return {k: _value(f)[0] for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}


def check_gguf(path: Path, cfg, vocab: list[int] | None, target_config: dict) -> list[str]:
    """Read back what llama.cpp will run from a DFlash GGUF and refuse any contract it breaks (docs/design.md section
    14): layer ids + 1, the block counting the anchor, mask id, rotated dims, mRoPE sections, draft vocabulary."""
    from dflashkit.drafter.model import rotary_dim

    keys = gguf_keys(path)
    a = keys.get("general.architecture")
    layers = [i + 1 for i in cfg.target_layer_ids]
    for key, value, fix in ((f"{a}.target_layers", layers, "llama.cpp taps output_hidden_states[id + 1]: write "
                             "target_layer_ids + 1"),
                            (f"{a}.block_size", cfg.block_size, "it counts the anchor: write the trained block_size"),
                            ("tokenizer.ggml.mask_token_id", cfg.mask_token_id, "write dflash_config.mask_token_id")):
        if keys.get(key) != value:
            raise DFlashError(f"{path}: {key} is {keys.get(key)!r}, the drafter needs {value!r}; {fix}")
    n_rot = keys.get(f"{a}.rope.dimension_count", keys.get(f"{a}.attention.key_length", cfg.head_dim))
    if n_rot != rotary_dim(cfg):
        raise DFlashError(f"{path}: {a}.rope.dimension_count is {n_rot}, but the drafter was trained rotating "
                          f"{rotary_dim(cfg)} of {cfg.head_dim} head dims (partial_rotary_factor "
                          f"{cfg.partial_rotary_factor:g}); write partial_rotary_factor into config.json and re-convert")
    sections = keys.get(f"{a}.rope.dimension_sections")
    text = target_config.get("text_config", target_config)  # mRoPE (RoPE with sections): Qwen2/3-VL, Qwen3.5
    if "mrope_section" in (text.get("rope_parameters") or text.get("rope_scaling") or {}) and not sections:
        raise DFlashError(f"{path}: no {a}.rope.dimension_sections, but the target uses mRoPE (rope_parameters."
                          "mrope_section); llama.cpp would rope the drafter as a text model: convert with a llama.cpp "
                          "whose converter writes the sections for a VL target (z-lab #170)")
    written = read_token_map(path)
    if written != (list(vocab) if vocab else None):
        raise DFlashError(f"{path}: d2t holds {len(written or [])} token ids, the drafter's draft vocabulary "
                          f"{len(vocab or [])}; export with the token map (drop --full-vocab) or re-export")
    return [f"{path.name}: {a}.target_layers {layers} (id + 1), {a}.block_size {cfg.block_size} "
            f"(anchor counted: llama.cpp --spec-draft-n-max {cfg.block_size - 1}), RoPE dims {n_rot}"
            + (f", mRoPE sections {sections}" if sections else "") + f", d2t {len(written) if written else 'none'}"]
