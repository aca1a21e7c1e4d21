"""Offline evaluation of drafters on cached target states, DDTree, and side-by-side comparison of runs. Names load
lazily so that the CLI's parser does not import torch."""

from dflashkit.lazy import lazy_exports

_OFFLINE = ("evaluate", "evaluate_sequence", "aggregate", "score_block", "stride_anchors", "parse_trees")
_EXPORTS = {**dict.fromkeys(_OFFLINE, "dflashkit.evaluate.offline"), "run_eval": "dflashkit.evaluate.runs",
            **dict.fromkeys(("compare_runs", "load_run"), "dflashkit.evaluate.compare")}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
