"""Online speculative decoding against the live target over two backends (hf, static); measuring it is
dflashkit.measure. Names load lazily so that the CLI's parser does not import torch."""

from __future__ import annotations

from dflashkit.lazy import lazy_exports

_EXPORTS = {
    "NgramLookup": "dflashkit.ngram", "parse_method": "dflashkit.decode.methods",
    "Sampling": "dflashkit.decode.sampling",
    **{name: "dflashkit.decode.session" for name in ("Backend", "DecodeSession", "Generation")},
    "TreeDrafts": "dflashkit.tree",
    **{name: "dflashkit.decode.speculative" for name in (
        "DFlashProposer", "Proposer", "generate", "generate_ar", "generate_chain", "generate_hf", "generate_tree",
        "tree_drafts")},
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
