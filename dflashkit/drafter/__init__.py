"""The DFlash drafter: config, module and checkpoint formats. Names load lazily so that the CLI's parser does not
import torch."""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

_EXPORTS = {
    "DrafterConfig": "dflashkit.drafter.config",
    "DFlashDrafter": "dflashkit.drafter.model",
    "ContextKV": "dflashkit.drafter.model",
    "build_block_mask": "dflashkit.drafter.model",
    "DraftHead": "dflashkit.drafter.head",
    "new_drafter": "dflashkit.drafter.checkpoint",
    "load_drafter": "dflashkit.drafter.checkpoint",
    "save_drafter": "dflashkit.drafter.checkpoint",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
