"""The data stage's throughput against its batch size: which batch makes the most training data per CPU-minute?

    python benchmarks/generation_batch.py [--sizes 8,16,32,64] [--prompts 64] [--new-tokens 192]

The demo's data stage generates the target's greedy answers with the drafter's layers recorded (target/
generation.py), batched. A larger batch reads the weights once for more rows, but every batch runs until its
longest answer ends, and each step attends over more padded rows. This generates the same first prompts of the
demo's training suite at each batch size, one size after another in one process (so the machine's state is
shared), and prints answer tokens/s (the training data) and the ratio to the demo's batch (32).
Writes benchmarks/results/cpu-DATE-generation-batch.{md,json}, naming the CPU and the dtype.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name, write_results  # noqa: E402
from dflashkit.demo import DemoConfig, demo_suites  # noqa: E402
from dflashkit.report import markdown_table  # noqa: E402
from dflashkit.targets.generation import iter_generate_with_features  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402

LAYERS = [1, 8, 14, 20, 27]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    target = load_target(args.target, device="cpu", dtype=args.dtype)
    suite = demo_suites(DemoConfig()).train
    prompts = [target.chat_ids(it.messages) for it in suite.items[: args.prompts]]
    list(iter_generate_with_features(target, prompts[:2], 4, LAYERS, batch_size=2))  # warm-up
    rows, answers = [], {}
    for size in sizes:
        t0, toks = time.perf_counter(), 0
        for i, comp, _ in iter_generate_with_features(target, prompts, args.new_tokens, LAYERS, batch_size=size):
            toks += len(comp)
            answers.setdefault(i, comp)
        seconds = time.perf_counter() - t0
        rows.append({"batch": size, "seconds": seconds, "answer_tokens": toks, "tokens_per_s": toks / seconds})
        print(f"batch {size}: {seconds:.1f} s, {toks / seconds:.1f} answer tokens/s", flush=True)
    base = next((r for r in rows if r["batch"] == 32), rows[0])
    for r in rows:
        r["vs_32"] = r["tokens_per_s"] / base["tokens_per_s"]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    day, dtype = time.strftime("%Y-%m-%d"), str(target.dtype).removeprefix("torch.")
    out = {"machine": cpu_name(), "target": args.target, "dtype": dtype, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "prompts": len(prompts), "new_tokens": args.new_tokens,
           "layers": LAYERS, "rows": rows, "best": best["batch"]}
    md = [f"# Data stage: generation throughput against batch size ({day})", "",
          f"Machine: {out['machine']}, {out['threads']} threads; {args.target} in {dtype}, torch {torch.__version__}. "
          f"Produced by benchmarks/generation_batch.py: the first {len(prompts)} prompts of the demo's training suite, "
          f"{args.new_tokens} new tokens at most, layers {LAYERS} recorded while generating, each batch size in turn in "
          f"one process. Best: batch {best['batch']}.", "",
          markdown_table(["batch", "seconds", "answer tokens/s", "vs batch 32"],
                         [[r["batch"], r["seconds"], r["tokens_per_s"], r["vs_32"]] for r in rows], digits=2)]
    print("\n".join(md[4:]))
    write_results(Path(args.results) / f"cpu-{day}-{dtype}-generation-batch", md, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
