"""A bench's finished runs, appended as each one ends, so that the same command resumes an interrupted bench."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.fileio import write_text

FORMAT = "dflashkit-bench-journal/1"


class Journal:
    """A JSONL file: the bench's settings, then one finished run a line; other settings are refused by name."""

    def __init__(self, path, settings: dict):
        self.path, self.settings = Path(path), json.loads(json.dumps(settings))

    def resume(self) -> list[dict]:
        """The runs an earlier, interrupted bench of these settings finished (none where there was none), the file
        rewritten as the header and those runs (a cut-off last line goes)."""
        head = {"format": FORMAT, "settings": self.settings}
        lines = self.path.read_text().splitlines() if self.path.is_file() else [json.dumps(head)]
        try:
            found = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            found = {}
        if found.get("format") != FORMAT:
            raise DFlashError(f"{self.path}: not a bench journal (its first line); delete it to start over")
        differ = sorted(k for k in set(found["settings"]) | set(self.settings)
                        if found["settings"].get(k) != self.settings.get(k))
        if differ:
            raise DFlashError(f"{self.path} holds an interrupted bench of other settings ({', '.join(differ)} "
                              "differ); rerun it as it was to finish it, pass another --out, or delete the file to "
                              "start over")
        runs = []
        for line in lines[1:]:
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:  # cut off mid-write: that run had not finished
                break
        write_text(self.path, "".join(json.dumps(x) + "\n" for x in [head, *runs]))
        return runs

    def add(self, run: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(run) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self) -> None:
        """The results are written: a rerun measures anew."""
        self.path.unlink(missing_ok=True)
