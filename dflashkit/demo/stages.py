"""Stage bookkeeping for `dflashkit demo`: a rerun skips a stage whose inputs are unchanged and whose outputs
still hash the same, rebuilds one whose outputs were corrupted, and resumes one that was interrupted (the stage's
own code resumes: extraction and training pick up where they stopped).

Each stage writes `<out>/stages/<name>.json`: {"inputs": hash, "done": bool, "outputs": hash, "seconds": float}.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dflashkit.errors import DFlashError
from dflashkit.fileio import sha256_file, sha256_json, write_json


@dataclass
class Stage:
    name: str
    inputs: dict  # what the outputs depend on, besides the outputs of the stages in `after`
    outputs: list[Path]
    build: Callable[[], None]
    after: tuple[str, ...] = ()  # earlier stages whose outputs this one reads
    digest: Callable[[list[Path]], str] | None = None  # what the outputs hold; default: every file's bytes


@dataclass
class Timing:
    seconds: float
    skipped: bool  # a skipped stage reports the seconds it took when it was built
    estimate_s: float | None = None  # what the demo predicted before the stage ran (probe.py)


def fingerprint(paths: list[Path]) -> str:
    """Content hash of files and folders (symlinks skipped); '' when something is missing."""
    rows = []
    for p in paths:
        if not p.exists():
            return ""
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.is_symlink())
        rows += [(str(f.relative_to(p.parent)), sha256_file(f)) for f in files]
    return sha256_json(rows)


@dataclass
class StageRunner:
    root: Path
    names: list[str]  # every step of the demo, in order, for the [n/total] counter
    console: object
    digests: dict[str, str] = field(default_factory=dict)
    timings: dict[str, Timing] = field(default_factory=dict)
    estimates: dict[str, float] = field(default_factory=dict)  # stage -> seconds expected here (plan.py)

    def __post_init__(self):
        (self.root / "stages").mkdir(parents=True, exist_ok=True)

    def label(self, name: str) -> str:
        return f"[{self.names.index(name) + 1}/{len(self.names)}] {name}"

    def header(self, name: str, estimate_s: float | None = None) -> None:
        n = self.label(name)
        if estimate_s is None:
            self.console.rule(f"[bold]{n}[/bold]")
            return
        left = sum(self.estimates.get(s, 0.0) for s in self.names[self.names.index(name):])
        self.console.rule(f"[bold]{n}[/bold]  (about {_mins(estimate_s)} for this stage, {_mins(left)} left in the demo)")

    def run(self, stage: Stage) -> None:
        """Build `stage` unless its stamp says the same inputs already produced these exact outputs."""
        n = self.label(stage.name)
        stamp_file = self.root / "stages" / f"{stage.name}.json"
        key = sha256_json({**stage.inputs, "after": {s: self.digests[s] for s in stage.after}})
        stamp = json.loads(stamp_file.read_text()) if stamp_file.is_file() else {}
        if stamp.get("inputs") == key and stamp.get("done"):
            if (stage.digest or fingerprint)(stage.outputs) == stamp.get("outputs"):
                self.console.print(f"[dim]{n}: unchanged, skipped[/dim]")
                self.digests[stage.name] = stamp["outputs"]
                self.timings[stage.name] = Timing(stamp.get("seconds", 0.0), skipped=True, estimate_s=stamp.get("estimate_s"))
                return
            self.console.print(f"[yellow]{n}: outputs changed or corrupted since they were written; rebuilding[/yellow]")
            stamp = {}
        if stamp.get("inputs") != key:  # new inputs: start clean; same inputs, not done: resume
            for p in stage.outputs:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        write_json(stamp_file, {"inputs": key, "done": False})
        estimate_s = self.estimates.get(stage.name)
        self.header(stage.name, estimate_s)
        t0 = time.time()
        stage.build()
        digest = (stage.digest or fingerprint)(stage.outputs)
        if not digest:
            missing = ", ".join(str(p) for p in stage.outputs if not p.exists())
            raise DFlashError(f"demo stage {stage.name} did not write {missing}")
        seconds = time.time() - t0
        write_json(stamp_file, {"inputs": key, "done": True, "outputs": digest, "seconds": seconds,
                                "estimate_s": estimate_s})
        self.digests[stage.name] = digest
        self.timings[stage.name] = Timing(seconds, skipped=False, estimate_s=estimate_s)


def _mins(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"
