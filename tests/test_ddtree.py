import itertools
import math

import pytest
import torch

from dflashkit.tree import (
    Tree,
    accepted_path,
    build_tree,
    parse_tree_spec,
    paths_streak,
    streak,
    topk_paths,
    width_streak,
)


def mass(tree) -> float:
    """If the target sampled from the drafter, P(depth >= d) is the mass of the depth-d nodes, so the expected
    accepted depth is the sum of every non-root prefix's probability."""
    return tree.log_probs[1:].double().exp().sum().item()


def rand_logits(seed, L, V, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, V, generator=g) * scale


def all_prefixes(logits):
    """Brute force: every prefix (token tuple) with its product log-prob, in float64."""
    lp = torch.log_softmax(logits.float(), dim=-1).double().tolist()
    L, V = logits.shape
    out = {}
    for d in range(1, L + 1):
        for toks in itertools.product(range(V), repeat=d):
            out[toks] = sum(lp[i][t] for i, t in enumerate(toks))
    return out


def node_prefixes(tree):
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    pref = [()]
    for i in range(1, len(toks)):
        pref.append(pref[parents[i]] + (toks[i],))
    return pref


@pytest.mark.parametrize("seed,L,V", [(0, 4, 5), (1, 4, 5), (2, 4, 5), (3, 3, 7), (4, 2, 30)])
def test_tree_is_top_budget_prefixes(seed, L, V):
    logits = rand_logits(seed, L, V)
    brute = all_prefixes(logits)
    ranked = sorted(brute, key=lambda p: -brute[p])
    for budget in range(1, 21):
        tree = build_tree(logits, budget, root_token=7)
        n = len(tree)
        assert n == budget + 1
        assert tree.tokens[0] == 7 and tree.depths[0] == 0 and tree.parents[0] == -1 and tree.log_probs[0] == 0
        for i in range(1, n):  # prefix-closed, parents first
            p = tree.parents[i].item()
            assert 0 <= p < i
            assert tree.depths[i] == tree.depths[p] + 1
        pref = node_prefixes(tree)
        assert set(pref[1:]) == set(ranked[:budget])
        for i in range(1, n):
            assert tree.log_probs[i].item() == pytest.approx(brute[pref[i]], abs=1e-4)
        assert mass(tree) == pytest.approx(sum(math.exp(brute[p]) for p in pref[1:]), rel=1e-5)
        # pop order is best-first
        assert (tree.log_probs[1:].diff() <= 1e-6).all()


def test_budget_exceeding_all_prefixes():
    logits = rand_logits(5, 2, 2)
    tree = build_tree(logits, 10)
    assert len(tree) == 1 + 2 + 4
    assert set(node_prefixes(tree)[1:]) == set(all_prefixes(logits))
    assert mass(tree) == pytest.approx(2.0, rel=1e-5)  # every depth fully covered
    assert len(build_tree(logits, 0)) == 1


def test_expected_depth_brute_force():
    logits = rand_logits(11, 3, 4, scale=1.0)
    brute = all_prefixes(logits)
    tree = build_tree(logits, 84)  # 4 + 16 + 64: the full tree
    assert len(tree) == 85
    assert mass(tree) == pytest.approx(sum(math.exp(v) for v in brute.values()), rel=1e-5)
    assert mass(tree) == pytest.approx(3.0, rel=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_accepted_depth_monotone_and_bounded(seed):
    L, V = 4, 5
    logits = rand_logits(100 + seed, L, V, scale=1.0)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (L,), generator=g)
    if seed % 2:  # make the continuation plausible so deep acceptance actually happens
        labels = torch.distributions.Categorical(logits=logits).sample()
    prev = 0
    for budget in range(1, 21):
        tree = build_tree(logits, budget)
        d = len(accepted_path(tree, labels))
        assert d == len(accepted_path(tree, labels.tolist()))
        assert d <= min(budget, L)
        assert d >= prev
        prev = d
        path = accepted_path(tree, labels)
        assert len(path) == d
        assert [tree.tokens[i].item() for i in path] == labels[:d].tolist()
        assert [tree.depths[i].item() for i in path] == list(range(1, d + 1))
    d1 = len(accepted_path(build_tree(logits, 1), labels))
    assert d1 == int(logits[0].argmax().item() == labels[0].item())
    assert d1 == min(streak(logits, labels).item(), 1)


def test_accepted_depth_full_tree_and_ignore_index():
    logits = rand_logits(3, 3, 3)
    tree = build_tree(logits, 3 + 9 + 27)
    labels = torch.tensor([2, 0, 1])
    assert len(accepted_path(tree, labels)) == 3
    assert len(accepted_path(tree, torch.tensor([2, -100, -100]))) == 1
    assert len(accepted_path(tree, [-100, 0, 1])) == 0


def test_ancestor_mask_hand_checked():
    #        0
    #      /   \
    #     1     2
    #    / \
    #   3   4
    #   |
    #   5
    tree = Tree(
        tokens=torch.tensor([-1, 10, 11, 20, 21, 30]),
        depths=torch.tensor([0, 1, 1, 2, 2, 3]),
        parents=torch.tensor([-1, 0, 0, 1, 1, 3]),
        log_probs=torch.tensor([0.0, -0.1, -0.2, -0.3, -0.4, -0.5]),
    )
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.children() == [{10: 1, 11: 2}, {20: 3, 21: 4}, {}, {30: 5}, {}, {}]
    assert accepted_path(tree, [10, 20, 30]) == [1, 3, 5]
    assert accepted_path(tree, [10, 21, 30]) == [1, 4]
    assert accepted_path(tree, [11, 20]) == [2]
    expected_depth = sum(math.exp(-0.1 * i) for i in range(1, 6))
    assert mass(tree) == pytest.approx(expected_depth, rel=1e-6)


def test_ancestor_mask_matches_depths_on_built_tree():
    tree = build_tree(rand_logits(9, 5, 6), 30)
    mask = tree.ancestor_mask()
    assert torch.equal(mask.sum(-1), tree.depths + 1)  # each node sees itself plus its depth-many ancestors
    assert mask[:, 0].all()


def brute_paths(logits, labels, k):
    lp = torch.log_softmax(logits.float(), dim=-1).double().tolist()
    L, V = logits.shape
    drafts = sorted(itertools.product(range(V), repeat=L), key=lambda t: -sum(lp[i][x] for i, x in enumerate(t)))
    top = drafts[:k]
    lab = labels.tolist()

    def lead(t):
        n = 0
        while n < L and t[n] == lab[n]:
            n += 1
        return n

    return top, max(lead(t) for t in top)


@pytest.mark.parametrize("seed", range(5))
def test_paths_matches_brute_force(seed):
    L, V = 3, 4
    logits = rand_logits(200 + seed, L, V, scale=1.0)
    labels = torch.distributions.Categorical(logits=logits).sample()
    for k in (1, 2, 3, 5, 8, 17, 64, 100):
        top, best = brute_paths(logits, labels, k)
        got = topk_paths(logits, k)
        assert [tuple(t) for t, _ in got] == top
        assert paths_streak(logits, labels, k) == best
        lp = torch.log_softmax(logits, -1)
        for toks, s in got:
            assert s == pytest.approx(sum(lp[i, t].item() for i, t in enumerate(toks)), abs=1e-5)


def test_streak_paths_width_ordering():
    g = torch.Generator().manual_seed(0)
    N, L, V = 40, 6, 8
    logits = torch.randn(N, L, V, generator=g) * 1.5
    labels = torch.distributions.Categorical(logits=logits).sample()
    labels[::7, 3:] = -100  # past sequence end
    s = streak(logits, labels)
    assert s.shape == (N,)
    for k in (1, 2, 4):
        w = width_streak(logits, labels, k)
        assert w.shape == (N,)
        for b in range(N):
            p = paths_streak(logits[b], labels[b], k)
            assert s[b].item() <= p <= w[b].item()
            if k == 1:
                assert p == s[b].item() == w[b].item()
                assert (s[::7] <= 3).all()
    # a budget:K tree only holds tokens of rank < K at their position, so width:K bounds it too
    for k in (1, 4, 16):
        w = width_streak(logits, labels, k)
        for b in range(N):
            assert len(accepted_path(build_tree(logits[b], k), labels[b])) <= w[b].item()


def test_streak_hand_checked():
    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]])  # argmax 1, 0, 1
    assert streak(logits, torch.tensor([[1, 0, 1]])).tolist() == [3]
    assert streak(logits, torch.tensor([[1, 1, 1]])).tolist() == [1]
    assert streak(logits, torch.tensor([[0, 0, 1]])).tolist() == [0]
    assert streak(logits, torch.tensor([[1, 0, -100]])).tolist() == [2]
    assert width_streak(logits, torch.tensor([[0, 1, 0]]), 2).tolist() == [3]
    assert width_streak(logits, torch.tensor([[0, 1, -100]]), 5).tolist() == [2]


def test_parse_tree_spec():
    assert parse_tree_spec("budget:8") == ("budget", 8)
    assert parse_tree_spec("paths:4") == ("paths", 4)
    assert parse_tree_spec("width:4") == ("width", 4)
    assert parse_tree_spec("8") == ("budget", 8)
    for bad in ("foo:3", "budget:0", "budget:x", "", "0", ":3", "budget:", "budget:-1", "budget:2:3"):
        with pytest.raises(ValueError, match="budget:N") as e:
            parse_tree_spec(bad)
        assert repr(bad) in str(e.value)


def test_large_vocab_smoke():
    logits = torch.randn(15, 151936, generator=torch.Generator().manual_seed(0))
    for budget in (16, 64):
        tree = build_tree(logits, budget)
        assert len(tree) == budget + 1
        assert tree.tokens[1] == logits[0].argmax()
        assert len(accepted_path(tree, logits.argmax(-1))) >= 1


def test_selector_tree_is_the_top_budget_prefixes_under_the_selectors_conditionals():
    """CandidateSelector.tree keeps exactly the `budget` most probable prefixes, where a prefix's probability is the
    product of each token's softmax over its position's candidates given the previous token (brute force here)."""
    import itertools

    from dflashkit.drafter.config import DrafterConfig
    from dflashkit.drafter.model import CandidateSelector

    torch.manual_seed(0)
    L, V, H, k = 3, 12, 8, 3
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=1, num_key_value_heads=1, head_dim=8, intermediate_size=8,
                        num_hidden_layers=1, target_layer_ids=[1], num_target_layers=4, mask_token_id=11, vocab_size=V,
                        arch="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=k)
    sel = CandidateSelector(cfg)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 1.0)
    hidden, logits, anchor = torch.randn(L, H), torch.randn(L, V), 5
    cands = logits.topk(k, -1).indices

    def logprob(prefix):
        total, prev = 0.0, anchor
        for d, tok in enumerate(prefix):
            s = logits[d, cands[d]] + sel.successor_codebook[cands[d]] @ (sel.predecessor_codebook[prev] *
                                                                           sel.hidden_projection(hidden[d]))
            total += float(s.detach().log_softmax(-1)[cands[d].tolist().index(tok)])
            prev = tok
        return total

    prefixes = [p for n in range(1, L + 1) for p in itertools.product(*[cands[d].tolist() for d in range(n)])]
    ranked = sorted(prefixes, key=logprob, reverse=True)
    for budget in (1, 4, 9, len(prefixes)):
        with torch.no_grad():
            tree = sel.tree(hidden, logits, anchor, budget)
        nodes = set()
        for i in range(1, len(tree)):
            path, j = [], i
            while j > 0:
                path.append(int(tree.tokens[j]))
                j = int(tree.parents[j])
            nodes.add(tuple(path[::-1]))
            assert abs(float(tree.log_probs[i]) - logprob(path[::-1])) < 1e-4
        assert nodes == set(ranked[:budget]), budget
