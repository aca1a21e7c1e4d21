"""An eval run as a user sees it: console lines and the run folder; the scoring itself is evaluate/offline.py."""

from __future__ import annotations

import os
import time
from itertools import zip_longest
from pathlib import Path

import torch

from dflashkit.drafter.checkpoint import drafter_identity, load_drafter
from dflashkit.evaluate.offline import DEFAULT_TREES, cache_info, check_mode, evaluate, parse_trees, stride_anchors
from dflashkit.fileio import atomic_dir, write_json, write_text
from dflashkit.report import bar_plot, hist_plot, line_plot, markdown_table
from dflashkit.tree import parse_tree_spec


def tree_label(spec: str) -> str:
    """Console name, one per tree offline and online: budget:8 -> ddtree-8 (as `--method ddtree-8`), paths:4 -> paths-4."""
    family, k = parse_tree_spec(spec)
    return f"{'ddtree' if family == 'budget' else family}-{k}"


def tree_note(trees) -> str:
    """The header line that says what each tree column means."""
    budgets = [t for t in trees if t.startswith("budget:")]
    parts = []
    if budgets:
        parts.append(f"{'/'.join(tree_label(t) for t in budgets)} = DDTree {'/'.join(budgets)} (paper's node-budget tree)")
    notes = {"paths": "best of the {k} most probable complete drafts",
             "width": "leading positions whose label is in the top-{k} (an upper bound)",
             "selector": "DDTree of {k} nodes scored by the DFlash2 selector given each parent"}
    parts += [f"{tree_label(t)} = {notes[f].format(k=k)}" for t in trees for f, k in [parse_tree_spec(t)] if f in notes]
    return "; ".join(parts) or "no trees requested"


def _f(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def prompt_line(summary: dict, trees, width: int = 24) -> str:
    """`fizzbuzz | 15 blocks | streak=0.47 dds4=0.60 dds8=0.80 | 8.7s` (the user's log format)."""
    metrics = " ".join([f"streak={_f(summary['streak'])}"] + [f"{tree_label(t)}={_f(summary.get(t))}" for t in trees])
    return f"{summary['id']:<{width}} | {summary['blocks']:3d} blocks | {metrics} | {summary['seconds']:.1f}s"


def match_line(block: dict, block_size: int, trees) -> str:
    """`    match: ✓✓✓✗✗...  streak=3` (· = no label: the sequence ended)."""
    marks = "".join("✓" if m else "✗" for m in block["matches"]) + "·" * (block_size - 1 - block["n_labels"])
    extra = " ".join(f"{tree_label(t)}={block['trees'][t]}" for t in trees)
    return f"    match: {marks}  streak={block['streak']}  {extra}  @{block['anchor']}".rstrip()


def overall_lines(result: dict) -> list[str]:
    o, s = result["overall"], result["settings"]
    parts = [f"streak={_f(o['streak'])}", f"tau={_f(o['tau'])}", f"pos1={_f(o['pos1_acc'])}"]
    for t in s["trees"]:
        exp = o["expected"].get(t)
        parts.append(f"{tree_label(t)}={_f(o[t])}" + (f" (expected {_f(exp)})" if exp is not None else ""))
    lines = [f"overall: {o['prompts']} prompts, {o['blocks']} blocks ({s['anchors']} anchors) | " + " ".join(parts)]
    if x := o.get("as_exported"):
        lines.append(f"as exported without the token map (full {x['vocabulary']}-token vocabulary): tau={_f(x['tau'])} "
                     f"vs {_f(o['tau'])} as trained over {s['draft_vocab']} tokens (`drafter export` keeps the map)")
    lines.append("per-position acc (cumulative P(streak>=k)): " + " ".join(_f(v) for v in o["acc_cumulative"]))
    lines.append("per-position acc (conditional P(k | k-1)):  " + " ".join(_f(v) for v in o["acc_conditional"]))
    if o.get("acc_predicted"):
        lines.append("calibration (drafter-predicted P(streak>=k)): " + " ".join(_f(v) for v in o["acc_predicted"]))
    lines.append("streak histogram: " + " ".join(f"{k}:{v:.0%}" for k, v in enumerate(o["histogram"]) if v))
    lines.append("DDTree budget curve (mean accepted depth / drafter-expected): " + " ".join(
        f"{b}:{_f(o['budget_curve'][b])}/{_f(o['budget_curve_expected'][b])}" for b in o["budget_curve"]))
    return lines + [hybrid_line(o)] if o.get("hybrid") else lines


def hybrid_line(o: dict) -> str:
    return "Hybrid replayed (drafter tree + n-gram branch, walked as decoding at T=0): " + " ".join(
        f"hybrid-{b} tau={_f(1 + sum(h['accepted']) / len(h['accepted']))}" for b, h in o["hybrid"].items())


def summary_markdown(result: dict, header: list[str], plots: bool = True) -> str:
    s, o = result["settings"], result["overall"]
    trees = s["trees"]
    heads = ["prompt", "blocks", "streak", "tau", "pos1"] + [tree_label(t) for t in trees]
    cols = lambda x: [x["blocks"], x["streak"], x["tau"], x["pos1_acc"]] + [x.get(t) for t in trees]
    rows = [[p["id"], *cols(p)] for p in result["per_prompt"]] + [["**overall**", *cols(o)]]
    md = ["# Offline evaluation", "", "```", *header, "```", "", markdown_table(heads, rows), ""]
    if per_cat := result.get("per_category"):
        rows = [[c, v["prompts"], *cols(v)] for c, v in per_cat.items()] + [["**overall**", o["prompts"], *cols(o)]]
        md += ["## Per category", "", markdown_table(["category", "prompts"] + heads[1:], rows),
               "![tau per category](categories.png)" if plots else "", ""]
    md.append("Means are over blocks. streak = leading draft tokens equal to the target's (bonus excluded; tau = streak + 1).")
    if x := o.get("as_exported"):
        md.append(f"As trained over the {s['draft_vocab']}-token draft vocabulary: tau {_f(o['tau'])}; as exported without "
                  f"the token map (engines drafting over the full {x['vocabulary']} tokens): tau {_f(x['tau'])}. "
                  "`dflashkit drafter export` keeps the map (vLLM and llama.cpp read it).")
    md.append(f"Trees: {tree_note(trees)}." + (f" {hybrid_line(o)} (tau per round)." if o.get("hybrid") else ""))
    if exp := [f"{tree_label(t)} {_f(o['expected'][t])}" for t in trees if t in o["expected"]]:
        md.append(f"Drafter-expected accepted depth (sum of tree-node probabilities): {', '.join(exp)}.")
    if sf := result.get("shortfall"):
        md.append(f"\n**Partial: {sf['present']} of {sf['requested']} requested prompts** (missing: {', '.join(sf['missing'])}).")
    md += ["", "## Per-position accuracy", "",
           markdown_table(["position", "cumulative P(streak>=k)", "drafter-predicted (calibration)",
                           "conditional P(k given k-1)"],
                          [[k, *v] for k, v in enumerate(zip_longest(
                              o["acc_cumulative"], o.get("acc_predicted") or [], o["acc_conditional"]), 1)]),
           "## DDTree budget curve", "",
           markdown_table(["budget", "accepted depth", "drafter-expected"],
                          [[b, o["budget_curve"][b], o["budget_curve_expected"][b]] for b in o["budget_curve"]]),
           "![acceptance](acceptance.png) ![streak histogram](streak_hist.png) ![budget curve](budget_curve.png)"
           if plots else "", ""]
    return "\n".join(md)


def write_plots(out_dir, results: dict[str, dict]) -> list[str]:
    """Per-position acceptance, streak histogram and DDTree budget curve; one series per named result."""
    out = Path(out_dir)
    acc, curve = {}, {}
    for name, r in results.items():
        o, sfx = r["overall"], f" {name}" if len(results) > 1 else ""
        k = list(range(1, len(o["acc_cumulative"]) + 1))
        acc[f"cumulative{sfx}"] = (k, [v or 0.0 for v in o["acc_cumulative"]])
        acc[f"conditional{sfx}"] = (k, [v or 0.0 for v in o["acc_conditional"]])
        b = [int(x) for x in o["budget_curve"]]
        curve[f"measured{sfx}"] = (b, list(o["budget_curve"].values()))
        curve[f"drafter-expected{sfx}"] = (b, list(o["budget_curve_expected"].values()))
    line_plot(out / "acceptance.png", acc, "Per-position acceptance", "draft position k", "accuracy", ylim=(0, 1.02))
    hist_plot(out / "streak_hist.png", {n: r["overall"]["histogram"] for n, r in results.items()},
              "Streak histogram (leading accepted drafts)", "streak")
    line_plot(out / "budget_curve.png", curve, "DDTree budget curve", "node budget", "mean accepted depth")
    files = ["acceptance.png", "streak_hist.png", "budget_curve.png"]
    if all(r.get("per_category") for r in results.values()):
        groups = {c: {n: r["per_category"].get(c, {}).get("tau") or 0.0 for n, r in results.items()}
                  for r in results.values() for c in r["per_category"]}
        groups["overall"] = {n: r["overall"]["tau"] or 0.0 for n, r in results.items()}
        bar_plot(out / "categories.png", groups, "tau per category (offline)", "tau")
        files.append("categories.png")
    return files


def header_lines(drafter_info: dict, target_ident: dict, cache_info: dict, settings: dict, blocks: int | None) -> list[str]:
    """What was evaluated, stated so that nobody mistakes a partial run for a full one."""
    sf = cache_info.get("shortfall")
    n = len(cache_info["prompt_ids"])
    prompts = (f"PARTIAL: {n} of {sf['requested']} requested prompts (missing: {', '.join(sf['missing'])})" if sf
               else f"{n} prompts (all {cache_info['requested']} requested)")
    per = "all" if settings["max_blocks"] is None else settings["max_blocks"]
    count = f"{blocks} blocks" if blocks is not None else "one block per walk round"
    vocab = f", draft vocabulary {settings['draft_vocab']} tokens" if settings.get("draft_vocab") else ""
    return [
        f"drafter  {drafter_info['path']}  (model.safetensors sha256 {drafter_info['sha256'][:12]})",
        *[f"  {line}" for line in drafter_info["load_report"]],
        f"target   {target_ident['name']}  {target_ident['path']}",
        f"weights  features at {target_ident.get('weights') or 'float'}; the drafter trained at "
        f"{((drafter_info.get('contract') or {}).get('target') or {}).get('weights') or 'float'} (compare the two "
        "formats' evals: dflashkit compare RUN RUN)",
        f"cache    {cache_info['path']}  (manifest {cache_info['manifest_hash'][:12]})",
        f"prompts  {prompts}",
        f"blocks   {count}: block_size={settings['block_size']}, max_blocks_per_seq={per}, anchors={settings['anchors']}{vocab}",
        f"trees    {tree_note(settings['trees'])}",
    ]


def save_run(run_dir, result: dict, log_lines: list[str], drafter_path, plots: bool = True):
    """Write the run folder atomically: results.json, summary.md, eval.log, plots, and a `drafter` symlink."""
    run_dir = Path(run_dir)
    result = {**result, "threads": result.get("threads", torch.get_num_threads())}  # what the timings ran on
    with atomic_dir(run_dir) as tmp:
        write_json(tmp / "results.json", result)
        write_text(tmp / "summary.md", summary_markdown(result, result.get("header", []), plots))
        write_text(tmp / "eval.log", "\n".join(log_lines) + "\n")
        if plots:
            write_plots(tmp, {"run": result})
        try:
            os.symlink(Path(drafter_path).resolve(), tmp / "drafter", target_is_directory=True)
        except OSError:
            write_text(tmp / "drafter.txt", f"{Path(drafter_path).resolve()}\n")
    return run_dir


def run_eval(drafter_path, target, cache, run_dir, anchors: str = "stride", trees=DEFAULT_TREES,
             max_blocks: int | None = None, show_matches: bool = False, progress: bool = True, say=print, replays=None,
             allow_skipped: bool = False, plots: bool = True) -> dict:
    """Evaluate a checkpoint on an opened cache and write its run folder: what `dflashkit eval` does."""
    trees = parse_trees(trees)
    check_mode(anchors, max_blocks)
    ckpt = Path(drafter_path)
    drafter = load_drafter(ckpt, target=target, device=target.device, allow_skipped=allow_skipped)
    drafter_info = {**drafter_identity(ckpt), "load_report": list(drafter.load_report),
                    "config": drafter.config.to_dict(), "contract": drafter.contract}
    info = cache_info(cache)
    B = drafter.config.block_size
    settings = {"anchors": anchors, "block_size": B, "max_blocks": max_blocks, "trees": trees}
    blocks = (sum(len(stride_anchors(r.prompt_len, len(r.tokens), B, max_blocks)) for r in cache)
              if anchors == "stride" else None)
    log: list[str] = []

    def out(*lines: str) -> None:
        for line in lines:
            say(line)
            log.append(line)

    out(*header_lines(drafter_info, target.identity(), info, settings, blocks))
    width = max((len(p) for p in cache.prompt_ids), default=8)

    def on_prompt(summary, recs):
        if show_matches:
            out(*(match_line(r, B, trees) for r in recs))
        out(prompt_line(summary, trees, width))

    t0 = time.perf_counter()
    result = evaluate(drafter, target, cache, trees=trees, anchors=anchors, max_blocks=max_blocks,
                      progress=progress, on_prompt=on_prompt, replays=replays)
    out(*overall_lines(result))
    out(f"evaluated in {time.perf_counter() - t0:.1f}s; run folder {run_dir}")
    header = header_lines(drafter_info, target.identity(), info, result["settings"], result["overall"]["blocks"])
    result = {"format": "dflashkit-eval/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "header": header,
              "drafter": drafter_info, "target": target.identity(), **result}
    save_run(run_dir, result, log, ckpt, plots)
    return result
