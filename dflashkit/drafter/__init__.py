"""The DFlash drafter: config, module and checkpoint formats.

    from dflashkit.drafter import DrafterConfig, DFlashDrafter, new_drafter, load_drafter, save_drafter, DraftHead

Names load lazily so that the CLI's parser does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DrafterConfig": "dflashkit.drafter.config",
    "DFlashDrafter": "dflashkit.drafter.model",
    "DrafterCache": "dflashkit.drafter.model",
    "build_block_mask": "dflashkit.drafter.model",
    "DraftHead": "dflashkit.drafter.head",
    "new_drafter": "dflashkit.drafter.checkpoint",
    "load_drafter": "dflashkit.drafter.checkpoint",
    "save_drafter": "dflashkit.drafter.checkpoint",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dflashkit.drafter' has no attribute {name!r}")
