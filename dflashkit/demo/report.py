"""The demo's report.md and report.json, read from the files the stages wrote (not passed in memory), so that a
rerun that skipped every stage still reports the run that built them. The bench sections are bench's own report."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from dflashkit.fileio import read_json, write_json, write_text
from dflashkit.measure.bench import PEERS, PLAIN, TRANSFORMERS, bench_markdown
from dflashkit.measure.probe import machine_key
from dflashkit.report import markdown_table
from dflashkit.targets.formats import describe
from dflashkit.targets.invariant import describe_kernels
from dflashkit.targets.model import dtype_reason

DRAFTERS, ANCHORS = ("trained", "first-checkpoint", "untrained"), ("stride", "walk")


def load(path: Path) -> dict:  # a stage's JSON output, {} when the stage has not written it (a corrupt one: an error)
    return read_json(path, fix="rerun `dflashkit demo` to rebuild it") if path.is_file() else {}


def headline(bench: dict, suite: str) -> str:
    """One line of a bench for the console: our fastest method against plain decoding, and lossless or not."""
    ours = {m: s for m, s in bench.get("methods", {}).items() if m not in PLAIN and not m.startswith(TRANSFORMERS + PEERS)}
    if not ours:
        return f"{suite}: not run"
    m, s = max(ours.items(), key=lambda x: x[1]["speedup_vs_ar"] or 0.0)
    lossless = "every output equal to plain greedy decoding" if not bench["mismatches"] else "OUTPUTS DIFFER"
    return (f"{suite}: {m} {s['speedup_vs_ar'] or 0:.2f}x plain decoding, {s['speedup_vs_fastest_plain'] or 0:.2f}x "
            f"the fastest plain decoder here ({s['fastest_plain']}), tau {s['tau'] or 0:.2f}; {lossless}")


def bench_section(root: Path, folder: str, title: str) -> list[str]:
    """bench's own report of one suite under `title`: its headings one level down, its images linked from here."""
    head, _, body = bench_markdown(load(root / folder / "results.json")).partition("\n")
    body = re.sub(r"^##", "###", body, flags=re.M).replace("](", f"]({folder}/")
    images = [f"![speedup]({folder}/speedup.png)"] if (root / folder / "speedup.png").is_file() else []  # (and bench's own)
    return [f"## {title}", "", f"{head.lstrip('# ')}.", body, *images, ""]


def offline_table(offline: dict) -> str:
    keys = ("prompts", "blocks", "streak", "tau", "pos1_acc", "budget:4", "budget:8")
    headers = ["anchors / drafter", "prompts", "blocks", "streak", "tau", "pos-1 acc", "ddtree-4", "ddtree-8"]
    return markdown_table(headers, [[name] + [o.get(k) for k in keys] for name, o in offline.items() if o])


def timings_table(timings: dict) -> str:
    rows = [[name, t["seconds"], t.get("estimate_s"), t["seconds"] / t["estimate_s"] if t.get("estimate_s") else None,
             t["skipped"], " / ".join(map(str, t["settings"].values()))] for name, t in timings.items()]
    return markdown_table(["stage", "seconds", "estimated s", "actual / estimate", "skipped", "built with"], rows)


def write_report(root: Path, cfg, target, timings: dict, plan: str) -> dict:
    """report.md and report.json; returns the lines for the console."""
    m = machine_key(target)[1]
    bench, holdout = load(root / "bench" / "results.json"), load(root / "bench-holdout" / "results.json")
    offline = {f"{a}/{d}": load(root / "eval" / f"{d}-{a}" / "results.json").get("overall") or {}
               for a in ANCHORS for d in DRAFTERS}
    lines = ["# dflashkit demo report", "",
             f"Target `{cfg.target}` on `{target.device}`, {m['cpu'] or 'unknown CPU'} ({', '.join(m['flags']) or '-'}), "
             f"{m['threads']} threads, torch {m['torch']}; eval suite `{cfg.eval_suite}`.", "",
             f"Numerics: dtype {dtype_reason(target.dtype, target.device, cfg.dtype)}; weights "
             f"{describe(target)}. Decoding kernels: {describe_kernels(target.model)}.", "", f"Plan: {plan}.", "",
             "## Offline evaluation (eval cache, temperature 0)", "",
             "ddtree-4/ddtree-8 = DDTree node-budget trees budget:4/8 (the paper's tree, docs/design.md section 5).", "",
             offline_table(offline),
             "![per-position acceptance](eval/compare-stride/acceptance.png)", "",
             *bench_section(root, "bench", f"Online speculative decoding on `{cfg.eval_suite}` (live target)"),
             *bench_section(root, "bench-holdout", f"Held-out suite `{cfg.holdout_suite}` (never trained on or "
                            "selected with: complete a function from its signature and docstring)")]
    train = root / "train" / "summary.md"  # train's own summary, held-out metrics included
    if train.is_file():
        lines += ["## Training", "", f"Recipe `{cfg.recipe}` (`dflashkit config show {cfg.recipe}`), "
                  f"{cfg.minutes:g} minutes.", "", train.read_text().partition("\n\n")[2], "![loss](train/loss.png)", ""]
    lines += ["## Stage timings", "", "Seconds each stage took when it was built (a skipped stage reused that output), "
              "against the estimate printed before it ran (plan.py), and the numerics it was built with.", "",
              timings_table(timings)]
    write_text(root / "report.md", "\n".join(lines) + "\n")
    write_json(root / "report.json", {"plan": plan, "machine": m, "config": asdict(cfg), "offline": offline,
                                      "training": load(root / "train" / "summary.json"), "timings": timings,
                                      "bench": bench.get("methods"), "holdout": holdout.get("methods")})
    return {"console": [headline(bench, cfg.eval_suite), headline(holdout, cfg.holdout_suite)]}
