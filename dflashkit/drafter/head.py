"""The target's lm_head as the drafter uses it, optionally over a draft vocabulary: the projection dominates drafter
cost on a CPU, and since the target verifies every token, proposing from a subset stays lossless."""

from __future__ import annotations

import torch
import torch.nn.functional as F


LOGIT_ELEMENTS = 1 << 24  # vocabulary logits held at once anywhere in dflashkit (64 MB of float32)
FEW_ROWS = 24  # at most this many rows, a decoding product on a CPU runs as weight @ x.T (few_rows_linear)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, but a CPU call of a few rows computes weight @ x.T: ATen's x @ weight.T repacks the weight every
    call, a multiple of the cost when the weight is out of cache. Decoding only; training and evaluation keep F.linear."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > FEW_ROWS or rows == 0 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    y = (weight @ x.reshape(rows, -1).T).T
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def scaled(raw: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None):
    """z-lab's logit transform, raw * output_multiplier then c * tanh(x / c) -> (logits, d logits / d raw)."""
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
        self.size = self.weight.shape[0]  # rows of the (draft) vocabulary
        if self.vocab_ids is not None:
            self._index = torch.full((lm_head_weight.shape[0],), -100, dtype=torch.long, device=lm_head_weight.device)
            self._index[self.vocab_ids] = torch.arange(len(self.vocab_ids), device=lm_head_weight.device)

    @classmethod
    def for_drafter(cls, target, drafter) -> "DraftHead":
        vocab = (getattr(drafter, "contract", None) or {}).get("draft_vocab")
        return cls(target.lm_head.weight, vocab, scaling_of(drafter.config))

    def logits(self, hidden: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """[..., H] -> [..., V'] in float32 (argmax and log-softmax need the precision)."""
        return scaled(linear(hidden.to(self.weight.dtype), self.weight).float(), *self.scaling)[0]

    def to_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into the (sub)vocabulary -> target token ids."""
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def to_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids -> indices into the subvocabulary; -100 for tokens outside it (and for -100)."""
        return tokens if self.vocab_ids is None else torch.where(tokens < 0, tokens, self._index[tokens.clamp(min=0)])


def scaling_of(cfg) -> tuple[float, float | None]:
    return cfg.output_multiplier, cfg.final_logit_softcapping
