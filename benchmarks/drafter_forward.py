"""One drafter forward of online decoding, as the loop runs it: F.linear vs the few-row products, side by side.

    python benchmarks/drafter_forward.py [--drafter runs/demo/train/best] [--calls 60] [--rounds 3]

In a decoding round the drafter runs right after a target forward that has pushed its weights out of the CPU's
caches. This replays DFlashProposer.propose on 1-4 new context positions per call (a 200-token context first),
streaming 96 MB through the cache before each call to stand in for the target forward, once with the drafter's
products on F.linear and once inside DecodingProducts (drafter/head.py), alternating rounds, and reports the
median milliseconds per forward, the ratio and the largest logit difference.
Writes benchmarks/results/cpu-DATE-drafter-forward.{md,json}, naming the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

import dflashkit.drafter.head as head  # noqa: E402
from common import cpu_name, write_results  # noqa: E402
from dflashkit.decode.speculative import DFlashProposer  # noqa: E402
from dflashkit.drafter.checkpoint import load_drafter  # noqa: E402
from dflashkit.report import markdown_table  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default="runs/demo/train/best", help="a trained drafter folder (make demo writes one)")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    target = load_target(args.target, device="cpu")
    drafter = load_drafter(args.drafter, target=target, device=target.device, dtype=target.dtype)
    prop = DFlashProposer(target, drafter)
    width = len(prop.layer_ids) * target.hidden_size
    g = torch.Generator().manual_seed(0)
    first = torch.randn(1, 200, width, generator=g)
    news = [torch.randn(1, 1 + i % 4, width, generator=g) for i in range(args.calls)]
    flush = torch.zeros(96 * 2**20 // 4)

    def run(few_rows: bool):
        head.FEW_ROWS = 24 if few_rows else 0
        prop.reset([])
        anchor, start = torch.tensor([5]), 200
        prop.propose(first, anchor, start)
        times, logits = [], []
        for f in news:
            start += f.shape[1]
            flush.add_(1.0)  # the target forward's weights pass through the caches
            t0 = time.perf_counter()
            logits.append(prop.propose(f, anchor, start))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000, logits

    ms, logits = {"F.linear": [], "few-row products": []}, {}
    for r in range(args.rounds):
        for name in (list(ms) if r % 2 == 0 else reversed(list(ms))):
            t, logits[name] = run(name != "F.linear")
            ms[name].append(t)
    diff = max(float((a - b).abs().max()) for a, b in zip(*logits.values()))
    med = {k: statistics.median(v) for k, v in ms.items()}
    rows = [[k, med[k], med["F.linear"] / med[k]] for k in med]
    day = time.strftime("%Y-%m-%d")
    out = {"machine": cpu_name(), "target": args.target, "drafter": args.drafter, "config": str(drafter.config),
           "torch": torch.__version__, "calls": args.calls, "rounds": args.rounds, "ms": ms, "max_logit_diff": diff}
    md = [f"# One drafter forward in online decoding: F.linear vs few-row products ({day})", "",
          f"Machine: {out['machine']}; torch {torch.__version__}; drafter {args.drafter} "
          f"({drafter.config.num_hidden_layers} layers, block {drafter.config.block_size}, float32). Produced by "
          f"benchmarks/drafter_forward.py: {args.calls} calls of DFlashProposer.propose on 1-4 new positions after a "
          f"200-token context, 96 MB streamed through the cache before each (the target forward's stand-in); median "
          f"ms per forward, median of {args.rounds} alternating rounds. Largest logit difference {diff:.1e}.", "",
          markdown_table(["products", "ms per forward", "speedup"], rows, digits=2)]
    print("\n".join(md[4:]))
    write_results(Path(args.results) / f"cpu-{day}-drafter-forward", md, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
