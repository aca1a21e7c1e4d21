"""Chain tau at T>0 under each acceptance rule, same prompts and seeds: `match` (greedy drafts kept iff equal to
the target's sample) and `rejection` (drafts drawn from the drafter's q, kept with min(1, p/q), as z-lab's
reference), with q at several temperatures and greedy shares (`--draft-mix`).

    python benchmarks/acceptance_at_temperature.py DRAFTER [DRAFTER ...] [--temperature 0.7] [--num-prompts 10]
        [--seeds 1] [--rules match,rejection:1:1,rejection:0.5:1,rejection:1:0.3]

A rule `rejection:F:M` samples q at temperature F x T and draws a share M of each position from it (the rest
keeps the greedy draft). Every rule leaves the output distributed as the target's own sampling; only the
acceptance differs. Writes JSON + Markdown to --results (default benchmarks/results/cpu-DATE-acceptance-T.*)
after every row, naming the CPU; tau comes with its standard error over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name  # noqa: E402
from dflashkit.decode.sampling import Sampling  # noqa: E402
from dflashkit.decode.speculative import DFlashProposer, generate  # noqa: E402
from dflashkit.drafter.checkpoint import load_drafter  # noqa: E402
from dflashkit.fileio import write_json, write_text  # noqa: E402
from dflashkit.prompts import load_prompts  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402


def parse_rules(spec: str, T: float) -> list[tuple[str, float | None, float]]:
    rules = []
    for part in spec.split(","):
        name, *nums = part.split(":")
        if name == "match" and not nums:
            rules.append(("match", None, 1.0))
        elif name == "rejection" and len(nums) == 2:
            rules.append(("rejection", float(nums[0]) * T, float(nums[1])))
        else:
            raise SystemExit(f"--rules: {part!r} is neither 'match' nor 'rejection:F:M' (q temperature F x T, share M)")
    return rules


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="coding-10")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=1, help="decodes per prompt, seeded 0..N-1 (the same for every rule)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rules", default="match,rejection:1:1,rejection:0.5:1,rejection:1:0.3")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    T = args.temperature
    rules = parse_rules(args.rules, T)
    target = load_target(args.target, device="cpu")
    suite = load_prompts(args.prompts).subset(args.num_prompts)
    prompts = [(it.id, target.chat_ids(it.messages)) for it in suite.items]
    out = {"machine": cpu_name(), "date": time.strftime("%Y-%m-%d"), "temperature": T, "prompts": len(prompts),
           "seeds": args.seeds, "suite": args.prompts, "max_new_tokens": args.max_new_tokens,
           "target_dtype": str(target.dtype), "rows": []}
    results = Path(args.results or ROOT / "benchmarks" / "results" / f"cpu-{out['date']}-acceptance-T{T:g}")
    for path in args.drafters:
        d = load_drafter(path, target=target)
        proposer = DFlashProposer(target, d)
        for rule, t_draft, mix in rules:
            acc = []
            for i, (_, ids) in enumerate(prompts):
                for seed in range(args.seeds):
                    gen = torch.Generator().manual_seed(1000 * seed + i)
                    g = generate(target, ids, "chain", proposer, max_new_tokens=args.max_new_tokens,
                                 sampling=Sampling(T, rule, t_draft, mix), generator=gen)
                    acc += g.accepted
            row = {"drafter": path, "arch": d.config.arch, "rule": rule, "draft_temperature": t_draft, "draft_mix": mix,
                   "tau": statistics.mean(acc), "se": statistics.stdev(acc) / len(acc) ** 0.5, "rounds": len(acc)}
            out["rows"].append(row)
            print(row, flush=True)
            write(results, out, args)
    return 0


def write(results: Path, out: dict, args) -> None:
    """JSON + Markdown of the rows so far (atomic writes: an interrupted run keeps what it measured)."""
    write_json(results.parent / (results.name + ".json"), out)  # (with_suffix would eat the ".7" of T0.7)
    T = out["temperature"]
    lines = [f"# Chain tau at T={T:g} by acceptance rule ({out['date']})", "",
             f"Machine: {out['machine']}. Target {args.target} ({out['target_dtype']}), {out['prompts']} prompts of "
             f"{args.prompts} x {out['seeds']} seed(s), {args.max_new_tokens} new tokens, the same seeds for every "
             "rule. Produced by benchmarks/acceptance_at_temperature.py. A rejection rule draws a share (mix) of each "
             "draft position from q at its temperature and keeps the greedy draft otherwise.", "",
             "| drafter | arch | rule | q temperature | mix | chain tau | s.e. | rounds |", "|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        qt = "greedy draft" if r["draft_temperature"] is None else f"{r['draft_temperature']:g}"
        mix = "" if r["rule"] == "match" else f"{r['draft_mix']:g}"
        lines.append(f"| {r['drafter']} | {r['arch']} | {r['rule']} | {qt} | {mix} | {r['tau']:.3f} | {r['se']:.3f} | "
                     f"{r['rounds']} |")
    write_text(results.parent / (results.name + ".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
