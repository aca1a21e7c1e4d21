"""`dflashkit parity RUN_A RUN_B`: two bench or generate outputs of any engines, compared by report/parity.py."""

from __future__ import annotations

from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.fileio import write_json, write_text
from dflashkit.report.parity import VERDICTS, describe, parity
from dflashkit.report.requests import FILE, read_requests
from dflashkit.targets.registry import resolve

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
