"""`dflashkit compare` of per-request records (bench folders, `generate --out` files): the same requests of two or
more runs, any engines, line by line (tokens, rounds, tau, acceptance per draft position, draft/verify time), with
the overall per method; the first run is the reference for token equality."""

from __future__ import annotations

from pathlib import Path

from dflashkit.report.requests import FILE


def holds_requests(path) -> bool:
    """A bench folder (requests.jsonl, and no eval results) or a records file: what compare reads as requests."""
    p = Path(path)
    return p.is_file() and p.suffix == ".jsonl" or (p.is_dir() and (p / FILE).is_file())


def _overall(recs: list[dict]) -> dict:
    """One method's requests of one run, totalled; a total over a field some request lacks is None."""
    def total(k):
        vals = [r[k] for r in recs]
        return None if any(v is None for v in vals) else sum(vals)

    rounds, accepted, seconds = total("rounds"), total("accepted"), total("total_s")
    pos = [r["accepted_per_position"] for r in recs]
    per_pos = None
    if rounds and all(p is not None for p in pos):
        per_pos = [sum(p[k] for p in pos if k < len(p)) / rounds for k in range(max(map(len, pos), default=0))]
    return {"requests": len(recs), "new_tokens": total("new_tokens"), "rounds": rounds,
            "tau": 1 + accepted / rounds if rounds and accepted is not None else None,
            "accepted_per_position": per_pos, "draft_s": total("draft_s"), "verify_s": total("verify_s"),
            "total_s": seconds, "tokens_per_s": total("new_tokens") / seconds if seconds else None}


def compare_requests(paths, out=None) -> dict:
    """The runs' records side by side: {"runs", "methods", "overall": {method: {run: totals}}, "lines": [per
    request: {prompt, method, run: {fields}}], "markdown", "files"}."""
    from dflashkit.evaluate.compare import run_names, write_compare
    from dflashkit.evaluate.parity import load_records

    names = run_names(paths)
    runs = {n: load_records(p) for n, p in zip(names, paths)}
    methods = list(dict.fromkeys(r["method"] for recs in runs.values() for r in recs))
    overall = {m: {n: _overall([r for r in recs if r["method"] == m]) for n, recs in runs.items()
                   if any(r["method"] == m for r in recs)} for m in methods}
    keys = list(dict.fromkeys((r["prompt"], r["method"]) for recs in runs.values() for r in recs))
    by = {n: {(r["prompt"], r["method"]): r for r in recs} for n, recs in runs.items()}
    ref, lines = names[0], []
    for key in keys:
        row = {"prompt": key[0], "method": key[1]}
        for n in names:
            r = by[n].get(key)
            row[n] = None if r is None else {
                **{k: r[k] for k in ("engine", "backend", "new_tokens", "rounds", "tau", "accepted_per_position",
                                     "draft_s", "verify_s", "total_s")},
                "equal_to_reference": None if key not in by[ref] else r["tokens"] == by[ref][key]["tokens"]}
        lines.append(row)
    res = {"runs": [{"name": n, "path": str(p)} for n, p in zip(names, paths)], "reference": ref, "methods": methods,
           "overall": overall, "lines": lines}
    res["markdown"] = requests_markdown(res, names)
    res["files"] = write_compare(out, res) if out is not None else []
    return res


def requests_markdown(res: dict, names: list[str]) -> str:
    from dflashkit.report import markdown_table

    md = ["# Per-request comparison", "", f"Reference: `{res['reference']}` (token equality is against it). "
          "tau = 1 + accepted drafts / rounds, as each source counts them; '-': the source does not give it "
          "(its records say why in `missing`).", ""]
    md += [f"- `{r['name']}`: {r['path']}" for r in res["runs"]]
    heads = ["method", "run", "requests", "new tokens", "rounds", "tau", "accepted per position", "draft s",
             "verify s", "total s", "tokens/s"]
    rows = [[m, n, o["requests"], o["new_tokens"], o["rounds"], o["tau"],
             " ".join(f"{v:.2f}" for v in o["accepted_per_position"]) if o["accepted_per_position"] else None,
             o["draft_s"], o["verify_s"], o["total_s"], o["tokens_per_s"]]
            for m, by_run in res["overall"].items() for n, o in by_run.items()]
    md += ["", "## Overall", "", markdown_table(heads, rows)]
    heads = ["prompt", "method"] + [h for n in names for h in (f"{n} tau", f"{n} rounds", f"{n} draft/verify s",
                                                               f"{n} equal")]
    rows = []
    for line in res["lines"]:
        cells = []
        for n in names:
            r = line[n] or {}
            dv = None if not r or r["draft_s"] is None else f"{r['draft_s']:.3f}/{r['verify_s']:.3f}"
            cells += [r.get("tau"), r.get("rounds"), dv, {True: "yes", False: "no"}.get(r.get("equal_to_reference"))]
        rows.append([line["prompt"], line["method"]] + cells)
    md += ["## Per request", "", markdown_table(heads, rows)]
    return "\n".join(md) + "\n"

