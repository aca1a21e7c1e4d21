"""Offline evaluation of a drafter on cached target states: each block's streak and accepted depth per draft tree,
anchored `stride` (comparable across drafters) or `walk` (as chain decoding at T=0); docs/design.md section 6."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from dflashkit.drafter.checkpoint import check_against_target, check_feature_layers
from dflashkit.drafter.head import LOGIT_ELEMENTS, DraftHead
from dflashkit.drafter.model import block_ids
from dflashkit.errors import DFlashError
from dflashkit.ngram import NgramLookup
from dflashkit.targets.model import check_same_target
from dflashkit.tree import (TreeDrafts, accepted_path, build_tree_topk, cut_candidates, parse_tree_spec,
                            path_tokens, paths_streak, streak as greedy_streak, subtree, top_logprobs, width_streak)

ANCHOR_MODES = ("stride", "walk")
DEFAULT_TREES = ("budget:4", "budget:8")
CURVE_BUDGETS = (1, 2, 4, 8, 16, 32)  # the DDTree budget curve in every run
BLOCKS_PER_CALL = 128  # bounds the attention scores of very long sequences; coding completions fit in one call


def parse_trees(trees) -> list[str]:
    """'budget:4,budget:8' or ['budget:4', '8'] -> canonical ['budget:4', 'budget:8'] (order kept, no repeats)."""
    if isinstance(trees, str):
        trees = [t for t in trees.split(",") if t.strip()]
    out = []
    for spec in trees or ():
        try:
            family, k = parse_tree_spec(spec)
        except ValueError as e:
            raise DFlashError(f"--trees: {e}") from e
        out.append(f"{family}:{k}")
    return list(dict.fromkeys(out))


def check_mode(anchors: str, max_blocks) -> None:
    if anchors not in ANCHOR_MODES:
        raise DFlashError(f"--anchors {anchors!r}: use one of {', '.join(ANCHOR_MODES)}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or int(max_blocks) < 1):
        raise DFlashError(f"--max-blocks {max_blocks!r}: must be a positive number of blocks per prompt (or omitted for all)")


def stride_anchors(prompt_len: int, num_tokens: int, block_size: int, max_blocks: int | None = None) -> list[int]:
    """a = prompt_len, prompt_len + B, ... while a + 1 is still a completion position (a <= T - 2)."""
    return list(range(prompt_len, num_tokens - 1, block_size))[:max_blocks]


def _labels(tokens, anchors: list[int], B: int) -> torch.Tensor:
    """[n, B-1] target ids a+1..a+B-1 per anchor, -100 past the end of the sequence."""
    T = tokens.shape[0]
    pos = torch.tensor(anchors, device=tokens.device)[:, None] + torch.arange(1, B, device=tokens.device)
    return torch.where(pos < T, tokens[pos.clamp(max=T - 1)], torch.full_like(pos, -100))


def block_embeddings(embed_tokens, tokens, anchors: list[int], B: int, mask_id: int, dtype) -> torch.Tensor:
    """block_embeds [n*B, H]: embeddings of each block, the anchor token then B-1 mask tokens (block_ids)."""
    ids = block_ids(tokens[torch.tensor(anchors, device=tokens.device)], B, mask_id)
    return embed_tokens(ids.reshape(-1)).to(dtype)


def _budgets(trees) -> list[int]:
    return sorted(set(CURVE_BUDGETS) | {k for f, k in map(parse_tree_spec, trees) if f == "budget"})


def score_block(logits: torch.Tensor, labels: torch.Tensor, label_index: torch.Tensor, trees: list[str]) -> dict:
    """Metrics of one block. logits [L, V'] float32 (draft vocabulary); labels [L] target ids (-100 past the
    end); label_index [L] the labels as draft-vocabulary indices (-100: past the end or outside it)."""
    hit = logits.argmax(-1) == label_index
    lp, idx = top_logprobs(logits, min(_budgets(trees)[-1], logits.shape[-1]))
    return _score(hit, lp.tolist(), idx.tolist(), logits, labels, label_index, trees)


def _score(hit, lp, idx, logits, labels, label_index, trees, selector_curve=None) -> dict:
    """hit [L] argmax == label; lp / idx [L][k] top log-probs and indices. One best-first tree serves every budget."""
    n_labels = int((labels != -100).sum())
    budgets = _budgets(trees)
    tree = build_tree_topk(lp, idx, budgets[-1])
    path = accepted_path(tree, label_index)
    probs = tree.log_probs.double().exp()
    curve = {b: sum(1 for node in path if node <= b) for b in budgets}
    expected = {b: probs[1 : b + 1].sum().item() for b in budgets}
    order, gains, cut_tokens = cut_candidates(tree, probs.tolist())  # what a cost-aware tree chooses among
    by_family = {"budget": lambda k: curve[k], "paths": lambda k: paths_streak(logits, label_index, k),
                 "selector": lambda k: selector_curve[k], "width": lambda k: int(width_streak(logits, label_index, k))}
    specs = [(spec, *parse_tree_spec(spec)) for spec in trees]
    out_trees = {spec: by_family[family](k) for spec, family, k in specs}
    out_expected = {spec: expected[k] for spec, family, k in specs if family == "budget"}
    chain = [row[0] for row in lp] if lp and lp[0] else []  # the greedy draft's log-prob at each position
    predicted = torch.tensor(chain, dtype=torch.float64).cumsum(0).exp().tolist()  # its P(streak >= k), as drafted
    return {"n_labels": n_labels, "streak": int(hit.long().cumprod(0).sum()), "matches": hit[:n_labels].int().tolist(),
            "predicted": [round(x, 5) for x in predicted],
            "trees": out_trees, "expected": out_expected, "curve": {str(b): curve[b] for b in CURVE_BUDGETS},
            "curve_expected": {str(b): expected[b] for b in CURVE_BUDGETS},  # and a verify one path per row's tokens:
            "curve_paths": {str(b): path_tokens(subtree(tree, range(min(b + 1, len(tree))))) for b in CURVE_BUDGETS},
            "cut": {"gains": [round(g, 4) for g in gains], "tokens": cut_tokens, "path": sorted(order.index(n) + 1 for n in path)}}


def _score_blocks(head, hidden: torch.Tensor, tokens, anchors: list[int], B: int, trees: list[str],
                  selector=None) -> list[dict]:
    """hidden [n, B-1, H] drafter states of the draft slots; logits, argmax and top-k once per chunk of blocks.
    selector (DFlash2): its greedy path is the draft streak scores, while DDTree budgets read the marginal logits."""
    labels = _labels(tokens, anchors, B)
    index = head.to_index(labels)
    k = min(_budgets(trees)[-1], head.size)
    sel_budgets = sorted(n for f, n in map(parse_tree_spec, trees) if f == "selector")
    if sel_budgets and selector is None:
        raise DFlashError(f"trees {[t for t in trees if t.startswith('selector:')]}: selector trees need a DFlash2 "
                          "drafter (its candidate selector); use budget:N for this drafter")
    per_chunk = max(1, LOGIT_ELEMENTS // (head.size * (B - 1)))
    out = []
    for s in range(0, len(anchors), per_chunk):
        logits = head.logits(hidden[s : s + per_chunk])  # [m, B-1, V'] float32
        if selector is None:
            hits = logits.argmax(-1) == index[s : s + per_chunk]
        else:
            anchor_ids = tokens[torch.tensor(anchors[s : s + per_chunk], device=tokens.device)]
            path = selector.select(hidden[s : s + per_chunk], logits, anchor_ids, 0.0, head.to_tokens)[0]
            hits = path == labels[s : s + per_chunk]
        lp, idx = (x.tolist() for x in top_logprobs(logits, k))
        for i in range(logits.shape[0]):
            j = s + i
            curve = None
            if sel_budgets:
                tree = selector.tree(hidden[j], logits[i], int(tokens[anchors[j]]), sel_budgets[-1], head.to_tokens)
                path = accepted_path(tree, index[j])
                curve = {b: sum(1 for node in path if node <= b) for b in sel_budgets}
            rec = _score(hits[i], lp[i], idx[i], logits[i], labels[j], index[j], trees, curve)
            out.append({"anchor": anchors[j], **rec})
    return out


def _exported_streaks(head, hidden: torch.Tensor, tokens, anchors: list[int], B: int, out: list[dict]) -> None:
    """Each block's streak_as_exported: greedy over the full vocabulary (`head`), as an export without a token map."""
    labels = _labels(tokens, anchors, B)
    per_chunk = max(1, LOGIT_ELEMENTS // (head.size * (B - 1)))
    for s in range(0, len(anchors), per_chunk):
        streaks = greedy_streak(head.logits(hidden[s : s + per_chunk]), labels[s : s + per_chunk])  # -100 never matches
        for rec, n in zip(out[s : s + per_chunk], streaks.tolist()):
            rec["streak_as_exported"] = n


def _check_sequence(drafter, tokens, features, prompt_len: int) -> None:
    cfg = drafter.config
    if tokens.dim() != 1:
        raise DFlashError(f"tokens must be a 1-D sequence [T], got shape {list(tokens.shape)}")
    width = cfg.num_features * cfg.hidden_size
    if features.dim() != 2 or features.shape[0] != tokens.shape[0]:
        raise DFlashError(f"features must be [T={tokens.shape[0]}, {width}] (one row per token), got {list(features.shape)}")
    if features.shape[1] != width:
        raise DFlashError(f"features have width {features.shape[1]} but the drafter's fc expects {width} = "
                          f"{cfg.num_features} target layers {cfg.target_layer_ids} x hidden {cfg.hidden_size}; "
                          "read the cache with the drafter's layer ids")
    if not 0 <= prompt_len <= tokens.shape[0]:
        raise DFlashError(f"prompt_len {prompt_len} is outside the sequence of {tokens.shape[0]} tokens")


@torch.no_grad()
def evaluate_sequence(drafter, head, embed_tokens, tokens: torch.Tensor, features: torch.Tensor, prompt_len: int,
                      anchors: str = "stride", trees=DEFAULT_TREES, max_blocks: int | None = None,
                      full_head=None) -> list[dict]:
    """One record per block of one sequence, in anchor order: tokens [T] prompt + completion ids, features [T, K*H]
    in the drafter's layer order, head a DraftHead; full_head (stride only) adds streak_as_exported."""
    check_mode(anchors, max_blocks)
    trees = parse_trees(trees)
    _check_sequence(drafter, tokens, features, prompt_len)
    cfg = drafter.config
    B, T = cfg.block_size, tokens.shape[0]
    p = next(drafter.parameters())
    embed = lambda ids: drafter.embed_block(embed_tokens, ids)  # noqa: E731 (input_embedding_scale applied)
    selector = getattr(drafter, "candidate_selector", None)  # DFlash2: its path is the draft
    tokens = tokens.to(p.device).long()
    feats = features.to(p.device, p.dtype)
    if anchors == "stride":
        starts = stride_anchors(prompt_len, T, B, max_blocks)
        out = []
        for s in range(0, len(starts), BLOCKS_PER_CALL):
            a = starts[s : s + BLOCKS_PER_CALL]
            block_embeds = block_embeddings(embed, tokens, a, B, cfg.mask_token_id, p.dtype)
            # context < the last anchor suffices
            h = drafter.forward_blocks(feats[None, : a[-1]], block_embeds[None], torch.tensor(a, device=p.device)[None])
            h = h[0].view(len(a), B, -1)[:, 1:]
            recs = _score_blocks(head, h, tokens, a, B, trees, selector)
            if full_head is not None and selector is None:
                _exported_streaks(full_head, h, tokens, a, B, recs)
            out += recs
        return out
    return _walk(drafter, embed, tokens, feats, prompt_len, max_blocks,
                 lambda h, a: _score_blocks(head, h, tokens, [a], B, trees, selector)[0], "streak")


def _walk(drafter, embed, tokens, feats, prompt_len: int, max_blocks, score, accepted: str) -> list[dict]:
    """Blocks one after another, each after the last one's `accepted` tokens and bonus; score(hidden [1, B-1, H], a)."""
    cfg, p = drafter.config, next(drafter.parameters())
    out, done, a, context_kv = [], 0, prompt_len, drafter.new_context_kv()
    while a <= tokens.shape[0] - 2 and (max_blocks is None or len(out) < max_blocks):
        block_embeds = block_embeddings(embed, tokens, [a], cfg.block_size, cfg.mask_token_id, p.dtype)
        pos = torch.arange(done, a + cfg.block_size, device=p.device)[None]  # new context positions, then the block
        h = drafter(feats[None, done:a], block_embeds[None], pos, past_key_values=context_kv, use_cache=True)
        done = a
        out.append(score(h[:, 1:], a))
        a += out[-1][accepted] + 1
    return out


@torch.no_grad()
def hybrid_walk(drafter, head, embed_tokens, tokens, features, prompt_len: int, budget: int, max_blocks=None,
                lookup=None, price: dict | None = None, ngram: bool = True):
    """A hybrid (without `ngram`: a DDTree) replayed on the cached greedy text by decoding's own TreeDrafts (with an
    engine's `price` in ms: its -auto, cut and gated as the loop does). Per round: accepted drafts, nodes, the tokens
    of a verify one path a row, whether it drafted."""
    p, ids = next(drafter.parameters()), tokens.tolist()
    tokens, price = tokens.to(p.device).long(), price or {}
    replayed = SimpleNamespace(to_tokens=head.to_tokens, layer_ids=None, logits=None, reset=lambda ids: None,
                               propose=lambda *_: replayed.logits)  # the drafter as TreeDrafts calls it: the walk's
    drafts = TreeDrafts(replayed, budget, (lookup or NgramLookup()) if ngram else None, price.get("cost"), price.get("draft"),
                        price.get("path_cost"), price.get("fixed", 0.0))
    drafts.reset(ids[:prompt_len])

    def score(h, a):
        replayed.logits = head.logits(h)[0]
        tree = drafts.propose(None, tokens[a : a + 1], a, lambda _: contextlib.nullcontext())
        path = accepted_path(tree, ids[a + 1 : a + 1 + int(tree.depths.max())])
        drafts.observe(ids[a + 1 : a + 1 + len(path)])
        return {"anchor": a, "accepted": len(path), "nodes": len(tree), "path_tokens": path_tokens(tree),
                "drafted": drafts.drafted}
    embed = lambda x: drafter.embed_block(embed_tokens, x)  # noqa: E731
    return _walk(drafter, embed, tokens, features.to(p.device, p.dtype), prompt_len, max_blocks, score, "accepted")


def replay_hybrids(drafter, head, embed_tokens, tokens, feats, prompt_len, max_blocks, walks):
    """Each walk (store, key, budget, lookup, price, ngram) replayed on one text, its rounds appended to store[key]."""
    for store, key, budget, lookup, price, ngram in walks:
        for r in hybrid_walk(drafter, head, embed_tokens, tokens, feats, prompt_len, budget, max_blocks, lookup, price,
                             ngram):
            for k in ("accepted", "nodes", "path_tokens") + (("drafted",) if price else ()):
                store.setdefault(key, {}).setdefault(k, []).append(r[k])


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def aggregate(blocks: list[dict], block_size: int, trees) -> dict:
    """Block-weighted means; acc_cumulative[k-1] = P(streak >= k), acc_conditional[k-1] = P(match at k | streak >=
    k-1) over blocks with a label at k, acc_predicted[k-1] the drafter's own P(streak >= k)."""
    L = block_size - 1
    trees = parse_trees(trees)
    n = len(blocks)
    cum, cond, pred = [], [], []
    for k in range(1, L + 1):
        have = [b for b in blocks if b["n_labels"] >= k]
        cum.append(_mean(b["streak"] >= k for b in have))
        pred.append(_mean(b["predicted"][k - 1] for b in have if len(b.get("predicted", ())) >= k))
        cond.append(_mean(b["matches"][k - 1] for b in have if b["streak"] >= k - 1))
    counts = [sum(1 for b in blocks if b["streak"] == s) for s in range(L + 1)]
    streak = _mean(b["streak"] for b in blocks)
    return {"blocks": n, "streak": streak, "tau": None if streak is None else streak + 1,
            "pos1_acc": cum[0] if L else None, **{t: _mean(b["trees"][t] for b in blocks) for t in trees},
            "expected": {t: _mean(b["expected"][t] for b in blocks) for t in trees if t.startswith("budget:")},
            "acc_cumulative": cum, "acc_conditional": cond, "acc_predicted": pred,
            "histogram": [c / n for c in counts] if n else [],
            "histogram_counts": counts,
            **{f"budget_{k}": {str(b): _mean(x[k][str(b)] for x in blocks) for b in CURVE_BUDGETS}
               for k in ("curve", "curve_expected", "curve_paths")}}


def evaluate(drafter, target, cache, trees=DEFAULT_TREES, anchors: str = "stride", max_blocks: int | None = None,
             progress: bool = False, on_prompt=None, replays: dict | None = None) -> dict:
    """Evaluate `drafter` on an opened cache; on_prompt(summary, records) runs after each prompt; `replays` {engine:
    its -auto budget, lookup and price} (walk only) adds "hybrid_auto" and "ddtree_auto", each replayed as it runs."""
    check_mode(anchors, max_blocks)
    trees = parse_trees(trees)
    cfg = drafter.config
    check_inputs(drafter, target, cache)
    head = DraftHead.for_drafter(target, drafter)
    full = (DraftHead(target.lm_head.weight, None, head.scaling)
            if head.vocab_ids is not None and anchors == "stride" and cfg.arch == "dflash" else None)
    B = cfg.block_size
    per_prompt, blocks, hybrid, cuts, auto, dd_auto = [], [], {}, {}, {}, {}
    # walk only: each budget's hybrid, and each engine's hybrid-auto and ddtree-auto
    walks = [(hybrid, str(b), b, None, None, True) for f, b in map(parse_tree_spec, trees) if f == "budget"] + [
        (store, e, r["budget"], r["lookup"], r["price"], ngram) for e, r in (replays or {}).items()
        for store, ngram in ((auto, True), (dd_auto, False))]
    for rec in tqdm(cache, total=len(cache), desc="eval", unit="prompt", disable=not progress, leave=False):
        t0 = time.perf_counter()
        tokens, feats = rec.tokens, rec.features(cfg.target_layer_ids)  # read once: the hybrid replays reuse them
        recs = evaluate_sequence(drafter, head, target.embed, tokens, feats, rec.prompt_len, anchors=anchors,
                                 trees=trees, max_blocks=max_blocks, full_head=full)
        for i, r in enumerate(recs):
            r["prompt"], r["block"], cut = rec.id, i, r.pop("cut", None)
            for key in ("gains", "tokens", "path") if cut and anchors == "walk" else ():  # as rounds: walk only
                cuts.setdefault(key, []).append(cut[key])
        summary = {"id": rec.id, "category": rec.category, "prompt_len": rec.prompt_len, "tokens": int(tokens.shape[0]),
                   "seconds": time.perf_counter() - t0, **aggregate(recs, B, trees)}
        if anchors == "walk":  # and the walks, replayed
            summary["accepted"] = [r["streak"] + 1 for r in recs]
            replay_hybrids(drafter, head, target.embed, tokens, feats, rec.prompt_len, max_blocks, walks)
        per_prompt.append(summary)
        blocks += recs
        if on_prompt is not None:
            on_prompt(summary, recs)
    if not blocks:
        raise DFlashError(f"cache {cache.path}: no block to score: every selected completion has fewer than 2 tokens")
    overall = {**aggregate(blocks, B, trees), "prompts": len(per_prompt), **({"hybrid": hybrid} if hybrid else {}),
               **({"ddtree_cuts": cuts} if cuts else {}),  # each round's budget-32 tree, for -auto's cut per round
               **({"hybrid_auto": auto, "ddtree_auto": dd_auto} if auto else {})}
    if full is not None:  # what an engine reading an export without the token map would accept
        streak = _mean(b["streak_as_exported"] for b in blocks)
        overall["as_exported"] = {"vocabulary": full.size, "streak": streak, "tau": streak + 1}
    category = {p["id"]: p["category"] for p in per_prompt}
    per_category = {c: {**aggregate([b for b in blocks if category[b["prompt"]] == c], B, trees),
                        "prompts": sum(v == c for v in category.values())}
                    for c in dict.fromkeys(category.values()) if c is not None}
    settings = {"anchors": anchors, "block_size": B, "max_blocks": max_blocks, "trees": trees,
                "curve_budgets": list(CURVE_BUDGETS), "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": list(cfg.target_layer_ids),
                "draft_vocab": head.size if head.vocab_ids is not None else None}
    return {"settings": settings, "cache": cache_info(cache), "shortfall": cache.shortfall, "overall": overall,
            "per_category": per_category, "per_prompt": per_prompt, "blocks": blocks}


def check_inputs(drafter, target, cache) -> None:
    """Drafter, target and cache belong together: same target config, the drafter's layers in the cache."""
    check_against_target(drafter.config, target, "drafter config")
    ident = target.identity()
    check_same_target(cache.target, ident, f"cache {cache.path}", "pass the cache's target with --target")
    made_for = (getattr(drafter, "contract", None) or {}).get("target")
    check_same_target(made_for, {**ident, "weights": None}, "the drafter (its dflashkit.json)",  # any format of it
                      "evaluate it with its own target")
    check_feature_layers(drafter.config, list(cache.layer_ids), f"cache {cache.path}")


def cache_info(cache) -> dict:
    """What a run records about its cache: comparisons refuse runs whose hash or prompts differ."""
    sf = cache.shortfall
    return {"path": str(Path(cache.path).resolve()), "manifest_hash": cache.manifest_hash, "target": cache.target,
            "prompt_ids": list(cache.prompt_ids), "requested": sf["requested"] if sf else len(cache.prompt_ids),
            "shortfall": sf}
