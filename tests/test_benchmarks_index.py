"""benchmarks/README.md indexes every script and every result file, so a figure can always be traced to its run, and
benchmarks/results keeps only current results: a new result replaces the one it supersedes (git history keeps it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "benchmarks"
MAX_RESULT_FILES = 80
MAX_RESULT_BYTES = 3_000_000


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


def test_results_folder_stays_bounded():
    files = [p for p in (ROOT / "results").rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= MAX_RESULT_FILES, (
        f"benchmarks/results holds {len(files)} files, more than {MAX_RESULT_FILES}: "
        "git rm the results a new one supersedes (benchmarks/README.md)")
    assert size <= MAX_RESULT_BYTES, (
        f"benchmarks/results holds {size / 1e6:.2f} MB, more than {MAX_RESULT_BYTES / 1e6:g} MB: "
        "git rm the results a new one supersedes, or keep a large run's raw records out of the tree")


def test_listed_names_expands_braces():
    assert listed_names("`a.{md,json}` and `b.py`") == {"a.md", "a.json", "b.py"}
