"""Two runs side by side. `dflashkit compare`: eval runs, with differences and ratios against the first run (only
runs of the same cache, prompts, anchors and block settings compare, docs/design.md section 6, else refused unless
forced); bench folders and `generate --out` files compare their per-request records instead, line by line.
`dflashkit parity`: two bench or generate outputs of any engines, token for token (report/parity.py)."""

from __future__ import annotations

from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.evaluate.runs import tree_label, write_plots
from dflashkit.fileio import atomic_dir, read_json, write_json, write_text
from dflashkit.report import bar_plot, markdown_table
from dflashkit.report.parity import VERDICTS, describe, parity
from dflashkit.report.requests import FILE, read_requests
from dflashkit.targets.registry import resolve

# what must agree, and where results.json holds it
MUST_MATCH = {"cache (manifest hash)": ("cache", "manifest_hash"), "prompts": ("cache", "prompt_ids"),
              "anchors": ("settings", "anchors"), "block size": ("settings", "block_size"),
              "max blocks per prompt": ("settings", "max_blocks")}


def load_run(path) -> dict:
    f = Path(path) / "results.json"
    if not f.is_file():
        raise DFlashError(f"{path}: no results.json; pass a run folder written by `dflashkit eval`")
    r = read_json(f, "rerun the evaluation")
    if r.get("format") != "dflashkit-eval/1":
        raise DFlashError(f"{f}: field 'format' is {r.get('format')!r}, expected 'dflashkit-eval/1'; not a dflashkit eval run")
    return r


def run_names(paths) -> list[str]:
    """Each run's folder name, numbered where two are alike."""
    names = [Path(p).resolve().name for p in paths]
    return [f"{i + 1}:{n}" for i, n in enumerate(names)] if len(set(names)) < len(names) else names


def default_out(run_dirs) -> Path:
    return Path(run_dirs[0]).resolve().parent / ("compare-" + "-vs-".join(Path(p).resolve().name for p in run_dirs))


def _short(v) -> str:
    if isinstance(v, list):
        return f"{len(v)} prompts [{', '.join(map(str, v[:3]))}{', ...' if len(v) > 3 else ''}]"
    return v[:12] if isinstance(v, str) and len(v) > 16 else str(v)


def differences(runs: list[dict], names: list[str]) -> list[str]:
    vals = {key: [r[part][field] for r in runs] for key, (part, field) in MUST_MATCH.items()}
    return [f"{key}: " + ", ".join(f"{n} {_short(v)}" for n, v in zip(names, vs))
            for key, vs in vals.items() if any(v != vs[0] for v in vs[1:])]


_ratio = lambda a, ref: None if a is None or not ref else a / ref
_diff = lambda a, ref: None if a is None or ref is None else a - ref


def compare_runs(run_dirs, out=None, force: bool = False) -> dict:
    """Compare eval run folders against the first, or per-request records; writes the report to `out` when given."""
    if len(run_dirs) < 2:
        raise DFlashError("compare needs at least two run folders")
    if all(holds_requests(p) for p in run_dirs):  # bench folders or generate outputs: per-request records
        return compare_requests(run_dirs, out)
    runs = [load_run(p) for p in run_dirs]
    names = run_names(run_dirs)
    diffs = differences(runs, names)
    if diffs and not force:
        raise DFlashError("runs are not comparable (" + "; ".join(diffs) + "): offline numbers only compare on the same "
                          "cache, prompts, anchors and block settings; rerun eval with matching settings or pass --force")
    res = {"runs": [{"name": n, "path": str(Path(p).resolve())} for n, p in zip(names, run_dirs)],
           "reference": names[0], "forced": bool(diffs), "differences": diffs, **_numbers(runs, names)}
    res["markdown"] = _markdown(res, runs, run_dirs, names)
    res["files"] = write_compare(out, res, dict(zip(names, runs))) if out is not None else []
    return res


def _numbers(runs: list[dict], names: list[str]) -> dict:
    ref, others = names[0], names[1:]
    trees = [t for t in runs[0]["settings"]["trees"] if all(t in r["settings"]["trees"] for r in runs[1:])]
    metrics = ["streak", "tau", "pos1_acc"] + trees
    overall = {m: {n: r["overall"].get(m) for n, r in zip(names, runs)} for m in metrics}
    expected = {t: {n: r["overall"]["expected"].get(t) for n, r in zip(names, runs)} for t in trees if t.startswith("budget:")}
    prompts = list(dict.fromkeys(p["id"] for r in runs for p in r["per_prompt"]))
    by_prompt = [{p["id"]: p for p in r["per_prompt"]} for r in runs]
    per_prompt = {m: {pid: {n: bp.get(pid, {}).get(m) for n, bp in zip(names, by_prompt)} for pid in prompts}
                  for m in ["streak"] + trees}
    cats = [c for c in (runs[0].get("per_category") or {}) if all(c in (r.get("per_category") or {}) for r in runs[1:])]
    per_category = {m: {c: {n: r["per_category"][c].get(m) for n, r in zip(names, runs)} for c in cats}
                    for m in ["tau"] + trees} if cats else {}
    return {"metrics": metrics, "trees": trees, "prompts": prompts, "overall": overall, "expected": expected,
            "per_prompt": per_prompt, "categories": cats, "per_category": per_category,
            "differences_vs_reference": {m: {n: _diff(overall[m][n], overall[m][ref]) for n in others} for m in metrics},
            "ratios": {m: {n: _ratio(overall[m][n], overall[m][ref]) for n in others} for m in metrics}}


def _labels(trees) -> dict:
    return {"streak": "streak", "tau": "tau", "pos1_acc": "pos1", **{t: tree_label(t) for t in trees}}


def _markdown(res: dict, runs: list[dict], run_dirs, names: list[str]) -> str:
    ref, others, label = names[0], names[1:], _labels(res["trees"])
    overall, ratios, expected = res["overall"], res["ratios"], res["expected"]

    def row(first, v: dict) -> list:  # the runs' values, then each one's difference and ratio to the reference
        return [first] + [v[n] for n in names] + [x for n in others for x in (_diff(v[n], v[ref]), _ratio(v[n], v[ref]))]

    md = ["# Drafter comparison", ""]
    if res["differences"]:
        md += [f"**NOT COMPARABLE (compared with --force)**: the runs differ in {'; '.join(res['differences'])}.", ""]
    md += [f"Reference: `{ref}`; differences are run - reference, ratios run / reference.", ""]
    md += [f"- `{n}`: {p} ({r['overall']['prompts']} prompts, {r['overall']['blocks']} blocks, "
           f"{r['settings']['anchors']} anchors, block {r['settings']['block_size']}; drafter {r['drafter']['path']})"
           for n, p, r in zip(names, run_dirs, runs)]
    md += ["", "## Overall", ""]
    heads = ["metric"] + names + [h for n in others for h in (f"{n} - {ref}", f"{n} / {ref}")]
    rows = []
    for m in res["metrics"]:
        rows.append(row(label[m], overall[m]))
        if m in expected:
            rows.append(row(f"{label[m]} expected", expected[m]))
    md.append(markdown_table(heads, rows))
    md += [f"{label[m]}: {n} / {ref} = {ratios[m][n]:.2f}" for m in res["metrics"] for n in others
           if ratios[m][n] is not None]
    for m, by_cat in res["per_category"].items():
        md += ["", f"## Per category: {label[m]}", "",
               markdown_table(["category"] + heads[1:], [row(c, v) for c, v in by_cat.items()])]
    if res["per_category"]:
        md += ["![tau per category](categories.png)"]
    for m in ["streak"] + res["trees"]:
        md += ["", f"## Per prompt: {label[m]}", "",
               markdown_table(["prompt"] + heads[1:], [row(pid, res["per_prompt"][m][pid]) for pid in res["prompts"]])]
    return "\n".join(md) + "\n"


def write_compare(out, res: dict, runs: dict | None = None) -> list[str]:
    """compare.md, compare.json and, for eval runs ({name: results}), the plots, atomically; returns the file names."""
    with atomic_dir(out) as tmp:
        files = ["compare.md", "compare.json"]
        if runs is not None:
            label = _labels(res["trees"])
            files += write_plots(tmp, runs)
            for m in ["streak"] + res["trees"]:
                f = f"{label[m]}_by_prompt.png"
                bar_plot(tmp / f, {pid: {n: v or 0.0 for n, v in res["per_prompt"][m][pid].items()}
                                   for pid in res["prompts"]},
                         f"{label[m]} per prompt" + (" (NOT COMPARABLE)" if res["differences"] else ""), label[m])
                files.append(f)
            res = {**res, "files": files}
        write_text(tmp / "compare.md", res["markdown"])
        write_json(tmp / "compare.json", {k: v for k, v in res.items() if k != "markdown"})
    return files


# ---- per-request records: the same requests of two or more runs, line by line -------------------------------

def holds_requests(path) -> bool:
    """A bench folder (requests.jsonl, and no eval results) or a records file: what compare reads as requests."""
    p = Path(path)
    return p.is_file() and p.suffix == ".jsonl" or (p.is_dir() and (p / FILE).is_file())


def _overall(recs: list[dict]) -> dict:
    """One method's requests of one run, totalled; a total over a field some request lacks is None."""
    def total(k):
        return None if any(r[k] is None for r in recs) else sum(r[k] for r in recs)

    rounds, accepted, seconds = total("rounds"), total("accepted"), total("total_s")
    pos = [r["accepted_per_position"] for r in recs]
    per_pos = ([sum(p[k] for p in pos if k < len(p)) / rounds for k in range(max(map(len, pos), default=0))]
               if rounds and None not in pos else None)
    return {"requests": len(recs), "new_tokens": total("new_tokens"), "rounds": rounds,
            "tau": 1 + accepted / rounds if rounds and accepted is not None else None,
            "accepted_per_position": per_pos, "draft_s": total("draft_s"), "verify_s": total("verify_s"),
            "total_s": seconds, "tokens_per_s": total("new_tokens") / seconds if seconds else None}


def compare_requests(paths, out=None) -> dict:
    """The runs' records side by side: totals per method and run, and one line per request."""
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

    def cells(r: dict) -> list:
        dv = None if not r or r["draft_s"] is None else f"{r['draft_s']:.3f}/{r['verify_s']:.3f}"
        return [r.get("tau"), r.get("rounds"), dv, {True: "yes", False: "no"}.get(r.get("equal_to_reference"))]

    rows = [[line["prompt"], line["method"]] + [c for n in names for c in cells(line[n] or {})] for line in res["lines"]]
    md += ["## Per request", "", markdown_table(heads, rows)]
    return "\n".join(md) + "\n"


# `dflashkit parity`: token equality of two runs
PASS = ("equal", "prefix", "numerics")  # verdicts a parity run accepts (exit 0); any other divergence exits 1


def load_records(path) -> list[dict]:
    """A bench folder (its requests.jsonl) or a file of records (`generate --out`, or a requests.jsonl)."""
    p = Path(path)
    f = p / FILE if p.is_dir() else p
    if not f.is_file():
        raise DFlashError(f"{path}: no {FILE if p.is_dir() else 'such file'}; pass a folder written by `dflashkit bench "
                          "--out` or a file written by `dflashkit generate --out`")
    if not (recs := read_requests(f)):
        raise DFlashError(f"{f}: no records; rerun the bench or generate that wrote it")
    return recs


def pairs(a: list[dict], b: list[dict], method: str | None = None, against: str | None = None):
    """[(method of a, method of b)] to compare: the named ones, each run's only one, or every method both hold."""
    ma, mb = list(dict.fromkeys(r["method"] for r in a)), list(dict.fromkeys(r["method"] for r in b))
    if method or against:
        chosen = [(method or ma[0], against or method or mb[0])]
    elif len(ma) == 1 and len(mb) == 1:
        chosen = [(ma[0], mb[0])]
    else:
        chosen = [(m, m) for m in ma if m in mb]
    if not chosen:
        raise DFlashError(f"the runs share no method (RUN_A: {', '.join(ma)}; RUN_B: {', '.join(mb)}); "
                          "name the two with --method and --against")
    for x, y in chosen:
        for name, have, side in ((x, ma, "RUN_A"), (y, mb, "RUN_B")):
            if name not in have:
                raise DFlashError(f"{side} has no method {name!r} (it holds {', '.join(have)}); "
                                  "pick one with --method/--against")
    return chosen


def same_prompts(ra: list[dict], rb: list[dict]) -> None:
    """Outputs compare only for the same prompt: a first turn asked with other ids is refused by name."""
    by = {r["prompt"]: r for r in rb}
    for r in ra:
        other = by.get(r["prompt"])
        if other and r["prompt_ids"] and other["prompt_ids"] and r["prompt_ids"][0] != other["prompt_ids"][0]:
            raise DFlashError(f"prompt {r['prompt']!r}: RUN_A and RUN_B asked it with different token ids (another "
                              "tokenizer or chat template); compare runs of the same target and prompts")


def same_target(a: list[dict], b: list[dict]) -> None:
    """Tokens compare only between runs of one target: two targets' runs are refused by name."""
    ta, tb = ({r["target"] for r in recs if r.get("target")} for recs in (a, b))
    if ta and tb and ta != tb:
        raise DFlashError(f"RUN_A ran target {', '.join(sorted(ta))}, RUN_B target {', '.join(sorted(tb))}: parity "
                          "compares runs of one target; rerun one of them on the other's target")


def tokenizer_for(records: list[dict], target: str | None = None):
    """decode(ids) -> text with the run's recorded target or `target`; None where neither is here."""
    where = target or next((r["target_path"] for r in records if r.get("target_path")), None)
    if where is None:
        return None
    try:
        from transformers import AutoTokenizer

        where = where if target is None else resolve(target)[1]
        if not Path(where).is_dir():
            return None
        tok = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as e:
        if target is not None:
            raise DFlashError(f"--target {target}: no tokenizer there ({str(e).splitlines()[0]}); pass the target folder")
        return None
    return tok.decode


def run_parity(path_a, path_b, method: str | None = None, against: str | None = None,
               target: str | None = None) -> dict:
    """Parity of two runs: {"runs", "tokenizer", "comparisons": {label: parity}, "ok"} (ok: no verdict beyond PASS)."""
    a, b = load_records(path_a), load_records(path_b)
    same_target(a, b)
    decode = tokenizer_for(a + b, target)
    table = {}
    for x, y in pairs(a, b, method, against):
        ra, rb = [r for r in a if r["method"] == x], [r for r in b if r["method"] == y]
        same_prompts(ra, rb)
        p = table[x if x == y else f"{x} vs {y}"] = {"against": y, **parity(ra, rb, decode)}
        if not p["prompts"]:
            raise DFlashError(f"{x} and {y}: the runs share no prompt; compare runs of the same prompts")
    ok = all(x["verdict"] in PASS for p in table.values() for x in p["per_prompt"])
    return {"runs": [str(path_a), str(path_b)], "tokenizer": decode is not None, "comparisons": table, "ok": ok}


def parity_markdown(res: dict) -> str:
    """The report: per comparison, counts and every prompt's line, with the text around each divergence."""
    a, b = res["runs"]
    md = ["# Token parity", "", f"RUN_A `{a}` against RUN_B `{b}`; token index = position in the answer (0 = the "
          f"first new token). {VERDICTS}", ""]
    if not res["tokenizer"]:
        md += ["No tokenizer: the recorded target folder is not here (pass --target); text shown as token ids.", ""]
    for label, p in res["comparisons"].items():
        counts = ", ".join(f"{k} {v}" for k, v in p["verdicts"].items())
        md += [f"## {label}", "", f"{p['equal']}/{p['prompts']} prompts equal ({counts}).", ""]
        for x in p["per_prompt"]:
            md.append(f"- {describe(x)}")
            if not x["equal"]:
                c = x["context"]
                show = (lambda k: repr(c[f"{k}_text"])) if "a_text" in c else (lambda k: str(c[k]))
                md += [f"  - before: {show('before')}", f"  - RUN_A: {show('a')}", f"  - RUN_B: {show('b')}"]
        md.append("")
    md.append("Verdict: " + ("every prompt equal, a prefix of the other or parted at a numerics near-tie." if res["ok"] else
                             "**a divergence that rounding does not explain** (or no logits recorded to tell)."))
    return "\n".join(md) + "\n"


def write_parity(res: dict, out) -> list[Path]:
    out = Path(out)
    write_json(out / "parity.json", res)
    write_text(out / "parity.md", parity_markdown(res))
    return [out / "parity.json", out / "parity.md"]
