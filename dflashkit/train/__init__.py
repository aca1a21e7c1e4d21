"""Drafter training: the paper's recipe (docs/design.md section 7) with guards against silent failures, e.g.
`train(load_config("smollm2-cpu", ["steps=100"]))`."""

from dflashkit.lazy import lazy_exports

_EXPORTS = {**dict.fromkeys(("TrainConfig", "default_gamma", "load_config"), "dflashkit.train.config"),
            "train": "dflashkit.train.loop"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
