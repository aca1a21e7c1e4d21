"""Online speculative decoding against the live target (chain, DDTree, n-gram, hybrid trees), the target's cost
curve, and the speed benchmark.

Names load lazily so that the CLI's parser does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CostCurve": "dflashkit.decode.cost",
    "measure_cost_curve": "dflashkit.decode.cost",
    "NgramLookup": "dflashkit.decode.ngram",
    "parse_method": "dflashkit.decode.methods",
    **{name: "dflashkit.decode.speculative" for name in (
        "DFlashProposer", "Generation", "Proposer", "TreeDrafts", "generate", "generate_ar", "generate_chain",
        "generate_ddtree", "generate_hf", "generate_tree", "tree_drafts")},
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dflashkit.decode' has no attribute {name!r}")
