"""Compare two caches layer by layer ("fla vs torch", "fp32 vs bf16"), over the prompts whose tokens are identical in
both: features of other tokens say nothing about a backend, so each skipped prompt is named with the reason."""

from __future__ import annotations

import torch
from tqdm import tqdm

from dflashkit.cache.store import open_cache
from dflashkit.errors import DFlashError
from dflashkit.report import markdown_table
from dflashkit.tree import common_prefix

SETTINGS_SHOWN = ("dtype", "device", "attention", "linear_attention", "max_new_tokens", "enable_thinking",
                  "target_config_hash", "layer_ids")


def layer_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Sums and extremes, in float64, of per-token cosine and element-wise |a-b| for a, b [T, H] of the same tokens."""
    a, b = a.double(), b.double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
    d = (a - b).abs()
    return {"cos_sum": float(cos.sum()), "cos_min": float(cos.min()), "abs_sum": float(d.sum()), "abs_max": float(d.max()),
            "sq_diff": float((d * d).sum()), "sq_a": float((a * a).sum()), "tokens": a.shape[0], "elements": a.numel()}


def diff_caches(a, b, min_cosine: float | None = None, progress: bool = False) -> dict:
    """Per-layer statistics over the prompts both caches hold with identical tokens; "below": layers under min_cosine."""
    ca, cb = open_cache(a), open_cache(b)
    if ca.hidden_size != cb.hidden_size:
        raise DFlashError(f"caches {a} (hidden size {ca.hidden_size}) and {b} (hidden size {cb.hidden_size}) hold "
                          "features of different targets; compare caches of the same target")
    sa, sb = ca.manifest.get("settings", {}), cb.manifest.get("settings", {})
    settings_differ = {k: (sa.get(k), sb.get(k)) for k in SETTINGS_SHOWN if sa.get(k) != sb.get(k)}
    layers = [l for l in ca.layer_ids if l in cb.layer_ids]
    if not layers:
        raise DFlashError(f"caches {a} (layers {ca.layer_ids}) and {b} (layers {cb.layer_ids}) share no layer")
    ids_a, ids_b, H = set(ca.prompt_ids), set(cb.prompt_ids), ca.hidden_size
    skipped, compared, stats = {}, [], {l: [] for l in layers}
    for pid in tqdm([p for p in ca.prompt_ids if p in ids_b], desc="diff", unit="prompt", disable=not progress,
                    leave=False):
        ra, rb = ca.record(pid), cb.record(pid)
        if not torch.equal(ra.tokens, rb.tokens):
            ta, tb = ra.tokens.tolist(), rb.tokens.tolist()
            p = common_prefix(ta, tb)
            skipped[pid] = (f"token sequences differ from position {p} ({ta[p]} vs {tb[p]})" if p < min(len(ta), len(tb))
                            else f"token sequences differ in length ({len(ta)} vs {len(tb)} tokens)")
            continue
        for l, fa, fb in zip(layers, ra.features(layers).split(H, dim=-1), rb.features(layers).split(H, dim=-1)):
            stats[l].append(layer_stats(fa, fb))
        compared.append(pid)
    if not compared:
        why = "; ".join(f"{p}: {r}" for p, r in list(skipped.items())[:5]) or "no prompt id in common"
        raise DFlashError(f"caches {a} and {b} share no prompt with identical tokens ({why}); extract the second one "
                          f"with `--completions-from {a}` so that both hold features of the same tokens")
    per_layer = {}
    for l, ss in stats.items():
        s = {k: sum(x[k] for x in ss) for k in ("cos_sum", "abs_sum", "sq_diff", "sq_a", "tokens", "elements")}
        per_layer[l] = {"cos_mean": s["cos_sum"] / s["tokens"], "cos_min": min(x["cos_min"] for x in ss),
                        "mean_abs": s["abs_sum"] / s["elements"], "max_abs": max(x["abs_max"] for x in ss),
                        "rel_err": (s["sq_diff"] / max(s["sq_a"], 1e-300)) ** 0.5, "tokens": s["tokens"]}
    below = [] if min_cosine is None else [l for l in layers if per_layer[l]["cos_min"] < min_cosine]
    return {"a": str(a), "b": str(b), "settings_differ": settings_differ, "layers": per_layer, "compared": compared,
            "skipped": skipped, "only_in_a": [p for p in ca.prompt_ids if p not in ids_b],
            "only_in_b": [p for p in cb.prompt_ids if p not in ids_a],
            "layers_only_in_a": [l for l in ca.layer_ids if l not in layers],
            "layers_only_in_b": [l for l in cb.layer_ids if l not in layers], "min_cosine": min_cosine, "below": below}


def format_diff(r: dict) -> str:
    differ = "; ".join(f"{k} {va!r} vs {vb!r}" for k, (va, vb) in r["settings_differ"].items())
    ntok = next(iter(r["layers"].values()))["tokens"]
    lines = [f"# cache diff: {r['a']} vs {r['b']}", "", f"settings that differ: {differ or 'none recorded'}",
             f"compared {len(r['compared'])} prompts, {ntok} tokens per layer"]
    for label, ids in (("skipped", r["skipped"]), ("only in A", r["only_in_a"]), ("only in B", r["only_in_b"])):
        if ids:
            body = "; ".join(f"{p} ({why})" for p, why in ids.items()) if isinstance(ids, dict) else ", ".join(ids)
            lines.append(f"{label} ({len(ids)}): {body}")
    lines += [f"{label}: {ls}" for label, ls in (("layers only in A", r["layers_only_in_a"]),
                                                 ("layers only in B", r["layers_only_in_b"])) if ls]
    rows = [[l, f"{s['cos_mean']:.6f}", f"{s['cos_min']:.6f}", f"{s['mean_abs']:.3e}", f"{s['max_abs']:.3e}",
             f"{s['rel_err']:.3e}"] for l, s in r["layers"].items()]
    lines += ["", markdown_table(["layer", "cos mean", "cos min", "mean |a-b|", "max |a-b|", "rel err"], rows),
              "rel err = ||A - B|| / ||A|| over all compared tokens; cosine per token."]
    if r["min_cosine"] is not None:
        lines.append(f"FAIL: layers {r['below']} have a token with cosine below {r['min_cosine']}" if r["below"]
                     else f"PASS: every token's cosine >= {r['min_cosine']} on every layer")
    return "\n".join(lines) + "\n"
