"""The static decoder's own CPU linear (`native.cpp`), built on first use by torch's extension builder for this
machine's instruction set and cached (a later process loads it in a second).

Why: a one-token step is a matrix-vector product per weight; the C++ dot keeps 64 independent float32 lanes, so it
streams weights at the memory's speed where inductor's reduction is bound by one accumulator chain, and every row's
sum has one fixed order (a verify's rows equal the one-token step's bit for bit).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
from pathlib import Path

import torch

from dflashkit.errors import DFlashError

SOURCE = Path(__file__).with_name("native.cpp")
# fp-contract: a * b + c is one fused multiply-add wherever it is written, so the one-row and four-row dots agree
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=fast", "-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package puts one in the venv, which a console script
    does not have on PATH."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError as e:
            raise DFlashError("native kernels: no `ninja` to build them; `pip install ninja` (in requirements), or "
                              "build the decoder with kernels='reduce'") from e
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> None:
    """Build (once per source, flags, CPU and torch version) and load `dflashkit::linear`."""
    from torch.utils.cpp_extension import load as build

    key = hashlib.sha256("\n".join([SOURCE.read_text(), *CFLAGS, _cpu_flags(), torch.__version__]).encode())
    _ninja_on_path()
    try:
        build(name=f"dflashkit_native_{key.hexdigest()[:12]}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as e:
        raise DFlashError(f"native kernels: building {SOURCE.name} failed ({e}); a C++ compiler (g++) is needed, "
                          "or build the decoder with kernels='reduce'") from e

    @torch.library.register_fake("dflashkit::linear")
    def _(x, w):
        return x.new_empty(*x.shape[:-1], w.shape[0])
