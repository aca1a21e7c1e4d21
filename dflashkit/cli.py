"""The `dflashkit` command: a thin layer that parses arguments and calls one function per command.

Each stage package contributes its subcommands through `register(subparsers)` in its own `cli.py`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dflashkit.errors import DFlashError

# The stages a user walks through, in order; each module defines register(subparsers). export (`drafter export`)
# needs engines and evaluate, above the drafter stage; prediction (`cost`, `eval --engine`) joins evaluate and decode.
STAGES = ["dflashkit.targets.cli", "dflashkit.drafter.cli", "dflashkit.export", "dflashkit.cache.cli",
          "dflashkit.evaluate.cli", "dflashkit.prediction", "dflashkit.decode.cli", "dflashkit.engines.cli",
          "dflashkit.train.cli", "dflashkit.configs.cli", "dflashkit.demo"]

# The only process state dflashkit sets (docs/design.md section 12): targets load from local folders,
# transformers' advisory warnings and its loading bars would bury our own progress lines.
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def build_parser() -> argparse.ArgumentParser:
    from dflashkit import __version__

    parser = argparse.ArgumentParser(prog="dflashkit", description="Train, evaluate and compare DFlash speculative drafters.")
    parser.add_argument("--version", action="version", version=f"dflashkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in STAGES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency, not a stage that is not written yet
                raise
            continue
        module.register(sub)
    return parser


def main(argv=None) -> int:
    from dflashkit.threads import isa_environment  # torch's own kernels on the code path ours are built for

    for key, value in {**ENVIRONMENT, **isa_environment()}.items():
        os.environ.setdefault(key, value)
    args = build_parser().parse_args(argv)
    before = None
    try:
        if getattr(args, "out", None):  # an output path that cannot be written fails now, not after the work
            from dflashkit.fileio import check_writable

            check_writable(args.out)
        if hasattr(args, "threads"):  # commands that run models take --threads (dflashkit.threads)
            import torch

            from dflashkit.threads import apply_threads, load_warning, under_torchrun

            before = torch.get_num_threads()
            n = apply_threads(args)
            warning = None if under_torchrun() or n == 1 else load_warning(n)  # one thread: nothing to share
            if warning:
                print(warning, file=sys.stderr)
        return args.func(args) or 0
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
              "as on a float32-only CPU or with DFLASHKIT_NATIVE_ISA=avx2); use --dtype float32 or auto", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; completed work is saved and a rerun resumes", file=sys.stderr)
        return 130
    finally:
        if before is not None:  # an in-process caller (tests, notebooks) gets its own setting back
            torch.set_num_threads(before)


if __name__ == "__main__":
    sys.exit(main())
