"""Online speculative decoding against the live target (chain and DDTree), and the speed benchmark."""

from dflashkit.decode.speculative import (
    DFlashProposer,
    Generation,
    Proposer,
    generate,
    generate_ar,
    generate_chain,
    generate_ddtree,
    generate_prompt_lookup,
    parse_method,
)

__all__ = ["DFlashProposer", "Generation", "Proposer", "generate", "generate_ar", "generate_chain", "generate_ddtree",
           "generate_prompt_lookup", "parse_method"]
