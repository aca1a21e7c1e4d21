"""Caches of target hidden states: `extract` writes one, `open_cache` reads one strictly.

    from dflashkit.cache import open_cache, extract
    path = extract(target, load_prompts("coding-10"), "runs/cache")
    cache = open_cache(path, num_prompts=10, expect_target=target.identity(), layer_ids=[1, 8, 14])
    for rec in cache:
        rec.tokens, rec.prompt_len, rec.features()  # [T], int, float32 [T, K*H]

Imports are lazy so that the CLI starts without torch.
"""

__all__ = ["open_cache", "extract", "Cache", "CacheRecord", "verify_cache", "diff_caches"]


def __getattr__(name):
    if name in ("open_cache", "Cache", "CacheRecord", "verify_cache"):
        from dflashkit.cache import store

        return getattr(store, name)
    if name == "extract":
        from dflashkit.cache.extraction import extract

        return extract
    if name == "diff_caches":
        from dflashkit.cache.diff import diff_caches

        return diff_caches
    raise AttributeError(name)
