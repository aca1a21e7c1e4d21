"""The DFlash drafter: config, module and checkpoint formats, loaded lazily so the CLI's parser skips torch."""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

_EXPORTS = {"DrafterConfig": "dflashkit.drafter.config",
            **dict.fromkeys(("DFlashDrafter", "ContextKV", "build_block_mask"), "dflashkit.drafter.model"),
            "DraftHead": "dflashkit.drafter.head",
            **dict.fromkeys(("new_drafter", "load_drafter", "save_drafter"), "dflashkit.drafter.checkpoint")}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
