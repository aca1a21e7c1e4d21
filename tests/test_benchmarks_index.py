"""benchmarks/README.md indexes every script and every result file, so a figure can always be traced to its run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "benchmarks"


def listed_names(text: str) -> set[str]:
    """Every `name` in backticks, with `stem.{md,json}` expanded to both files."""
    names = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        brace = re.fullmatch(r"(.+)\.\{([^}]+)\}", token)
        if brace:
            names.update(f"{brace.group(1)}.{ext}" for ext in brace.group(2).split(","))
        else:
            names.add(token)
    return names


def test_every_script_and_result_is_listed():
    names = listed_names((ROOT / "README.md").read_text())
    scripts = {p.name for p in ROOT.glob("*.py")}
    results = {p.name for p in (ROOT / "results").iterdir() if p.is_file()}
    assert not scripts - names, f"benchmarks/README.md does not list these scripts: {sorted(scripts - names)}"
    assert not results - names, f"benchmarks/README.md does not list these results: {sorted(results - names)}"
    stale = {n for n in names if n.startswith("cpu-") and n.endswith((".md", ".json", ".png"))} - results
    assert not stale, f"benchmarks/README.md lists results that do not exist: {sorted(stale)}"


def test_listed_names_expands_braces():
    assert listed_names("`a.{md,json}` and `b.py`") == {"a.md", "a.json", "b.py"}
