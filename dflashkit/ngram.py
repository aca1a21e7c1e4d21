"""n-gram lookup: propose the continuation of the last earlier occurrence of the text's own suffix, and learn how
often its proposals survive (docs/design.md, "The n-gram lookup in detail")."""

from __future__ import annotations


class NgramLookup:
    def __init__(self, max_ngram: int = 3, max_tokens: int = 10, prior: tuple[float, float] = (1.0, 2.0),
                 branches: int = 1):
        self.max_ngram, self.max_tokens, self.prior, self.branches = max_ngram, max_tokens, prior, branches
        self.stats: dict[tuple[int, int], list[float]] = {}  # (match length, depth) -> [accepted, tried]
        self.reset([])

    def reset(self, tokens) -> None:
        """Start a new text (prompt ids); acceptance statistics carry over between texts."""
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions of its occurrences with a successor
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 2  # this position just got a successor
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.index.setdefault(tuple(self.tokens[end - n + 1 : end + 1]), []).append(end)

    def propose_all(self, k: int | None = None) -> list[tuple[list[int], int]]:
        """Up to k distinct (continuation, matched suffix length), longest match first, then the most recent."""
        k, out = k or self.branches, {}  # continuation -> (it, matched length), the first found kept
        for n in range(min(self.max_ngram, len(self.tokens)), 0, -1):
            for end in reversed(self.index.get(tuple(self.tokens[-n:]), ())):
                cont = self.tokens[end + 1 : end + 1 + self.max_tokens]
                out.setdefault(tuple(cont), (cont, n))
                if len(out) == k:
                    return list(out.values())
        return list(out.values())

    def probs(self, match: int, length: int) -> list[float]:
        """Estimated chance that the proposal's first 1..length tokens are all accepted."""
        out, p = [], 1.0
        for d in range(1, length + 1):
            hit, tried = self.stats.get((match, d), (0.0, 0.0))
            p *= (hit + self.prior[0]) / (tried + self.prior[1])
            out.append(p)
        return out

    def observe(self, match: int, length: int, accepted: int) -> None:
        """A proposal of `length` tokens from a `match`-token suffix had its first `accepted` tokens accepted."""
        for d in range(1, min(length, accepted + 1) + 1):  # depth d was tried iff depth d-1 was accepted
            s = self.stats.setdefault((match, d), [0.0, 0.0])
            s[0] += d <= accepted
            s[1] += 1
