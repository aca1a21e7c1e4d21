"""What a verify of n tokens costs on the static step with the dot kernels (`native`) and the AMX tile kernels
(`tiles`), side by side in one process: the compiled step of each width, timed alternately, after 200 tokens of
context. A cost-aware tree grows while a wider verify pays, so a flat curve buys larger trees (more tau).

    python benchmarks/tile_verify.py [--target smollm2-135m] [--rounds 7] [--out benchmarks/results/NAME]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import cpu_name, write_results
from dflashkit.decode.static import TREE_WIDTHS, StaticDecoder, cpu_kernels, geometry_of
from dflashkit.targets.model import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--depth", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_target(args.target, device="cpu", dtype="bfloat16")
    if cpu_kernels(target, geometry_of(target)) != "tiles":
        raise SystemExit("the tile kernels do not run here (bf16 weights that tile and a CPU with AMX)")
    decoders = {k: StaticDecoder(target, 512, kernels=k, layer_ids=[1, 2], trees=True) for k in ("native", "tiles")}
    for d in decoders.values():
        d.warm(timed=1)
    times = {k: {w: [] for w in (1, *TREE_WIDTHS)} for k in decoders}
    for _ in range(args.rounds):  # alternate, so that the host's drift falls on both alike
        for k, d in decoders.items():
            for w, s in d.time_widths(args.depth, timed=3).items():
                times[k][w].append(s)
    med = {k: {w: statistics.median(v) * 1e3 for w, v in t.items()} for k, t in times.items()}
    md = [f"# Static step per verify width: native dots vs AMX tiles ({args.target}, bf16)", "",
          f"Machine: {cpu_name()}. Compiled steps, {args.depth} tokens of context, median of {args.rounds} alternating "
          "rounds of 3.", "", "| width | native ms | ratio to 1 | tiles ms | ratio to 1 | tiles vs native |",
          "|---|---|---|---|---|---|"]
    for w in med["native"]:
        n, t = med["native"][w], med["tiles"][w]
        md.append(f"| {w} | {n:.2f} | {n / med['native'][1]:.2f} | {t:.2f} | {t / med['tiles'][1]:.2f} | {n / t:.2f}x |")
    print("\n".join(md))
    if args.out:
        write_results(args.out, md, {"machine": cpu_name(), "ms": med})


if __name__ == "__main__":
    main()
