"""The static backend's C++ linear, this tree's against a git revision's, side by side in one process.

    python benchmarks/native_linear.py [--against REV] [--dtype float32] [--rows 1,4,8,16,32]
    DFLASHKIT_ISA=v3 python benchmarks/native_linear.py ...   # the v3 level (AVX2 + FMA), as a float32-only CPU runs

Both sources are built with the flags dflashkit builds with (each under its own op namespace, so one process loads
both), then every decoder linear of SmolLM2-135M (30 layers, random weights of the target's shapes and dtype) runs
in layer order, then the head (49152 x 576), the two kernels alternating, 7 times per row count; each side reads
the weights in the layout its source reads (panel order where it says so). Per row count: median ms of a pass for
each, the ratio new / old, each one's cost against its own one-row pass (the verify cost curve the tree cut reads),
and each one's largest error against a float64 product over the first layer (its sum order is its own).
Writes benchmarks/results/cpu-DATE-native-linear[-TAG].{md,json}, naming the CPU and the build.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from common import cpu_name, write_results
from dflashkit.decode import native
from dflashkit.decode.static import panel_order
from dflashkit.report import markdown_table

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's decoder linears (out, in) in layer order: q, k, v, o, gate, up, down
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def build(name: str, files: dict[str, str], tmp: Path):
    """Compile the sources `files` (native.cpp and the headers it includes) as op namespace dfk_NAME at the chosen
    level, and return its linear."""
    folder, lib = tmp / name, tmp / f"{name}.so"
    folder.mkdir()
    for file, text in files.items():
        (folder / file).write_text(text.replace("TORCH_LIBRARY(dflashkit,", f"TORCH_LIBRARY(dfk_{name},")
                                   .replace("TORCH_LIBRARY_IMPL(dflashkit,", f"TORCH_LIBRARY_IMPL(dfk_{name},"))
    cmd = [str(folder / "native.cpp") if c == str(native.SOURCE) else f"-DDFLASHKIT_OPS=dfk_{name}"
           if c.startswith("-DDFLASHKIT_OPS=") else c for c in native.compile_command(lib)]
    subprocess.run(cmd, check=True)
    torch.ops.load_library(str(lib))
    op = getattr(torch.ops, f"dfk_{name}").linear
    return (lambda x, w: op(x, w[1])) if "panel order" in "".join(files.values()) else (lambda x, w: op(x, w[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD", help="git revision whose native.cpp is the baseline")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    old = {f: subprocess.run(["git", "-C", str(ROOT), "show", f"{args.against}:dflashkit/decode/{f}"],
                             capture_output=True, text=True).stdout for f in ("native.cpp", "kernels.h")}
    with tempfile.TemporaryDirectory() as tmp:
        new = {f: (native.HERE / f).read_text() for f in ("native.cpp", "kernels.h")}
        ops = {"old": build("old", old, Path(tmp)), "new": build("new", new, Path(tmp))}
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    # each weight in both layouts: (rows of outputs, panel order)
    layers = [[(w, panel_order(w)) for w in (torch.randn(o, i, generator=g).to(dtype) for o, i in SHAPES)]
              for _ in range(30)]
    head = torch.randn(49152, 576, generator=g).to(dtype)
    head = (head, panel_order(head))
    rows, ms = [], {}
    for n in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(n, i, generator=g) for i in (576, 1536)}
        err = {k: max((op(xs[w[0].shape[1]], w).double() - xs[w[0].shape[1]].double() @ w[0].double().T).abs().max()
                      .item() for w in layers[0]) for k, op in ops.items()}
        times = {k: [] for k in ops}
        for _ in range(7):
            for name, op in ops.items():
                t = time.perf_counter()
                for layer in layers:
                    for w in layer:
                        op(xs[w[0].shape[1]], w)
                op(xs[576], head)
                times[name].append(time.perf_counter() - t)
        ms[n] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        first = ms[min(ms)]
        rows.append([n, f"{ms[n]['old']:.2f}", f"{ms[n]['new']:.2f}", f"{ms[n]['new'] / ms[n]['old']:.2f}x",
                     f"{ms[n]['old'] / first['old']:.2f}", f"{ms[n]['new'] / first['new']:.2f}",
                     f"{err['old']:.1e}", f"{err['new']:.1e}"])
        print(*rows[-1], flush=True)
    build_line = native.instruction_set()
    md = [f"# Native linear, {args.against} vs this tree ({args.dtype})", "",
          f"CPU: {cpu_name()}; kernels built for {build_line}; SmolLM2-135M's 210 decoder linears and its head, "
          "median of 7; error: the largest against a float64 product, first layer.", "",
          markdown_table(["rows", "old ms", "new ms", "new/old", "old vs 1 row", "new vs 1 row", "old error",
                          "new error"], rows)]
    tag = f"-{args.tag}" if args.tag else ""
    write_results(ROOT / "benchmarks" / "results" / f"cpu-{date.today()}-native-linear{tag}", md,
                  {"cpu": cpu_name(), "build": build_line, "dtype": args.dtype, "against": args.against, "ms": ms})


if __name__ == "__main__":
    sys.exit(main())
