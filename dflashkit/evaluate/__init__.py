"""Offline evaluation of drafters on cached target states, DDTree, and side-by-side comparison of runs.

    from dflashkit.evaluate import evaluate, evaluate_sequence, compare_runs

Names load lazily so that the CLI's parser does not import torch.
"""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

_EXPORTS = {
    "evaluate": "dflashkit.evaluate.offline",
    "evaluate_sequence": "dflashkit.evaluate.offline",
    "aggregate": "dflashkit.evaluate.offline",
    "score_block": "dflashkit.evaluate.offline",
    "stride_anchors": "dflashkit.evaluate.offline",
    "parse_trees": "dflashkit.evaluate.offline",
    "run_eval": "dflashkit.evaluate.runs",
    "compare_runs": "dflashkit.evaluate.compare",
    "load_run": "dflashkit.evaluate.compare",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
