"""Caches of target hidden states: `extract` writes one, `open_cache` reads one strictly; each record gives
`tokens` [T], `prompt_len` and `features()` float32 [T, K*H]. Imports are lazy so that the CLI starts without torch."""

from dflashkit.lazy import lazy_exports

_EXPORTS = {**dict.fromkeys(("open_cache", "Cache", "CacheRecord", "verify_cache"), "dflashkit.cache.store"),
            "extract": "dflashkit.cache.extraction", "diff_caches": "dflashkit.cache.diff"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
