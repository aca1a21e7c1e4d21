"""Offline evaluation and comparison: batched == block-by-block, walk == online chain decoding, cheating and
random drafters, budget trees, aggregates, errors, and the eval/compare CLI end to end on a real cache."""

import json
import re
from pathlib import Path

import pytest
import torch

from dflashkit.cache import extract, open_cache
from dflashkit.cli import main
from dflashkit.drafter.checkpoint import new_drafter, save_drafter
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.drafter.head import DraftHead
from dflashkit.errors import DFlashError
from dflashkit.evaluate.compare import compare_runs
from dflashkit.tree import accepted_path, build_tree, parse_tree_spec, paths_streak, streak as ddtree_streak, width_streak
from dflashkit.evaluate.offline import (
    CURVE_BUDGETS,
    aggregate,
    evaluate,
    evaluate_sequence,
    hybrid_walk,
    score_block,
    stride_anchors,
)
from dflashkit.fileio import sha256_file
from dflashkit.prompts import load_prompts

B = 8  # block size of the test drafters: 7 draft slots
LAYERS = [1, 3]  # z-lab's rule for 2 features of a 6-layer target
TREES = ["budget:4", "budget:8", "paths:3", "width:3"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def t64(tiny_dirs):
    """The tiny llama in float64: equality tests compare argmaxes, and float64 keeps them away from ties."""
    from dflashkit.targets.model import load_target

    return load_target(tiny_dirs["llama"], device="cpu", dtype=torch.float64)


def tree_streak(logits, labels, spec: str) -> float:
    """Accepted depth of one block under a tree spec, each family by its own definition."""
    family, k = parse_tree_spec(spec)
    if family == "budget":
        return float(len(accepted_path(build_tree(logits, k), labels)))
    if family == "paths":
        return float(paths_streak(logits, labels, k))
    return float(width_streak(logits, labels, k).item())


def drafter_for(target, seed=0, layers=LAYERS):
    torch.manual_seed(seed)
    return new_drafter(target, num_layers=2, target_layer_ids=layers, block_size=B).to(target.dtype).eval()


def features(target, tokens, layers=LAYERS):
    return target.forward(torch.as_tensor(tokens)[None], layer_ids=layers, use_cache=False).features[0]


def block_reference(target, drafter, tokens, feats, a):
    """One block alone, the straightforward way: the drafter's single-block forward over context < a."""
    mask = drafter.config.mask_token_id
    ids = torch.tensor([int(tokens[a])] + [mask] * (B - 1))
    h = drafter(feats[None, :a], target.embed_tokens(ids)[None], torch.arange(a + B)[None])
    logits = target.lm_head(h[0, 1:]).float()
    labels = torch.full((B - 1,), -100, dtype=torch.long)
    tail = torch.as_tensor(tokens[a + 1 : a + B])
    labels[: len(tail)] = tail
    return logits, labels


class CopyLabelDrafter(torch.nn.Module):
    """A cheating drafter: the state of the block slot at absolute position p is the lm_head row of tokens[p]
    (scaled so that its softmax is nearly one-hot), except at positions in `wrong`, where it proposes
    tokens[p] + 1. It answers the same two calls as DFlashDrafter, so it runs through the real evaluator."""

    def __init__(self, cfg, lm_head_weight, tokens, wrong=()):
        super().__init__()
        self.config = cfg
        self.w = lm_head_weight.detach()
        self.tokens = torch.as_tensor(tokens)
        self.wrong = set(wrong)
        self.fc = torch.nn.Linear(1, 1, bias=False).to(lm_head_weight.dtype)  # dtype/device, as DFlashDrafter has

    def _states(self, pos):  # [b, Q] absolute positions -> [b, Q, H]
        tok = self.tokens[pos.clamp(max=len(self.tokens) - 1)].clone()
        bad = torch.tensor([[int(p) in self.wrong for p in row] for row in pos.tolist()])
        tok[bad] = (tok[bad] + 1) % self.w.shape[0]
        row = self.w[tok]
        return row * (50.0 / row.pow(2).sum(-1, keepdim=True))  # label logit 50, others far below

    embed_block = DFlashDrafter.embed_block  # the input/output transforms of the config (identity here)
    scale_logits = DFlashDrafter.scale_logits

    def forward_blocks(self, target_hidden, block_embeds, anchors, valid=None):
        return self._states((anchors[:, :, None] + torch.arange(self.config.block_size)).reshape(anchors.shape[0], -1))

    def forward(self, target_hidden, block_embeds, position_ids, past_key_values=None, use_cache=False, linear=None):
        return self._states(position_ids[:, target_hidden.shape[1] :])

    def new_context_kv(self):
        return None


def planted_sequence(target, drafter, prompt_len=12, n_blocks=8, seed=0):
    """Tokens on which the drafter's stride streaks are known by construction: block j's labels start with
    the drafter's own first k_j = j % B predictions (computed block by block with the reference forward),
    then a token it did not predict. Context < anchor never depends on the planted tokens, so this is exact."""
    g = torch.Generator().manual_seed(seed)
    T = prompt_len + n_blocks * B
    tokens = torch.randint(3, 259, (T,), generator=g)
    planted = []
    for j in range(n_blocks):
        a = prompt_len + j * B
        logits, _ = block_reference(target, drafter, tokens, features(target, tokens), a)
        pred = logits.argmax(-1)
        k = min(j % B, T - 1 - a)
        tokens[a + 1 : a + 1 + k] = pred[:k]
        if a + 1 + k < T and tokens[a + 1 + k] == pred[k]:
            tokens[a + 1 + k] = (pred[k] + 1) % 259
        planted.append(k)
    return tokens, planted


# ---- batched == block by block ------------------------------------------------------------------------------

def test_batched_stride_equals_block_by_block_loop(t64):
    d = drafter_for(t64)
    tokens, planted = planted_sequence(t64, d)
    feats = features(t64, tokens)
    head = DraftHead.for_drafter(t64, d)
    recs = evaluate_sequence(d, head, t64.embed_tokens, tokens, feats, 12, anchors="stride", trees=TREES)
    anchors = list(range(12, len(tokens) - 1, B))
    assert [r["anchor"] for r in recs] == anchors
    assert [r["streak"] for r in recs] == planted  # known by construction
    for r, a in zip(recs, anchors):
        logits, labels = block_reference(t64, d, tokens, feats, a)
        n = int((labels != -100).sum())
        hit = (logits.argmax(-1) == labels)[:n]
        assert r["n_labels"] == n and r["matches"] == hit.int().tolist()
        assert r["streak"] == int(ddtree_streak(logits, labels))
        for spec in TREES:
            assert r["trees"][spec] == tree_streak(logits, labels, spec), (a, spec)
        for b in (4, 8):
            assert r["expected"][f"budget:{b}"] == pytest.approx(build_tree(logits, b).log_probs[1:].double().exp().sum().item(), rel=1e-5)
    assert max(planted) >= 5  # the comparison saw long streaks, not only zeros

    few = evaluate_sequence(d, head, t64.embed_tokens, tokens, feats, 12, trees=TREES, max_blocks=3)
    assert few == recs[:3]


def test_all_budgets_from_one_tree_equal_separate_trees():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.randn(7, 30, generator=g) * 2
        top = logits.topk(3, dim=-1).indices
        pick = torch.randint(0, 3, (7,), generator=g)
        labels = top[torch.arange(7), pick]  # labels that often lie in the tree
        labels[5:] = -100
        rec = score_block(logits, labels, labels, ["budget:4", "budget:8"])
        for b in CURVE_BUDGETS:
            tree = build_tree(logits, b)
            assert rec["curve"][str(b)] == len(accepted_path(tree, labels))
            assert rec["curve_expected"][str(b)] == pytest.approx(tree.log_probs[1:].double().exp().sum().item(), rel=1e-6)
            leaves = len(tree) - len(set(tree.parents.tolist()) - {-1})  # a verify one root-to-leaf path per row
            assert rec["curve_paths"][str(b)] == leaves * (int(tree.depths.max()) + 1)
        assert rec["curve"]["1"] == rec["matches"][0]  # budget 1 is position-1 accuracy


# ---- walk == online chain decoding --------------------------------------------------------------------------

def online_chain(target, drafter, prompt, max_new):
    """Chain speculative decoding at T=0 written plainly: full target forwards, no caches. Returns the
    sequence and tau per round (accepted drafts + 1)."""
    mask = drafter.config.mask_token_id
    seq = list(prompt)
    seq.append(int(target.forward(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    taus = []
    while len(seq) - len(prompt) < max_new:
        a = len(seq) - 1  # the bonus token's position
        ctx = target.forward(torch.tensor([seq[:a]]), layer_ids=LAYERS, use_cache=False).features
        block = torch.tensor([seq[a]] + [mask] * (B - 1))
        h = drafter(ctx, target.embed_tokens(block)[None], torch.arange(a + B)[None])
        draft = target.lm_head(h[0, 1:]).argmax(-1).tolist()
        post = target.forward(torch.tensor([seq + draft]), use_cache=False).logits[0, a : a + B].argmax(-1).tolist()
        acc = 0
        while acc < B - 1 and draft[acc] == post[acc]:
            acc += 1
        seq += draft[:acc] + [post[acc]]
        taus.append(acc + 1)
    return seq, taus


def greedy(target, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target.forward(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_walk_reproduces_online_chain_decoding(t64, kind):
    prompt = t64.chat_ids([{"role": "user", "content": "def fib(n):"}])
    if kind == "oracle":  # right except at some positions: streaks of every length
        ref = greedy(t64, prompt, 60)
        wrong = {p for p in range(len(ref)) if p % 7 == 3 or p % 11 == 0}
        d = CopyLabelDrafter(drafter_for(t64).config, t64.lm_head.weight, ref, wrong)
    else:
        d = drafter_for(t64, seed=3)
    seq, taus = online_chain(t64, d, prompt, 50 if kind == "oracle" else 24)
    if kind == "oracle":
        assert seq == ref[: len(seq)] and max(taus) >= 4
    tokens = torch.tensor(seq)
    feats = features(t64, tokens)
    head = DraftHead.for_drafter(t64, d)
    recs = evaluate_sequence(d, head, t64.embed_tokens, tokens, feats, len(prompt), anchors="walk", trees=TREES)
    assert [r["streak"] + 1 for r in recs] == taus
    if kind == "random":  # the cached walk forward gives each block exactly what a block alone gives
        for r in recs:
            logits, labels = block_reference(t64, d, tokens, feats, r["anchor"])
            assert r["matches"] == (logits.argmax(-1) == labels)[: r["n_labels"]].int().tolist()
            assert r["expected"]["budget:8"] == pytest.approx(build_tree(logits, 8).log_probs[1:].double().exp().sum().item(), rel=1e-5)
            assert r["trees"] == {s: tree_streak(logits, labels, s) for s in TREES}
    for r in recs:  # the cuts a cost-aware tree chooses among, as the budget curve counts them
        for b in CURVE_BUDGETS:
            assert sum(rank <= b for rank in r["cut"]["path"]) == r["curve"][str(b)]
            assert r["cut"]["gains"][b] - 1 == pytest.approx(r["curve_expected"][str(b)], abs=1e-3)


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_walk_reproduces_dflashkit_decode_chain(t64, kind):
    """The same against the project's online loop (target KV, drafter context KV, verify features)."""
    from dflashkit.decode.hf import HfBackend
    from dflashkit.decode.speculative import DFlashProposer, generate_chain

    prompt = t64.chat_ids([{"role": "user", "content": "class LRU:"}])
    if kind == "oracle":
        ref = greedy(t64, prompt, 50)
        d = CopyLabelDrafter(drafter_for(t64).config, t64.lm_head.weight, ref, {p for p in range(len(ref)) if p % 6 == 2})
    else:
        d = drafter_for(t64, seed=4)
    gen = generate_chain(HfBackend(t64), DFlashProposer(t64, d), prompt, max_new_tokens=40, stop_ids=[])
    tokens = torch.tensor(prompt + gen.tokens)
    head = DraftHead.for_drafter(t64, d)
    recs = evaluate_sequence(d, head, t64.embed_tokens, tokens, features(t64, tokens), len(prompt), anchors="walk")
    # the last online round may have accepted tokens past the max_new_tokens cut, which the cache lacks
    assert [r["streak"] + 1 for r in recs][: gen.rounds - 1] == gen.accepted[:-1]
    if kind == "oracle":
        assert max(gen.accepted) >= 4


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_hybrid_walk_reproduces_dflashkit_decode_hybrid(t64, kind):
    """Issue 50: hybrid-b replayed offline on the greedy answer (drafter tree + n-gram branch per round) accepts
    what the online loop accepts, round for round, over trees of the same nodes and path tokens."""
    from dflashkit.decode.speculative import DFlashProposer, generate
    from dflashkit.decode.hf import HfBackend

    prompt = t64.chat_ids([{"role": "user", "content": "class LRU:"}])
    ref = greedy(t64, prompt, 50)
    d = (CopyLabelDrafter(drafter_for(t64).config, t64.lm_head.weight, ref, {p for p in range(len(ref)) if p % 6 == 2})
         if kind == "oracle" else drafter_for(t64, seed=4))
    gen = generate(t64, prompt, "hybrid-4", DFlashProposer(t64, d), max_new_tokens=40, stop_ids=[])
    tokens = torch.tensor(prompt + gen.tokens)
    rounds = hybrid_walk(d, DraftHead.for_drafter(t64, d), t64.embed_tokens, tokens, features(t64, tokens),
                         len(prompt), 4)
    n = gen.rounds - 1  # the last online round may have accepted tokens past the cut, which the cache lacks
    assert [r["accepted"] + 1 for r in rounds][:n] == gen.accepted[:n] and len(rounds) >= n
    verified = "path_tokens" if HfBackend(t64).by_paths else "nodes"  # what the online loop records as widths
    assert [r[verified] for r in rounds][:n] == gen.widths[:n] and max(r["nodes"] for r in rounds) > 5  # + n-gram
    assert max(gen.accepted) >= (5 if kind == "oracle" else 2)  # past the drafter's 3 slots: the n-gram's tokens


@pytest.mark.parametrize("method", ["hybrid-auto", "ddtree-auto"])
@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_auto_replayed_at_an_engines_prices_is_what_the_loop_does(t64, kind, method, monkeypatch):
    """Issues 50 and 73: hybrid-auto and ddtree-auto replayed offline at an engine's prices (each round's tree cut to
    what pays, the drafter sitting out rounds it does not pay for) commit, verify and draft what the online loop does
    at those prices: the loop's clock is fixed here (a drafter call 1/256 s, nothing else), so both price a round
    alike."""
    import itertools

    import dflashkit.decode.session as session
    import dflashkit.decode.speculative as speculative
    import dflashkit.tree as tree
    from dflashkit.measure.curve import CostCurve
    from dflashkit.decode.speculative import DFlashProposer, generate, new_lookup
    from dflashkit.decode.hf import HfBackend

    clock = itertools.count()
    monkeypatch.setattr(tree, "perf_counter", lambda: next(clock) / 256)  # one tick per drafter call
    for module in (speculative, session):  # the loop's own work and its timer: none
        monkeypatch.setattr(module, "perf_counter", lambda: 0.0)
    cost = CostCurve([1, 4, 8, 16, 48], [0.010, 0.011, 0.013, 0.020, 0.060])
    prompt = t64.chat_ids([{"role": "user", "content": "class LRU:"}])
    ref = greedy(t64, prompt, 70)
    d = (CopyLabelDrafter(drafter_for(t64).config, t64.lm_head.weight, ref, {p for p in range(len(ref)) if p % 5 == 2})
         if kind == "oracle" else drafter_for(t64, seed=4))
    gen = generate(t64, prompt, method, DFlashProposer(t64, d), max_new_tokens=60, stop_ids=[], cost=cost)
    tokens = torch.tensor(prompt + gen.tokens)
    by_paths = HfBackend(t64).by_paths  # how the online loop verifies a branching tree, and so records its widths
    price = {"cost": cost, "path_cost": cost if by_paths else None, "draft": 1 / 256, "fixed": 0.0}
    rounds = hybrid_walk(d, DraftHead.for_drafter(t64, d), t64.embed_tokens, tokens, features(t64, tokens),
                         len(prompt), 32, lookup=new_lookup(method), price=price, ngram=method == "hybrid-auto")
    n = gen.rounds - 1  # the last online round may have accepted tokens past the cut, which the cache lacks
    assert [r["accepted"] + 1 for r in rounds][:n] == gen.accepted[:n] and len(rounds) >= n
    widths = [r["path_tokens" if by_paths else "nodes"] for r in rounds]
    assert widths[:n] == gen.widths[:n] and [r["drafted"] for r in rounds][:n] == gen.drafted[:n]
    assert max(r["nodes"] for r in rounds) < 33  # cut: the drafter alone offers 32 nodes
    if kind == "random":  # a drafter that adds nothing sits out rounds
        assert not all(gen.drafted)


# ---- cheating and random drafters -----------------------------------------------------------------------------

def test_cheating_drafter_scores_everything_and_random_drafter_near_zero(tiny_targets):
    t = tiny_targets["llama"]
    tokens = torch.randint(3, 259, (140,), generator=torch.Generator().manual_seed(5))
    feats = features(t, tokens)
    real = drafter_for(t)
    cheat = CopyLabelDrafter(real.config, t.lm_head.weight, tokens)
    head = DraftHead.for_drafter(t, real)
    for anchors in ("stride", "walk"):
        recs = evaluate_sequence(cheat, head, t.embed_tokens, tokens, feats, 20, anchors=anchors, trees=TREES)
        assert recs and all(r["streak"] == min(B - 1, r["n_labels"]) for r in recs)
        for r in recs:
            n = r["n_labels"]
            assert r["trees"] == {"budget:4": min(4, n), "budget:8": min(7, n), "paths:3": min(7, n), "width:3": min(7, n)}
        full = [r for r in recs if r["n_labels"] == B - 1]
        assert aggregate(full, B, TREES)["streak"] == B - 1
        assert all(len(r["predicted"]) == B - 1 and r["predicted"] == sorted(r["predicted"], reverse=True)
                   and 0 < r["predicted"][-1] <= r["predicted"][0] <= 1 for r in recs)  # P(streak >= k) as promised
    # the untrained drafter, on the same blocks, is at chance
    recs = evaluate_sequence(real, head, t.embed_tokens, tokens, feats, 20, trees=TREES)
    agg = aggregate(recs, B, TREES)
    assert agg["blocks"] == 15 and agg["streak"] < 0.1 and agg["pos1_acc"] < 0.1 and agg["budget:8"] < 0.3


def test_aggregate_hand_checked():
    def blk(matches, n=None):
        s = 0
        while s < len(matches) and matches[s]:
            s += 1
        return {"n_labels": n or len(matches), "streak": s, "matches": matches, "trees": {"budget:4": min(s + 1, 4)},
                "expected": {"budget:4": 1.0}, "curve": {str(b): s for b in CURVE_BUDGETS},
                "curve_expected": {str(b): 0.5 for b in CURVE_BUDGETS}, "curve_paths": {str(b): s + b for b in CURVE_BUDGETS}}

    blocks = [blk([1, 1, 0, 1, 0, 0, 0]), blk([0, 1, 1, 0, 0, 0, 0]), blk([1, 1, 1, 1, 1, 1, 1]), blk([1, 0])]
    a = aggregate(blocks, B, ["budget:4"])
    assert a["blocks"] == 4 and a["streak"] == pytest.approx((2 + 0 + 7 + 1) / 4) and a["tau"] == pytest.approx(3.5)
    assert a["pos1_acc"] == pytest.approx(3 / 4)
    assert a["acc_cumulative"][:3] == pytest.approx([3 / 4, 2 / 4, 1 / 3])  # the 2-label block leaves at k=3
    assert a["acc_conditional"][:3] == pytest.approx([3 / 4, 2 / 3, 1 / 2])  # P(k | streak >= k-1)
    assert a["acc_conditional"][3] == pytest.approx(1.0)
    assert a["histogram_counts"] == [1, 1, 1, 0, 0, 0, 0, 1] and sum(a["histogram"]) == pytest.approx(1)
    assert a["acc_predicted"] == [None] * 7  # blocks scored before calibration was recorded
    blocks = [{**b, "predicted": [0.9 ** (k + 1) for k in range(7)]} for b in blocks]
    a = aggregate(blocks, B, ["budget:4"])  # the drafter promised 0.9, 0.81, ... at every block: its calibration
    assert a["acc_predicted"][:2] == pytest.approx([0.9, 0.81]) and a["acc_cumulative"][0] == pytest.approx(3 / 4)
    assert a["budget:4"] == pytest.approx((3 + 1 + 4 + 2) / 4) and a["expected"]["budget:4"] == 1.0
    assert a["budget_curve_paths"]["8"] == pytest.approx(8 + (2 + 0 + 7 + 1) / 4)


# ---- errors -----------------------------------------------------------------------------------------------------

def test_bad_inputs_fail_with_one_clear_error(tiny_targets):
    t = tiny_targets["llama"]
    d = drafter_for(t)
    head = DraftHead.for_drafter(t, d)
    tokens = torch.randint(3, 259, (30,))
    feats = features(t, tokens)
    run = lambda **kw: evaluate_sequence(d, head, t.embed_tokens, **{"tokens": tokens, "features": feats, "prompt_len": 5, **kw})
    with pytest.raises(DFlashError, match="--anchors 'zigzag': use one of stride, walk"):
        run(anchors="zigzag")
    with pytest.raises(DFlashError, match="bad tree spec 'budget:0'"):
        run(trees=["budget:0"])
    with pytest.raises(DFlashError, match="--max-blocks 0"):
        run(max_blocks=0)
    with pytest.raises(DFlashError, match=r"width 192 but the drafter's fc expects 128 = 2 target layers \[1, 3\]"):
        run(features=features(t, tokens, [1, 2, 3]))
    with pytest.raises(DFlashError, match=r"features must be \[T=30, 128\]"):
        run(features=feats[:20])
    with pytest.raises(DFlashError, match="prompt_len 31 is outside"):
        run(prompt_len=31)
    assert run(prompt_len=29) == [] and stride_anchors(28, 30, B) == [28]


# ---- a real cache through evaluate() and the CLI ------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_targets):
    """A 3-prompt cache of the tiny llama (layers 1,2,3) and two saved random drafters."""
    t = tiny_targets["llama"]
    root = tmp_path_factory.mktemp("eval")
    cache = extract(t, load_prompts("coding-10").subset(3), root / "cache", layer_ids=[1, 2, 3], max_new_tokens=40,
                    progress=False)
    for seed in (0, 1):
        save_drafter(drafter_for(t, seed), root / f"d{seed}", target_identity=t.identity())
    return root, cache


def test_evaluate_on_cache_matches_per_sequence_and_refuses_missing_layers(setup, tiny_targets):
    root, cache_dir = setup
    t = tiny_targets["llama"]
    from dflashkit.drafter.checkpoint import load_drafter

    d = load_drafter(root / "d0", target=t)
    cache = open_cache(cache_dir)
    res = evaluate(d, t, cache, trees=TREES, max_blocks=4)
    head = DraftHead.for_drafter(t, d)
    direct = []
    for rec in cache:
        direct += evaluate_sequence(d, head, t.embed_tokens, rec.tokens, rec.features(LAYERS), rec.prompt_len,
                                    trees=TREES, max_blocks=4)
    strip = lambda b: {k: v for k, v in b.items() if k not in ("prompt", "block", "cut")}  # noqa: E731 (cut: walk's)
    assert [strip(b) for b in res["blocks"]] == [strip(b) for b in direct]
    assert res["overall"]["blocks"] == len(direct) == sum(p["blocks"] for p in res["per_prompt"])
    assert res["overall"]["prompts"] == 3 and res["overall"]["streak"] == aggregate(direct, B, TREES)["streak"]
    other = new_drafter(t, num_layers=2, target_layer_ids=[1, 2, 0], block_size=B)
    with pytest.raises(DFlashError, match=r"missing \[0\]: re-extract with --target-layers 1,2,0"):
        evaluate(other, t, cache)


def _eval(root, cache, drafter, run, *extra):
    return main(["eval", "--drafter", str(root / drafter), "--cache", str(cache), "--out", str(root / run), *extra])


def test_cli_eval_writes_a_complete_run(setup, capsys):
    root, cache = setup
    assert _eval(root, cache, "d0", "r0", "--show-matches", "--trees", "budget:4,budget:8,paths:2") == 0
    out = capsys.readouterr().out
    run = root / "r0"
    res = json.loads((run / "results.json").read_text())
    n_blocks = sum(len(stride_anchors(r.prompt_len, len(r.tokens), B)) for r in open_cache(cache))
    assert res["overall"]["blocks"] == n_blocks and res["overall"]["prompts"] == 3
    assert "3 prompts (all 3 requested)" in out and f"blocks   {n_blocks} blocks: block_size=8" in out
    assert "ddtree-4/ddtree-8 = DDTree budget:4/budget:8 (paper's node-budget tree)" in out
    assert "Detected fc input: 128 = 2 target layers x 64" in out  # the load report
    assert str(Path(cache).resolve()) in out
    row = r"\| +\d+ blocks \| streak=\d+\.\d\d ddtree-4=\d+\.\d\d ddtree-8=\d+\.\d\d paths-2="
    lines = [l for l in out.splitlines() if re.search(row, l)]
    assert [l.split()[0] for l in lines] == res["cache"]["prompt_ids"]
    assert len(re.findall(r"match: [✓✗·]{7}  streak=\d", out)) == n_blocks
    assert "overall: 3 prompts" in out
    for f in ("eval.log", "summary.md", "acceptance.png", "streak_hist.png", "budget_curve.png"):
        assert (run / f).stat().st_size > 0, f
    assert (run / "drafter").resolve() == (root / "d0").resolve()
    assert res["drafter"]["sha256"] == sha256_file(root / "d0" / "model.safetensors")
    assert res["cache"]["manifest_hash"] == open_cache(cache).manifest_hash and res["shortfall"] is None
    assert len(res["blocks"]) == n_blocks and set(res["settings"]["trees"]) == {"budget:4", "budget:8", "paths:2"}
    assert "| **overall** |" in (run / "summary.md").read_text()

    assert _eval(root, cache, "d0", "r0") == 2  # never overwrites a run silently
    assert "exists and is not empty" in capsys.readouterr().err


def test_eval_on_a_served_format_runs_the_drafter_trained_on_floats_and_says_both(setup, tiny_dirs, capsys):
    """A cache extracted at q8_0 (the target as served) takes the drafter trained on float features; the run says
    which format its features are and which the drafter was trained at."""
    from dflashkit.targets.model import load_target

    root, _ = setup
    q = load_target(tiny_dirs["llama"], device="cpu", dtype="float32", weights="q8_0")
    cache = extract(q, load_prompts("coding-10").subset(2), root / "cache-q8_0", layer_ids=[1, 2, 3], max_new_tokens=20,
                    progress=False)
    assert _eval(root, cache, "d0", "r-q8_0") == 0
    assert "weights  features at q8_0; the drafter trained at float" in capsys.readouterr().out
    assert json.loads((root / "r-q8_0" / "results.json").read_text())["target"]["weights"] == "q8_0"


def test_cli_eval_partial_cache_needs_allow_partial(setup, capsys):
    root, cache = setup
    assert _eval(root, cache, "d0", "rp", "--num-prompts", "5") == 2
    assert "3 of the 5 requested prompts" in capsys.readouterr().err
    assert _eval(root, cache, "d0", "rp", "--num-prompts", "5", "--allow-partial", "--max-blocks", "2") == 0
    out = capsys.readouterr().out
    assert "PARTIAL: 3 of 5 requested prompts" in out
    res = json.loads((root / "rp" / "results.json").read_text())
    assert res["shortfall"]["requested"] == 5 and res["overall"]["blocks"] <= 6
    assert "**Partial: 3 of 5 requested prompts**" in (root / "rp" / "summary.md").read_text()


@pytest.mark.slow  # a whole bench or compare folder, figures included
def test_compare_runs_ratios_and_refusal(setup, capsys):
    root, cache = setup
    assert _eval(root, cache, "d0", "ca") == 0 and _eval(root, cache, "d1", "cb") == 0
    assert _eval(root, cache, "d1", "cw", "--anchors", "walk") == 0
    capsys.readouterr()
    a, b = (json.loads((root / n / "results.json").read_text()) for n in ("ca", "cb"))
    res = compare_runs([root / "ca", root / "cb"], out=root / "cmp")
    assert res["reference"] == "ca" and not res["forced"]
    for m in ("streak", "budget:8"):
        ref, ours = a["overall"][m], b["overall"][m]
        assert res["differences_vs_reference"][m]["cb"] == pytest.approx(ours - ref)
        assert res["ratios"][m]["cb"] == (None if not ref else pytest.approx(ours / ref))
    assert "Reference: `ca`" in res["markdown"] and "## Per prompt: ddtree-8" in res["markdown"]
    for f in ("compare.md", "compare.json", "acceptance.png", "streak_by_prompt.png", "ddtree-4_by_prompt.png"):
        assert (root / "cmp" / f).is_file(), f

    with pytest.raises(DFlashError, match=r"not comparable \(anchors: ca stride, cw walk\).*--force"):
        compare_runs([root / "ca", root / "cw"])
    assert main(["compare", str(root / "ca"), str(root / "cw"), "--out", str(root / "cmp2")]) == 2
    assert "not comparable" in capsys.readouterr().err and not (root / "cmp2").exists()
    assert main(["compare", str(root / "ca"), str(root / "cw"), "--force", "--out", str(root / "cmp2")]) == 0
    out = capsys.readouterr().out
    assert "NOT COMPARABLE (compared with --force)" in out and "anchors: ca stride, cw walk" in out
    assert "NOT COMPARABLE" in (root / "cmp2" / "compare.md").read_text()
    with pytest.raises(DFlashError, match="no results.json"):
        compare_runs([root / "ca", root / "d0"])


def test_nan_bytes_inside_a_record_stop_eval_naming_the_record(setup, tmp_path, capsys):
    """A same-size corruption keeps every shape valid; eval must refuse it, not score NaN features."""
    import shutil
    import struct

    root, cache = setup
    bad = tmp_path / "cache"
    shutil.copytree(cache, bad)
    rec = list(open_cache(bad))[1]
    raw = bytearray(rec.file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8:8 + n])["layer_3"]
    dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[entry["dtype"]]
    nan = torch.full((4,), float("nan"), dtype=dtype).view(torch.uint8).numpy().tobytes()
    start = 8 + n + entry["data_offsets"][0] + 3 * len(nan) // 4
    raw[start:start + len(nan)] = nan  # same size: the file still parses
    rec.file.write_bytes(bytes(raw))
    with pytest.raises(DFlashError, match=rf"{re.escape(str(rec.file))}: prompt '{rec.id}' has non-finite features"):
        rec.features()
    assert _eval(root, bad, "d0", "nan-run") == 2
    err = capsys.readouterr().err
    assert "non-finite features" in err and "dflashkit cache verify" in err
