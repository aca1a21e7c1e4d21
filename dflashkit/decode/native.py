"""The static decoder's own CPU kernels (`kernels.h`, bound by `native.cpp`), built per ISA level on first use, each
under an op namespace of its own so a process can load several (docs/design.md, "Native kernels in detail")."""

from __future__ import annotations

import functools
import hashlib
import subprocess
import sys
from pathlib import Path

import torch
from filelock import FileLock

from dflashkit import levels
from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_path, home, sha256_file, write_text

HERE = Path(__file__).parent
SOURCE, CORE, DOTS = HERE / "native.cpp", HERE / "kernels.h", HERE / "int8.h"
# fp-contract off: a fused multiply-add is one where the source names it (kernels.h), never a compiler's choice
COMMON = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++20", "-fPIC", "-shared", "-Wno-psabi"]


def namespace(level: str, tune: str | None = None) -> str:
    return "dflashkit_" + level + (f"_{tune}" if tune else "")


def cflags(level: str | None = None, tune: str | None = None) -> list[str]:
    """The compiler flags of a level's build (the chosen level's by default): its ISA, generic tuning, or `tune`."""
    flags = list(levels.LEVELS[level or levels.chosen()].flags)
    if tune:
        flags = [f for f in flags if not f.startswith("-mtune=")] + [f"-mtune={tune}"]
    return flags + COMMON


def instruction_set() -> str:
    """What bench and the demo report beside dtype and threads: the level the kernels run at."""
    return levels.describe()


def tiles_run_here() -> bool:
    """linear_tiles runs: level v4 on a CPU with AMX."""
    return levels.amx()


def library_path(level: str | None = None, tune: str | None = None) -> Path:
    """Where a level's build of this source, flags and torch lives: named by the level, not by the CPU."""
    level = level or levels.chosen()
    sources = [path.read_text() for path in (SOURCE, CORE, DOTS)]
    key = "\n".join([*sources, *cflags(level, tune), torch.__version__, torch.__file__])
    return home() / "native" / f"native-{level}{'-' + tune if tune else ''}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def compile_command(out, level: str | None = None, tune: str | None = None) -> list[str]:
    """The compiler call that builds the level's library `out` (torch's extension flags)."""
    from torch.utils import cpp_extension
    return ["c++", *cflags(level, tune), f"-DDFLASHKIT_OPS={namespace(level or levels.chosen(), tune)}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE), "-o", str(out),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]


def _build(lib: Path, level: str, tune: str | None) -> None:
    """Compile to a temporary file renamed into place, then write its digest (a library without one is built again)."""
    try:
        with atomic_path(lib) as tmp:
            res = subprocess.run(compile_command(tmp, level, tune), capture_output=True, text=True)
            if res.returncode != 0:
                raise DFlashError(f"native kernels: building {SOURCE} for level {level} failed; build the decoder with "
                                  f"kernels='reduce' meanwhile. The compiler said:\n{res.stderr[-3000:]}")
            digest = sha256_file(tmp)
        write_text(lib.with_suffix(".sha256"), digest)
    except OSError as e:
        raise DFlashError(f"native kernels: no C++ compiler to build {SOURCE} ({e}); install g++ (inductor needs one "
                          "too), or build the decoder with kernels='reduce'") from e


def _intact(lib: Path) -> bool:
    """The library is the file its build wrote (a truncated or replaced one would crash the process on load)."""
    try:
        return lib.is_file() and lib.with_suffix(".sha256").read_text().strip() == sha256_file(lib)
    except OSError:
        return False


def load(level: str | None = None, tune: str | None = None) -> str:
    """Build once and load a level's kernels (the chosen level's by default); returns their torch.ops namespace."""
    return _load(level or levels.chosen(), tune)


def ensure_built(level: str, tune: str | None = None) -> Path:
    """The level's library, built where missing or not the file its build wrote (one line says so)."""
    if not levels.runs_here(level):
        raise DFlashError(f"native kernels: this CPU cannot run level {level}; use one of {', '.join(levels.runnable())}")
    lib = library_path(level, tune)
    lib.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lib.with_suffix(".lock"))):  # a second process starting meanwhile waits for this build
        if lib.exists() and not _intact(lib):
            print(f"native kernels: {lib} is damaged (not the file its build wrote); building it again", file=sys.stderr)
            lib.unlink()
        if not lib.exists():
            _build(lib, level, tune)
    return lib


@functools.cache
def _load(level: str, tune: str | None) -> str:
    torch.ops.load_library(str(ensure_built(level, tune)))
    ns = namespace(level, tune)
    for op in ("linear", "linear_tiles"):
        torch.library.register_fake(f"{ns}::{op}")(lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0]))
    for op in ("linear_quant", "linear_int8", "linear_vnni"):
        torch.library.register_fake(f"{ns}::{op}")(lambda x, w, f, outs: x.new_empty(*x.shape[:-1], outs))
    torch.library.register_fake(f"{ns}::attend")(
        lambda q, k, v, start, path: torch.empty_like(q, memory_format=torch.contiguous_format))
    return ns


def ops(level: str | None = None, tune: str | None = None):
    """The operators of a level's build (loaded on first use): `.linear`, `.linear_tiles`, `.linear_quant`,
    `.linear_int8`, `.linear_vnni`, `.attend`."""
    return getattr(torch.ops, load(level, tune))
