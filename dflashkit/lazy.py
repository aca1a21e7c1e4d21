"""Lazy package exports: a sub-package names what it offers without importing it, so that `import dflashkit` and
the CLI's parser start without torch."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """A module-level `__getattr__` that imports each exported name's module (exports: name -> module) on first use."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
