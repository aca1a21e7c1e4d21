"""The reference backend: transformers' own forward over a DynamicCache, and the cache surgery the loops need."""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from dflashkit.decode.session import Timer
from dflashkit.errors import DFlashError
from dflashkit.targets.invariant import kernels_for, needs_invariant
from dflashkit.tree import Tree, attention_mask, path_tokens

def sliding_layers(target) -> list[int]:
    """The target's sliding-window attention layers, as transformers' DynamicCache reads them from the config."""
    return [i for i, kind in enumerate(get_layer_types_and_kwargs(target.config)[0]) if kind == "sliding_attention"]


def new_target_kv(target):
    """The target KV of an online loop, every position kept so that a rejected draft can be cropped: a sliding layer
    becomes a full DynamicLayer still marked sliding, which transformers masks by absolute position (so exact)."""
    kv = DynamicCache(config=target.config)
    for i in sliding_layers(target):
        if type(kv.layers[i]) is DynamicSlidingWindowLayer:
            kv.layers[i] = DynamicLayer()
            kv.layers[i].is_sliding = True
    left = [i for i, layer in enumerate(kv.layers) if getattr(layer, "is_sliding", False) and type(layer) is not DynamicLayer]
    if left:
        raise DFlashError(
            f"target {target.name} ({target.config.model_type}) has chunked or hybrid windowed attention on layers "
            f"{left} ({', '.join(sorted({type(kv.layers[i]).__name__ for i in left}))}): online speculative decoding "
            "cannot roll their caches back, so the online loops (ar, chain, DDTree) refuse it; offline extraction and "
            "evaluation still work, and online decoding of a copy of the target whose config.json layer_types has "
            "full_attention (hybrid for hybrid_sliding) there is exact for prompts plus outputs shorter than the window"
        )
    return kv


def verify_mask(target, tree: Tree, start: int, window: int | None = None):
    """The tree verify's attention mask. transformers hands a custom mask to every layer as it is, so with a `window`
    the sliding layers get their own (per layer type where the config has layer_types, else the windowed one)."""
    full = attention_mask(tree, start, target.dtype, target.device)
    if window is None:
        return full
    windowed = attention_mask(tree, start, target.dtype, target.device, window)
    types = getattr(target.config, "layer_types", None)
    return windowed if types is None else {k: windowed if k == "sliding_attention" else full for k in set(types)}


def _attention_layers(kv):
    return [layer for layer in kv.layers if getattr(layer, "keys", None) is not None]


def _linear_layers(kv):
    return [layer for layer in kv.layers if hasattr(layer, "recurrent_states")]


def crop_kv(kv, length: int, row: int = 0) -> None:
    """Keep every attention layer's first `length` positions and only batch row `row` (a path verify makes many)."""
    for layer in _attention_layers(kv):
        layer.keys, layer.values = layer.keys[row : row + 1, :, :length], layer.values[row : row + 1, :, :length]


def compact_kv(kv, start: int, keep: torch.Tensor) -> None:
    """Keep positions < start plus the tree slots start + keep (the accepted path), moved down to start.. in order.
    Slots already in place (every chain) are not copied: many small copies add up to a visible share of a round."""
    order = keep.tolist()
    moved = next((i for i, slot in enumerate(order) if slot != i), len(order))
    if moved < len(order):
        src = start + keep[moved:]
        for layer in _attention_layers(kv):
            for t in (layer.keys, layer.values):
                t[:, :, start + moved : start + len(order)] = t.index_select(2, src)
    crop_kv(kv, start + len(order))


def _cloned(states: dict) -> dict:
    return {i: None if s is None else s.clone() for i, s in states.items()}


def save_linear_states(kv) -> list:
    """Clones of every linear-attention layer's conv and recurrent states (they are updated in place)."""
    return [(_cloned(layer.conv_states), _cloned(layer.recurrent_states), dict(layer.has_previous_state))
            for layer in _linear_layers(kv)]


def load_linear_states(kv, saved) -> None:
    for layer, (conv, rec, prev) in zip(_linear_layers(kv), saved):
        layer.conv_states, layer.recurrent_states, layer.has_previous_state = _cloned(conv), _cloned(rec), dict(prev)


class HfBackend:
    """transformers' own forward as a decode/session.Backend. Hybrid targets re-run their accepted tokens (a recurrent
    state cannot be cropped); `stock` (hf-stock): the model's own kernels, the fair speed baseline in low precision."""

    widest = None

    def __init__(self, target, cost=None, stock: bool = False):
        self.target, self.cost, self.stock = target, cost, stock
        self.engine = "hf-stock" if stock else "hf"
        self.invariant = not stock and needs_invariant(target.model)
        self.window = target.config.sliding_window if sliding_layers(target) else None  # read once, not on every call
        self.by_paths = self.invariant or target.is_hybrid  # how a branching tree is verified (the cost model reads it)
        # what -auto cuts a tree verified one path a row on: the curve's own of such verifies where it has one
        self.path_cost = (getattr(cost, "paths", None) or cost) if cost is not None and self.by_paths else None
        self.timer, self.paths = Timer(target.device), False

    def session(self, timer: Timer):  # nothing to enter: the kernels go around each target forward
        self.timer = timer
        return contextlib.nullcontext()

    def verified_tokens(self, tree: Tree) -> int:
        return path_tokens(tree) if self.paths else len(tree)

    def kernels(self):
        """Every target forward's kernels (never the drafter's): row-invariant ones in bf16 on a CPU (targets/invariant.py)."""
        return kernels_for(self.target, self.stock)

    def prefill(self, ids: list[int], layer_ids):
        self.kv, self.layer_ids, self.start = new_target_kv(self.target), layer_ids, len(ids)
        with self.kernels():
            out = self.target.forward(torch.tensor([ids], device=self.target.device), layer_ids=layer_ids,
                                      past_key_values=self.kv, logits_to_keep=1)
        return out.logits[0, -1:], out.features

    def verify(self, tokens: torch.Tensor, tree: Tree | None = None) -> torch.Tensor:
        t, kv, start, dev = self.target, self.kv, self.start, self.target.device
        self.tree, self.tokens = tree, tokens
        self.saved = save_linear_states(kv) if t.is_hybrid else None
        branching = tree is not None and int(tree.depths.max()) < len(tree) - 1
        self.paths = branching and self.by_paths
        with self.kernels():
            if self.paths:
                logits, self.out, self.row_of = verify_tree_by_paths(t, kv, tree, start, self.layer_ids)
                return logits
            pos = start + (tree.depths if branching else torch.arange(len(tokens)))
            mask = verify_mask(t, tree, start, self.window) if branching else None  # a chain: the causal mask
            self.out = t.forward(tokens[None].to(dev), layer_ids=self.layer_ids, past_key_values=kv,
                                 position_ids=pos[None].to(dev), attention_mask=mask)
        return self.out.logits[0]

    def commit(self, keep: list[int]):
        """Keep the verified nodes `keep` (root first, in depth order) in the target KV, at the positions plain
        decoding would have written; returns their features [1, len(keep), F] (None without layer ids)."""
        kv, start, n, out = self.kv, self.start, len(self.tokens), self.out
        self.start += len(keep)
        idx = torch.tensor(keep, device=self.target.device)
        if self.saved is not None:  # a recurrent state: roll the KV back to start and re-run the accepted tokens
            if len(keep) == n and self.tree is None:
                return out.features
            pos = start + torch.arange(len(keep), device=idx.device)
            with self.timer("verify"), self.kernels():
                crop_kv(kv, start)
                load_linear_states(kv, self.saved)
                return self.target.forward(self.tokens.to(idx.device)[idx][None], layer_ids=self.layer_ids,
                                           past_key_values=kv, position_ids=pos[None], compute_logits=False).features
        if self.paths:  # the accepted path is a prefix of its last node's row: keep that row only
            r = int(self.row_of[keep[-1]])
            crop_kv(kv, start + len(keep), r)
            return out.features[r : r + 1, : len(keep)] if self.layer_ids is not None else None
        if len(keep) < n:
            compact_kv(kv, start, idx)
        return out.features[:, idx] if self.layer_ids is not None else None


def verify_tree_by_paths(target, kv, tree: Tree, start: int, layer_ids=None):
    """One batch row per root-to-leaf path, for hybrid targets (a recurrent layer reads one sequence) and row-invariant
    kernels (a flat tree reorders sums). Returns (logits [n, V], the output, each node's row [n]); KV left expanded."""
    has_child, seen = set(tree.parents.tolist()), tree.ancestor_mask()  # a node's ancestors, in depth order
    rows = [seen[leaf].nonzero()[:, 0].tolist() for leaf in range(len(tree)) if leaf not in has_child]
    width = max(len(r) for r in rows)
    grid = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows])  # node index per slot; right padding
    row_of = torch.zeros(len(tree), dtype=torch.long)
    for r, row in enumerate(rows):
        row_of[row] = r
    n, dev = len(rows), target.device
    for layer in _attention_layers(kv):
        layer.keys, layer.values = layer.keys.expand(n, -1, -1, -1), layer.values.expand(n, -1, -1, -1)
    rows_of = lambda states: {i: None if s is None else s.repeat(n, *[1] * (s.dim() - 1)) for i, s in states.items()}
    for layer in _linear_layers(kv):
        layer.conv_states, layer.recurrent_states = rows_of(layer.conv_states), rows_of(layer.recurrent_states)
    pos = (start + torch.arange(width, device=dev)).expand(n, -1)
    out = target.forward(tree.tokens[grid].to(dev), past_key_values=kv, position_ids=pos, layer_ids=layer_ids)
    return out.logits[row_of.to(dev), tree.depths.to(dev)], out, row_of
