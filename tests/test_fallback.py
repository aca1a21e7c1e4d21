"""Speculation that never loses (issue 73): the -auto methods stop calling a drafter that does not pay, prompt by
prompt, and retry it at a bounded interval; counted here, not timed, with a drafter that is always wrong."""

from __future__ import annotations

import pytest
import torch

from dflashkit.measure.curve import CostCurve
from dflashkit.decode.speculative import DFlashProposer, generate
from dflashkit.drafter.checkpoint import new_drafter
from dflashkit.rng import seeded
from dflashkit.tree import RETRY_MOST

pytestmark = pytest.mark.usefixtures("one_thread")
WARM_UP = 30  # rounds: the prior (one token a draft) decays and the retries back off


def random_proposer(t):
    with seeded(0):
        return DFlashProposer(t, new_drafter(t, num_layers=1, block_size=4, target_layer_ids=[1, 2]).eval())


@pytest.mark.parametrize("method", ["ddtree-auto", "hybrid-auto"])
def test_a_drafter_that_is_always_wrong_is_called_at_most_one_round_in_ten(tiny_targets, method):
    """A random drafter on a tiny target: after the warm-up at most 1 round in 10 calls it (the rest are plain
    decoding, or the n-gram branch alone), and the output is plain greedy decoding's."""
    t = tiny_targets["llama"]
    ids = t.chat_ids([{"role": "user", "content": "def add(a, b): return a + b  # and more text"}])
    plain = generate(t, ids, "ar", max_new_tokens=200, stop_ids=[]).tokens
    cost = CostCurve([1, 32], [0.01, 0.02])  # a verify of 5 tokens costs a little more than one
    g = generate(t, ids, method, random_proposer(t), max_new_tokens=200, stop_ids=[], cost=cost)
    assert g.tokens == plain and len(g.drafted) > WARM_UP + 40
    late = g.drafted[WARM_UP:]
    assert sum(late) <= len(late) / 10, (sum(late), len(late))
    assert any(late)  # still retried now and then: at most RETRY_MOST idle rounds apart
    gaps = [i for i, d in enumerate(late) if d]
    assert all(b - a <= RETRY_MOST + 1 for a, b in zip(gaps, gaps[1:]))


def test_a_drafter_that_pays_keeps_drafting(tiny_targets):
    """The oracle drafter (the target's own continuation, a few planted mistakes) pays every round: the gate keeps
    it on, as ddtree-auto ran before the gate."""
    from helpers import Oracle

    t = tiny_targets["llama"]
    ids = t.chat_ids([{"role": "user", "content": "def add(a, b): return a + b  # and more text"}])
    plain = generate(t, ids, "ar", max_new_tokens=60).tokens
    oracle = Oracle(ids + plain + [0] * 8, 4, t.vocab_size, {len(ids) + 7}, [1, 2])
    g = generate(t, ids, "ddtree-auto", oracle, max_new_tokens=60, cost=CostCurve([1, 32], [0.01, 0.02]))
    assert g.tokens == plain and all(g.drafted) and sum(g.accepted) / len(g.accepted) > 2
    assert torch.tensor(g.accepted).max() <= 4


def test_bench_reports_the_share_of_drafted_rounds_and_the_worst_prompt(tiny_targets):
    """Each speculative row states how many rounds called the drafter and its worst prompt against plain decoding on
    its own backend (an aggregate speedup hides one prompt made slower)."""
    from dflashkit.measure.bench import bench_markdown, run_bench

    t = tiny_targets["llama"]
    prompts = [(p, t.chat_ids([{"role": "user", "content": p}])) for p in ("def add(a, b):", "sort a list")]
    # a fixed, rising cost: a tiny target's measured curve is noise on a busy host, and one that falls past n = 1
    # makes drafting look free there
    cost = CostCurve([1, 4, 8, 16], [0.004, 0.005, 0.006, 0.009])
    res = run_bench(t, random_proposer(t).drafter, prompts, ["ar", "chain", "ddtree-auto"], max_new_tokens=60,
                    progress=False, warmup=False, predict=False, cost=cost)
    auto, chain = res["methods"]["ddtree-auto"], res["methods"]["chain"]
    assert 0 < auto["drafted_share"] < 0.5 and chain["drafted_share"] == 1.0  # chain drafts every round
    assert auto["worst_prompt"]["vs"] == "ar" and auto["worst_prompt"]["prompt"] in ("def add(a, b):", "sort a list")
    assert "worst_prompt" not in res["methods"]["ar"]
    md = bench_markdown(res)
    assert "| worst prompt vs plain | drafted rounds |" in md and f"{100 * auto['drafted_share']:.0f}%" in md


def test_the_cut_trusts_the_drafters_probabilities_as_far_as_the_target_bore_them_out():
    """Calibration, counted: a drafter that promised 0.9 and 0.8 at depths 1 and 2 for twenty rounds the target
    accepted nothing of has its probabilities scaled down there, and the cost-aware cut then keeps fewer nodes; one
    that undersold itself is scaled up, never past 1; before any round, its own probabilities."""
    from types import SimpleNamespace

    from dflashkit.tree import Tree, best_cut, cut_candidates
    from dflashkit.tree import TreeDrafts

    tree = Tree(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 1]), torch.tensor([-1, 0, 1, 0]),
                torch.zeros(4))
    probs = [1.0, 0.9, 0.8, 0.05]
    cost = CostCurve([1, 5], [0.01, 0.03])  # a verify of n tokens: 0.01 s + 0.005 s a token past the first
    td = TreeDrafts(SimpleNamespace(layer_ids=None), budget=3, cost=cost)
    assert td.calibrated(tree, probs) == probs
    kept = lambda p: best_cut(*cut_candidates(tree, p)[1:], cost)  # noqa: E731
    td.drafted = True
    for _ in range(20):
        td.promised = [0.95, 0.8]
        td.observe([])
    low = td.calibrated(tree, probs)
    assert low[1] < 0.3 * probs[1] and low[2] < 0.3 * probs[2] and low[0] == 1.0
    assert kept(low) < kept(probs)
    for _ in range(40):
        td.promised = [0.3, 0.2]
        td.observe([9, 9])
    high = td.calibrated(tree, probs)
    assert high[1] == 1.0 and probs[2] < high[2] <= 1.0
    td.drafted = False  # rounds of the n-gram branch alone keep their own account
    assert td.calibrated(tree, probs) == probs
