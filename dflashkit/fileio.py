"""Atomic writes and hashing: an interrupted run never leaves a file that looks complete."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from dflashkit import machine
from dflashkit.errors import DFlashError


def home() -> Path:
    """Where prepared targets live: $DFLASHKIT_HOME as the entry point read it, default ~/.cache/dflashkit."""
    return Path(machine.current().home).expanduser()


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temp path beside `path`; rename it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; shared caches and checkpoints should be readable
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(path: str | os.PathLike) -> None:
    """Refuse, before any work, an output path whose nearest existing ancestor is not a writable folder."""
    p = Path(path).absolute()
    here = p if p.exists() else next(a for a in p.parents if a.exists())
    if here != p and not here.is_dir():
        raise DFlashError(f"--out {path}: {here} is a file, not a folder, so nothing can be written under it; "
                          "choose another --out")
    if not os.access(here if here.is_dir() else here.parent, os.W_OK | os.X_OK):
        raise DFlashError(f"--out {path}: {here} is not writable by this user; choose another --out")


def read_json(path, fix: str = ""):
    """Parse a JSON file; a corrupt one is a DFlashError naming the file and, if given, the fix."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: invalid JSON ({e}){'; ' + fix if fix else ''}") from e


def write_json(path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temp folder beside `path`; it replaces `path` only when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
