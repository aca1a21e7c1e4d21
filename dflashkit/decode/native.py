"""The static decoder's own CPU kernels (`native.cpp`: `dflashkit::linear`, `dflashkit::attend`), compiled on
first use for this machine's instruction set and cached (docs/design.md, "Native kernels in detail")."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from dflashkit.errors import DFlashError
from dflashkit.fileio import home
from dflashkit.threads import ISA_VAR, cpu, isa

SOURCE = Path(__file__).with_name("native.cpp")
# fp-contract: a * b + c is one fused multiply-add wherever it is written, so a lane and a scalar sum alike
COMMON = ["-O3", "-ffp-contract=fast", "-fopenmp", "-std=c++20", "-fPIC", "-shared"]
# The instruction set the kernels are built for (threads.isa): this CPU's own, or AVX2 + FMA without AVX-512 (what
# a float32-only laptop or cloud CPU has; any x86 machine runs it, so the two compare side by side on one)
ISA_FLAGS = {"native": ["-march=native", "-mprefer-vector-width=512"],
             "avx2": ["-march=haswell", "-mno-avx512f", "-mprefer-vector-width=256"]}


def tiles_run_here() -> bool:
    """linear_tiles runs on this CPU's own code path with AMX (the AVX2 path stands for a CPU without it)."""
    return {"amx_bf16", "amx_tile"} <= cpu()[1] and isa() == "native"


def cflags() -> list[str]:
    return ISA_FLAGS[isa()] + COMMON


def instruction_set() -> str:
    """The widest vector ISA the kernels are built for here and whether bf16 dots are native (bench and the demo
    report it beside dtype and threads)."""
    if isa() == "avx2":
        return f"avx2+fma, no native bf16 ({ISA_VAR}=avx2)"
    flags = cpu()[1]
    widest = "avx512" if "avx512f" in flags else "avx2+fma" if {"avx2", "fma"} <= flags else "baseline x86-64" \
        if "sse2" in flags else platform.machine()
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return widest + (f" ({', '.join(bf16)})" if bf16 else ", no native bf16")


def library_path() -> Path:
    """Where this source, these flags, this CPU and this torch build their library."""
    key = "\n".join([SOURCE.read_text(), *cflags(), *sorted(cpu()[1]), torch.__version__, torch.__file__])
    return home() / "native" / f"native-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def compile_command(source, out) -> list[str]:
    """The compiler call that builds `source` into the library `out` for this machine (torch's extension flags)."""
    from torch.utils import cpp_extension
    return ["c++", *cflags(), f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", str(out),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]


@functools.cache
def load() -> None:
    """Build (once per source, flags, CPU and torch) and load the kernels; a second process only loads them.
    Concurrent builds each write their own temporary file and the last rename wins (the files are alike)."""
    if isa() == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT"):
        raise DFlashError(f"{ISA_VAR}=avx2, but torch loaded with its {torch.backends.cpu.get_cpu_capability()} "
                          "kernels: set ATEN_CPU_CAPABILITY=avx2 and TORCHINDUCTOR_CPP_MARCH=haswell before torch is "
                          "imported (the dflashkit command does), so every kernel takes the AVX2 path")
    lib = library_path()
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            res = subprocess.run(compile_command(SOURCE, tmp), capture_output=True, text=True)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise DFlashError(f"native kernels: no C++ compiler to build {SOURCE} ({e}); install g++ (inductor "
                              "needs one too), or build the decoder with kernels='reduce'") from e
        if res.returncode != 0:
            Path(tmp).unlink(missing_ok=True)
            raise DFlashError(f"native kernels: building {SOURCE} failed; build the decoder with kernels='reduce' "
                              f"meanwhile. The compiler said:\n{res.stderr[-3000:]}")
        os.replace(tmp, lib)
    torch.ops.load_library(str(lib))

    for op in ("dflashkit::linear", "dflashkit::linear_tiles"):
        torch.library.register_fake(op)(lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("dflashkit::attend")
    def _(q, k, v, start, path):
        return torch.empty_like(q, memory_format=torch.contiguous_format)
