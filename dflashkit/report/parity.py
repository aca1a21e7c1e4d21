"""Token parity of two runs' per-request records: per prompt, equal or the first divergence, the text around it and
the target's top-2 margin there (docs/design.md, "Token parity in detail")."""

from __future__ import annotations

from collections import Counter

from dflashkit.report import markdown_table

EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}  # torch.finfo(dtype).eps
CONTEXT = 8  # tokens shown on each side of a divergence
# Between engines, the relative logit gap bench holds our static step to against transformers' float32 forward
ACROSS_ENGINES = 1e-3


def rounding_tolerance(dtype: str | None, logit: float, across_engines: bool = False) -> float:
    """The logit gap rounding in `dtype` can explain: a few ulps of the top logit (ACROSS_ENGINES between engines)."""
    return max(8 * EPS.get(dtype or "float32", EPS["float32"]), ACROSS_ENGINES * across_engines) * max(abs(logit), 1.0)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first new-token index where a and b differ (the shorter's length for a prefix); None when equal."""
    return None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def margin_at(records: tuple[dict, dict], i: int) -> dict | None:
    """The top-2 margin recorded at token i by either run (both ran the same prefix before i)."""
    return next((m for r in records if (m := (r.get("top2") or {}).get(str(i))) is not None), None)


def top2_at(target, record: dict, i: int) -> tuple[float, float]:
    """(top-2 margin, top logit) of the target's logits before new token i of a record's answer, by one forward over
    its turn's prompt and that turn's tokens before i."""
    import torch

    k, start = 0, 0
    for k, n in enumerate(record["turn_tokens"] or [len(record["tokens"])]):
        if i < start + n:
            break
        start += n
    ids = record["prompt_ids"][k] + record["tokens"][start:i]
    with torch.no_grad():
        top = target.forward(torch.tensor([ids], device=target.device), logits_to_keep=1).logits[0, -1].float().topk(2)
    return float(top.values[0] - top.values[1]), float(top.values[0])


def verdict(index: int | None, a: list[int], b: list[int], margin: dict | None, dtype: str | None,
            across_engines: bool = False) -> str:
    """equal | prefix (one stops where the other goes on, same tokens) | numerics | logic | unknown (no logits)."""
    if index is None:
        return "equal"
    if index >= min(len(a), len(b)):
        return "prefix"
    if margin is None:
        return "unknown"
    return "numerics" if abs(margin["margin"]) <= rounding_tolerance(dtype, margin["logit"], across_engines) else "logic"


def around(a: list[int], b: list[int], i: int, decode=None) -> dict:
    """The tokens (and, with `decode`, the text) before token i, which both share, and from i on in each run."""
    part = {"before": a[max(0, i - CONTEXT):i], "a": a[i:i + CONTEXT], "b": b[i:i + CONTEXT]}
    return part if decode is None else part | {f"{k}_text": decode(v) for k, v in part.items()}


def looser(*dtypes: str | None) -> str | None:
    """Of two runs' dtypes, the one whose rounding explains more (bf16 against float32: bf16)."""
    return max((d for d in dtypes if d), key=lambda d: EPS.get(d, EPS["float32"]), default=None)


def compare_pair(ra: dict, rb: dict, decode=None) -> dict:
    a, b = ra["tokens"], rb["tokens"]
    i = first_divergence(a, b)
    m = margin_at((ra, rb), i) if i is not None else None
    across = ra.get("engine", "dflashkit") != rb.get("engine", "dflashkit")
    out = {"prompt": ra["prompt"], "a": ra["method"], "b": rb["method"], "equal": i is None, "index": i, "margin": m,
           "lengths": [len(a), len(b)], "verdict": verdict(i, a, b, m, looser(ra.get("dtype"), rb.get("dtype")), across)}
    if i is not None:
        out["tokens"] = [a[i] if i < len(a) else None, b[i] if i < len(b) else None]
        out["context"] = around(a, b, i, decode)
    return out


def parity(a: list[dict], b: list[dict], decode=None) -> dict:
    """One method's records of run a against run b, paired by prompt, with counts and the first divergence."""
    by_b = {r["prompt"]: r for r in b}
    rows = [compare_pair(r, by_b[r["prompt"]], decode) for r in a if r["prompt"] in by_b]
    parted = [x for x in rows if not x["equal"]]
    return {"prompts": len(rows), "equal": len(rows) - len(parted), "diverged": len(parted),
            "first": min(parted, key=lambda x: x["index"], default=None),
            "verdicts": dict(Counter(x["verdict"] for x in rows)), "per_prompt": rows}


def describe(x: dict) -> str:
    if x["equal"]:
        return f"{x['prompt']}: equal ({x['lengths'][0]} tokens)"
    line = f"{x['prompt']}: parts at token {x['index']} ({x['verdict']}"
    if x["margin"] is not None:
        line += f", top-2 margin {x['margin']['margin']:.4g}"
    return line + f"; lengths {x['lengths'][0]} and {x['lengths'][1]})"


def brief(p: dict) -> dict:
    """A parity result in a few fields (bench's per-method summary)."""
    first = p["first"]
    return {"against": p.get("against"), "prompts": p["prompts"], "equal": p["equal"], "verdicts": p["verdicts"],
            "first_prompt": first and first["prompt"], "first_index": first and first["index"],
            "margin": first and first["margin"] and first["margin"]["margin"], "verdict": first and first["verdict"]}


VERDICTS = ("equal: the same tokens; prefix: one stops where the other goes on with the same tokens (a shorter "
            "--max-new-tokens, or an engine that leaves the stop token out); numerics: the target's top-2 margin "
            "there is within the dtype's rounding (between two engines, 1e-3 of the logit: a near-tie two kernels may "
            "break either way); logic: a clear margin (a loop committed a token the target does not choose); unknown: "
            "no logits recorded there.")


def parity_markdown(table: dict[str, dict], title: str = "## Parity") -> list[str]:
    """One row per compared pair (label -> parity with its `against`), then each divergence with its text."""
    rows, lines = [], []
    for label, p in table.items():
        b = brief(p)
        rows.append([label, b["against"], f"{b['equal']}/{b['prompts']}",
                     "-" if b["first_index"] is None else f"{b['first_prompt']} @ token {b['first_index']}",
                     b["margin"], b["verdict"] or "equal",
                     ", ".join(f"{k} {v}" for k, v in p["verdicts"].items() if k != "equal") or "-"])
        for x in (x for x in p["per_prompt"] if not x["equal"]):
            c = x["context"]
            text = (f": ...{c['before_text']!r} then {c['a_text']!r} / {c['b_text']!r}" if "a_text" in c
                    else f": ...{c['before']} then {c['a']} / {c['b']}")
            lines.append(f"- {label} vs {b['against']}, {describe(x)}{text}")
    heads = ["method", "against", "equal", "first divergence", "top-2 margin", "verdict", "divergences"]
    return [title, "", "Per prompt: equal, or the first new token where the outputs part (by the index of the token "
            "in the answer). " + VERDICTS, "", markdown_table(heads, rows, digits=4), *lines, ""]
