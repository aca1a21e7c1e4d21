"""The target's lm_head as the drafter uses it, optionally restricted to a draft vocabulary.

On a CPU the vocabulary projection dominates drafter cost (49,152 rows for SmolLM2); proposing only tokens
of a subset stays lossless because the target verifies every token (EAGLE-3 ships a token map for the same
reason). The subset is part of a dflashkit checkpoint's contract (`draft_vocab`); a z-lab export has none
and drafts over the full vocabulary.
"""

from __future__ import annotations

import torch


LOGIT_ELEMENTS = 1 << 24  # vocabulary logits held at once anywhere in dflashkit (64 MB of float32)


def scaled(raw: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None):
    """A drafter's logit transform as z-lab's reference applies it: x = raw * output_multiplier, then
    c * tanh(x / c) with c = final_logit_softcapping. Returns (logits, d logits / d raw)."""
    x = raw * multiplier if multiplier != 1.0 else raw
    if not softcap:
        return x, multiplier
    t = torch.tanh(x / softcap)
    return softcap * t, (1 - t * t) * multiplier


class DraftHead:
    """scaling: (output_multiplier, final_logit_softcapping) of the drafter, applied after the projection."""

    def __init__(self, lm_head_weight: torch.Tensor, vocab_ids=None, scaling=(1.0, None)):
        self.scaling = tuple(scaling)
        self.vocab_ids = None if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long, device=lm_head_weight.device)
        self.weight = lm_head_weight if self.vocab_ids is None else lm_head_weight[self.vocab_ids]
        self.full_size = lm_head_weight.shape[0]
        if self.vocab_ids is not None:
            self._index = torch.full((self.full_size,), -100, dtype=torch.long, device=lm_head_weight.device)
            self._index[self.vocab_ids] = torch.arange(len(self.vocab_ids), device=lm_head_weight.device)

    @classmethod
    def for_drafter(cls, target, drafter) -> "DraftHead":
        vocab = (getattr(drafter, "contract", None) or {}).get("draft_vocab")
        return cls(target.lm_head.weight, vocab, scaling_of(drafter.config))

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V'] in float32 (argmax and log-softmax need the precision)."""
        return scaled(torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight).float(), *self.scaling)[0]

    def to_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the (sub)vocabulary -> target token ids."""
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def to_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids -> indices into the subvocabulary; -100 for tokens outside it (and for -100)."""
        if self.vocab_ids is None:
            return tokens
        safe = tokens.clamp(min=0)
        return torch.where(tokens < 0, tokens, self._index[safe])


def scaling_of(cfg) -> tuple[float, float | None]:
    return cfg.output_multiplier, cfg.final_logit_softcapping
