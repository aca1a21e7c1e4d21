"""The data stage's features recorded while generating vs a second forward over prompt + answer, side by side.

    python benchmarks/fused_capture.py [--batch 32] [--prompts 32] [--new-tokens 192] [--rounds 2]

Extraction (and so the demo's data stage) used to generate the target's answers, then run one more forward over
every prompt + answer to capture the drafter's layers. Recording them during generation (target/generation.py)
drops that pass. This runs both on the first prompts of the demo's training suite with the demo's settings
(batch 32, 192 new tokens, layers 1,8,14,20,27), in alternating rounds: two-pass = iter_generate_greedy then
capture_features in groups as extraction formed them (capture_tokens 4096), fused = iter_generate_with_features.
It checks the answers are the same and the features agree, and prints prompt+answer tokens/s and the ratio.
Writes benchmarks/results/cpu-DATE-fused-capture.{md,json}, naming the CPU.
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
from dflashkit.cache.extraction import _batches, capture_features  # noqa: E402
from dflashkit.demo import DemoConfig, demo_suites  # noqa: E402
from dflashkit.report import markdown_table  # noqa: E402
from dflashkit.targets.generation import iter_generate_greedy, iter_generate_with_features  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402

LAYERS = [1, 8, 14, 20, 27]


def two_pass(target, prompts, new_tokens, batch):
    answers = dict(iter_generate_greedy(target, prompts, new_tokens, batch_size=batch))
    seqs = {i: prompts[i] + answers[i] for i in answers}
    lengths = {i: len(s) for i, s in seqs.items()}
    feats = {}
    for group in _batches(sorted(seqs, key=lengths.__getitem__), lengths, batch, 4096):
        feats.update(zip(group, capture_features(target, [seqs[i] for i in group], LAYERS)))
    return answers, feats


def fused(target, prompts, new_tokens, batch):
    answers, feats = {}, {}
    for i, comp, fe in iter_generate_with_features(target, prompts, new_tokens, LAYERS, batch_size=batch):
        answers[i], feats[i] = comp, fe
    return answers, feats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    target = load_target(args.target, device="cpu")
    suite = demo_suites(DemoConfig()).train
    prompts = [target.chat_ids(it.messages) for it in suite.items[: args.prompts]]
    ways = {"two-pass": two_pass, "fused": fused}
    ways["fused"](target, prompts[:2], 4, 2)  # warm-up
    times, outs = {k: [] for k in ways}, {}
    for r in range(args.rounds):
        for name, fn in (ways.items() if r % 2 == 0 else reversed(ways.items())):
            t0 = time.perf_counter()
            outs[name] = fn(target, prompts, args.new_tokens, args.batch)
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
    (a_ans, a_feat), (b_ans, b_feat) = outs["two-pass"], outs["fused"]
    same = sum(a_ans[i] == b_ans[i] for i in a_ans)
    diff = max(float((a_feat[i][layer].float() - b_feat[i][layer].float()).abs().max()) for i in a_ans for layer in LAYERS)
    tokens = sum(len(prompts[i]) + len(a_ans[i]) for i in a_ans)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [[k, med[k], tokens / med[k], med["two-pass"] / med[k]] for k in med]
    day = time.strftime("%Y-%m-%d")
    out = {"machine": cpu_name(), "target": args.target, "dtype": str(target.dtype).removeprefix("torch."),
           "torch": torch.__version__, "batch": args.batch, "prompts": len(prompts), "new_tokens": args.new_tokens,
           "layers": LAYERS, "tokens": tokens, "same_answers": same, "max_feature_diff": diff, "seconds": times}
    md = [f"# Data stage: features recorded while generating vs a second forward ({day})", "",
          f"Machine: {out['machine']}; {args.target} in {out['dtype']}, torch {torch.__version__}. Produced by "
          f"benchmarks/fused_capture.py: the first {len(prompts)} prompts of the demo's training suite, batches of "
          f"{args.batch}, {args.new_tokens} new tokens at most, layers {LAYERS}; median of {args.rounds} alternating "
          f"rounds. Answers equal: {same} of {len(prompts)}; largest feature difference {diff:.2e}.", "",
          markdown_table(["capture", "seconds", "prompt+answer tokens/s", "speedup"], rows, digits=2)]
    print("\n".join(md[4:]))
    write_results(Path(args.results) / f"cpu-{day}-fused-capture", md, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
