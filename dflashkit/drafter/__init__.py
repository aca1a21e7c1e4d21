"""The DFlash drafter: config, module and checkpoint formats, loaded lazily so the CLI's parser skips torch."""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

_EXPORTS = {
    "DrafterConfig": "dflashkit.drafter.config",
    **{name: "dflashkit.drafter.model" for name in ("DFlashDrafter", "ContextKV", "build_block_mask")},
    "DraftHead": "dflashkit.drafter.head",
    **{name: "dflashkit.drafter.checkpoint" for name in ("new_drafter", "load_drafter", "save_drafter")},
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
