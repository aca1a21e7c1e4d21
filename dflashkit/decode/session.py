"""The contract the decoding loops are written over: `Backend`, `DecodeSession`, `Timer` and the `Generation` returned."""

from __future__ import annotations

import sys
from collections import defaultdict
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Protocol

import torch


@dataclass
class Generation:
    method: str
    tokens: list[int]  # new tokens, cut exactly where plain decoding stops (stop token kept, or max_new_tokens)
    accepted: list[int]  # per round: accepted drafts + 1 (the bonus), as verified, before any cut
    times: dict[str, float] = field(default_factory=dict)  # seconds: prefill, draft, verify, other, total
    engine: str = "hf"  # the backend that ran it: hf (transformers' forward) or static (our compiled step)
    widths: list[int] = field(default_factory=list)  # per round: tokens the target verified (root included)
    drafted: list[bool] = field(default_factory=list)  # per round: whether the drafter ran (the cost model prices both)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


class Timer:
    """Wall time per named section (CUDA synchronized); `other` is a round's time outside prefill, verify and draft."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: dict[str, float] = defaultdict(float)
        self.t0 = perf_counter()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return perf_counter()

    @contextmanager
    def __call__(self, name: str):
        t = self.now()
        yield
        self.times[name] += self.now() - t

    def finish(self) -> dict[str, float]:
        out = {k: self.times.get(k, 0.0) for k in ("prefill", "draft", "verify")}
        out["total"] = self.now() - self.t0
        out["other"] = max(0.0, out["total"] - out["prefill"] - out["draft"] - out["verify"])
        return out


class Backend(Protocol):
    """What runs the target for a loop (decode/hf.py, decode/static.py): the loops use these verbs and nothing else."""

    engine: str  # the name a Generation records: hf, hf-stock or static
    widest: int | None  # the most nodes one verify takes (None: any)
    cost: Any  # seconds of a verify over n tokens (a CostCurve or the static step's own times), or None
    path_cost: Any  # the cost of a tree verified one root-to-leaf path a row, where trees go so; else None
    target: Any
    start: int  # the next position

    def session(self, timer: Timer) -> AbstractContextManager:
        """What one generation runs under; `timer` times the backend's own re-runs."""

    def prefill(self, ids: list[int], layer_ids) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [1, V] after the prompt, its features or None)."""

    def verify(self, tokens: torch.Tensor, tree=None) -> torch.Tensor:
        """Logits [n, V] after each of `tokens` from the next position on: a chain (tree None) or a flat tree."""

    def commit(self, keep: list[int]) -> torch.Tensor | None:
        """Keep the verified nodes `keep` (root first); returns their features."""

    def verified_tokens(self, tree) -> int:
        """The tokens the last verify of `tree` ran: what the cost model prices."""


@dataclass
class DecodeSession:
    """What one run keeps across its calls (a bench's rows, a conversation's turns). `probe(session)` answers
    `--engine auto` (measure/probe.py); a session without one cannot run auto."""

    target: Any
    proposer: Any = None
    trees: bool = False  # build the static decoder with tree widths from the start
    reprobe: bool = False  # auto's probe measures again instead of reading its cached answer
    log: Callable[[str], None] | None = None
    probe: Callable[[DecodeSession], dict] | None = None
    static: Any = None  # the static decoder, once built
    auto: dict | None = None  # auto's answer: {"plain": backend, "speculative": backend, ...}
    lookups: dict = field(default_factory=dict)  # row label -> its NgramLookup

    def say(self, message: str) -> None:
        (self.log or (lambda m: print(m, file=sys.stderr)))(message)
