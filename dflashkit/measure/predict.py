"""Predicted decoding speed: an acceptance (an offline eval's, or a decode's own rounds) priced on an engine's cost
model (docs/decoding.md, "Predicting an engine's speed before serving")."""

from __future__ import annotations

import math

from dflashkit.decode.methods import AUTO_BUDGET, PEERS
from dflashkit.decode.speculative import new_lookup
from dflashkit.errors import DFlashError
from dflashkit.measure.costmodel import cost_model, in_window
from dflashkit.report import fmt, markdown_table, scatter_against_measured
from dflashkit.tree import best_cut

ERROR_BAR = 0.10  # |predicted - measured| / measured the prediction is held to


def _row(tokens: float, draft: float, verify: float, overhead: float, **extra) -> dict:
    total = draft + verify + overhead
    tps = 1000 * tokens / total if math.isfinite(total) and total > 0 else None
    return {"tokens_per_round": tokens, "ms_per_round": {"draft": draft, "verify": verify, "overhead": overhead,
            "total": total}, "tokens_per_s": tps, **extra}


def plain(model) -> dict:
    return _row(1.0, 0.0, model.forward(1), model.overhead("ar"), width=1)


def _draft_ms(model) -> float:
    if model.draft_ms is None:
        raise DFlashError(f"cost model {model.path or model.engine}: measured without a drafter (field 'draft_ms' is "
                          "null); measure it with the drafter: `dflashkit cost --drafter DIR --force`")
    return float(model.draft_ms)


def predict_offline(acceptance: dict, model, only: str | None = None) -> dict:
    """{method: predicted row} for ar, chain, every ddtree-b and hybrid-b of `acceptance` (offline_acceptance's) and
    their -auto; `only`: the one method a caller reads (the others' per-round replays are skipped)."""
    for field in ("block_size", "chain", "ddtree"):
        if field not in acceptance:
            raise DFlashError(f"acceptance: field {field!r} is missing (an eval results.json's 'overall' gives it)")
    draft, base, B = _draft_ms(model), plain(model), int(acceptance["block_size"])
    chain = 1.0 + sum(p for p in acceptance["chain"] if p is not None)  # the bonus + each draft reached and kept
    out = {"ar": base, "chain": _row(chain, draft, model.forward(B), model.overhead("chain"), width=B)}
    paths = acceptance.get("paths", {}) if model.paths else {}  # a branching tree's tokens, one path a row
    verify = lambda b: model.forward_paths(paths[b]) if b in paths else math.inf if model.paths else model.forward(b + 1)
    why = {"why": "the eval has no path tokens (overall.budget_curve_paths, one path a row here): rerun dflashkit eval"}
    depths = sorted((int(b), d) for b, d in acceptance["ddtree"].items() if d is not None)
    trees = {f"ddtree-{b}": _row(1.0 + d, draft, verify(b), model.overhead("tree"), width=paths.get(b, b + 1),
                                 **(why if model.paths and b not in paths else {})) for b, d in depths}
    hybrids = {f"hybrid-{b}": _replayed(h, [True] * len(h["accepted"]), model)
               for b, h in acceptance.get("hybrid", {}).items()}
    for kind, rows in (("ddtree", trees), ("hybrid", hybrids)):
        out.update(rows)
        if paying := [(r["tokens_per_s"], m) for m, r in rows.items() if r["tokens_per_s"]]:
            out[f"{kind}-auto"] = {**rows[max(paying)[1]], "budget": int(max(paying)[1].split("-")[1])}
    if only in (None, "ddtree-auto") and (dd := (acceptance.get("ddtree_auto") or {}).get(model.engine)):
        out["ddtree-auto"] = {**_replayed(dd, dd["drafted"], model), "budget": "replayed per round"}  # gate included
    elif acceptance.get("cuts") and only in (None, "ddtree-auto"):  # each round's tree cut as decoding cuts it
        out["ddtree-auto"] = replay_cuts(acceptance["cuts"], model, draft)
    if only in (None, "hybrid-auto") and (auto := (acceptance.get("hybrid_auto") or {}).get(model.engine)):
        out["hybrid-auto"] = {**_replayed(auto, auto["drafted"], model), "budget": "replayed per round"}
    for r in out.values():
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if r["tokens_per_s"] and base["tokens_per_s"] else None
    return out


def _replayed(rounds: dict, drafted: list[bool], model) -> dict:
    """A tree walk's replayed rounds ("accepted" depths, "nodes", "path_tokens") priced by the model."""
    widths = rounds["path_tokens" if model.paths else "nodes"]
    return predict_rounds([d + 1 for d in rounds["accepted"]], widths, drafted, model, "tree")


def replay_cuts(cuts: dict, model, draft: float) -> dict:
    """ddtree-auto over the walk's `cuts`: each round's tree cut where decoding cuts it here, accepted nodes inside."""
    fixed, flat, accepted, widths = draft + model.overhead("tree"), not model.paths, [], []
    for gains, tokens, path in zip(cuts["gains"], cuts["tokens"], cuts["path"]):
        n = best_cut(gains, tokens, model.forward, fixed, None if flat else model.forward_paths)
        accepted.append(1 + sum(r <= n for r in path))
        widths.append(n + 1 if flat or n == 0 else tokens[n])
    return {**predict_rounds(accepted, widths, [True] * len(accepted), model, "tree"), "budget": "cut per round"}


def hybrid_replay(model) -> dict:
    """What the offline walk (evaluate/offline.py, hybrid_walk) needs to replay -auto as decoding runs it here."""
    return {"budget": AUTO_BUDGET, "lookup": new_lookup("hybrid-auto"), "price": {
        "cost": model.forward, "path_cost": model.forward_paths if model.paths else None, "draft": _draft_ms(model),
        "fixed": model.overhead("tree")}}


def offline_acceptance(overall: dict, block_size: int, source: str = "offline eval") -> dict:
    """An eval's `overall` (evaluate/offline.py) as acceptance: per position (chain), and the mean depth per budget."""
    for field in ("acc_cumulative", "budget_curve"):
        if field not in overall:
            raise DFlashError(f"{source}: field 'overall.{field}' is missing; rerun `dflashkit eval` to rewrite it")
    ddtree = {int(b): d for b, d in overall["budget_curve"].items()}
    ddtree |= {int(k.split(":")[1]): v for k, v in overall.items() if k.startswith("budget:") and v is not None}
    paths = {int(b): n for b, n in (overall.get("budget_curve_paths") or {}).items() if n is not None}
    return {"block_size": block_size, "chain": overall["acc_cumulative"], "ddtree": ddtree, "paths": paths,
            "hybrid": {int(b): h for b, h in (overall.get("hybrid") or {}).items()}, "cuts": overall.get("ddtree_cuts"),
            "hybrid_auto": overall.get("hybrid_auto"), "ddtree_auto": overall.get("ddtree_auto"), "source": source}


def predict_rounds(accepted: list[int], widths: list[int], drafted: list[bool], model, loop: str) -> dict:
    """A decode's own rounds (tokens committed, nodes verified, whether the drafter ran) priced by the model."""
    if not accepted:
        return _row(0.0, 0.0, float("inf"), 0.0)
    n = len(accepted)
    draft = (_draft_ms(model) * sum(drafted) / n) if any(drafted) else 0.0
    verify = sum(model.forward_paths(w) for w in widths) / n if widths else model.forward(1)
    return _row(sum(accepted) / n, draft, verify, model.overhead(loop), width=sum(widths) / n if widths else 1)


def error(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured - 1 if predicted and measured else None


def prediction_markdown(rows: dict, model, source: str) -> list[str]:
    table = [[m, r["tokens_per_round"], r["ms_per_round"]["draft"], r["ms_per_round"]["verify"],
              r["ms_per_round"]["overhead"], r["tokens_per_s"], r.get("speedup")]
             + ([f"budget {r['budget']}"] if "budget" in r else [""]) for m, r in rows.items()]
    return [f"## Predicted decoding speed on {model.engine}", "",
            f"Acceptance: {source}; cost model: {model.path or model.engine}. Per round: time = draft + forward(width) "
            "+ the loop's own work; tokens/s = tokens per round / time per round (decoding only, prefill excluded); "
            f"speedup against plain decoding on {model.engine}.", "",
            markdown_table(["method", "tokens/round", "ms draft", "ms verify", "ms overhead", "tokens/s",
                            "speedup vs plain", "note"], table, digits=2)]


# ---- bench: predicted beside measured ----------------------------------------------------------------------

def measured_decode_tps(runs: list[dict]) -> float | None:
    """Tokens per second after each turn's prefill (its first token comes from the prefill), as bench states."""
    tokens = sum(len(r["tokens"]) - len(r.get("turns") or [1]) for r in runs)
    seconds = sum(r["times"]["total"] - r["times"]["prefill"] for r in runs)
    return tokens / seconds if seconds > 0 else None


def _online(label: str, runs: list[dict], summary: dict, model, block_size: int | None) -> dict:
    """A row's own acceptance priced by the model: our loops' rounds, or an engine peer's own tau."""
    if label in PEERS:
        return plain(model)
    if label.endswith("-dflash"):
        return _row(summary["tau"] or 1.0, _draft_ms(model), model.forward(block_size), model.overhead("chain"),
                    width=block_size)
    pick = lambda key: [x for r in runs for x in (r.get(key) or [])]
    loop = {"ar": "ar", "chain": "chain"}.get(label.split("@")[0], "tree")  # whose work a round pays
    return predict_rounds(pick("accepted"), pick("widths"), pick("drafted"), model, loop)


def predicted_engine(label: str, rows: dict) -> str | None:
    """The engine whose cost model prices a bench row; None: stock kernels or transformers' loops (none of ours)."""
    method, engine = rows.get(label, (label, label))
    ours = method.split("-")[0] not in ("prompt", "hf") and engine != "hf-stock"  # not prompt-lookup, hf-generate
    return engine.removesuffix("-dflash") if ours else None


def predict_bench(target, proposer, runs: list[dict], rows: dict, summary: dict, session,
                  offline: dict | None = None, log=None, window: dict | None = None) -> dict:
    """Each row's predicted decode tokens/s beside its measured one, from its own rounds and from `offline` {engine, or
    "" for the rest: an eval's results}, on its engine's model over its runs' minutes (`window` {row: samples})."""
    B, window = proposer.block_size if proposer is not None else None, window or {}
    models, acceptances = {}, {e: offline_acceptance(o["overall"], o["settings"]["block_size"], o.get(
        "source", "offline eval")) for e, o in (offline or {}).items()}
    for label, s in summary.items():
        if (engine := predicted_engine(label, rows)) is None:
            s["predicted"] = {"why": "stock kernels or transformers' own loop: no cost model of ours"}
            continue
        if engine not in models:
            try:
                models[engine] = cost_model(engine, target, proposer, session, log=log, measure=engine != "vllm")
            except (DFlashError, OSError) as e:
                models[engine] = str(e)
        if isinstance(models[engine], str):
            s["predicted"] = {"why": models[engine]}
            continue
        model = in_window(models[engine], window.get(label, []))
        measured = measured_decode_tps([r for r in runs if r["method"] == label])
        online = _online(label, [r for r in runs if r["method"] == label], s, model, B)
        s["predicted"] = {"engine": engine, "measured_decode_tokens_per_s": measured, "window": model.record.get(
            "window"), "online": {**online, "error": error(online["tokens_per_s"], measured)}}
        method = "chain" if label.endswith("-dflash") else rows.get(label, (label,))[0]
        if (acceptance := acceptances.get(engine, acceptances.get(""))) and (
                row := predict_offline(acceptance, model, only=method).get(method)):
            s["predicted"]["offline"] = {**row, "error": error(row["tokens_per_s"], measured),
                                         "source": acceptance["source"]}
    _speedup_errors(rows, summary)
    return {e: {"why": m} if isinstance(m, str) else in_window(m, [x for label, w in window.items() if predicted_engine(
            label, rows) == e for x in w]).to_dict() for e, m in models.items()}


def _speedup_errors(rows: dict, summary: dict) -> None:
    """Each prediction's speedup over its engine's plain decoding against the measured one (the host's speed cancels)."""
    plain = {e: summary[label].get("predicted") or {} for label, (m, e) in rows.items() if m in ("ar", e)}
    for s in summary.values():
        p = s.get("predicted") or {}
        base = plain.get(p.get("engine")) or {}
        if not (base.get("online") and base["online"]["tokens_per_s"] and base["measured_decode_tokens_per_s"]):
            continue
        measured = p["measured_decode_tokens_per_s"] / base["measured_decode_tokens_per_s"]
        for row in (p.get("online"), p.get("offline")):
            if row and row.get("tokens_per_s"):
                row["speedup_error"] = error(row["tokens_per_s"] / base["online"]["tokens_per_s"], measured)


def predicted_markdown(result: dict) -> list[str]:
    """The bench's predicted-beside-measured table (decode tokens/s, prefill excluded), with each error."""
    rows, sources = [], {}
    for m, s in result["methods"].items():
        if not (p := s.get("predicted")):
            continue
        if "why" in p:
            rows.append([m, "-", "", "", "", "", "", "", "", p["why"][:120]])
            continue
        on, off = p["online"], p.get("offline") or {}
        sources |= {off["source"]: None} if off.get("source") else {}
        pct = lambda e: "" if e is None else f"{100 * e:+.1f}%" + ("" if abs(e) <= ERROR_BAR else " (beyond 10%)")
        rows.append([m, p["engine"], p["measured_decode_tokens_per_s"], on["tokens_per_s"], pct(on["error"]),
                     pct(on.get("speedup_error")), off.get("tokens_per_s"), pct(off.get("error")),
                     pct(off.get("speedup_error")), off.get("why") or (f"tokens/round {off['tokens_per_round']:.2f} "
                     f"offline, {on['tokens_per_round']:.2f} here" + (f"; offline as its best fixed budget, "
                     f"{off['budget']}" if isinstance(off.get("budget"), int) else "") if off else "")])
    if not rows:
        return []
    windows = [f"{e}" + (f" x{fmt(w['level'], 2)}" if "level" in w else "") + f" over {w['samples']}" + (
               ", its rounds " + ", ".join(f"{k} {fmt(v, 1)} ms" for k, v in w["rounds"].items()) if w.get("rounds")
               else "") for e, m in (result.get("cost_models") or {}).items() if (w := (m.get("record") or {}).get("window"))]
    return ["## Predicted beside measured", "",
            "Decode tokens/s (prefill excluded) measured here, and predicted by the engine's cost model (`dflashkit cost`)"
            " over each row's own minutes: a quick sample of its engine's cost taken seconds before each of its runs (our "
            "backends: each forward, and hf's verifies by paths; llama.cpp: its own round on the probe prompt), each "
            "row's model their median, the drafter call and our loops' work as cached (samples against the cached "
            "model: " + (", ".join(windows) or "none sampled") + "; vLLM's cached) from each row's own acceptance (its rounds' "
            "tokens and widths: checks the cost half) "
            + (f"and from {' and '.join(sources)} (checks both halves)" if sources else "and, given `--offline RUN`, "
               "from an offline eval of the drafter (both halves)") + f"; the bar is {fmt(100 * ERROR_BAR, 0)}%. The speedup error "
            "compares the predicted speedup over the engine's plain decoding with the measured one (the host's level "
            "cancels)." + share(result.get("seconds")), "",
            markdown_table(["method", "engine", "measured", "predicted (own acceptance)", "error", "speedup error",
                            "predicted (offline)", "error", "speedup error", "note"], rows, digits=1),
            *(["![predicted against measured](predicted.png)"] if predicted_points(result) else []), ""]


def share(seconds: dict | None) -> str:
    """What the prediction cost the bench (its samples and cost models), beside the bench's own time."""
    if not seconds or not seconds.get("bench"):
        return ""
    return (f" The prediction took {seconds['predict']:.1f} s of the bench's {seconds['bench']:.0f} s "
            f"({100 * seconds['predict'] / seconds['bench']:.0f}%; `--no-predict` skips it).")


def predicted_points(result: dict) -> dict[str, tuple[float, float]]:
    """label -> (measured, predicted) decode tokens/s of every bench row that has both, for the plot."""
    points = {}
    for m, s in result["methods"].items():
        p = s.get("predicted") or {}
        row = p.get("offline") or p.get("online") or {}
        if p.get("measured_decode_tokens_per_s") and row.get("tokens_per_s"):
            points[m] = (p["measured_decode_tokens_per_s"], row["tokens_per_s"])
    return points


def predicted_plot(result: dict, path):
    """predicted.png: predicted against measured decode tokens/s with the 10% band; None without predictions."""
    if not (points := predicted_points(result)):
        return None
    return scatter_against_measured(path, points, f"Predicted vs measured ({result['config']['target']}, "
                                    f"{result['config']['dtype']})", "decode tokens/s", ERROR_BAR)
