"""Seeded blocks that leave the caller's random state as it was: weight initialisation and transformers' sampling
draw from torch's global generators, and a library call that seeded them for the rest of the process would change
what its caller draws next, so library code seeds inside `seeded` only."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def seeded(seed: int, device=None):
    """torch's CPU generator (and `device`'s, on CUDA) seeded for the block, restored afterwards."""
    import torch  # here: importing dflashkit stays light

    dev = torch.device(device) if device is not None else None
    devices = [dev.index or 0] if dev is not None and dev.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
