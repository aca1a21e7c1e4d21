"""The DFlash drafter: config, module and checkpoint formats."""

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter, DrafterCache, build_block_mask

__all__ = ["DrafterConfig", "DFlashDrafter", "DrafterCache", "build_block_mask"]
