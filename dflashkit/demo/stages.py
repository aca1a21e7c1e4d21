"""Stage bookkeeping for `dflashkit demo`: a rerun skips a stage whose inputs are unchanged and whose outputs
still hash the same, rebuilds one whose outputs were corrupted, and resumes one that was interrupted (the stage's
own code resumes: extraction and training pick up where they stopped).

A stage's fingerprint holds its own inputs, the numeric settings it was built with (dtype, device, kernels) and,
for each earlier stage it reads, that stage's fingerprint and output digest: a stage rebuilt for new inputs rebuilds
what reads it, while one rebuilt after corruption into the same outputs does not.

Each stage writes `<out>/stages/<name>.json`: {"inputs": hash, "done": bool, "outputs": hash, "seconds": float,
"settings": dict, "about": str}. "seconds" is the whole build, across the runs an interruption split it into, so that
the plan's refit (plan.py) sees what the stage cost, not only its last part.
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
    settings: dict = field(default_factory=dict)  # the numerics it is built with: fingerprinted, and recorded as is
    about: str = ""  # the same in words for the report (recorded, not fingerprinted)


@dataclass
class Timing:
    seconds: float
    skipped: bool  # a skipped stage reports the seconds it took when it was built
    estimate_s: float | None = None  # what the demo predicted before the stage ran (probe.py)
    settings: dict = field(default_factory=dict)  # what it was built with, from its stamp (not today's command line)
    about: str = ""


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
    keys: dict[str, str] = field(default_factory=dict)  # stage -> the fingerprint it was built or kept with
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

    def key(self, stage: Stage) -> str:
        """The stage's fingerprint: its inputs and settings, and each earlier stage's fingerprint and outputs."""
        return sha256_json({**stage.inputs, "settings": stage.settings,
                            "after": {s: [self.keys[s], self.digests[s]] for s in stage.after}})

    def run(self, stage: Stage) -> None:
        """Build `stage` unless its stamp says the same inputs already produced these exact outputs."""
        n = self.label(stage.name)
        stamp_file = self.root / "stages" / f"{stage.name}.json"
        key = self.key(stage)
        self.keys[stage.name] = key
        stamp = json.loads(stamp_file.read_text()) if stamp_file.is_file() else {}
        if stamp.get("inputs") == key and stamp.get("done"):
            if (stage.digest or fingerprint)(stage.outputs) == stamp.get("outputs"):
                self.console.print(f"[dim]{n}: unchanged, skipped[/dim]")
                self.digests[stage.name] = stamp["outputs"]
                self.timings[stage.name] = Timing(stamp.get("seconds", 0.0), skipped=True,
                                                  estimate_s=stamp.get("estimate_s"),
                                                  settings=stamp.get("settings", {}), about=stamp.get("about", ""))
                return
            self.console.print(f"[yellow]{n}: outputs changed or corrupted since they were written; rebuilding[/yellow]")
            stamp = {}
        if stamp.get("inputs") != key:  # new inputs: start clean; same inputs, not done: resume
            for p in stage.outputs:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            stamp = {}
        spent_s = stamp.get("spent_s", 0.0) + interrupted_s(stamp, stage.outputs)  # the earlier runs of this build
        t0 = time.time()
        write_json(stamp_file, {"inputs": key, "done": False, "started": t0, "spent_s": spent_s})
        estimate_s = self.estimates.get(stage.name)
        self.header(stage.name, estimate_s)
        stage.build()
        digest = (stage.digest or fingerprint)(stage.outputs)
        if not digest:
            missing = ", ".join(str(p) for p in stage.outputs if not p.exists())
            raise DFlashError(f"demo stage {stage.name} did not write {missing}")
        seconds = spent_s + time.time() - t0
        write_json(stamp_file, {"inputs": key, "done": True, "outputs": digest, "seconds": seconds,
                                "estimate_s": estimate_s, "settings": stage.settings, "about": stage.about})
        self.digests[stage.name] = digest
        self.timings[stage.name] = Timing(seconds, skipped=False, estimate_s=estimate_s, settings=stage.settings,
                                          about=stage.about)


def interrupted_s(stamp: dict, outputs: list[Path]) -> float:
    """Seconds an interrupted run of a stage spent: from its start to the last file it wrote (when it died is not
    recorded, so the time after its last write is not counted)."""
    if stamp.get("done") or "started" not in stamp:
        return 0.0
    files = [f for p in outputs if p.exists() for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    return max([0.0] + [f.stat().st_mtime - stamp["started"] for f in files])

def _mins(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"
