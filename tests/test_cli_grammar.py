"""One CLI grammar (issue 13): a flag means one thing in every command, every output location is `--out`, a
malformed number is a one-line usage error with exit 2, the tour (docs/tour.md) parses and the Python example (docs/python.md) imports
from the package. These tests only build and parse the argparse tree: no command runs, nothing loads a model."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import dflashkit
from dflashkit.cli import build_parser, main

DOCS = Path(__file__).resolve().parents[1] / "docs"

# Meanings pinned by the grammar: option -> (dest, kind). Every other option only has to agree with itself.
PINNED = {
    "--json": ("json", "flag"),  # print JSON on stdout
    "--out": ("out", "value"),  # where the command writes (a folder; a file for `data generate` and `cache diff`)
    "--target-layers": ("target_layers", "value"),  # target layer ids: auto or 1,8,14
    "--num-layers": ("num_layers", "value"),  # drafter depth
    "--force": ("force", "flag"),
    "--threads": ("threads", "value"),
}
GONE = {"--layers", "--run-dir", "--output", "--output-dir", "--out-dir", "--outdir", "--dir", "--save-dir"}
# Commands that write files; each names its output with --out (train's folder is its config key `out=`).
WRITERS = {"extract", "drafter init", "drafter export", "eval", "compare", "bench", "demo", "data generate",
           "cache diff", "cost", "generate", "parity"}


def commands(parser, path=()):
    """(command path, parser) for every parser in the tree, nested subcommands included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def options(parser):
    for action in parser._actions:
        if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield action


def kind(action) -> str:
    return "flag" if action.nargs == 0 else "value"


@pytest.fixture(scope="module")
def tree():
    return {" ".join(path): p for path, p in commands(build_parser())}


def test_the_tree_holds_every_stage(tree):
    for name in ("target prepare", "drafter init", "drafter export", "extract", "cache diff", "eval", "compare",
                 "generate", "bench", "train", "data generate", "demo", "parity"):
        assert name in tree, name
    assert "export" not in tree  # export sits with the drafter commands


def test_each_option_has_one_meaning(tree):
    meanings = defaultdict(set)  # option string -> {(dest, kind, type)}
    spellings = defaultdict(set)  # dest -> {option strings}
    for name, parser in tree.items():
        for a in options(parser):
            for opt in a.option_strings:
                meanings[opt].add((a.dest, kind(a), a.type))
            spellings[a.dest].add(tuple(a.option_strings))
    clashes = {opt: m for opt, m in meanings.items() if len(m) > 1}
    assert not clashes, f"options with more than one meaning: {clashes}"
    aliases = {dest: s for dest, s in spellings.items() if len(s) > 1}
    assert not aliases, f"one setting spelled several ways: {aliases}"
    for opt, (dest, k) in PINNED.items():
        assert opt in meanings, opt
        assert {(d, kk) for d, kk, _ in meanings[opt]} == {(dest, k)}, opt


def test_retired_options_are_gone(tree):
    used = {opt for p in tree.values() for a in options(p) for opt in a.option_strings}
    assert not used & GONE


def test_every_command_that_writes_uses_out(tree):
    with_out = {name for name, p in tree.items() if any("--out" in a.option_strings for a in options(p))}
    assert with_out == WRITERS


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


@pytest.mark.parametrize("argv, option", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "abc"], "--max-new-tokens"),
    (["bench", "--num-prompts", "2.5"], "--num-prompts"),
    (["extract", "--prompts", "coding-10", "--out", "x", "--target-layers", "1,x"], "--target-layers"),
    (["drafter", "init", "--out", "x", "--target-layers", ",,"], "--target-layers"),
    (["drafter", "init", "--out", "x", "--num-layers", "five"], "--num-layers"),
    (["eval", "--drafter", "d", "--cache", "c", "--max-blocks", "1e3"], "--max-blocks"),
    (["cache", "diff", "a", "b", "--min-cosine", "high"], "--min-cosine"),
    (["data", "generate", "--prompts", "p", "--out", "o", "--batch-size", "8x"], "--batch-size"),
    (["demo", "--minutes", "ten"], "--minutes"),
    (["target", "info", "t", "--threads", "two"], "--threads"),
])
def test_a_malformed_number_is_a_one_line_usage_error(capsys, argv, option):
    assert f"argument {option}" in _usage_error(capsys, argv)


@pytest.mark.parametrize("argv", [
    ["export", "--drafter", "d", "--out", "o"],
    ["eval", "--drafter", "d", "--cache", "c", "--run-dir", "r"],
    ["extract", "--prompts", "coding-10", "--out", "x", "--layers", "1,2"],
    ["drafter", "init", "--out", "x", "--layers", "2"],
    ["cache", "diff", "a", "b", "--json", "d.json"],  # --json is a flag; a file is --out
])
def test_old_spellings_are_refused(capsys, argv):
    _usage_error(capsys, argv)


def test_parsed_values():
    p = build_parser()
    assert p.parse_args(["drafter", "init", "--out", "x"]).target_layers is None  # auto: z-lab's rule
    assert p.parse_args(["drafter", "init", "--out", "x", "--target-layers", "1, 8,14"]).target_layers == [1, 8, 14]
    assert p.parse_args(["extract", "--prompts", "p", "--out", "x", "--target-layers", "auto"]).target_layers is None
    a = p.parse_args(["cache", "diff", "a", "b", "--json", "--out", "d.json"])
    assert a.json is True and a.out == "d.json"


def _tour_commands() -> list[list[str]]:
    text = (DOCS / "tour.md").read_text()
    tour = text.split("```bash", 1)[1].split("```", 1)[0]
    tour = tour.replace("\\\n", " ")
    out = []
    for line in tour.splitlines():
        for part in line.split(" ; "):
            argv = shlex.split(part, comments=True)
            if argv[:1] == ["dflashkit"] and not any(t.startswith("[") or t == "..." for t in argv):
                out.append(argv[1:])
    return out


def test_the_readme_tour_parses():
    cmds = _tour_commands()
    assert len(cmds) > 15
    p = build_parser()
    for argv in cmds:
        p.parse_args(argv)  # a stale flag exits 2 here


def test_the_readme_python_example_imports_from_the_package():
    text = (DOCS / "python.md").read_text()
    names = {n.strip() for m in re.findall(r"^from dflashkit import (.+)$", text, re.M) for n in m.split(",")}
    assert {"load_target", "new_drafter", "load_drafter", "save_drafter", "DraftHead"} <= names
    assert names <= set(dflashkit.__all__)
    assert not re.search(r"^from dflashkit\.", text, re.M)  # the example needs no submodule


def test_import_dflashkit_stays_light():
    code = ("import sys, dflashkit, dflashkit.drafter, dflashkit.cache, dflashkit.evaluate, dflashkit.decode, "
            "dflashkit.cli; dflashkit.cli.build_parser(); "
            "bad = sorted(m for m in ('torch', 'transformers') if m in sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bf16_refused_by_torchs_avx2_attention_is_one_line(monkeypatch, capsys):
    """On AVX2 kernels (a float32-only CPU, or --isa v3) torch's stock attention raises on bf16
    (`pack_vnni2 is only supported when avx512 is supported`, measured in bench's ar@hf-stock prefill): the command
    says what to use instead; any other RuntimeError still surfaces whole."""
    import argparse

    from dflashkit import cli

    def fails_with(message):
        def func(args):
            raise RuntimeError(message)
        parser = argparse.ArgumentParser()
        parser.set_defaults(func=func)
        return lambda: parser

    monkeypatch.setattr(cli, "build_parser", fails_with("pack_vnni2 is only supported when avx512 is supported"))
    assert cli.main([]) == 2
    assert "use --dtype float32 or auto" in capsys.readouterr().err
    monkeypatch.setattr(cli, "build_parser", fails_with("shapes do not match"))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cli.main([])
