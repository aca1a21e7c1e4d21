"""ISA levels: the named instruction sets our kernels are built for instead of the build machine's own, so any test machine
builds and runs what a user's CPU runs (docs/design.md, "Threads and ISA levels"). The CLI's `--isa` calls `choose`
once; else the widest level this CPU runs."""

from __future__ import annotations

import contextlib
import functools
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from dflashkit.errors import DFlashError


@dataclass(frozen=True)
class Level:
    name: str
    about: str
    flags: tuple[str, ...]  # the compiler's: an ISA baseline and generic tuning, never this CPU's own
    needs: frozenset[str]  # /proc/cpuinfo flags a CPU must have to run it (none: any CPU, aarch64 included)


V3_NEEDS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
LEVELS = {level.name: level for level in (
    Level("portable", "GCC vector extensions, no intrinsics: any CPU (aarch64 included), the v3 level's sums",
          ("-mtune=generic",) if platform.machine() in ("x86_64", "AMD64") else (), frozenset()),
    Level("v3", "x86-64-v3: AVX2 + FMA, 8-lane registers (most laptops and cloud CPUs)",
          ("-march=x86-64-v3", "-mtune=generic"), V3_NEEDS),
    Level("v4", "x86-64-v4: AVX-512, 16-lane registers, AMX tiles for bf16 weights where the CPU has them",
          ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512"),
          V3_NEEDS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
)}
# earlier spellings: the CPU's own code path, and the AVX2 one
ALIASES = {"native": None, "best": None, "avx2": "v3", "x86-64-v3": "v3", "x86-64-v4": "v4"}
_chosen: str | None = None


@functools.cache
def cpu() -> tuple[str, frozenset[str]]:
    """This CPU's model name and flags from /proc/cpuinfo (the platform's name and none where there is none)."""
    info = {}
    with contextlib.suppress(OSError):
        for key, _, value in (line.partition(":") for line in Path("/proc/cpuinfo").read_text().splitlines()):
            info.setdefault(key.strip(), value.strip())  # the first processor's
    return info.get("model name", platform.processor()), frozenset(info.get("flags", "").split())


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def runs_here(name: str) -> bool:
    needs = LEVELS[name].needs
    return not needs or (is_x86() and needs <= cpu()[1])


def runnable() -> list[str]:
    """The levels this CPU runs, narrowest first."""
    return [name for name in LEVELS if runs_here(name)]


def best() -> str:
    return runnable()[-1]


def resolve(value: str | None) -> str:
    """A level's name from what a user wrote (None or 'native': the widest this CPU runs)."""
    name = ALIASES.get(value, value) if value else None
    if name is None:
        return best()
    if name not in LEVELS:
        raise DFlashError(f"--isa {value!r}: use one of {', '.join(LEVELS)} (or native: the widest this CPU runs, "
                          f"{best()} here)")
    if not runs_here(name):
        missing = sorted(LEVELS[name].needs - cpu()[1]) if is_x86() else ["an x86-64 CPU"]
        raise DFlashError(f"--isa {value}: this CPU ({cpu()[0] or platform.machine()}) cannot run level {name} "
                          f"(missing {', '.join(missing)}); use one of {', '.join(runnable())}")
    return name


def choose(value: str | None) -> str:
    """Set this process's level (the CLI calls it once, before torch loads); returns its name."""
    global _chosen
    name = resolve(value)
    torch = sys.modules.get("torch")
    if torch_environment(name) and torch and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT"):
        raise DFlashError(f"--isa {value}: torch already loaded its {torch.backends.cpu.get_cpu_capability()} kernels; "
                          f"set {', '.join(f'{k}={v}' for k, v in torch_environment(name).items())} before torch is "
                          "imported (the dflashkit command does), so every kernel takes the level's code path")
    _chosen = name
    return _chosen


def chosen() -> str:
    return _chosen or best()


def narrower() -> bool:
    """The chosen level leaves out vector units this CPU has (a float32-only CPU emulated on a wider one)."""
    return chosen() != best()


def native_bf16() -> bool:
    """bf16 dot products in hardware at the chosen level (avx512_bf16 or AMX, which need v4)."""
    return chosen() == "v4" and bool({"avx512_bf16", "amx_bf16"} & cpu()[1])


def amx() -> bool:
    return chosen() == "v4" and {"amx_bf16", "amx_tile"} <= cpu()[1]


VNNI = {"v3": "avx_vnni", "v4": "avx512_vnni"}  # the level's integer dots through vpdpbusd, where the CPU has it


def vnni() -> bool:
    """Integer dots through VNNI (the same bits, fewer instructions): the chosen level's kind of it on this CPU, unless
    the level emulates a narrower CPU (x86-64-v3 itself has none)."""
    return not narrower() and VNNI.get(chosen()) in cpu()[1]


def torch_environment(name: str) -> dict[str, str]:
    """The environment torch needs before it loads for its kernels to take a narrower level's path (the CLI sets it)."""
    return {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"} if (name, best()) == ("v3", "v4") else {}


def describe() -> str:
    """One line for reports: the level, what it is, and this CPU's native bf16."""
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in cpu()[1]]
    narrow = f" (this CPU runs {best()})" if narrower() else ""
    dots = f"; integer dots through {VNNI[chosen()]}" if vnni() else ""
    return f"level {chosen()}{narrow}: {LEVELS[chosen()].about}; " + (
        f"native bf16 ({', '.join(bf16)})" if native_bf16() else "no native bf16") + dots
