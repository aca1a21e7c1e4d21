"""Online decoding cost: per-round overhead outside the drafter and target forwards, all methods side by side.

    python benchmarks/bench_decode.py [--num-prompts 3] [--max-new-tokens 32] [--out runs/bench-decode]

SmolLM2-135M in fp32 with a random 5-layer drafter (block 16, z-lab layer ids) on coding-10 prompts. A random
drafter is rejected almost always (tau ~1), so speedups here are below 1 by construction; what this measures
is the loop itself. Target (issue 5): the time a round spends outside drafter and target forwards (Python,
cache cropping and compaction, tree building, sampling) is under 10% of the round, for chain and DDTree.
All methods run in one process, rotated per prompt after a warm-up, and every output is checked against
plain decoding. Writes results.json, report.md and plots to --out; exits 1 if the overhead target is missed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dflashkit.cli import use_environment
from dflashkit.measure.bench import bench_markdown, parse_methods, run_bench, write_bench
from dflashkit.drafter.checkpoint import new_drafter
from dflashkit.prompts import load_prompts
from dflashkit.targets.model import load_target

LIMIT = 0.10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--methods", default="ar,chain,ddtree-4,ddtree-8,ddtree-16,prompt-lookup")
    ap.add_argument("--out", default="runs/bench-decode")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's). On a 2-core machine shared with other jobs, 1 "
                         "avoids spinning threads that slow a 16-token forward 5x")
    args = ap.parse_args()
    use_environment()  # $DFLASHKIT_HOME and the rest, as the `dflashkit` command reads them
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    drafter = new_drafter(target, num_layers=5).eval()
    suite = load_prompts("coding-10").subset(args.num_prompts)
    prompts = [(item.id, target.chat_ids(item.messages)) for item in suite.items]
    result = run_bench(target, drafter, prompts, parse_methods(args.methods), max_new_tokens=args.max_new_tokens)
    write_bench(result, args.out)
    print(bench_markdown(result))

    ok = not result["mismatches"]
    for m, s in result["methods"].items():
        if m == "ar" or s["overhead"] is None:
            continue
        r = s["ms_per_round"]
        verdict = "ok" if s["overhead"] < LIMIT else "OVER"
        ok &= s["overhead"] < LIMIT
        print(f"{m:10s} round {r['total']:7.1f} ms = draft {r['draft']:6.1f} + verify {r['verify']:6.1f} + "
              f"other {r['other']:5.1f} ms -> overhead {100 * s['overhead']:4.1f}% (limit {100 * LIMIT:.0f}%) {verdict}")
    print(f"threads {torch.get_num_threads()}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
