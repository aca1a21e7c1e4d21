"""DDTree over a DFlash2 drafter: children scored by its candidate selector given their parent (new) against the
reference's independent marginals, offline (accepted depth per block, stride anchors) and online (ddtree-N tau and
tokens/s, every output checked against plain greedy decoding), in one run.

    python benchmarks/selector_trees.py DRAFTER --cache runs/demo/cache/coding-10 [--num-prompts 5] [--budget 8]

Writes JSON + Markdown to --results (default benchmarks/results/cpu-DATE-selector-trees.*), naming the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name  # noqa: E402
from dflashkit.cache import open_cache  # noqa: E402
from dflashkit.decode.speculative import DFlashProposer, generate  # noqa: E402
from dflashkit.drafter.checkpoint import load_drafter  # noqa: E402
from dflashkit.evaluate.offline import evaluate  # noqa: E402
from dflashkit.fileio import write_json  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter")
    ap.add_argument("--cache", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    target = load_target(args.target, device="cpu")
    d = load_drafter(args.drafter, target=target)
    if d.config.arch != "dflash2":
        raise SystemExit(f"{args.drafter}: a DFlash2 drafter is needed (this one is {d.config.arch})")
    cache = open_cache(args.cache, expect_target=target.identity())
    trees = ["budget:4", f"budget:{args.budget}", "selector:4", f"selector:{args.budget}"]
    off = evaluate(d, target, cache, trees=trees, anchors="stride")["overall"]
    out = {"machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "drafter": args.drafter, "cache": args.cache,
           "offline": {t: off[t] for t in trees} | {"blocks": off["blocks"]}, "online": {}}
    prompts = [(r.id, r.tokens[: r.prompt_len].tolist()) for r in list(cache)[: args.num_prompts]]
    ar = {pid: generate(target, ids, "ar", max_new_tokens=args.max_new_tokens).tokens for pid, ids in prompts}
    for name, selector in (("marginals", False), ("selector", True)):
        proposer = DFlashProposer(target, d, selector_trees=selector)
        acc, seconds, tokens = [], 0.0, 0
        for pid, ids in prompts:
            g = generate(target, ids, f"ddtree-{args.budget}", proposer, max_new_tokens=args.max_new_tokens)
            if g.tokens != ar[pid]:
                raise SystemExit(f"{name} ddtree: LOSSLESS CHECK FAILED on {pid}")
            acc, seconds, tokens = acc + g.accepted, seconds + g.times["total"], tokens + len(g.tokens)
        out["online"][name] = {"tau": sum(acc) / len(acc), "tokens_per_s": tokens / seconds, "rounds": len(acc)}
        print(name, out["online"][name], flush=True)
    results = Path(args.results or ROOT / "benchmarks" / "results" / f"cpu-{out['date']}-selector-trees")
    write_json(results.with_suffix(".json"), out)
    b, o, n = args.budget, out["offline"], out["online"]
    md = [f"# DFlash2: selector-scored DDTree vs marginals ({out['date']})", "",
          f"Machine: {out['machine']}. Drafter {args.drafter}; offline on {args.cache} (stride anchors, {o['blocks']} "
          f"blocks), online ddtree-{b} on its first {len(prompts)} prompts ({args.max_new_tokens} new tokens, outputs "
          "equal to plain greedy decoding). Produced by benchmarks/selector_trees.py.", "",
          f"| tree | offline depth, 4 nodes | offline depth, {b} nodes | online ddtree-{b} tau | online tokens/s |",
          "|---|---|---|---|---|",
          f"| marginals (reference DDTree) | {o['budget:4']:.3f} | {o[f'budget:{b}']:.3f} | {n['marginals']['tau']:.3f} | "
          f"{n['marginals']['tokens_per_s']:.1f} |",
          f"| selector given the parent | {o['selector:4']:.3f} | {o[f'selector:{b}']:.3f} | {n['selector']['tau']:.3f} | "
          f"{n['selector']['tokens_per_s']:.1f} |"]
    results.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
