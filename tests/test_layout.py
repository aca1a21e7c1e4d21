"""The package's architecture as a contract (what import-linter's layer contracts check): the stages a user walks
through are layers, and no module imports a higher layer or a sibling stage of its own layer."""

from __future__ import annotations

import ast
from pathlib import Path

import dflashkit

ROOT = Path(dflashkit.__file__).parent
# lower number = lower layer; shared utilities sit at the bottom, the CLI and the demo at the top
LAYERS = {
    "errors": 0, "lazy": 0, "rng": 0, "machine": 0,  # machine: the values the process entry reads (dflashkit.cli)
    "configs": 2, "fileio": 1, "levels": 1, "threads": 2, "report": 2, "prompts": 2, "tree": 2,
    "ngram": 2,  # the n-gram lookup: decoding proposes with it, the offline walk replays it
    "targets": 3,
    "drafter": 4, "distributed": 4,  # distributed picks the device the way targets does
    "cache": 5, "engines": 5,  # engines export drafters in the formats llama.cpp and vLLM read
    "evaluate": 6, "decode": 6,
    "measure": 7,  # measures decoding (bench, cost models, peers, auto's probe): above it, never imported by it
    "train": 8,  # evaluates held-out checkpoints while it trains; `data generate` answers with measure's peers
    "demo": 9, "cli": 9, "__init__": 9, "export": 9,
}
TOP = 9


def stage_of(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py")


def imported_stages(path: Path) -> set[str]:
    """dflashkit stages a module imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "dflashkit" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_every_stage_has_a_layer():
    stages = {stage_of(p) for p in ROOT.rglob("*.py")}
    assert stages <= set(LAYERS), f"place {sorted(stages - set(LAYERS))} in LAYERS"


def test_no_stage_imports_a_higher_layer_or_a_sibling_stage():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        own = stage_of(path)
        for dep in imported_stages(path):
            if dep != own and LAYERS[dep] >= LAYERS[own] and LAYERS[own] < TOP:
                bad.append(f"{path.relative_to(ROOT)} imports dflashkit.{dep}")
    assert not bad, "\n".join(bad)


def imported_modules(path: Path) -> set[str]:
    """dflashkit modules a module imports, at any depth, as dotted names ('dflashkit.decode.static')."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from dflashkit.decode import native`
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("dflashkit.")}


def module_cycles() -> list[list[str]]:
    """Import circles between the modules of one package (function-level imports count: they are edges too)."""
    modules = {".".join(("dflashkit",) + p.relative_to(ROOT).with_suffix("").parts): p for p in ROOT.rglob("*.py")
               if p.name != "__init__.py"}
    package = lambda m: m.rsplit(".", 1)[0]
    edges = {m: {d for d in imported_modules(p) if d in modules and d != m and package(d) == package(m)}
             for m, p in modules.items()}
    cycles, done = [], set()

    def visit(m, trail):
        if m in trail:
            cycles.append(trail[trail.index(m):] + [m])
            return
        if m in done:
            return
        for d in sorted(edges[m]):
            visit(d, trail + [m])
        done.add(m)

    for m in sorted(edges):
        visit(m, [])
    return cycles


def test_no_import_circle_between_the_modules_of_a_package():
    """Issue 70: decode/ was a seven-module import circle; the modules of a package form layers too, so a new
    back-edge between two of them fails here."""
    assert not module_cycles(), "\n".join(" -> ".join(c) for c in module_cycles())


def test_a_planted_back_edge_is_a_circle(monkeypatch):
    real = imported_modules
    plant = lambda path: real(path) | ({"dflashkit.decode.speculative"} if path.name == "static.py" else set())
    monkeypatch.setitem(globals(), "imported_modules", plant)
    assert any("dflashkit.decode.static" in c for c in module_cycles())


def test_decoding_imports_nothing_that_measures_it():
    for path in (ROOT / "decode").rglob("*.py"):
        assert not {m for m in imported_modules(path) if m.startswith("dflashkit.measure")}, path


def test_decode_does_not_import_evaluate():
    for path in (ROOT / "decode").rglob("*.py"):
        assert "evaluate" not in imported_stages(path), path


def test_citations_resolve_inside_the_repository():
    """Every "docs/design.md section N" names a section that exists; nothing cites a file outside the repository
    (the facts a newcomer needs are in docs/design.md)."""
    import re

    repo = ROOT.parent
    design = (repo / "docs" / "design.md").read_text()
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", design, flags=re.M)}
    files = [p for pattern in ("dflashkit/**/*.py", "benchmarks/**/*", "dflashkit/configs/*", "tests/*.py", "*.md", "*.toml",
                               "Makefile", "docs/*.md") for p in repo.glob(pattern) if p.is_file()]
    cited = set()
    for f in files:
        text = f.read_text(errors="ignore")
        assert "SPEC" + ".md" not in text, f
        assert "../" + "shared" not in text or f.parent.name == "tests", f  # tests may read shared data if present
        cited |= {int(n) for n in re.findall(r"design\.md sections? (\d+)", text)}
    assert cited and cited <= sections, cited - sections


def test_no_function_is_longer_than_60_lines():
    """Readable in one sitting: a function that outgrows a screen gets split where its steps are."""
    long = [f"{p.relative_to(ROOT)}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p in ROOT.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read the process environment (os.environ, os.getenv); a store into it, or a copy for a child
    process (`{**os.environ, ...}`, `os.environ.copy()`), is not a read."""
    spared = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)):
            spared.add(id(n.value))
        elif isinstance(n, ast.Dict):
            spared |= {id(v) for k, v in zip(n.keys, n.values) if k is None}
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "copy":
            spared.add(id(n.func.value))
    return sorted(n.lineno for n in ast.walk(tree) if id(n) not in spared and (
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "os"
        and n.attr in ("environ", "environb", "getenv", "getenvb")
        or isinstance(n, ast.ImportFrom) and n.module == "os" and any(a.name.startswith(("environ", "getenv"))
                                                                      for a in n.names)))


def test_machine_choices_are_read_at_the_entry_point_alone():
    """Issue 70: library code takes $DFLASHKIT_HOME, OMP_NUM_THREADS, torchrun's variables and the rest as values
    (dflashkit/machine.py) that the process entry reads once; only it and the engine launchers, which build a
    child's environment, read os.environ."""
    readers = {"cli.py", "engines/vllm_client.py"}
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(ROOT.rglob("*.py"))
             if str(p.relative_to(ROOT)) not in readers for line in environment_reads(ast.parse(p.read_text()))]
    assert not found, f"read the environment in dflashkit/cli.py and pass the value: {found}"
    assert environment_reads(ast.parse("import os\nos.environ['A'] = '1'\nenv = {**os.environ, 'B': '2'}")) == []
    assert environment_reads(ast.parse("import os\nx = os.environ.get('A')\ny = os.getenv('B')")) == [2, 3]


def test_the_training_recipe_is_resolved_in_one_place():
    """Issue 39: the recipe (TrainConfig) is read by the loop's set-up, which hands data, checkpoint and loss code
    plain values; before, the config object visited 13 modules and they climbed back to it."""
    readers = {"train/config.py", "train/loop.py", "train/__init__.py"}
    seen = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "TrainConfig" in p.read_text()}
    assert seen <= readers, f"modules that take the recipe object: {sorted(seen - readers)}"
    for name in ("data", "checkpoint", "loss"):
        tree = ast.parse((ROOT / "train" / f"{name}.py").read_text())
        args = {a.arg for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for a in f.args.args}
        assert "cfg" not in args, f"train/{name}.py takes the recipe; pass it the values it needs"


def test_the_demo_stays_a_thin_recipe():
    """Issue 51: the demo is a recipe over public functions, 600 lines at most; it crept to 601 once unnoticed."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "demo").glob("*.py"))
    assert lines <= 600, f"dflashkit/demo is {lines} lines: move what grew into the stage it belongs to"


def test_every_command_is_declared_whole_in_its_own_parser():
    """Issue 70: `eval --engine` and `drafter export` were added by other modules to parsers they did not own, so a
    reader of evaluate/cli.py never saw the option. Now no module reaches into another's parser, and a handler a
    higher stage implements is named by its module path and resolves."""
    import argparse

    from dflashkit.cli import build_parser, handler

    reach = [f"{p.relative_to(ROOT)}" for p in ROOT.rglob("*.py") if ".choices[" in p.read_text()]
    assert not reach, f"modules that patch another command's parser: {reach}"

    def commands(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield sub
                    yield from commands(sub)

    named = [p.get_default("func") for p in commands(build_parser()) if isinstance(p.get_default("func"), str)]
    assert "dflashkit.measure.cli:cmd_eval" in named and "dflashkit.export:cmd_export" in named
    assert all(callable(handler(f)) for f in named)
