"""Offline evaluation of drafters on cached target states, DDTree, and side-by-side comparison of runs. Names load
lazily so that the CLI's parser does not import torch."""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

_EXPORTS = {
    **{name: "dflashkit.evaluate.offline" for name in (
        "evaluate", "evaluate_sequence", "aggregate", "score_block", "stride_anchors", "parse_trees")},
    "run_eval": "dflashkit.evaluate.runs",
    **{name: "dflashkit.evaluate.compare" for name in ("compare_runs", "load_run")},
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
