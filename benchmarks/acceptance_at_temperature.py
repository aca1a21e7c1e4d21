"""Chain tau at T>0 under each acceptance rule, same prompts and seeds: `match` (greedy drafts kept iff equal to
the target's sample) and `rejection` (drafts sampled from the drafter's q, kept with min(1, p/q), as z-lab's
reference) with q at several draft temperatures.

    python benchmarks/acceptance_at_temperature.py DRAFTER [DRAFTER ...] [--temperature 0.7] [--num-prompts 10]

Every rule leaves the output distributed as the target's own sampling; only the acceptance differs. Writes JSON +
Markdown to --results (default benchmarks/results/cpu-DATE-acceptance-T.*), naming the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.dflash2_vs_dflash import cpu_name  # noqa: E402
from dflashkit.decode.speculative import DFlashProposer, generate  # noqa: E402
from dflashkit.drafter.checkpoint import load_drafter  # noqa: E402
from dflashkit.fileio import write_json  # noqa: E402
from dflashkit.prompts import load_prompts  # noqa: E402
from dflashkit.target.model import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="coding-10")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--draft-temperatures", default="1,0.5,0.25", help="fractions of T for the rejection rule's q")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    T = args.temperature
    target = load_target(args.target, device="cpu")
    suite = load_prompts(args.prompts).subset(args.num_prompts)
    prompts = [(it.id, target.chat_ids(it.messages)) for it in suite.items]
    rules = [("match", None)] + [("rejection", float(f) * T) for f in args.draft_temperatures.split(",")]
    out = {"machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "temperature": T, "prompts": len(prompts),
           "suite": args.prompts, "max_new_tokens": args.max_new_tokens, "target_dtype": str(target.dtype), "rows": []}
    for path in args.drafters:
        d = load_drafter(path, target=target)
        proposer = DFlashProposer(target, d)
        for rule, t_draft in rules:
            acc = []
            for i, (_, ids) in enumerate(prompts):
                gen = torch.Generator().manual_seed(i)
                g = generate(target, ids, "chain", proposer, max_new_tokens=args.max_new_tokens, temperature=T,
                             generator=gen, acceptance=rule, draft_temperature=t_draft)
                acc += g.accepted
            row = {"drafter": path, "arch": d.config.arch, "rule": rule, "draft_temperature": t_draft,
                   "tau": sum(acc) / len(acc), "rounds": len(acc)}
            out["rows"].append(row)
            print(row, flush=True)
    results = Path(args.results or ROOT / "benchmarks" / "results" / f"cpu-{out['date']}-acceptance-T{T:g}")
    write_json(results.parent / (results.name + ".json"), out)  # (with_suffix would eat the ".7" of T0.7)
    lines = [f"# Chain tau at T={T:g} by acceptance rule ({out['date']})", "",
             f"Machine: {out['machine']}. Target {args.target} ({out['target_dtype']}), {out['prompts']} prompts of "
             f"{args.prompts}, {args.max_new_tokens} new tokens, the same seeds for every rule. Produced by "
             "benchmarks/acceptance_at_temperature.py.", "",
             "| drafter | arch | rule | q temperature | chain tau | rounds |", "|---|---|---|---|---|---|"]
    for r in out["rows"]:
        qt = "greedy draft" if r["draft_temperature"] is None else f"{r['draft_temperature']:g}"
        lines.append(f"| {r['drafter']} | {r['arch']} | {r['rule']} | {qt} | {r['tau']:.3f} | {r['rounds']} |")
    (results.parent / (results.name + ".md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
