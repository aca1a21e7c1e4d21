"""Do the compiled linears pay inside a whole target forward? Stock vs compiled kernels, side by side.

    python benchmarks/compiled_forward.py [--ns 1,2,4,8,16] [--rounds 3]

benchmarks/cpu_kernels.py times the decoder's linears back to back in one compiled graph. A verify also runs
attention, norms and rotary embeddings between them, and calls each compiled unit from Python (61 calls per
forward on SmolLM2), so this times the product itself: the cost curve `bench` measures (one forward over n new
tokens after a 400-token KV cache), on the stock kernels and on `--kernels compiled` (dflashkit/targets/compiled.py),
in alternating rounds so that both see the same machine; the compile seconds; and whether plain greedy decoding on
the compiled kernels equals the stock one. Writes benchmarks/results/cpu-DATE-compiled-forward.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name, write_results  # noqa: E402
from dflashkit.decode.cost import measure_cost_curve  # noqa: E402
from dflashkit.decode.speculative import generate  # noqa: E402
from dflashkit.report import markdown_table  # noqa: E402
from dflashkit.targets.invariant import row_invariant, stock_kernels  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--ns", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    target = load_target(args.target, device="cpu", dtype="float32", kernels="compiled")
    ns = [int(n) for n in args.ns.split(",")]
    ids = target.chat_ids([{"role": "user", "content": "Write a Python function that reverses a linked list."}])
    t0 = time.perf_counter()
    with row_invariant(target.model):
        measure_cost_curve(target, ns=(1, 3), repeats=1)  # compiles every unit
    compile_s = time.perf_counter() - t0
    print(f"compiled in {compile_s:.0f} s", flush=True)
    with stock_kernels():
        stock_tokens = generate(target, ids, "ar", max_new_tokens=64).tokens
    same = generate(target, ids, "ar", max_new_tokens=64).tokens == stock_tokens
    times = {"stock": [], "compiled": []}
    for r in range(args.rounds):
        with stock_kernels():
            times["stock"].append(measure_cost_curve(target, ns=ns, repeats=5).seconds)
        with row_invariant(target.model):  # what every decoding loop switches to
            times["compiled"].append(measure_cost_curve(target, ns=ns, repeats=5).seconds)
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(
            f"n={n} {1000 * times['stock'][-1][i]:.0f}/{1000 * times['compiled'][-1][i]:.0f} ms"
            for i, n in enumerate(ns)), flush=True)
    med = {k: [1000 * statistics.median(r[i] for r in v) for i in range(len(ns))] for k, v in times.items()}
    s, c = med["stock"], med["compiled"]
    rows = [[n, s[i], s[i] / s[0], c[i], c[i] / c[0], s[i] / c[i]] for i, n in enumerate(ns)]
    day = time.strftime("%Y-%m-%d")
    stem = Path(args.results) / f"cpu-{day}-compiled-forward"
    out = {"machine": cpu_name(), "target": target.name, "dtype": "float32", "torch": torch.__version__,
           "compile_s": compile_s, "greedy_equal": same, "ns": ns, "ms": med, "rounds": times}
    md = [f"# A whole {target.name} forward (float32): stock vs compiled kernels ({day})", "",
          f"Machine: {out['machine']}; torch {torch.__version__}. Produced by benchmarks/compiled_forward.py: the "
          f"cost curve `bench` measures (one forward over n new tokens after a 400-token KV cache, median of 5), "
          f"median of {args.rounds} alternating rounds; compiling took {compile_s:.0f} s. Plain greedy decoding "
          f"(64 tokens) on the compiled kernels equals the stock one: {same}.", "",
          markdown_table(["n tokens", "stock ms", "stock vs n=1", "compiled ms", "compiled vs n=1", "stock / compiled"],
                         rows, digits=2)]
    print("\n".join(md[4:]))
    write_results(stem, md, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
