"""The field's standard sets on this machine: Spec-Bench (the first N of each of its 13 categories) and z-lab's four
sets (gsm8k, math500, mbpp, mt-bench; the first N of each), per category and overall, in one process per set.

    python benchmarks/standard_sets.py --drafter runs/dflash2-vs-dflash/dflash/best --data DATA

DATA holds spec-bench/question.jsonl (hemingkx/Spec-Bench, Apache-2.0) and deepspec/{gsm8k,math500,mbpp,mt-bench}.jsonl
(deepseek-ai/DeepSpec eval_datasets, MIT): public files, not shipped with dflashkit.

Methods (default): ar, ngram, ddtree-8, hybrid-auto, prompt-lookup. Multi-turn rows (MT-Bench, Spec-Bench's first
eight categories) ask each turn after the method's own answer; tokens and time count both answers. Every output at
T=0 is checked against plain decoding (a mismatch exits 1). Writes benchmarks/results/cpu-DATE-<set>.{md,json} and
the per-category plot beside them, naming the CPU; the bench folders (all plots) stay under --runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name  # noqa: E402
from dflashkit.measure.bench import bench_markdown, parse_methods, run_bench, write_bench  # noqa: E402
from dflashkit.drafter.checkpoint import load_drafter  # noqa: E402
from dflashkit.fileio import write_text  # noqa: E402
from dflashkit.prompts import select_prompts  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402

SETS = {"spec-bench": ["spec-bench/question.jsonl"],
        "zlab-sets": [f"deepspec/{n}.jsonl" for n in ("gsm8k", "math500", "mbpp", "mt-bench")]}


def compact_json(result: dict) -> str:
    """The result indented, but each run (its token ids included) on one line: a reviewable file of ~1/4 the size."""
    runs = result["runs"]
    body = json.dumps({**result, "runs": ["RUNS"]}, indent=1)
    return body.replace('"RUNS"', ",\n  ".join(json.dumps(r) for r in runs)) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="drafter folder (the demo's, or any trained on the target)")
    ap.add_argument("--data", required=True, help="folder holding spec-bench/ and deepspec/")
    ap.add_argument("--sets", default="spec-bench,zlab-sets", help="comma list of " + ", ".join(SETS))
    ap.add_argument("--per-category", default="spec-bench=5,zlab-sets=10", help="N per category, per set")
    ap.add_argument("--methods", default="ngram,ddtree-8,hybrid-auto,prompt-lookup")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--runs", default="runs/standard-sets", help="bench folders (results.json, report.md, plots)")
    ap.add_argument("--results", default="benchmarks/results", help="where the committed summaries go")
    args = ap.parse_args()
    per = dict(x.split("=") for x in args.per_category.split(","))
    target = load_target(args.target, device="cpu", dtype="auto")
    drafter = load_drafter(args.drafter, target=target, device=target.device, dtype=target.dtype)
    day, machine, failed = time.strftime("%Y-%m-%d"), cpu_name(), 0
    for name in args.sets.split(","):
        files = [str(Path(args.data) / f) for f in SETS[name]]
        suite = select_prompts(",".join(files), per_category=int(per[name]))
        t0 = time.time()
        result = run_bench(target, drafter, [(it.id, it) for it in suite.items], parse_methods(args.methods),
                           max_new_tokens=args.max_new_tokens)
        result["config"].update(machine=machine, drafter=str(args.drafter), files=files, wall_s=time.time() - t0)
        write_bench(result, Path(args.runs) / name)
        stem = Path(args.results) / f"cpu-{day}-{name}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(args.runs) / name / "categories.png", f"{stem}-categories.png")
        header = (f"Machine: {machine}. Target {target.name} ({result['config']['dtype']}), drafter {args.drafter}. "
                  f"Prompts: {', '.join(SETS[name])} from the shared data, the first {per[name]} of each category "
                  f"({len(suite)} conversations). Produced by benchmarks/standard_sets.py in "
                  f"{result['config']['wall_s'] / 60:.0f} min.\n\n")
        md = bench_markdown(result).replace("](categories.png)", f"]({stem.name}-categories.png)")
        md = md.replace("![cost curve](cost.png)\n", "")
        write_text(f"{stem}.md", md.replace("\n\n", "\n\n" + header, 1))
        write_text(f"{stem}.json", compact_json(result))
        print(f"wrote {stem}.md, {stem}.json")
        failed += bool(result["mismatches"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
