"""The `dflashkit` command: parses arguments and calls one function per command; each stage registers its own."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dflashkit import __version__, levels, machine, threads
from dflashkit.errors import DFlashError
from dflashkit.fileio import check_writable

# The stages a user walks through, in order; each module's register(subparsers) declares its commands whole
STAGES = ["dflashkit.targets.cli", "dflashkit.drafter.cli", "dflashkit.cache.cli",
          "dflashkit.evaluate.cli", "dflashkit.measure.cli", "dflashkit.engines.cli",
          "dflashkit.train.cli", "dflashkit.configs.cli", "dflashkit.demo"]

# The only process state dflashkit sets (docs/design.md section 12): targets load from local folders,
# transformers' advisory warnings and its loading bars would bury our own progress lines.
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflashkit", description="Train, evaluate and compare DFlash speculative drafters.")
    parser.add_argument("--version", action="version", version=f"dflashkit {__version__}")
    parser.add_argument("--isa", metavar="LEVEL", help=(
        "the ISA level our CPU kernels (and a llama.cpp peer) run at: portable, v3 (x86-64-v3: AVX2+FMA), v4 "
        "(AVX-512), or native, the widest this CPU runs (the default; also $DFLASHKIT_ISA). A narrower level than "
        "this CPU's runs here as a CPU of that level would, torch's own kernels included"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in STAGES:
        importlib.import_module(name).register(sub)
    return parser


def asked_isa(argv: list[str]) -> str | None:
    """`--isa LEVEL` before the command, else $DFLASHKIT_ISA (or its earlier name): read before the parser imports
    torch, whose kernels take the level's code path only if told first."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            break
        if arg == "--isa" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--isa="):
            return arg.partition("=")[2]
    return os.environ.get("DFLASHKIT_ISA") or os.environ.get("DFLASHKIT_NATIVE_ISA") or None


def use_environment(env=os.environ) -> machine.Machine:
    """The machine choices a user makes in the environment, read here alone (docs/design.md section 12); returns the
    machine before, for an in-process caller."""
    def count(name: str, default: int | None) -> int | None:
        value = env.get(name, "").strip()
        return int(value) if value.isdigit() else default

    torchrun = "LOCAL_WORLD_SIZE" in env or "TORCHELASTIC_RUN_ID" in env  # it also sets OMP_NUM_THREADS=1
    return machine.use(machine.Machine(
        home=env.get("DFLASHKIT_HOME", machine.Machine.home), engines=env.get("DFLASHKIT_ENGINES"),
        omp_threads=count("OMP_NUM_THREADS", None), local_world=count("LOCAL_WORLD_SIZE", 1) if torchrun else None,
        world=count("WORLD_SIZE", 1), local_rank=count("LOCAL_RANK", 0)))


def handler(func):
    """A command's function, or where one lives ("package.module:name": work done by a stage above its parser's)."""
    if isinstance(func, str):
        module, name = func.split(":")
        return getattr(importlib.import_module(module), name)
    return func


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, before, outer = None, None, use_environment()
    try:
        level = levels.choose(asked := asked_isa(argv))
        if asked:
            os.environ["DFLASHKIT_ISA"] = level  # what a dflashkit process started from this one runs at
        for key, value in {**ENVIRONMENT, **levels.torch_environment(level)}.items():
            os.environ.setdefault(key, value)
        args = build_parser().parse_args(argv)
        if getattr(args, "out", None):  # an output path that cannot be written fails now, not after the work
            check_writable(args.out)
        if hasattr(args, "threads"):  # commands that run models take --threads (dflashkit.threads)
            import torch

            before = torch.get_num_threads()
            n = threads.apply_threads(args)  # one thread: nothing to share
            if n > 1 and not threads.under_torchrun() and (warning := threads.load_warning(n)):
                print(warning, file=sys.stderr)
        return handler(args.func)(args) or 0
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the checks could not foresee (a full disk, a folder removed meanwhile)
        where = f" {e.filename}" if e.filename else ""
        print(f"error:{where}: {e.strerror or e}; check the path and free space, then rerun", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if "pack_vnni2" not in str(e):
            raise
        # torch's CPU attention computes bf16 with AVX-512 kernels only (measured: its AVX2 path refuses)
        print("error: --dtype bfloat16 needs AVX-512 on a CPU (torch's attention refuses bf16 on its AVX2 kernels, "
              "as on a float32-only CPU or with --isa v3); use --dtype float32 or auto", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # each command says what it kept (those that resume set args.on_interrupt)
        print(getattr(args, "on_interrupt", None) or "interrupted", file=sys.stderr)
        return 130
    finally:
        machine.use(outer)
        if before is not None:  # an in-process caller (tests, notebooks) gets its own setting back
            torch.set_num_threads(before)


if __name__ == "__main__":
    sys.exit(main())
