"""Draft trees shared by offline evaluation and online decoding: DDTree (Ringel & Romano, arXiv:2604.12989), n-gram
branches, the verify mask, cost-aware cuts and `TreeDrafts` (docs/design.md, "Draft trees in detail")."""
from __future__ import annotations

import heapq
import itertools
import re
from dataclasses import dataclass, field, replace
from time import perf_counter
from typing import Sequence

import torch
from torch import Tensor

@dataclass
class Tree:
    """Draft tree in pop order; node 0 is the root (the last verified token), so arrays are [budget+1]."""

    tokens: Tensor  # [n] long, root holds root_token
    depths: Tensor  # [n] long, root 0
    parents: Tensor  # [n] long, root -1; a parent always precedes its children
    log_probs: Tensor  # [n] float32 prefix log-prob under the drafter, root 0
    _children: list[dict[int, int]] | None = field(default=None, init=False, repr=False)

    @classmethod
    def of(cls, tokens, depths, parents, log_probs) -> Tree:
        return cls(torch.tensor(tokens), torch.tensor(depths), torch.tensor(parents),
                   torch.tensor(log_probs, dtype=torch.float32))

    @classmethod
    def chain(cls, tokens: Tensor) -> Tree:
        n = len(tokens)
        return cls(tokens.cpu(), torch.arange(n), torch.arange(-1, n - 1), torch.zeros(n))

    def __len__(self) -> int:
        return self.tokens.numel()

    def children(self) -> list[dict[int, int]]:
        """Per node, token -> child index; cached because the verify walk needs it per step."""
        if self._children is None:
            self._children = [{} for _ in range(len(self))]
            for i, (t, p) in enumerate(zip(self.tokens.tolist(), self.parents.tolist())):
                if p >= 0:
                    self._children[p][t] = i
        return self._children

    def ancestor_mask(self) -> Tensor:
        """[n, n] bool verify mask: node i sees node j iff j is i or one of its ancestors (root included)."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:  # parents come first, so their row is already complete
                mask[i] |= mask[p]
        return mask


def attention_mask(tree: Tree, past: int, dtype: torch.dtype, device, window: int | None = None) -> Tensor:
    """[1, 1, n, past + n] additive verify mask: the whole target KV, then the node's ancestors and itself. With
    `window` (a sliding layer), only keys less than `window` before the node's position, as transformers keeps them."""
    allowed = torch.cat([torch.ones(len(tree), past, dtype=torch.bool), tree.ancestor_mask()], dim=1)
    if window is not None:
        q_pos = past + tree.depths
        k_pos = torch.cat([torch.arange(past), q_pos])
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def walk(tree: Tree, choice: Sequence[int]) -> list[int]:
    """The accepted nodes (root excluded): from the root, follow choice[node] (the target's token after it)."""
    kids, node, path = tree.children(), 0, []
    while (child := kids[node].get(choice[node])) is not None:
        path.append(child)
        node = child
    return path


def add_branch(tree: Tree, branch: Sequence[int], log_prob: float = 0.0) -> tuple[Tree, list[int]]:
    """The tree plus a root path `branch`, merged where it shares a prefix, and the branch's node indices."""
    branch = [int(t) for t in branch]
    shared = accepted_path(tree, branch)  # the nodes the tree holds already; the rest hangs below as a new chain
    top, n, new = (shared or [0])[-1], len(tree), branch[len(shared):]
    depth = int(tree.depths[top])
    grown = Tree.of(tree.tokens.tolist() + new, tree.depths.tolist() + list(range(depth + 1, depth + 1 + len(new))),
                    tree.parents.tolist() + [top if i == n else i - 1 for i in range(n, n + len(new))],
                    tree.log_probs.tolist() + [log_prob] * len(new))
    return grown, shared + list(range(n, n + len(new)))


def subtree(tree: Tree, keep: Sequence[int]) -> Tree:
    """The nodes `keep` (root included, prefix-closed, any order) renumbered in tree order."""
    keep = sorted(set(keep) | {0})
    new = {old: i for i, old in enumerate(keep)}
    parents = [-1] + [new[p] for p in tree.parents[keep[1:]].tolist()]
    idx = torch.tensor(keep)
    return Tree(tree.tokens[idx], tree.depths[idx], torch.tensor(parents), tree.log_probs[idx])


def path_tokens(tree: Tree) -> int:
    """Tokens a verify one root-to-leaf path per batch row runs: leaves x (depth + 1)."""
    return (len(tree) - len(set(tree.parents.tolist()) - {-1})) * (int(tree.depths.max()) + 1)


def cut_candidates(tree: Tree, probs: Sequence[float]) -> tuple[list[int], list[float], list[int]]:
    """(nodes in the order a cut keeps them, per cut of the first n: 1 + their acceptance probabilities, and the
    tokens of a verify one path a row). probs[i] is capped by its parent's, so every cut is prefix-closed."""
    p = list(map(float, probs))
    parents = tree.parents.tolist()
    for i, par in enumerate(parents):  # parents precede children: one pass makes p monotone
        if par > 0:
            p[i] = min(p[i], p[par])
    depths = tree.depths.tolist()
    order = sorted(range(1, len(tree)), key=lambda i: (-p[i], depths[i], i))
    gains, tokens, has_child, leaves, depth = [1.0], [1], set(), 1, 0
    for i in order:
        leaves += parents[i] in has_child  # a second child opens a new path; a first one extends its parent's
        has_child.add(parents[i])
        depth = max(depth, depths[i])
        gains.append(gains[-1] + p[i])
        tokens.append(leaves * (depth + 1))
    return order, gains, tokens


def best_cut(gains: Sequence[float], tokens: Sequence[int], cost, fixed: float = 0.0, path_cost=None) -> int:
    """The n of cut_candidates whose expected committed tokens per unit of time is highest (the fewest on ties)."""
    verify = lambda n: cost(1) if n == 0 else path_cost(tokens[n]) if path_cost else cost(n + 1)  # noqa: E731
    return max(range(len(gains)), key=lambda n: gains[n] / (fixed + verify(n)))


def prune_by_cost(tree: Tree, probs: Sequence[float], cost, fixed: float = 0.0, path_cost=None) -> Tree:
    """The cut that maximizes (1 + kept probabilities) / (fixed + cost(nodes + 1)), or + path_cost(leaves x (depth
    + 1)) for a batch row per root-to-leaf path: exact for the flat cost, greedy for paths (docs/design.md section 5)."""
    order, gains, tokens = cut_candidates(tree, probs)
    return subtree(tree, order[:best_cut(gains, tokens, cost, fixed, path_cost)])


def draft_tree(logits: Tensor, budget: int, anchor: Tensor, to_tokens) -> Tree:
    """The budget-node DDTree of a drafter's logits [L, V'], rooted at `anchor` [1], in target token ids."""
    return rooted(build_tree(logits, budget), anchor, to_tokens, logits.device)


def rooted(tree: Tree, anchor: Tensor, to_tokens, device) -> Tree:
    """A drafter's tree (node tokens are draft-vocabulary indices) with target token ids, the anchor at the root."""
    return replace(tree, tokens=torch.cat([anchor.cpu(), to_tokens(tree.tokens[1:].to(device)).cpu()]))


def top_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(log-probs, indices) [..., k] of the float32 log-softmax's top-k, descending, materialising only k per row."""
    logits = logits.detach().float()
    vals, idx = logits.topk(k, dim=-1)
    return vals - logits.logsumexp(dim=-1, keepdim=True), idx


def build_tree(logits: Tensor, budget: int, root_token: int = -1) -> Tree:
    """The `budget` most probable prefixes of the product distribution logits[L, V], popped best-first from a heap (a
    prefix scores no more than its previous sibling or parent), so prefix-closed; the top min(budget, V) suffice."""
    if logits.dim() != 2:
        raise ValueError(f"build_tree expects logits [L, V], got shape {tuple(logits.shape)}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    lp, idx = (t.tolist() for t in top_logprobs(logits, min(budget, logits.shape[1])))
    return build_tree_topk(lp, idx, budget, root_token)


def build_tree_topk(lp: list, idx: list, budget: int, root_token: int = -1) -> Tree:
    """build_tree from each position's top-k log-probs and ids (lists [L][k], descending): one top-k, many budgets."""
    L = len(lp)
    rows = [(root_token, 0, -1, 0.0)]  # (token, depth, parent, score) per node
    if budget > 0 and L > 0:
        k, tie = min(budget, len(lp[0])), itertools.count(1)
        # heap entry: (-score, tiebreak, depth, rank, parent index, parent score)
        heap = [(-lp[0][0], 0, 1, 0, 0, 0.0)]
        while heap and len(rows) <= budget:
            neg, _, d, r, par, par_score = heapq.heappop(heap)
            node = len(rows)
            rows.append((idx[d - 1][r], d, par, -neg))
            if r + 1 < k:  # next sibling
                heapq.heappush(heap, (-(par_score + lp[d - 1][r + 1]), next(tie), d, r + 1, par, par_score))
            if d < L:  # first child
                heapq.heappush(heap, (neg - lp[d][0], next(tie), d + 1, 0, node, -neg))
    return Tree.of(*zip(*rows))


def accepted_path(tree: Tree, continuation: Sequence[int] | Tensor) -> list[int]:
    """Node indices (root excluded) the target accepts; continuation[i] is its token at depth i+1."""
    kids, path, node = tree.children(), [], 0
    for tok in continuation.tolist() if isinstance(continuation, Tensor) else continuation:
        if (node := kids[node].get(tok)) is None:
            break
        path.append(node)
    return path


def streak(logits: Tensor, labels: Tensor) -> Tensor:
    """Greedy acceptance: leading positions with argmax == label ([..., L, V], [..., L] -> [...]); -100 never matches."""
    return (logits.argmax(dim=-1) == labels).long().cumprod(dim=-1).sum(dim=-1)


def width_streak(logits: Tensor, labels: Tensor, k: int) -> Tensor:
    """`width:K` upper bound (a tree of all K^L combinations): leading positions whose label is in the top-K."""
    idx = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    return (idx == labels.unsqueeze(-1)).any(dim=-1).long().cumprod(dim=-1).sum(dim=-1)


def topk_paths(logits: Tensor, k: int) -> list[tuple[list[int], float]]:
    """The k most probable complete drafts with log-probs, best first (beam search is exact for a product distribution)."""
    kk = min(k, logits.shape[1])
    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    for lp, idx in zip(*(t.tolist() for t in top_logprobs(logits, kk))):  # per position
        cand = [(s + lp[r], toks + [idx[r]]) for s, toks in beams for r in range(kk)]
        beams = sorted(cand, key=lambda c: -c[0])[:k]  # stable: ties keep beam-then-rank order
    return [(toks, s) for s, toks in beams]


def paths_streak(logits: Tensor, labels: Tensor, k: int) -> int:
    """`paths:K`: best accepted depth among the K most probable complete drafts (K independent chains)."""
    lab = labels.tolist() if isinstance(labels, Tensor) else list(labels)
    return max(common_prefix(toks, lab) for toks, _ in topk_paths(logits, k))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parse_tree_spec(spec: str) -> tuple[str, int]:
    """'budget:8' | 'paths:4' | 'width:4' | 'selector:8' (DFlash2's CandidateSelector.tree) | '8' -> (family, K >= 1)."""
    m = re.fullmatch(r"(?:(budget|paths|width|selector):)?([0-9]+)", str(spec).strip())
    if m is None or int(m.group(2)) < 1:
        raise ValueError(f"bad tree spec {spec!r}: expected 'budget:N', 'paths:N', 'width:N', 'selector:N' (DFlash2) "
                         "or a bare 'N' (= budget:N), with integer N >= 1")
    return m.group(1) or "budget", int(m.group(2))


ADDED_PRIOR = (1.0, 1.0)  # what the gate assumes the drafter adds before it has drafted: one token, worth one round
ADDED_DECAY = 0.9  # per drafted round: a mean over about ten, not a moving average that two misses can shut
# an idle drafter is retried after RETRY rounds, the wait doubling up to RETRY_MOST while it does not pay
RETRY, RETRY_MOST = 8, 64
# per depth, promised (summed kept probabilities) against accepted, over about 20 rounds, from PRIOR kept promises
CALIBRATION_DECAY, CALIBRATION_PRIOR = 0.95, 2.0


class TreeDrafts:
    """What one round verifies: the drafter's DDTree, n-gram branches, or both merged. With a cost curve (-auto)
    the tree is cut for tokens per second and the drafter sits out rounds where what it adds does not pay."""

    def __init__(self, drafter=None, budget: int = 0, ngram=None, cost=None, draft_cost: float | None = None,
                 path_cost=None, fixed: float = 0.0):
        self.drafter, self.budget, self.ngram, self.cost = drafter, budget, ngram, cost
        self.timed = draft_cost is None  # an offline replay prices the drafter's call (draft_cost), not times it
        self.layer_ids = drafter.layer_ids if drafter is not None else None
        self.gated = drafter is not None and cost is not None
        self.fixed = fixed  # seconds a round costs besides the verify and draft forwards (running mean: round_took)
        self.path_cost = path_cost  # the backend's cost of a tree verified one root-to-leaf path a row, where it does
        self.timed_rounds = 0
        self.branches: list[tuple[list[int], int]] = []  # this round's verified n-gram proposals, matched lengths
        self.t_draft = draft_cost or 0.0  # running mean of one drafter forward
        # n-gram confidence bucket (0: no n-gram proposal) -> [tokens added, weight, rounds idle, idle rounds to retry]
        self.added: dict[int, list[float]] = {}
        self.bucket, self.drafted, self.pending = 0, False, None
        # per kind of round (drafted, or the n-gram branch alone), per depth: [accepted, promised] (decayed sums)
        self.calibration: dict[bool, list[list[float]]] = {True: [], False: []}
        self.promised: list[float] = []  # this round's kept nodes' probabilities, summed per depth

    def most_nodes(self) -> int:
        """The widest tree this proposer can build (root included): the drafter's budget plus each n-gram branch."""
        n = self.ngram
        return 1 + self.budget + (n.max_tokens * getattr(n, "branches", 1) if n is not None else 0)

    def round_took(self, seconds: float) -> None:
        """A round's own work besides its forwards (the loop times it): `fixed`, a running mean from the first."""
        self.fixed = seconds if not self.timed_rounds else 0.9 * self.fixed + 0.1 * seconds
        self.timed_rounds += 1

    def reset(self, prompt_ids) -> None:
        self.pending = None
        for proposer in (p for p in (self.drafter, self.ngram) if p is not None):
            proposer.reset(prompt_ids)

    def propose(self, features, bonus: torch.Tensor, start: int, timer) -> Tree:
        found = []
        if self.ngram is not None:
            self.ngram.extend(bonus.tolist())
            found = [(cont, match, self.ngram.probs(match, len(cont))) for cont, match in self.ngram.propose_all()]
        if self.drafter is not None:  # features of every committed position reach the drafter, drafted or not
            self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)
        self.drafted = self.drafter is not None and self._worth_drafting(found)
        if self.drafted:
            t = perf_counter()
            with timer("draft"):
                logits = self.drafter.propose(self.pending, bonus, start)
            if self.timed:
                self.t_draft = 0.8 * self.t_draft + 0.2 * (perf_counter() - t) if self.t_draft else perf_counter() - t
            self.pending = None
            tree = (self.drafter.tree(logits, self.budget, bonus) if hasattr(self.drafter, "tree")
                    else draft_tree(logits, self.budget, bonus, self.drafter.to_tokens))
        else:
            tree = Tree.chain(bonus)  # the root alone
        probs = tree.log_probs.double().exp().tolist()
        for cont, _, qs in found:
            tree, nodes = add_branch(tree, cont, log_prob=float("-inf"))
            probs += [0.0] * (len(tree) - len(probs))
            for node, q in zip(nodes, qs):
                probs[node] = 1 - (1 - probs[node]) * (1 - q)  # independent proposers agreeing on a token
        self.branches = [(cont, match) for cont, match, _ in found]
        if self.cost is not None:  # the cut, on probabilities scaled by what the drafter's promises achieved
            order, gains, tokens = cut_candidates(tree, self.calibrated(tree, probs) if self.gated else probs)
            kept = order[:best_cut(gains, tokens, self.cost, self.fixed + self.drafted * self.t_draft, self.path_cost)]
            depths = tree.depths.tolist()
            self.promised = [min(1.0, sum(probs[i] for i in kept if depths[i] == d)) for d in range(1, 1 + max(
                (depths[i] for i in kept), default=0))] if self.gated else []
            tree = subtree(tree, kept)
            # what survived of each branch is what the target gets to test
            self.branches = [(cont[: len(accepted_path(tree, cont))], match) for cont, match in self.branches]
        return tree

    def calibrated(self, tree: Tree, probs: list[float]) -> list[float]:
        """Node probabilities scaled per depth by accepted / promised in this run's rounds of this kind (drafted or not)."""
        scale = [(a + CALIBRATION_PRIOR) / (p + CALIBRATION_PRIOR) for a, p in self.calibration[self.drafted]]
        return [min(1.0, q * (scale[d - 1] if 0 < d <= len(scale) else 1.0))
                for q, d in zip(probs, tree.depths.tolist())]

    def _worth_drafting(self, found) -> bool:
        """Draft unless what the drafter adds at this n-gram confidence does not pay for its forward (retried idle)."""
        if not self.gated:
            return True
        self.bucket = 0 if not found else 1 + int(4 * max(qs[0] for _, _, qs in found))  # by the surest first token
        stat = self.added.setdefault(self.bucket, [*ADDED_PRIOR, 0, RETRY])
        total, weight, idle, wait = stat
        if not self.t_draft:
            return True
        # expected and verified tokens (root included) of each n-gram prefix; the best by tokens per second
        prefixes = [(g, n) for _, _, qs in found for n, g in enumerate(itertools.accumulate(qs, initial=1.0), start=1)]
        gain, n = max([(1.0, 1), *prefixes], key=lambda p: p[0] / (self.fixed + self.cost(p[1])))
        without = gain / (self.fixed + self.cost(n))
        with_ = (gain + total / weight) / (self.fixed + self.t_draft + self.cost(n + 4))
        if with_ > without:
            stat[3] = RETRY
            return True
        if idle >= wait:  # a retry, to keep the estimate fresh; the next one waits longer
            stat[3] = min(2 * wait, RETRY_MOST)
            return True
        return False

    def observe(self, new: list[int]) -> None:
        """Learn from the round's accepted drafts `new`: what each n-gram proposal and the drafter got accepted."""
        best = 0
        for cont, match in self.branches if self.ngram is not None else ():
            if cont:
                depth = common_prefix(cont, new)
                self.ngram.observe(match, len(cont), depth)
                best = max(best, depth)
        table = self.calibration[self.drafted]
        table += [[0.0, 0.0] for _ in range(len(self.promised) - len(table))]
        for d, (c, promised) in enumerate(zip(table, self.promised), start=1):  # promised against accepted
            c[:] = [CALIBRATION_DECAY * c[0] + (len(new) >= d), CALIBRATION_DECAY * c[1] + promised]
        self.promised = []
        if self.gated and self.bucket in self.added:
            stat = self.added[self.bucket]
            if self.drafted:  # a decayed mean over about the last ten drafted rounds of this bucket
                stat[:3] = [ADDED_DECAY * stat[0] + len(new) - best, ADDED_DECAY * stat[1] + 1, 0]
            else:
                stat[2] += 1
        if self.ngram is not None:
            self.ngram.extend(new)
