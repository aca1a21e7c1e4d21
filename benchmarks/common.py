"""What every benchmark script shares: the machine line its results name, and atomic JSON + Markdown results.
Scripts run as `python benchmarks/NAME.py`, so this folder is on their path and `from common import ...` works.
A script is a process entry: importing this module reads $DFLASHKIT_HOME and the rest as the `dflashkit` command
does (docs/design.md section 12)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflashkit.cli import use_environment
from dflashkit.fileio import write_json, write_text

use_environment()


def cpu_name() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    return f"{model}, {torch.get_num_threads()} threads, {'native bf16' if bf16 else 'no native bf16 (AVX2)'}"


def write_results(stem, md: list[str], data: dict) -> None:
    """A benchmark's STEM.md (its lines) and STEM.json (its figures), both written atomically."""
    write_text(f"{stem}.md", "\n".join(md) + "\n")
    write_json(f"{stem}.json", data)
    print(f"wrote {stem}.md, {stem}.json")
