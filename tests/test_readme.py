"""The tour (docs/tour.md) runs top to bottom: every path a step reads was written by an earlier step, every option
exists, and every file it names is in the repository."""

from __future__ import annotations

import shlex
from pathlib import Path

from dflashkit.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
READ_OPTIONS = ("--drafter", "--cache", "--config")  # options that read a path
READ_KEYS = ("data", "eval_cache", "init")  # train settings (key=value) that read a path
POSITIONAL_READS = {("drafter", "info"), ("cache", "inspect"), ("cache", "verify"), ("cache", "diff"), ("compare",),
                    ("cache", "ls")}


def tour_commands() -> list[list[str]]:
    text = (REPO / "docs" / "tour.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    cmds = []
    for line in lines:
        line = line.split("#", 1)[0] if not line.lstrip().startswith("dflashkit") else _strip_comment(line)
        for part in line.split(";"):
            words = shlex.split(part)
            if words and words[0] == "dflashkit":
                cmds.append(words[1:])
    return cmds


def _strip_comment(line: str) -> str:
    """Drop a trailing `# comment` (outside quotes)."""
    out, quote = [], None
    for i, ch in enumerate(line):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        if ch == "#" and quote is None and (i == 0 or line[i - 1] == " "):
            break
        out.append(ch)
    return "".join(out)


def reads_and_writes(words: list[str]) -> tuple[list[str], list[str]]:
    reads, writes = [], []
    positional = [w for i, w in enumerate(words) if not w.startswith("-") and "=" not in w
                  and (i == 0 or not words[i - 1].startswith("--") or words[i - 1] in ("--fresh",))]
    for i, w in enumerate(words):
        if w in READ_OPTIONS and i + 1 < len(words):
            reads.append(words[i + 1])
        if w == "--out" and i + 1 < len(words):
            writes.append(words[i + 1])
        if "=" in w and not w.startswith("-"):
            key, value = w.split("=", 1)
            (writes if key == "out" else reads if key in READ_KEYS else []).append(value)
    for head in POSITIONAL_READS:
        if tuple(positional[: len(head)]) == head:
            reads += positional[len(head):]
    return reads, writes


def test_the_tour_reads_only_what_it_wrote_and_parses():
    parser = build_parser()
    written: list[str] = []
    cmds = tour_commands()
    assert len(cmds) >= 15
    for words in cmds:
        parser.parse_args(words)  # every command and option exists (exits 2 otherwise)
        reads, writes = reads_and_writes(words)
        for path in reads:
            if path.startswith("runs"):
                assert any(path.rstrip("/") == w or path.startswith(w + "/") or w.startswith(path.rstrip("/") + "/")
                           for w in written), f"`dflashkit {' '.join(words)}` reads {path}, which no earlier step wrote"
            else:
                from dflashkit.configs import shipped

                assert (REPO / path).exists() or path in shipped(), \
                    f"`dflashkit {' '.join(words)}` reads {path}, neither in the repository nor a shipped config"
        written += [w.rstrip("/") for w in writes]
    assert "runs/train" in written and "runs/cache/train" in written


def test_the_parser_of_this_test_sees_reads_and_writes():
    assert reads_and_writes(["eval", "--drafter", "runs/d", "--cache", "runs/c", "--out", "runs/e"]) == \
        (["runs/d", "runs/c"], ["runs/e"])
    assert reads_and_writes(["train", "--config", "x.yaml", "data=runs/c", "out=runs/t"]) == (["x.yaml", "runs/c"],
                                                                                             ["runs/t"])
    assert reads_and_writes(["compare", "runs/a", "runs/b"])[0] == ["runs/a", "runs/b"]
