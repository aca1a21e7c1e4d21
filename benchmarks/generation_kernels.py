"""Batched greedy generation (the data stage, `extract`) on the stock kernels vs the compiled ones, side by side.

    python benchmarks/generation_kernels.py [--batch 32] [--prompts 32] [--new-tokens 64] [--rounds 2]

The demo's data stage generates the target's answers in batches of 32 prompts: each step is a 32-row product, the
small-M regime where the compiled kernels (target/compiled.py) beat the stock ones in a verify. This times
iter_generate_greedy over the first prompts of the demo's training suite on both, in alternating rounds (the first
call compiles, outside the timing), checks that both give the same answers, and prints generated tokens/s and the
ratio. Writes benchmarks/results/cpu-DATE-generation-kernels.{md,json}, naming the CPU.
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
from dflashkit.demo import DemoConfig, demo_suites  # noqa: E402
from dflashkit.report import markdown_table  # noqa: E402
from dflashkit.targets.generation import iter_generate_greedy  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    targets = {k: load_target(args.target, device="cpu", dtype="float32", kernels=k) for k in ("eager", "compiled")}
    suite = demo_suites(DemoConfig()).train
    prompts = [targets["eager"].chat_ids(it.messages) for it in suite.items[: args.prompts]]

    def run(kind: str) -> tuple[float, dict]:
        t0 = time.perf_counter()
        out = dict(iter_generate_greedy(targets[kind], prompts, args.new_tokens, batch_size=args.batch))
        return time.perf_counter() - t0, out

    t0 = time.perf_counter()
    run("compiled")  # compiles
    compile_s = time.perf_counter() - t0
    print(f"compiled (and a first pass) in {compile_s:.0f} s", flush=True)
    times, answers = {"eager": [], "compiled": []}, {}
    for r in range(args.rounds):
        for kind in times:
            s, answers[kind] = run(kind)
            times[kind].append(s)
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    tokens = sum(map(len, answers["eager"].values()))
    same = sum(answers["eager"][i] == answers["compiled"][i] for i in answers["eager"])
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [[k, med[k], tokens / med[k], med["eager"] / med[k]] for k in med]
    day = time.strftime("%Y-%m-%d")
    stem = Path(args.results) / f"cpu-{day}-generation-kernels"
    out = {"machine": cpu_name(), "target": args.target, "torch": torch.__version__, "batch": args.batch,
           "prompts": len(prompts), "new_tokens": args.new_tokens, "tokens": tokens, "compile_s": compile_s,
           "same_answers": same, "seconds": times}
    md = [f"# Batched greedy generation of {args.target} (float32): stock vs compiled kernels ({day})", "",
          f"Machine: {out['machine']}; torch {torch.__version__}. Produced by benchmarks/generation_kernels.py: "
          f"iter_generate_greedy over the first {len(prompts)} prompts of the demo's training suite, batches of "
          f"{args.batch}, {args.new_tokens} new tokens each ({tokens} generated), median of {args.rounds} alternating "
          f"rounds; compiling took {compile_s:.0f} s. Answers equal on both kernels: {same} of {len(prompts)}.", "",
          markdown_table(["kernels", "seconds", "generated tokens/s", "speedup"], rows, digits=2)]
    print("\n".join(md[4:]))
    write_results(stem, md, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
