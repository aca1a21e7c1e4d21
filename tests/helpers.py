"""Test helpers shared by several test modules: reference loops, oracle proposers, statistics, folder edits."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

KINDS = ("llama", "qwen3", "qwen3_5")
# torch's own CPU attention computes bf16 on its AVX-512 kernels only (their AVX2 path raises "pack_vnni2 is only
# supported when avx512 is supported"): a float32-only CPU, or this one at level v3 (`--isa v3` starts torch with
# ATEN_CPU_CAPABILITY=avx2), cannot run a bf16 forward on stock kernels. The row-invariant
# kernels (float64 attention) run bf16 everywhere; tests of bf16 on stock kernels skip there.
stock_bf16 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX", "AVX2"),
                                reason="torch's CPU attention computes bf16 on its AVX-512 code path only")


def greedy_reference(target, ids, n, stops=()):
    """Plain greedy decoding written out: full recompute each step, no cache."""
    seq, out = list(ids), []
    for _ in range(n):
        t = int(target.model(torch.tensor([seq])).logits[0, -1].argmax())
        out.append(t)
        seq.append(t)
        if t in stops:
            break
    return out


class Oracle:
    """A drafter stand-in that proposes the target's own continuation `sequence` (prompt + greedy completion).

    `wrong` positions get a planted mistake: a wrong token first and the right one second, so chain stops
    there while DDTree finds the right token as a sibling. Every call's context features are recorded."""

    def __init__(self, sequence, block_size, vocab, wrong=(), layer_ids=(1,)):
        self.seq, self.block_size, self.vocab, self.wrong = list(sequence), block_size, vocab, set(wrong)
        self.layer_ids = list(layer_ids)
        self.calls = []

    def reset(self, prompt_ids):
        self.calls = []

    def propose(self, features, anchor, start):
        self.calls.append((start, features.clone()))
        logits = torch.zeros(self.block_size - 1, self.vocab)
        for j in range(1, self.block_size):
            p = start + j
            want = self.seq[p] if p < len(self.seq) else 0
            if p in self.wrong:
                logits[j - 1, (want + 1) % self.vocab] = 20.0
                logits[j - 1, want] = 19.0
            else:
                logits[j - 1, want] = 20.0
        return logits

    def to_tokens(self, idx):
        return idx


def eager_decoders(monkeypatch, length: int = 160):
    """decoder_for builds eager static steps (compiling costs a minute): one decoder per run, as the real one
    shares, rebuilt for another drafter or for trees."""
    from dflashkit.decode import static

    real = static.StaticDecoder

    def eager(session, n, proposer=None, trees=False):
        target, d = session.target, session.static
        other = proposer is not None and d is not None and (d.layer_ids, d.verify_width) != (
            proposer.layer_ids, proposer.block_size)
        n += 32  # room for the last verify, as decoder_for leaves
        if d is None or trees and not d.trees or other or d.max_len < n:
            drafting = {} if proposer is None else {"layer_ids": proposer.layer_ids,
                                                    "verify_width": proposer.block_size}
            d = session.static = real(target, max(length, n), compile=False, trees=trees, **drafting)
            d.warm(timed=1)
        return d

    monkeypatch.setattr(static, "decoder_for", eager)


def chi_square(counts: dict, probs: torch.Tensor, n: int) -> tuple[float, float]:
    """Pearson statistic over bins of expected count >= 5 plus one pooled bin for the rest, and its critical
    value at p = 1e-4 (Wilson-Hilferty approximation of the chi-square quantile)."""
    big = [t for t in range(len(probs)) if probs[t] * n >= 5]
    obs = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
    exp = [float(probs[t]) * n for t in big] + [n * (1.0 - float(probs[big].sum()))]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 1e-9)
    dof = len([e for e in exp if e > 1e-9]) - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
    return stat, crit


@torch.no_grad()
def first_two_token_distributions(target, ids, T):
    """The target's softmax(logits / T) for the first new token [V], and for the second given each first [V, V]."""
    p1 = torch.softmax(target.model(torch.tensor([ids])).logits[0, -1] / T, -1)
    first = torch.arange(target.vocab_size)[:, None]
    both = torch.cat([torch.tensor([ids]).expand(target.vocab_size, -1), first], dim=1)
    return p1, torch.softmax(target.model(both).logits[:, -1] / T, -1)


class SpreadOracle(Oracle):
    """Rejection sampling with a q that is not one-hot: half on the target's greedy token, the rest over three
    others (as a DFlash2 q over its top-k), drafts sampled from q, so the residual max(p - q, 0) gets used."""

    def draft(self, features, anchor, start, temperature, generator, mix=1.0):
        from dflashkit.drafter.model import mix_greedy

        want = self.propose(features, anchor, start).argmax(-1)
        q = torch.zeros(len(want), self.vocab)
        rows = torch.arange(len(want))
        q[rows, want] = 0.5
        for k in (1, 2, 3):
            q[rows, (want + 7 * k) % self.vocab] = 0.5 / 3
        if temperature <= 0:
            return want, None
        return mix_greedy(q, torch.multinomial(q, 1, generator=generator)[:, 0], mix, generator)


def sampling_setup(target, text: str, T: float = 0.2, B: int = 4):
    """(prompt ids, an oracle of the greedy continuation, p1 [V], p2 [V], p2_given [V, V]) for the first-two-token
    distribution tests at temperature T."""
    ids = target.chat_ids([{"role": "user", "content": text}])
    oracle = Oracle(ids + greedy_reference(target, ids, 8), B, target.vocab_size)
    p1, p2_given = first_two_token_distributions(target, ids, T)
    return ids, oracle, p1, p1 @ p2_given, p2_given


def edit_folder(path, cfg_edit=None, state_edit=None):
    """Edit a drafter folder in place: config.json through cfg_edit(dict), the tensors through state_edit(dict)."""
    if cfg_edit:
        cfg = json.loads((path / "config.json").read_text())
        cfg_edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if state_edit:
        state = load_file(path / "model.safetensors")
        state_edit(state)
        save_file(state, path / "model.safetensors")
    return path


def perturb(drafter, conv_std: float = 0.3):
    """Non-trivial norm weights (a missed norm shows up) and DFlash2 convolutions off their identity start."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif "_conv." in name:
                p.normal_(0, conv_std)
    return drafter


def standard_set(rel: str):
    """A standard prompt set: `../shared/data/<rel>` when this checkout sits beside the shared data, else the
    stand-in of the same format under tests/data/."""
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    shared = tests.parent.parent / "shared" / "data" / rel
    return shared if shared.is_file() else tests / "data" / rel


ENGINE_TEXTS = ["def add(a, b):", "Write a haiku about the sea."]  # two short prompts the engine-peer tests share


def drafter_and_prompts(t, texts=ENGINE_TEXTS):
    """(target, a seeded one-layer block-4 drafter on layers [1, 3], [(text, chat ids)]): what the engine-peer and
    parity tests run."""
    from dflashkit.drafter.checkpoint import new_drafter

    torch.manual_seed(0)
    d = new_drafter(t, num_layers=1, target_layer_ids=[1, 3], block_size=4).eval()
    return t, d, [(x, t.chat_ids([{"role": "user", "content": x}])) for x in texts]


def exercised_levels() -> list[str]:
    """The ISA levels the suite exercises: every one this CPU runs, up to the one asked for, so that `make test
    ISA=v3` runs as a float32-only CPU does (it has no v4); v3 built with Zen 1-3's tuning planted joins them
    wherever v3 is one (tests/test_static_decoder.py)."""
    from dflashkit import levels

    here = levels.runnable()
    return here[: here.index(levels.chosen()) + 1] if levels.chosen() in here else here
