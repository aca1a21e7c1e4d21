"""ISA levels (issue 68): named levels instead of -march=native, chosen from the CPU's flags or `--isa`; the kernel
core built alone (tests/kernel_bits.cpp) gives the same bits at every level, with Zen's tuning planted, and for
aarch64 under qemu-user where the cross tools are installed; a damaged library is built again."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dflashkit import levels
from dflashkit.decode import native
from dflashkit.errors import DFlashError
from dflashkit.fileio import sha256_file

HERE = Path(__file__).parent
CORE = [str(HERE / "kernel_bits.cpp"), f"-I{native.HERE}", "-O3", "-ffp-contract=off", "-std=c++20", "-Wno-psabi"]
X86 = levels.is_x86()


def kernel_bits(tmp_path, name: str, flags: list[str], compiler: str = "g++", runner: list[str] = ()) -> bytes:
    """Build the kernel core alone with `flags`, run it on its fixed inputs: its outputs' bits (every verify row was
    checked equal to its one-token step inside, and every row of a linear to that row alone)."""
    exe, out = tmp_path / name, tmp_path / f"{name}.bin"
    if not exe.exists():
        subprocess.run([compiler, *CORE, *flags, "-o", str(exe)], check=True, capture_output=True, timeout=300)
    res = subprocess.run([*runner, str(exe), str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "differs" not in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("equal") == 211
    if runner == () and levels.VNNI["v3"] in levels.cpu()[1] and "-march=x86-64-v3" in flags:
        assert res.stdout.count("same") == 10  # AVX-VNNI's dots: the level's own bits
    return out.read_bytes()


@pytest.mark.skipif(not X86 or not shutil.which("g++"), reason="the x86 levels need an x86-64 CPU and g++")
def test_the_kernel_core_builds_alone_and_with_zens_tuning_gives_the_same_bits(tmp_path):
    """The kernel core without torch at v3's own flags (levels.LEVELS) and with -mtune=znver3 planted (GCC then leaves
    single-chain loops unfused where -ffp-contract merely allows fusion): one set of bits, and within each build every
    verify row equals the one-token step. (The other levels' builds are compared with v3's through torch:
    tests/test_static_decoder.py.)"""
    with ThreadPoolExecutor(2) as pool:  # the two compiles side by side
        v3, zen = pool.map(lambda a: kernel_bits(tmp_path, *a), [("v3", list(levels.LEVELS["v3"].flags)),
                                                                ("v3-znver3", ["-march=x86-64-v3", "-mtune=znver3"])])
    assert v3 == zen


AARCH64 = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


@pytest.mark.skipif(not AARCH64, reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
def test_the_portable_path_builds_for_aarch64_and_runs_there_with_the_v3_bits(tmp_path):
    """The portable path has no x86 intrinsics: it builds for aarch64 (Graviton, Apple Silicon under Linux), and under
    qemu-user (where installed) gives the bits the x86 levels give."""
    exe_flags = ["-static", "-march=armv8-a"]
    if not QEMU or not X86:
        subprocess.run([AARCH64, *CORE, *exe_flags, "-o", str(tmp_path / "arm")], check=True, capture_output=True)
        pytest.skip("built for aarch64; no qemu-user here to run it (apt-get install qemu-user)")
    arm = kernel_bits(tmp_path, "aarch64", exe_flags, compiler=AARCH64, runner=[QEMU])
    assert arm == kernel_bits(tmp_path, "v3", list(levels.LEVELS["v3"].flags))


def test_the_levels_are_named_and_refused_by_name():
    assert "portable" in levels.runnable() and levels.best() == levels.runnable()[-1]
    assert levels.resolve(None) == levels.resolve("native") == levels.best()
    if levels.runs_here("v3"):
        assert levels.resolve("avx2") == levels.resolve("x86-64-v3") == "v3"  # the earlier spelling
    with pytest.raises(DFlashError, match="--isa 'avx512': use one of portable, v3, v4"):
        levels.resolve("avx512")
    for name in levels.LEVELS:
        flags = native.cflags(name)
        assert "-march=native" not in flags and "-ffp-contract=off" in flags
        assert native.library_path(name).name.startswith(f"native-{name}-")  # the cache names the level, not the CPU


def test_a_level_this_cpu_cannot_run_is_refused_with_the_ones_it_can(monkeypatch):
    monkeypatch.setattr(levels, "cpu", lambda: ("Some CPU", frozenset({"sse2", "avx", "avx2", "fma"})))
    if not X86:
        pytest.skip("x86 levels")
    assert levels.runnable() == ["portable"] and levels.best() == "portable"
    with pytest.raises(DFlashError, match=r"--isa v3: this CPU \(Some CPU\) cannot run level v3 \(missing abm, bmi1, "
                                          r"bmi2, f16c, movbe\); use one of portable"):
        levels.resolve("v3")


def test_vnni_dots_run_where_the_level_and_the_cpu_have_them_and_not_in_a_narrower_level(monkeypatch):
    if not X86:
        pytest.skip("x86 levels")
    v4 = levels.LEVELS["v4"].needs
    for flags, chosen, expect in ((v4 | {"avx512_vnni"}, "v4", True), (v4, "v4", False),
                                  (v4 | {"avx512_vnni", "avx_vnni"}, "v3", False),  # a v3 CPU emulated: none
                                  (levels.V3_NEEDS | {"avx_vnni"}, "v3", True), (levels.V3_NEEDS, "v3", False)):
        monkeypatch.setattr(levels, "cpu", lambda flags=flags: ("Some CPU", frozenset(flags)))
        monkeypatch.setattr(levels, "_chosen", chosen)
        assert levels.vnni() is expect, (sorted(flags), chosen)
        assert ("integer dots through" in levels.describe()) is expect


def test_the_cli_takes_isa_before_the_command_and_from_the_environment(monkeypatch, capsys):
    from dflashkit.cli import asked_isa, main

    monkeypatch.delenv("DFLASHKIT_ISA", raising=False)
    monkeypatch.delenv("DFLASHKIT_NATIVE_ISA", raising=False)
    assert asked_isa(["--isa", "v3", "bench", "--isa", "v4"]) == "v3" and asked_isa(["--isa=portable", "x"]) == "portable"
    assert asked_isa(["bench"]) is None
    monkeypatch.setenv("DFLASHKIT_NATIVE_ISA", "avx2")
    assert asked_isa(["bench"]) == "avx2"
    assert main(["--isa", "sse9", "configs", "list"]) == 2
    assert "--isa 'sse9': use one of portable, v3, v4" in capsys.readouterr().err


def test_a_damaged_library_is_built_again_and_a_whole_one_is_not(tmp_path, monkeypatch, capsys, machine_env):
    """Issue 72: a truncated library (which crashed the process on load with a bus error) or one replaced by text is
    not the file its build wrote: built again with one line; an intact one is loaded as it is."""
    machine_env(DFLASHKIT_HOME=tmp_path)
    built = []

    def fake_build(lib, level, tune):
        built.append(level)
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"\x7fELF library " * 100)
        lib.with_suffix(".sha256").write_text(sha256_file(lib))

    monkeypatch.setattr(native, "_build", fake_build)
    lib = native.ensure_built("portable")
    assert built == ["portable"] and native.ensure_built("portable") == lib and built == ["portable"]
    for damage in (lambda: lib.write_bytes(lib.read_bytes()[:50]), lambda: lib.write_text("not a library")):
        damage()
        assert native.ensure_built("portable") == lib and native._intact(lib)
        assert f"native kernels: {lib} is damaged (not the file its build wrote); building it again" in \
            capsys.readouterr().err
    assert built == ["portable"] * 3
    lib.with_suffix(".sha256").unlink()  # a library without its digest (an older build, a copy) is built again
    native.ensure_built("portable")
    assert built == ["portable"] * 4
    assert not list(lib.parent.glob("*.tmp*"))
