"""`dflashkit bench`: every decoding method on the same prompts in one process, with the gap to the bound.

Methods run after a warm-up, in an order rotated per prompt so that no method always runs first (caches,
allocator, CPU frequency). Per method: tau, the accepted-length histogram, tokens/s, speedup against plain
decoding (ar) and against transformers' prompt lookup, where the time goes (draft / verify / other), and the
ceiling tau * t_ar / (t_draft + t_verify): the decode speedup if nothing but the two forwards cost time.
At temperature 0 every output must equal plain decoding token for token; a mismatch fails loudly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflashkit.decode.speculative import DFlashProposer, generate, parse_method
from dflashkit.errors import DFlashError
from dflashkit.fileio import write_json, write_text

DEFAULT_METHODS = "ar,chain,ddtree-4,ddtree-8,ddtree-16,prompt-lookup"


def parse_methods(spec: str) -> list[str]:
    """'ar,chain,ddtree-8' -> list with ar first (it is the baseline and the lossless reference)."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    for m in names:
        try:
            parse_method(m)
        except ValueError as e:
            raise DFlashError(f"--methods: {e}") from None
    if len(set(names)) != len(names):
        raise DFlashError(f"--methods {spec!r} names a method twice; list each once")
    return ["ar"] + [m for m in names if m != "ar"]


def _run(target, proposer, ids, method, max_new_tokens, temperature, seed):
    gen = torch.Generator(device=target.device).manual_seed(seed)
    torch.manual_seed(seed)  # prompt lookup samples from the global generator
    return generate(target, ids, method, proposer, max_new_tokens=max_new_tokens, temperature=temperature, generator=gen)


def run_bench(target, drafter, prompts: list[tuple[str, list[int]]], methods: list[str], max_new_tokens: int = 128,
              block_size: int | None = None, temperature: float = 0.0, seed: int = 0, warmup: bool = True,
              progress: bool = True) -> dict:
    """prompts: (id, prompt token ids). Returns {"config", "methods": {name: summary}, "runs": [...], "mismatches"}."""
    proposer = DFlashProposer(target, drafter, block_size) if drafter is not None else None
    if proposer is None and any(parse_method(m)[0] in ("chain", "ddtree") for m in methods):
        raise DFlashError("chain and ddtree methods need --drafter")
    if warmup:
        for m in methods:
            _run(target, proposer, prompts[0][1], m, min(8, max_new_tokens), temperature, seed)
    runs = []
    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("bench", total=len(prompts) * len(methods))
        for i, (pid, ids) in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for m in order:
                bar.update(task, description=f"{pid} {m}")
                g = _run(target, proposer, ids, m, max_new_tokens, temperature, seed + i)
                runs.append({"prompt": pid, "method": m, "prompt_tokens": len(ids), "tokens": g.tokens,
                             "accepted": g.accepted, "times": g.times})
                bar.advance(task)
    mismatches = check_lossless(runs) if temperature == 0 else []
    B = proposer.block_size if proposer else None
    summary = {m: summarize([r for r in runs if r["method"] == m], B if parse_method(m)[0] in ("chain", "ddtree") else None)
               for m in methods}
    add_ratios(summary)
    return {
        "config": {"target": target.name, "target_identity": target.identity(), "device": str(target.device),
                   "dtype": str(target.dtype).removeprefix("torch."), "block_size": B, "methods": methods,
                   "prompts": [p for p, _ in prompts], "max_new_tokens": max_new_tokens, "temperature": temperature,
                   "seed": seed, "drafter_layers": drafter.config.num_hidden_layers if drafter is not None else None},
        "methods": summary,
        "mismatches": mismatches,
        "runs": runs,
    }


def check_lossless(runs: list[dict]) -> list[dict]:
    """Every output must equal plain decoding's (temperature 0): one entry per differing (prompt, method)."""
    ref = {r["prompt"]: r["tokens"] for r in runs if r["method"] == "ar"}
    bad = []
    for r in runs:
        want = ref[r["prompt"]]
        if r["method"] != "ar" and r["tokens"] != want:
            first = next((j for j, (a, b) in enumerate(zip(r["tokens"], want)) if a != b), min(len(want), len(r["tokens"])))
            bad.append({"prompt": r["prompt"], "method": r["method"], "first_difference": first,
                        "lengths": [len(r["tokens"]), len(want)]})
    return bad


def summarize(runs: list[dict], block_size: int | None = None) -> dict:
    """Totals of one method's runs; `block_size` (speculative methods only) adds the accepted-length histogram."""
    t = {k: sum(r["times"][k] for r in runs) for k in ("prefill", "draft", "verify", "other", "total")}
    tokens = sum(len(r["tokens"]) for r in runs)
    accepted = [a for r in runs for a in r["accepted"]]
    rounds = len(accepted)
    decode = t["total"] - t["prefill"]
    out = {"prompts": len(runs), "new_tokens": tokens, "rounds": rounds, "seconds": t["total"],
           "tokens_per_s": tokens / t["total"] if t["total"] else None,
           "tau": sum(accepted) / rounds if rounds else None, "accepted_hist": None,
           "decode_tokens_per_s": None, "ms_per_round": None, "split": None, "overhead": None}
    if rounds:
        out["ms_per_round"] = {k: 1000 * t[k] / rounds for k in ("draft", "verify", "other")}
        out["ms_per_round"]["total"] = 1000 * decode / rounds
        out["split"] = {k: t[k] / decode for k in ("draft", "verify", "other")} if decode > 0 else None
        out["overhead"] = t["other"] / decode if decode > 0 else None
        out["decode_tokens_per_s"] = sum(len(r["tokens"]) - 1 for r in runs) / decode if decode > 0 else None
        if block_size:
            size = max(block_size, max(accepted))  # a DDTree round never exceeds B; keep every bin anyway
            out["accepted_hist"] = [sum(a == k for a in accepted) / rounds for k in range(1, size + 1)]
    return out


def add_ratios(summary: dict) -> None:
    """Speedups against ar and prompt lookup, and the ceiling tau * t_ar / (t_draft + t_verify)."""
    ar = summary["ar"]
    pl = next((s for m, s in summary.items() if m.startswith("prompt-lookup")), None)
    t_ar = ar["ms_per_round"]["total"] if ar["ms_per_round"] else None
    for m, s in summary.items():
        tps = s["tokens_per_s"]
        s["speedup_vs_ar"] = tps / ar["tokens_per_s"] if tps and ar["tokens_per_s"] else None
        s["speedup_vs_prompt_lookup"] = tps / pl["tokens_per_s"] if tps and pl and pl["tokens_per_s"] else None
        s["decode_speedup_vs_ar"] = (s["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
                                     if s["decode_tokens_per_s"] and ar["decode_tokens_per_s"] else None)
        s["ceiling"] = None
        if s["ms_per_round"] and t_ar and s["tau"]:
            fwd = s["ms_per_round"]["draft"] + s["ms_per_round"]["verify"]
            s["ceiling"] = s["tau"] * t_ar / fwd if fwd else None


def bench_markdown(result: dict) -> str:
    from dflashkit.report import markdown_table

    c = result["config"]
    lines = [f"# Decoding benchmark: {c['target']} on {c['device']} ({c['dtype']})", "",
             f"{len(c['prompts'])} prompts, up to {c['max_new_tokens']} new tokens, temperature {c['temperature']}, "
             f"block size {c['block_size']}; methods run in rotated order per prompt after a warm-up.", ""]
    headers = ["method", "tau", "tokens/s", "speedup vs ar", "vs prompt-lookup", "decode speedup", "ceiling",
               "ms/round draft", "verify", "other", "overhead"]
    rows = []
    for m, s in result["methods"].items():
        r = s["ms_per_round"] or {}
        rows.append([m, s["tau"], s["tokens_per_s"], s["speedup_vs_ar"], s["speedup_vs_prompt_lookup"],
                     s["decode_speedup_vs_ar"], s["ceiling"], r.get("draft"), r.get("verify"), r.get("other"),
                     None if s["overhead"] is None else f"{100 * s['overhead']:.1f}%"])
    lines.append(markdown_table(headers, rows, digits=2))
    lines += ["tau: mean tokens committed per round (accepted drafts + the bonus). decode speedup excludes prefill; "
              "ceiling = tau * t_ar / (t_draft + t_verify), the decode speedup with zero overhead. overhead = time "
              "outside drafter and target forwards / decode time. prompt-lookup is transformers' "
              "`generate(prompt_lookup_num_tokens=...)`, timed end to end.", ""]
    if c["temperature"] == 0:
        if result["mismatches"]:
            lines.append(f"**LOSSLESS CHECK FAILED**: {len(result['mismatches'])} outputs differ from plain decoding:")
            lines += [f"- {x['method']} on {x['prompt']}: first difference at token {x['first_difference']}"
                      for x in result["mismatches"]]
        else:
            lines.append("Lossless check: every output equals plain greedy decoding token for token.")
    else:
        lines.append("Temperature > 0: outputs are samples; the token-for-token check applies at temperature 0 only.")
    return "\n".join(lines) + "\n"


def write_bench(result: dict, out) -> list[Path]:
    """results.json, report.md, speedup.png and accepted.png under `out`."""
    from dflashkit.report import bar_plot, hist_plot

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    write_text(out / "report.md", bench_markdown(result))
    paths = [out / "results.json", out / "report.md"]
    groups = {m: {"end to end": s["speedup_vs_ar"] or 0.0, "decode": s["decode_speedup_vs_ar"] or 0.0,
                  "decode ceiling": s["ceiling"] or 0.0} for m, s in result["methods"].items()}
    paths.append(bar_plot(out / "speedup.png", groups, f"Speedup over plain decoding ({result['config']['target']})",
                          "x plain decoding"))
    hists = {m: s["accepted_hist"] for m, s in result["methods"].items() if s["accepted_hist"]}
    if hists:
        paths.append(hist_plot(out / "accepted.png", hists, "Tokens committed per round", "tokens per round", start=1))
    return paths
