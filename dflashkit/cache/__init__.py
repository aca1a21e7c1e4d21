"""Caches of target hidden states: `extract` writes one, `open_cache` reads one strictly.

    from dflashkit.cache import open_cache, extract
    path = extract(target, load_prompts("coding-10"), "runs/cache")
    cache = open_cache(path, num_prompts=10, expect_target=target.identity(), layer_ids=[1, 8, 14])
    for rec in cache:
        rec.tokens, rec.prompt_len, rec.features()  # [T], int, float32 [T, K*H]

Imports are lazy so that the CLI starts without torch.
"""

from dflashkit.lazy import lazy_exports

_EXPORTS = {**dict.fromkeys(("open_cache", "Cache", "CacheRecord", "verify_cache"), "dflashkit.cache.store"),
            "extract": "dflashkit.cache.extraction", "diff_caches": "dflashkit.cache.diff"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
