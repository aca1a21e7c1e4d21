"""Online speculative decoding against the live target (chain, DDTree, n-gram, hybrid trees), the target's cost
curve, and the speed benchmark."""

from dflashkit.decode.cost import CostCurve, measure_cost_curve
from dflashkit.decode.ngram import NgramLookup
from dflashkit.decode.speculative import (
    DFlashProposer,
    Generation,
    Proposer,
    TreeDrafts,
    generate,
    generate_ar,
    generate_chain,
    generate_ddtree,
    generate_hf,
    generate_tree,
    parse_method,
    tree_drafts,
)

__all__ = ["CostCurve", "DFlashProposer", "Generation", "NgramLookup", "Proposer", "TreeDrafts", "generate",
           "generate_ar", "generate_chain", "generate_ddtree", "generate_hf", "generate_tree", "measure_cost_curve",
           "parse_method", "tree_drafts"]
