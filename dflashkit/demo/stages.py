"""Stage bookkeeping for `dflashkit demo`: a rerun skips a stage whose inputs and outputs are unchanged, rebuilds
one whose outputs were corrupted, and resumes one that was interrupted (extraction and training pick up where they
stopped). A stage's fingerprint holds each earlier stage's fingerprint and output digest, so that a stage rebuilt for
new inputs rebuilds what reads it, while one rebuilt into the same outputs does not."""

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
    settings: dict = field(default_factory=dict)  # the numerics it is built with: fingerprinted and recorded


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
    timings: dict[str, dict] = field(default_factory=dict)  # stage -> its stamp (seconds, estimate_s, ...), skipped
    estimates: dict[str, float] = field(default_factory=dict)  # stage -> seconds expected here (plan.py)

    def label(self, name: str) -> str:
        return f"[{self.names.index(name) + 1}/{len(self.names)}] {name}"

    def header(self, name: str) -> None:
        """The stage's rule, with the time it and the rest of the demo should take."""
        rule = f"[bold]{self.label(name)}[/bold]"
        if name in self.estimates:
            left = sum(self.estimates.get(s, 0.0) for s in self.names[self.names.index(name):])
            rule += f"  (about {minutes(self.estimates[name])} for this stage, {minutes(left)} left in the demo)"
        self.console.rule(rule)

    def key(self, stage: Stage) -> str:
        return sha256_json({**stage.inputs, "settings": stage.settings,
                            "after": {s: [self.keys[s], self.digests[s]] for s in stage.after}})

    def run(self, stage: Stage) -> None:
        """Build `stage` unless its stamp says the same inputs already produced these exact outputs."""
        n, stamp_file, key = self.label(stage.name), self.root / "stages" / f"{stage.name}.json", self.key(stage)
        self.keys[stage.name] = key
        stamp = json.loads(stamp_file.read_text()) if stamp_file.is_file() else {}
        digest = stage.digest or fingerprint
        if stamp.get("inputs") == key and stamp.get("done"):
            if digest(stage.outputs) == stamp.get("outputs"):
                self.console.print(f"[dim]{n}: unchanged, skipped[/dim]")
                self.digests[stage.name], self.timings[stage.name] = stamp["outputs"], {**stamp, "skipped": True}
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
        self.header(stage.name)
        stage.build()
        self.digests[stage.name] = digest(stage.outputs)
        if not self.digests[stage.name]:
            missing = ", ".join(str(p) for p in stage.outputs if not p.exists())
            raise DFlashError(f"demo stage {stage.name} did not write {missing}")
        stamp = {"inputs": key, "done": True, "outputs": self.digests[stage.name], "seconds": spent_s + time.time() - t0,
                 "estimate_s": self.estimates.get(stage.name), "settings": stage.settings}
        write_json(stamp_file, stamp)
        self.timings[stage.name] = {**stamp, "skipped": False}


def interrupted_s(stamp: dict, outputs: list[Path]) -> float:
    """Seconds an interrupted run of a stage spent: from its start to the last file it wrote (when it died is not
    recorded, so the time after its last write is not counted)."""
    if stamp.get("done") or "started" not in stamp:
        return 0.0
    files = [f for p in outputs if p.exists() for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    return max([0.0] + [f.stat().st_mtime - stamp["started"] for f in files])


def minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"
