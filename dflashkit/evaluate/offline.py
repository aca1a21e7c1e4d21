"""Offline evaluation of a drafter on cached target states (docs/design.md section 6).

For an anchor position a in the completion: context = target features of positions < a, block =
[token_a, MASK x (B-1)] at positions a..a+B-1, labels = tokens a+1..a+B-1 (-100 past the end). A block is
scored by its greedy `streak` (leading slots whose argmax equals the label; tau = streak + 1 online) and by
one accepted depth per requested draft-tree family (dflashkit/tree.py): `budget:B` (the paper's DDTree, shown as
ddsB), `paths:K` and `width:K`.

Anchor schedules: `stride` (a = prompt_len, prompt_len + B, ...: the same blocks for every drafter, so runs
compare) and `walk` (next anchor = a + streak + 1: online chain decoding at T=0 when the cache holds the
target's own greedy output). Stride puts all blocks of a prompt through ONE `drafter.forward_blocks` call
(block j sees context < anchor_j and its own block); walk depends on each result, so it runs block after
block with the drafter's context KV, exactly as the online loop drafts.
"""

from __future__ import annotations

import time

import torch

from dflashkit.drafter.head import LOGIT_ELEMENTS
from dflashkit.errors import DFlashError
from dflashkit.tree import (accepted_path, build_tree_topk, parse_tree_spec, paths_streak, top_logprobs,
                                       width_streak)

ANCHOR_MODES = ("stride", "walk")
DEFAULT_TREES = ("budget:4", "budget:8")
CURVE_BUDGETS = (1, 2, 4, 8, 16, 32)  # the DDTree budget curve in every run
BLOCKS_PER_CALL = 128  # bounds the attention scores of very long sequences; coding completions fit in one call


# ---- settings -----------------------------------------------------------------------------------------------

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
        name = f"{family}:{k}"
        if name not in out:
            out.append(name)
    return out


def tree_label(spec: str) -> str:
    """Console name: budget:8 -> dds8 (the user's DDTree-8), paths:4 -> paths4, width:4 -> width4."""
    family, k = parse_tree_spec(spec)
    return {"budget": f"dds{k}", "selector": f"sel{k}"}.get(family, f"{family}{k}")


def tree_note(trees) -> str:
    """The header line that says what each tree column means."""
    budgets = [t for t in trees if t.startswith("budget:")]
    parts = []
    if budgets:
        parts.append(f"{'/'.join(tree_label(t) for t in budgets)} = DDTree {'/'.join(budgets)} (paper's node-budget tree)")
    for t in trees:
        family, k = parse_tree_spec(t)
        if family == "paths":
            parts.append(f"{tree_label(t)} = best of the {k} most probable complete drafts")
        elif family == "width":
            parts.append(f"{tree_label(t)} = leading positions whose label is in the top-{k} (an upper bound)")
        elif family == "selector":
            parts.append(f"{tree_label(t)} = DDTree of {k} nodes scored by the DFlash2 selector given each parent")
    return "; ".join(parts) or "no trees requested"


def check_mode(anchors: str, max_blocks) -> None:
    if anchors not in ANCHOR_MODES:
        raise DFlashError(f"--anchors {anchors!r}: use one of {', '.join(ANCHOR_MODES)}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or int(max_blocks) < 1):
        raise DFlashError(f"--max-blocks {max_blocks!r}: must be a positive number of blocks per prompt (or omitted for all)")


def stride_anchors(prompt_len: int, num_tokens: int, block_size: int, max_blocks: int | None = None) -> list[int]:
    """a = prompt_len, prompt_len + B, ... while a + 1 is still a completion position (a <= T - 2)."""
    out = list(range(prompt_len, num_tokens - 1, block_size))
    return out if max_blocks is None else out[:max_blocks]


# ---- one sequence -------------------------------------------------------------------------------------------

def _labels(tokens, anchors: list[int], B: int) -> torch.Tensor:
    """[n, B-1] target ids a+1..a+B-1 per anchor, -100 past the end of the sequence."""
    T = tokens.shape[0]
    pos = torch.tensor(anchors, device=tokens.device)[:, None] + torch.arange(1, B, device=tokens.device)
    return torch.where(pos < T, tokens[pos.clamp(max=T - 1)], torch.full_like(pos, -100))


def block_embeddings(embed_tokens, tokens, anchors: list[int], B: int, mask_id: int, dtype) -> torch.Tensor:
    """block_embeds [n*B, H]: embeddings of each block, the anchor token then B-1 mask tokens."""
    ids = torch.full((len(anchors), B), mask_id, dtype=torch.long, device=tokens.device)
    ids[:, 0] = tokens[torch.tensor(anchors, device=tokens.device)]
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
    """hit [L] argmax == label; lp / idx: the top log-probs and indices per position (lists [L][k]).

    Every budget comes from ONE best-first tree of the largest budget: the heap pops prefixes in score order,
    so the budget-b tree is its first b nodes, and its accepted depth counts the accepted path's nodes <= b.
    """
    n_labels = int((labels != -100).sum())
    budgets = _budgets(trees)
    tree = build_tree_topk(lp, idx, budgets[-1])
    path = accepted_path(tree, label_index)
    probs = tree.log_probs.double().exp()
    curve = {b: sum(1 for node in path if node <= b) for b in budgets}
    expected = {b: probs[1 : b + 1].sum().item() for b in budgets}
    out_trees, out_expected = {}, {}
    for spec in trees:
        family, k = parse_tree_spec(spec)
        if family == "budget":
            out_trees[spec], out_expected[spec] = curve[k], expected[k]
        elif family == "paths":
            out_trees[spec] = paths_streak(logits, label_index, k)
        elif family == "selector":
            out_trees[spec] = selector_curve[k]
        else:
            out_trees[spec] = int(width_streak(logits, label_index, k))
    return {
        "n_labels": n_labels,
        "streak": int(hit.long().cumprod(0).sum()),
        "matches": hit[:n_labels].int().tolist(),
        "trees": out_trees,
        "expected": out_expected,
        "curve": {str(b): curve[b] for b in CURVE_BUDGETS},
        "curve_expected": {str(b): expected[b] for b in CURVE_BUDGETS},
    }


def _score_blocks(head, hidden: torch.Tensor, tokens, anchors: list[int], B: int, trees: list[str],
                  selector=None) -> list[dict]:
    """hidden [n, B-1, H] drafter states of the draft slots. Vocabulary logits in chunks of blocks; argmax and
    top-k once per chunk (few large ops instead of several small ones per block). selector: DFlash2's; its greedy
    path (each position reranked given its own previous choice, as at inference) is the draft that streak and
    per-position acceptance score, while DDTree budgets read the marginal logits."""
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
        lp, idx = top_logprobs(logits, k)
        lp, idx = lp.tolist(), idx.tolist()
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


def _check_sequence(drafter, tokens, features, prompt_len: int) -> None:
    cfg = drafter.config
    if tokens.dim() != 1:
        raise DFlashError(f"tokens must be a 1-D sequence [T], got shape {list(tokens.shape)}")
    width = cfg.num_features * cfg.hidden_size
    if features.dim() != 2 or features.shape[0] != tokens.shape[0]:
        raise DFlashError(f"features must be [T={tokens.shape[0]}, {width}] (one row per token), got {list(features.shape)}")
    if features.shape[1] != width:
        raise DFlashError(
            f"features have width {features.shape[1]} but the drafter's fc expects {width} = {cfg.num_features} target layers "
            f"{cfg.target_layer_ids} x hidden {cfg.hidden_size}; read the cache with the drafter's layer ids"
        )
    if not 0 <= prompt_len <= tokens.shape[0]:
        raise DFlashError(f"prompt_len {prompt_len} is outside the sequence of {tokens.shape[0]} tokens")


@torch.no_grad()
def evaluate_sequence(drafter, head, embed_tokens, tokens: torch.Tensor, features: torch.Tensor, prompt_len: int,
                      anchors: str = "stride", trees=DEFAULT_TREES, max_blocks: int | None = None) -> list[dict]:
    """Score the blocks of one sequence.

    tokens [T] prompt + completion ids; features [T, K*H] target features of every position, in the drafter's
    layer order; head: a DraftHead (drafter logits, optional draft vocabulary); embed_tokens: the target's.
    Returns one record per block, in anchor order: anchor, n_labels, streak, matches (per position 0/1),
    trees / expected (per requested tree), curve / curve_expected (per CURVE_BUDGETS budget).
    """
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
            anchor_t = torch.tensor(a, device=p.device)[None]
            h = drafter.forward_blocks(feats[None, : a[-1]], block_embeds[None], anchor_t)  # context < last anchor suffices
            out += _score_blocks(head, h[0].view(len(a), B, -1)[:, 1:], tokens, a, B, trees, selector)
        return out
    # walk: each anchor follows from the previous streak; the context KV takes only the new positions
    context_kv = drafter.new_context_kv()
    out, done, a = [], 0, prompt_len
    while a <= T - 2 and (max_blocks is None or len(out) < max_blocks):
        block_embeds = block_embeddings(embed, tokens, [a], B, cfg.mask_token_id, p.dtype)
        pos = torch.arange(done, a + B, device=p.device)[None]  # new context positions, then the block
        h = drafter(feats[None, done:a], block_embeds[None], pos, past_key_values=context_kv, use_cache=True)
        done = a
        rec = _score_blocks(head, h[:, 1:], tokens, [a], B, trees, selector)[0]
        out.append(rec)
        a += rec["streak"] + 1
    return out


# ---- aggregates ---------------------------------------------------------------------------------------------

def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def aggregate(blocks: list[dict], block_size: int, trees) -> dict:
    """Block-weighted means. acc_cumulative[k-1] = P(streak >= k) and acc_conditional[k-1] =
    P(match at k | streak >= k-1), both over blocks that have a label at position k."""
    L = block_size - 1
    trees = parse_trees(trees)
    n = len(blocks)
    cum, cond = [], []
    for k in range(1, L + 1):
        have = [b for b in blocks if b["n_labels"] >= k]
        cum.append(_mean(b["streak"] >= k for b in have))
        cond.append(_mean(b["matches"][k - 1] for b in have if b["streak"] >= k - 1))
    counts = [sum(1 for b in blocks if b["streak"] == s) for s in range(L + 1)]
    streak = _mean(b["streak"] for b in blocks)
    return {
        "blocks": n,
        "streak": streak,
        "tau": None if streak is None else streak + 1,
        "pos1_acc": cum[0] if L else None,
        **{t: _mean(b["trees"][t] for b in blocks) for t in trees},
        "expected": {t: _mean(b["expected"][t] for b in blocks) for t in trees if t.startswith("budget:")},
        "acc_cumulative": cum,
        "acc_conditional": cond,
        "histogram": [c / n for c in counts] if n else [],
        "histogram_counts": counts,
        "budget_curve": {str(b): _mean(x["curve"][str(b)] for x in blocks) for b in CURVE_BUDGETS},
        "budget_curve_expected": {str(b): _mean(x["curve_expected"][str(b)] for x in blocks) for b in CURVE_BUDGETS},
    }


# ---- a cache ------------------------------------------------------------------------------------------------

def evaluate(drafter, target, cache, trees=DEFAULT_TREES, anchors: str = "stride", max_blocks: int | None = None,
             progress: bool = False, on_prompt=None) -> dict:
    """Evaluate `drafter` on every selected prompt of an opened cache (dflashkit.cache.open_cache).

    Returns {"settings", "cache", "shortfall", "overall", "per_prompt", "blocks"}; overall holds streak, tau,
    pos1_acc, one mean per tree spec (e.g. "budget:8"), "expected", per-position accuracies, histogram, budget
    curve, blocks and prompts.
    For walk, each per-prompt entry also lists "accepted": tau per round (accepted drafts + 1), like online decoding.
    on_prompt(prompt_summary, block_records) is called after each prompt (console lines).
    """
    from tqdm import tqdm

    from dflashkit.drafter.head import DraftHead

    check_mode(anchors, max_blocks)
    trees = parse_trees(trees)
    cfg = drafter.config
    check_inputs(drafter, target, cache)
    head = DraftHead.for_drafter(target, drafter)
    B = cfg.block_size
    per_prompt, blocks = [], []
    for rec in tqdm(cache, total=len(cache), desc="eval", unit="prompt", disable=not progress, leave=False):
        t0 = time.perf_counter()
        tokens = rec.tokens
        recs = evaluate_sequence(drafter, head, target.embed_tokens, tokens, rec.features(cfg.target_layer_ids),
                                 rec.prompt_len, anchors=anchors, trees=trees, max_blocks=max_blocks)
        for i, r in enumerate(recs):
            r["prompt"], r["block"] = rec.id, i
        summary = {"id": rec.id, "prompt_len": rec.prompt_len, "tokens": int(tokens.shape[0]),
                   "seconds": time.perf_counter() - t0, **aggregate(recs, B, trees)}
        if anchors == "walk":
            summary["accepted"] = [r["streak"] + 1 for r in recs]
        per_prompt.append(summary)
        blocks += recs
        if on_prompt is not None:
            on_prompt(summary, recs)
    if not blocks:
        raise DFlashError(f"cache {cache.path}: no block to score: every selected completion has fewer than 2 tokens")
    overall = {**aggregate(blocks, B, trees), "prompts": len(per_prompt)}
    settings = {
        "anchors": anchors,
        "block_size": B,
        "max_blocks": max_blocks,
        "trees": trees,
        "curve_budgets": list(CURVE_BUDGETS),
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "draft_vocab": head.size if head.vocab_ids is not None else None,
    }
    return {"settings": settings, "cache": cache_info(cache), "shortfall": cache.shortfall, "overall": overall,
            "per_prompt": per_prompt, "blocks": blocks}


def check_inputs(drafter, target, cache) -> None:
    """Drafter, target and cache belong together: same target config, the drafter's layers in the cache."""
    from dflashkit.drafter.checkpoint import check_against_target, check_feature_layers

    check_against_target(drafter.config, target, "drafter config")
    ident = target.identity()
    have = cache.target or {}
    for key in ("config_hash", "hidden_size", "num_layers"):
        if have.get(key) is not None and have.get(key) != ident.get(key):
            raise DFlashError(f"cache {cache.path} was extracted from target {have.get('name')} ({key} {have.get(key)}) but the "
                              f"target in use is {ident['name']} ({key} {ident.get(key)}); pass the cache's target with --target")
    made_for = (getattr(drafter, "contract", None) or {}).get("target") or {}
    if made_for.get("config_hash") and made_for["config_hash"] != ident["config_hash"]:
        raise DFlashError(f"the drafter's dflashkit.json records target {made_for.get('name')} (config {made_for['config_hash']}) "
                          f"but the target in use is {ident['name']} (config {ident['config_hash']}); evaluate it with its own target")
    check_feature_layers(drafter.config, list(cache.layer_ids), f"cache {cache.path}")


def cache_info(cache) -> dict:
    """What a run records about its cache: comparisons refuse runs whose hash or prompts differ."""
    from pathlib import Path

    sf = cache.shortfall
    return {"path": str(Path(cache.path).resolve()), "manifest_hash": cache.manifest_hash, "target": cache.target,
            "prompt_ids": list(cache.prompt_ids), "requested": sf["requested"] if sf else len(cache.prompt_ids),
            "shortfall": sf}


# ---- console and run folder ---------------------------------------------------------------------------------

def _f(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def prompt_line(summary: dict, trees, width: int = 24) -> str:
    """`fizzbuzz | 15 blocks | streak=0.47 dds4=0.60 dds8=0.80 | 8.7s` (the user's log format)."""
    metrics = " ".join([f"streak={_f(summary['streak'])}"] + [f"{tree_label(t)}={_f(summary.get(t))}" for t in trees])
    return f"{summary['id']:<{width}} | {summary['blocks']:3d} blocks | {metrics} | {summary['seconds']:.1f}s"


def match_line(block: dict, block_size: int, trees) -> str:
    """`    match: ✓✓✓✗✗...  streak=3` (· = no label: the sequence ended)."""
    marks = "".join("✓" if m else "✗" for m in block["matches"]) + "·" * (block_size - 1 - block["n_labels"])
    extra = " ".join(f"{tree_label(t)}={block['trees'][t]}" for t in trees)
    return f"    match: {marks}  streak={block['streak']}  {extra}  @{block['anchor']}".rstrip()


def overall_lines(result: dict) -> list[str]:
    o, s = result["overall"], result["settings"]
    trees = s["trees"]
    parts = [f"streak={_f(o['streak'])}", f"tau={_f(o['tau'])}", f"pos1={_f(o['pos1_acc'])}"]
    for t in trees:
        exp = o["expected"].get(t)
        parts.append(f"{tree_label(t)}={_f(o[t])}" + (f" (expected {_f(exp)})" if exp is not None else ""))
    lines = [f"overall: {o['prompts']} prompts, {o['blocks']} blocks ({s['anchors']} anchors) | " + " ".join(parts)]
    lines.append("per-position acc (cumulative P(streak>=k)): " + " ".join(_f(v) for v in o["acc_cumulative"]))
    lines.append("per-position acc (conditional P(k | k-1)):  " + " ".join(_f(v) for v in o["acc_conditional"]))
    lines.append("streak histogram: " + " ".join(f"{k}:{v:.0%}" for k, v in enumerate(o["histogram"]) if v))
    lines.append("DDTree budget curve (mean accepted depth / drafter-expected): " + " ".join(
        f"{b}:{_f(o['budget_curve'][b])}/{_f(o['budget_curve_expected'][b])}" for b in o["budget_curve"]))
    return lines


def summary_markdown(result: dict, header: list[str]) -> str:
    from dflashkit.report import markdown_table

    s, o = result["settings"], result["overall"]
    trees = s["trees"]
    heads = ["prompt", "blocks", "streak", "tau", "pos1"] + [tree_label(t) for t in trees]
    rows = [[p["id"], p["blocks"], p["streak"], p["tau"], p["pos1_acc"]] + [p.get(t) for t in trees]
            for p in result["per_prompt"]]
    rows.append(["**overall**", o["blocks"], o["streak"], o["tau"], o["pos1_acc"]] + [o[t] for t in trees])
    md = ["# Offline evaluation", "", "```", *header, "```", "", markdown_table(heads, rows), ""]
    md.append("Means are over blocks. streak = leading draft tokens equal to the target's (bonus excluded; tau = streak + 1).")
    md.append(f"Trees: {tree_note(trees)}.")
    exp = [f"{tree_label(t)} {_f(o['expected'][t])}" for t in trees if t in o["expected"]]
    if exp:
        md.append(f"Drafter-expected accepted depth (sum of tree-node probabilities): {', '.join(exp)}.")
    if result.get("shortfall"):
        sf = result["shortfall"]
        md.append(f"\n**Partial: {sf['present']} of {sf['requested']} requested prompts** (missing: {', '.join(sf['missing'])}).")
    md += ["", "## Per-position accuracy", "",
           markdown_table(["position", "cumulative P(streak>=k)", "conditional P(k given k-1)"],
                          [[k + 1, c, d] for k, (c, d) in enumerate(zip(o["acc_cumulative"], o["acc_conditional"]))]),
           "## DDTree budget curve", "",
           markdown_table(["budget", "accepted depth", "drafter-expected"],
                          [[b, o["budget_curve"][b], o["budget_curve_expected"][b]] for b in o["budget_curve"]]),
           "![acceptance](acceptance.png) ![streak histogram](streak_hist.png) ![budget curve](budget_curve.png)", ""]
    return "\n".join(md)


def write_plots(out_dir, results: dict[str, dict]) -> list[str]:
    """Per-position acceptance, streak histogram and DDTree budget curve; one series per named result."""
    from pathlib import Path

    from dflashkit.report import hist_plot, line_plot

    out = Path(out_dir)
    acc = {}
    for name, r in results.items():
        o = r["overall"]
        k = list(range(1, len(o["acc_cumulative"]) + 1))
        sfx = f" {name}" if len(results) > 1 else ""
        acc[f"cumulative{sfx}"] = (k, [v or 0.0 for v in o["acc_cumulative"]])
        acc[f"conditional{sfx}"] = (k, [v or 0.0 for v in o["acc_conditional"]])
    line_plot(out / "acceptance.png", acc, "Per-position acceptance", "draft position k", "accuracy", ylim=(0, 1.02))
    hist_plot(out / "streak_hist.png", {n: r["overall"]["histogram"] for n, r in results.items()},
              "Streak histogram (leading accepted drafts)", "streak")
    curve = {}
    for name, r in results.items():
        o = r["overall"]
        b = [int(x) for x in o["budget_curve"]]
        sfx = f" {name}" if len(results) > 1 else ""
        curve[f"measured{sfx}"] = (b, list(o["budget_curve"].values()))
        curve[f"drafter-expected{sfx}"] = (b, list(o["budget_curve_expected"].values()))
    line_plot(out / "budget_curve.png", curve, "DDTree budget curve", "node budget", "mean accepted depth")
    return ["acceptance.png", "streak_hist.png", "budget_curve.png"]


def header_lines(drafter_info: dict, load_report: list[str], target_ident: dict, cache_info: dict, settings: dict,
                 blocks: int | None) -> list[str]:
    """What was evaluated, stated so that nobody mistakes a partial run for a full one."""
    sf = cache_info.get("shortfall")
    n = len(cache_info["prompt_ids"])
    if sf:
        prompts = f"PARTIAL: {n} of {sf['requested']} requested prompts (missing: {', '.join(sf['missing'])})"
    else:
        prompts = f"{n} prompts (all {cache_info['requested']} requested)"
    per = "all" if settings["max_blocks"] is None else settings["max_blocks"]
    count = f"{blocks} blocks" if blocks is not None else "one block per walk round"
    vocab = f", draft vocabulary {settings['draft_vocab']} tokens" if settings.get("draft_vocab") else ""
    return [
        f"drafter  {drafter_info['path']}  (model.safetensors sha256 {drafter_info['sha256'][:12]})",
        *[f"  {line}" for line in load_report],
        f"target   {target_ident['name']}  {target_ident['path']}",
        f"cache    {cache_info['path']}  (manifest {cache_info['manifest_hash'][:12]})",
        f"prompts  {prompts}",
        f"blocks   {count}: block_size={settings['block_size']}, max_blocks_per_seq={per}, anchors={settings['anchors']}{vocab}",
        f"trees    {tree_note(settings['trees'])}",
    ]


def save_run(run_dir, result: dict, log_lines: list[str], drafter_path):
    """Write the run folder atomically: results.json, summary.md, eval.log, plots, and a `drafter` symlink
    to the checkpoint (a reference, not a copy; results.json holds its path and sha256)."""
    import os
    from pathlib import Path

    from dflashkit.fileio import atomic_dir, write_json, write_text

    run_dir = Path(run_dir)
    with atomic_dir(run_dir) as tmp:
        write_json(tmp / "results.json", result)
        write_text(tmp / "summary.md", summary_markdown(result, result.get("header", [])))
        write_text(tmp / "eval.log", "\n".join(log_lines) + "\n")
        write_plots(tmp, {"run": result})
        try:
            os.symlink(Path(drafter_path).resolve(), tmp / "drafter", target_is_directory=True)
        except OSError:
            write_text(tmp / "drafter.txt", f"{Path(drafter_path).resolve()}\n")
    return run_dir


def run_eval(drafter_path, target, cache, run_dir, anchors: str = "stride", trees=DEFAULT_TREES,
             max_blocks: int | None = None, show_matches: bool = False, progress: bool = True, say=print) -> dict:
    """Evaluate a checkpoint on an opened cache and write its run folder: what `dflashkit eval` does."""
    import time
    from pathlib import Path

    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.fileio import sha256_file

    trees = parse_trees(trees)
    check_mode(anchors, max_blocks)
    ckpt = Path(drafter_path)
    drafter = load_drafter(ckpt, target=target, device=target.device)
    drafter_info = {"path": str(ckpt.resolve()), "sha256": sha256_file(ckpt / "model.safetensors"),
                    "load_report": list(drafter.load_report), "config": drafter.config.to_dict(),
                    "contract": drafter.contract}
    info = cache_info(cache)
    B = drafter.config.block_size
    settings = {"anchors": anchors, "block_size": B, "max_blocks": max_blocks, "trees": trees}
    blocks = None
    if anchors == "stride":
        blocks = sum(len(stride_anchors(r.prompt_len, len(r.tokens), B, max_blocks)) for r in cache)
    log: list[str] = []

    def out(line: str = "") -> None:
        say(line)
        log.append(line)

    for line in header_lines(drafter_info, drafter.load_report, target.identity(), info, settings, blocks):
        out(line)
    width = max((len(p) for p in cache.prompt_ids), default=8)

    def on_prompt(summary, recs):
        if show_matches:
            for r in recs:
                out(match_line(r, B, trees))
        out(prompt_line(summary, trees, width))

    t0 = time.perf_counter()
    result = evaluate(drafter, target, cache, trees=trees, anchors=anchors, max_blocks=max_blocks,
                      progress=progress, on_prompt=on_prompt)
    for line in overall_lines(result):
        out(line)
    out(f"evaluated in {time.perf_counter() - t0:.1f}s; run folder {run_dir}")
    header = header_lines(drafter_info, drafter.load_report, target.identity(), info, result["settings"],
                          result["overall"]["blocks"])
    result = {"format": "dflashkit-eval/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "header": header,
              "drafter": drafter_info, "target": target.identity(), **result}
    save_run(run_dir, result, log, ckpt)
    return result
