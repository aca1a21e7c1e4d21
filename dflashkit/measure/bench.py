"""`dflashkit bench`: every decoding method on the same prompts in one process, in an order rotated per prompt
(docs/decoding.md). At temperature 0 every output must equal plain decoding token for token, or the bench fails."""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from contextlib import ExitStack, suppress
from pathlib import Path

import torch
from tqdm import tqdm

from dflashkit.decode.conversation import decode_conversation, turn_of
from dflashkit.measure.curve import CostCurve, cost_report, tree_cost_curve
from dflashkit.measure.costmodel import SAMPLED, forward_sample
from dflashkit.decode.backends import backend_for
from dflashkit.measure.probe import new_session, probe_note
from dflashkit.decode.methods import ENGINES, PEER_METHODS, PEERS, STATIC_KINDS, TREE_KINDS, needs_drafter, parse_method
from dflashkit.decode.native import cflags, instruction_set
from dflashkit.measure.peers import (TAU_TOLERANCE, ar_parting, check_engines, check_tau, differences, engine_tau,
                                   is_engine, plain_of, predicted_tau, EnginePeer)
from dflashkit.targets.formats import DOTS, base, lossy, describe as describe_weights
from dflashkit.measure.predict import (measured_decode_tps, predict_bench, predicted_engine, predicted_markdown,
                                     predicted_plot)
from dflashkit.measure.records import TRANSFORMERS, bench_parity, bench_records, kind_of, plain_row
from dflashkit.decode.sampling import GREEDY, Sampling
from dflashkit.decode.speculative import DFlashProposer, generate, new_lookup
from dflashkit.errors import DFlashError
from dflashkit.fileio import write_json, write_text
from dflashkit.prompts import PromptItem
from dflashkit.report import bar_plot, fmt, hist_plot, line_plot, markdown_table
from dflashkit.report.parity import brief, parity_markdown, rounding_tolerance
from dflashkit.report.requests import FILE, write_requests
from dflashkit.rng import seeded
from dflashkit.targets.invariant import needs_invariant

STOCK_AR = "ar@hf-stock"  # plain decoding on torch's own kernels: the speed baseline where `ar` runs invariant ones
# no drafter: what the speedups are stated against
PLAIN = ("ar", STOCK_AR, "ar@hf", "ar@static", "hf-generate") + PEERS


def parse_engines(spec: str) -> list[str]:
    engines = [e.strip() for e in spec.split(",") if e.strip()]
    if not engines or len(set(engines)) != len(engines) or any(e not in ENGINES for e in engines):
        raise DFlashError(f"--engine {spec!r}: one of {', '.join(ENGINES)}, or several joined by commas, each once")
    return engines


def engine_rows(session, methods: list[str], engines: list[str],
                references: bool = True) -> dict[str, tuple[str, str]]:
    """label -> (method, engine): each method on each engine ('method@engine' past the first), and ar on each used."""
    rows: dict[str, tuple[str, str]] = {}
    for m in methods:
        if is_engine(m) or parse_method(m)[0] not in STATIC_KINDS:
            rows[m] = (m, "hf" if not is_engine(m) else m)
            continue
        for i, e in enumerate(engines):
            concrete = backend_for(session, e, m)
            if (m, concrete) not in rows.values():
                rows[m if i == 0 else f"{m}@{e}"] = (m, concrete)
    ar_engine, used = rows["ar"][1], {e for m, e in rows.values() if e in ("hf", "static")}
    held = {"hf"} if references and "static" in used else set()  # static held to hf too
    for e in sorted((used | held) - {ar_engine}):
        rows[f"ar@{e}"] = ("ar", e)
    return rows


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
    for m in [m for m in names if is_engine(m) and m.endswith("-dflash")]:
        # lossless is checked against the engine's own plain decoding, tau against our chain on the same drafter
        names += [x for x in (plain_of(m), "chain") if x not in names]
    return ["ar"] + [m for m in names if m != "ar"]


def _run(target, proposer, item, label, max_new_tokens, sampling: Sampling, seed: int, cost, session, rows,
         budget: int = 8):
    """One conversation (every turn) of row `label` on the row's backend (`generate` decodes with it too)."""
    method, engine = rows.get(label, (label, "hf"))
    gen = torch.Generator(device=target.device).manual_seed(seed)
    ngram = session.lookups.setdefault(label, new_lookup(method)) if kind_of(method) in ("ngram", "hybrid") else None

    def one(ids):  # a fresh context per turn: a conversation calls this once per user turn
        return generate(target, ids, method, proposer, budget=budget, max_new_tokens=max_new_tokens, sampling=sampling,
                        generator=gen, cost=cost, ngram=ngram, engine=engine, session=session)
    with seeded(seed, target.device):  # transformers' generate samples from the global generator
        return decode_conversation(target, item, one)


def _engine_parting(target, runs: list[dict], rows: dict, turns: dict, decoder=None):
    """Static's plain decoding vs hf's: a difference fails in float32; below it, one within rounding is reported."""
    hf, st = plain_row(rows, "hf"), plain_row(rows, "static")
    if hf is None or st is None:
        return [], [], {}
    summary = {**ar_parting(runs, st, against=hf), "against": hf}
    if target.weights.endswith(DOTS):  # static's integer dots are another model than hf's floats: reported only
        return [], [], summary
    step = check_static_step(target, decoder, runs, st) if decoder is not None else []
    found = [{"prompt": k, "method": st, "against": hf, "first_difference": v} for k, v in summary["parts_at"].items()]
    if target.dtype == torch.float32 or not found:
        return step + found, [], summary
    failed, explained = explain_by_rounding(target, turns, runs, found, reference=hf)
    return step + failed, explained, summary


STEP_TOLERANCE = 1e-3  # of the largest logit: float32 math over the same weights, summed in another order
CHECKED = (2, 64)  # prompts whose first tokens the static step is checked on, and how many answer tokens


@torch.no_grad()
def check_static_step(target, decoder, runs: list[dict], label: str) -> list[dict]:
    """The static step's logits (float32 in every dtype) against transformers' float32 forward on the first prompts:
    a gap beyond STEP_TOLERANCE fails, as tokens alone cannot tell a slightly wrong bf16 step from rounding."""
    ref = target.model if target.dtype == torch.float32 else copy.deepcopy(target.model).float()
    bad = []
    for r in [r for r in runs if r["method"] == label][: CHECKED[0]]:
        ids = (r["prompt_ids"] + r["tokens"][: CHECKED[1]])[: decoder.max_len - 1]
        want = ref(torch.tensor([ids], device=target.device)).logits[0].float()
        got = torch.stack([decoder.forward([t], i) for i, t in enumerate(ids)])
        gap = (got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1.0)
        if len(past := (gap > STEP_TOLERANCE).nonzero()):
            i = int(past[0])
            bad.append({"prompt": r["prompt"], "method": label, "against": "float32 reference",
                        "first_difference": max(0, i - r["prompt_tokens"] + 1), "position": i,
                        "logit_gap": float(gap[i]), "tolerance": STEP_TOLERANCE})
    return bad


@torch.no_grad()
def float_agreement(target, runs: list[dict], rows: dict) -> dict | None:
    """A lossy format (quantized here, or -int8) against float32 (the file's own values, or the float target): along
    our plain decoding's output, teacher-forced, how often float32's top-1 token is the one chosen, and each prompt's
    first parting (float32's greedy decoding equals ours on a prompt with none). Single-turn prompts."""
    label = plain_row(rows, "static") or plain_row(rows, "hf")
    if not lossy(target.weights) or label is None:
        return None
    from dflashkit.targets.model import load_target

    ref = target.model if base(target.weights) == "gguf" else \
        load_target(str(target.path), device=str(target.device), dtype="float32").model
    parting, same, total = {}, 0, 0
    for r in [r for r in runs if r["method"] == label and len(r["turn_prompts"]) == 1 and r["tokens"]]:
        n, p = len(r["tokens"]), len(r["prompt_ids"])
        top = ref(torch.tensor([r["prompt_ids"] + r["tokens"]], device=target.device)).logits[0, p - 1: p - 1 + n]
        hits = top.argmax(-1).cpu() == torch.tensor(r["tokens"])
        same, total = same + int(hits.sum()), total + n
        parting[r["prompt"]] = None if bool(hits.all()) else int((~hits).nonzero()[0])
    firsts = [v for v in parting.values() if v is not None]
    return {"row": label, "weights": target.weights, "against": "float32 over the same values" if base(
        target.weights) == "gguf" else "the float32 target", "top1": same / max(total, 1), "tokens": total,
        "prompts_equal": len(parting) - len(firsts), "prompts": len(parting), "first_parting": parting,
        "earliest_parting": min(firsts, default=None)}


def agreement_markdown(a: dict | None) -> list[str]:
    if not a:
        return []
    first = f"; earliest first parting at token {a['earliest_parting']}" if a["earliest_parting"] is not None else ""
    return ["", f"Agreement with float32 ({a['weights']} against {a['against']}, along {a['row']}'s output): top-1 "
            f"{100 * a['top1']:.1f}% of {a['tokens']} tokens; {a['prompts_equal']}/{a['prompts']} prompts equal"
            f"{first}."]


def run_bench(target, drafter, prompts: list[tuple[str, list[int] | PromptItem]], methods: list[str],
              max_new_tokens: int = 128, block_size: int | None = None, sampling: Sampling = GREEDY,
              warmup: bool = True, progress: bool = True, cost: CostCurve | None = None, engine: str = "hf",
              log=None, offline: dict | None = None, predict: bool = True, references: bool = True,
              journal=None, reprobe: bool = False) -> dict:
    """prompts: (id, prompt token ids or a PromptItem). `engine`: auto, hf, static, or several joined by commas (a row
    per method and engine). `references`: also ar@hf beside static and ar@hf-stock where kernels are switched."""
    proposer = DFlashProposer(target, drafter, block_size) if drafter is not None else None
    if proposer is None and any(needs_drafter(m) for m in methods):
        raise DFlashError(f"methods {', '.join(m for m in methods if needs_drafter(m))} need --drafter")
    switched, t0 = needs_invariant(target.model), time.perf_counter()
    # one static decoder for every method (tree widths when a tree method runs) and auto's choice
    session = new_session(target, proposer, reprobe, log, trees=any(kind_of(m) in TREE_KINDS for m in methods))
    rows = engine_rows(session, methods, parse_engines(engine), references)
    if references and switched and STOCK_AR not in rows:  # the fair speed baseline: torch's own kernels
        rows[STOCK_AR] = ("ar", "hf-stock")
    curve = cost or hf_curve(target, proposer, rows)
    ours = [m for m in rows if not is_engine(m)]
    methods = ours + [m for m in methods if is_engine(m)]
    engines = sorted((m for m in methods if is_engine(m)), key=lambda m: (plain_of(m), m != plain_of(m)))
    if engines and sampling.temperature != 0:
        raise DFlashError(f"--methods {', '.join(engines)}: the engine peers run greedy only (--temperature 0)")
    B = proposer.block_size if proposer else None
    with ExitStack() as stack:  # the engines up through the whole rotation, idle but for their own turns
        peers = {m: stack.enter_context(EnginePeer(m, target, drafter, B or 0, max_new_tokens)) for m in engines}
        window = {m: [] for m in methods if predict and predicted_engine(m, rows) in SAMPLED}
        spent = {"predict": 0.0}  # seconds the prediction cost the bench: its samples, its cost models

        def sample(m):  # a quick sample of the row's engine cost before its run, timed against the prediction
            t = time.perf_counter()
            with suppress(DFlashError, OSError):
                if m in window and (got := forward_sample(predicted_engine(m, rows), target, proposer, session,
                                                          peers.get(m), m.endswith("-dflash"))):
                    window[m].append(got)
            spent["predict"] += time.perf_counter() - t
        runs, turns = _timed_runs(target, proposer, prompts, ours + engines, max_new_tokens, sampling, warmup,
                                  progress, curve, peers, session, rows, sample, journal)
    mismatches, divergences, judged = _judge(target, runs, rows, turns, sampling, switched, session.static)
    categories = {pid: getattr(item, "category", None) for pid, item in prompts}
    summary = summarize_methods(runs, methods, B)
    _annotate(summary, runs, rows, {m: p.info for m, p in peers.items()}, judged, target, proposer)
    # predicted beside measured (measure/predict.py): each row's own rounds, and `offline` ({engine: an eval}) given
    t1 = time.perf_counter()
    models = predict_bench(target, proposer, runs, rows, summary, session, offline, log, window) if predict else {}
    spent["predict"] += time.perf_counter() - t1
    costs = backend_cost(target, rows, curve, session.static)
    spent["bench"] = time.perf_counter() - t0
    by_category = {c: summarize_methods([r for r in runs if categories[r["prompt"]] == c], methods, B)
                   for c in dict.fromkeys(categories.values()) if c is not None}
    return _add_parity(target, rows, sampling, {
        "config": _config(target, drafter, B, methods, engine, rows, session, prompts, categories, turns,
                          max_new_tokens, sampling),
        "cost": costs, "cost_models": models, "seconds": spent, "methods": summary, "categories": by_category,
        "mismatches": mismatches, "divergences": divergences, "engine_divergences": judged["engine_divergences"],
        "tau_checks": check_tau(summary), "agreement": float_agreement(target, runs, rows), "runs": runs})


def _config(target, drafter, B, methods, engine, rows, session, prompts, categories, turns, max_new_tokens,
            sampling: Sampling) -> dict:
    return {"target": target.name, "target_identity": target.identity(), "device": str(target.device),
            "dtype": str(target.dtype).removeprefix("torch."), "weights": describe_weights(target), "block_size": B,
            "methods": methods, "engine": engine, "backends": {label: e for label, (m, e) in rows.items()},
            "auto": session.auto and probe_note(session.auto),
            "threads": torch.get_num_threads(), "static_kernels": _kernels_built_for(session.static),
            "prompts": [p for p, _ in prompts], "categories": categories,
            "turns": {pid: len(next(iter(t.values()))[0]) for pid, t in turns.items()}, "max_new_tokens": max_new_tokens,
            **sampling.record(), "sampling": sampling.describe(),
            "drafter_layers": drafter.config.num_hidden_layers if drafter is not None else None}


def _add_parity(target, rows: dict, sampling: Sampling, result: dict) -> dict:
    """The per-request records of every run and, at temperature 0, each row's parity against its plain baseline."""
    result["requests"] = bench_records(result)
    result["parity"] = bench_parity(target, result["requests"], rows) if sampling.temperature == 0 else {}
    for label in result["parity"].keys() & result["methods"].keys():
        result["methods"][label]["parity"] = brief(result["parity"][label])
    return result


def _kernels_built_for(decoder) -> str | None:
    """The static step's kernels and the instruction set they were compiled for, where a static row ran."""
    if decoder is None or decoder.kernels not in ("native", "tiles"):
        return decoder and f"{decoder.kernels} (inductor)"
    return f"{decoder.kernels}, {' '.join(f for f in cflags() if f.startswith('-m'))} on this CPU: {instruction_set()}"


def _annotate(summary: dict, runs: list[dict], rows: dict, started: dict, judged: dict, target, proposer) -> None:
    """Each row's backend, method and partings; engine peers' start and predicted tau; per speculative row the share
    of rounds that drafted, and its worst prompt against plain decoding there."""
    for m, info in started.items():
        summary[m].update(engine=info, ar_parting=judged["parting"].get(m))
        if m.endswith("-dflash"):
            summary[m]["predicted_tau"] = predicted_tau(target, proposer, [r for r in runs if r["method"] == m])
    for label, (m, engine) in rows.items():
        if (s := summary.get(label)) is None:
            continue
        s.update(backend=engine, method_name=m)
        if kind_of(m) in ("ar", *TRANSFORMERS, *PEER_METHODS):
            continue
        plain, mine = plain_row(rows, engine), [r for r in runs if r["method"] == label]
        drafted = [d for r in mine for d in r.get("drafted") or ()]
        s["drafted_share"] = sum(drafted) / len(drafted) if drafted else None
        base = {r["prompt"]: measured_decode_tps([r]) for r in runs if r["method"] == plain}
        ratios = {r["prompt"]: tps / base[r["prompt"]] for r in mine
                  if (tps := measured_decode_tps([r])) and base.get(r["prompt"])}
        worst = min(ratios, key=ratios.get, default=None)
        s["worst_prompt"] = {"prompt": worst, "vs": plain, "ratio": ratios[worst]} if worst else None
    if judged["static_parting"]:
        summary[plain_row(rows, "static")]["ar_parting"] = judged["static_parting"]


def _judge(target, runs: list[dict], rows: dict, turns: dict, sampling: Sampling, switched: bool, decoder=None):
    """(failures, reported divergences, {engine_divergences, parting, static_parting}) of the lossless checks."""
    def stock(m):  # on other kernels where bf16 switched ours: not held to our plain decoding
        return switched and (m == STOCK_AR or kind_of(m) in TRANSFORMERS)

    for r in runs:
        r["backend"] = rows.get(r["method"], (r["method"], r["method"]))[1]
    ours_exact = [r for r in runs if not stock(r["method"]) and not is_engine(r["method"])]
    mismatches = check_lossless(ours_exact, rows) if sampling.temperature == 0 else []
    engine_mismatches, parting = check_engines(runs)
    engine_divergences = []
    if target.dtype != torch.float32:  # an engine verifies a block on other kernels than its one-token step
        engine_mismatches, engine_divergences = [], engine_mismatches
    static_mismatches, static_divergences, static_parting = (
        _engine_parting(target, runs, rows, turns, decoder) if sampling.temperature == 0 else ([], [], {}))
    divergences = []
    if mismatches and not exact_kernels(target):  # CUDA low precision: a rounding-sized near-tie is not a bug
        mismatches, divergences = explain_by_rounding(target, turns, runs, mismatches)
    return (mismatches + engine_mismatches + static_mismatches, divergences + static_divergences,
            {"engine_divergences": engine_divergences, "parting": parting, "static_parting": static_parting})


def _timed_runs(target, proposer, prompts, methods, max_new_tokens, sampling, warmup, progress, curve,
                peers: dict, session, rows: dict, sample, journal=None) -> tuple[list[dict], dict]:
    """Each method on each prompt after a warm-up, in an order rotated per prompt (drift hits all alike); ar's turns."""
    runs = journal.resume() if journal is not None else []
    if runs:
        print(f"bench: resuming from {journal.path}: {len(runs)} of {len(prompts) * len(methods)} runs done",
              file=sys.stderr)
    finished = {(r["prompt"], r["method"]) for r in runs}

    def run(m: str, i: int, pid: str, item, n: int) -> dict:
        if m in peers:  # an engine warms on a whole first conversation: its graphs, caches, allocator
            return peers[m].run(pid, item)
        c = _run(target, proposer, item, m, n, sampling, sampling.seed + i, curve, session, rows)
        g = c.generation
        return {"prompt": pid, "method": m, "prompt_tokens": len(c.prompts[0]), "prompt_ids": c.prompts[0],
                "turn_prompts": c.prompts, "turns": c.lengths, "tokens": g.tokens, "accepted": g.accepted,
                "times": g.times, "widths": g.widths, "drafted": g.drafted}

    for m in methods if warmup else ():
        run(m, 0, *prompts[0], min(8, max_new_tokens))
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", disable=not progress,
              mininterval=2.0) as bar:
        for i, (pid, item) in enumerate(prompts):
            for m in methods[i % len(methods):] + methods[: i % len(methods)]:
                if (pid, m) in finished:
                    bar.update()
                    continue
                bar.set_description(f"bench {pid} {m}")
                sample(m)
                runs.append(r := run(m, i, pid, item, max_new_tokens))
                if journal is not None:
                    journal.add(r)
                bar.set_postfix_str(f"last {m}: {len(r['tokens']) / r['times']['total']:.1f} tok/s", refresh=False)
                bar.update()
    turns = {}
    for r in runs:
        if rows.get(r["method"], (r["method"],))[0] == "ar":
            turns.setdefault(r["prompt"], {})[r["method"]] = (r["turn_prompts"], r["turns"])
    return runs, turns


def exact_kernels(target) -> bool:
    """Where the kernels make speculative decoding equal plain decoding token for token (docs/design.md section 8)."""
    return target.dtype == torch.float32 or target.device.type == "cpu"


def explain_by_rounding(target, turns: dict, runs: list[dict], mismatches: list[dict], reference: str = "ar"):
    """(unexplained, divergences): a divergence's two tokens lie within rounding_tolerance in plain decoding's logits."""
    tokens = {(r["prompt"], r["method"]): r["tokens"] for r in runs}
    failed, explained = [], []
    for x in mismatches:
        i, want, got = x["first_difference"], tokens[(x["prompt"], reference)], tokens[(x["prompt"], x["method"])]
        if i >= len(want) or i >= len(got):  # one output stops where the other goes on: not a rounding flip
            failed.append(x)
            continue
        prompts, lengths = turns[x["prompt"]][reference]
        k, offset = turn_of(lengths, i)
        ids = torch.tensor([prompts[k] + want[i - offset:i]], device=target.device)
        with torch.no_grad():
            logits = target.forward(ids, logits_to_keep=1).logits[0, -1].float()
        a, b = float(logits[want[i]]), float(logits[got[i]])
        entry = {**x, "gap": a - b, "tolerance": rounding_tolerance(str(target.dtype).removeprefix("torch."),
                                                                    max(abs(a), abs(b)))}
        (explained if abs(entry["gap"]) <= entry["tolerance"] else failed).append(entry)
    return failed, explained


def check_lossless(runs: list[dict], rows: dict | None = None) -> list[dict]:
    """Each (prompt, method) whose output differs from plain decoding's on its engine (in `rows`, else hf)."""
    rows = {label: (rows or {}).get(label, (label, "hf")) for label in dict.fromkeys(r["method"] for r in runs)}
    return differences(runs, lambda label: plain_row(rows, rows[label][1], "ar"))


def summarize_methods(runs: list[dict], methods: list[str], block_size: int | None) -> dict:
    out = {m: summarize([r for r in runs if r["method"] == m],
                        None if kind_of(m) in ("ar", *TRANSFORMERS, *PEER_METHODS) else (block_size or 1))
           for m in methods}
    for m in methods:
        if is_engine(m):  # counted by the engine itself, not per round by us
            out[m]["tau"] = engine_tau([r for r in runs if r["method"] == m]) if m.endswith("-dflash") else None
        if kind_of(m) in TRANSFORMERS:  # transformers' loops are timed end to end: no split of a round
            out[m].update(ms_per_round=None, split=None, overhead=None)
    add_ratios(out)
    return out


def summarize(runs: list[dict], block_size: int | None = None) -> dict:
    """Totals of one method's runs; `block_size` (speculative methods only) adds the accepted-length histogram."""
    t = {k: sum(r["times"][k] for r in runs) for k in ("prefill", "draft", "verify", "other", "total")}
    tokens, accepted = sum(len(r["tokens"]) for r in runs), [a for r in runs for a in r["accepted"]]
    rounds, decode = len(accepted), t["total"] - t["prefill"]
    out = {"prompts": len(runs), "new_tokens": tokens, "rounds": rounds, "seconds": t["total"],
           "tokens_per_s": tokens / t["total"] if t["total"] else None,
           "tau": sum(accepted) / rounds if rounds else None, "accepted_hist": None,
           "decode_tokens_per_s": None, "ms_per_round": None, "split": None, "overhead": None}
    if rounds:
        out["ms_per_round"] = {k: 1000 * t[k] / rounds for k in ("draft", "verify", "other")}
        out["ms_per_round"]["total"] = 1000 * decode / rounds
        out["split"] = {k: t[k] / decode for k in ("draft", "verify", "other")} if decode > 0 else None
        out["overhead"] = t["other"] / decode if decode > 0 else None
        out["decode_tokens_per_s"] = measured_decode_tps(runs)
        if block_size:
            size = max(block_size, max(accepted))  # a DDTree round never exceeds B; keep every bin anyway
            out["accepted_hist"] = [sum(a == k for a in accepted) / rounds for k in range(1, size + 1)]
    return out


def add_ratios(summary: dict) -> None:
    """Speedups against plain decoding (the faster of ar and ar@hf-stock), hf-generate, prompt lookup; the ceiling."""
    ar = max((s for s in (summary.get(STOCK_AR), summary["ar"]) if s), key=lambda s: s["tokens_per_s"] or 0)
    pl = next((s for m, s in summary.items() if m.startswith("prompt-lookup")), None)
    hf = summary.get("hf-generate")
    t_ar = ar["ms_per_round"]["total"] if ar["ms_per_round"] else None
    fastest = max(((m, s["tokens_per_s"] or 0.0) for m, s in summary.items() if m in PLAIN), key=lambda x: x[1])
    ratio = lambda a, b: a / b if a and b else None
    for s in summary.values():
        r = s["ms_per_round"]
        tps, fwd = s["tokens_per_s"], r["draft"] + r["verify"] if r else 0
        s.update(fastest_plain=fastest[0], speedup_vs_ar=ratio(tps, ar["tokens_per_s"]),
                 speedup_vs_hf_generate=ratio(tps, hf and hf["tokens_per_s"]),
                 speedup_vs_prompt_lookup=ratio(tps, pl and pl["tokens_per_s"]),
                 speedup_vs_fastest_plain=ratio(tps, fastest[1]),
                 decode_speedup_vs_ar=ratio(s["decode_tokens_per_s"], ar["decode_tokens_per_s"]),
                 ceiling=ratio((s["tau"] or 0) * (t_ar or 0), fwd))


def bench_weights(c: dict) -> str:
    """The header's note of quantized weights, and that llama.cpp's rows run the same ones."""
    weights = f"; weights {c['weights']}" if not c.get("weights", "(float)").endswith("(float)") else ""
    if weights and any(m.startswith("llama.cpp") for m in c["methods"]):
        weights += ", llama.cpp on the same weights" + (" (the file itself)" if c["weights"].startswith("gguf") else "")
    return weights


def bench_markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# Decoding benchmark: {c['target']} on {c['device']} ({c['dtype']}{bench_weights(c)})", "",
             f"{len(c['prompts'])} prompts, up to {c['max_new_tokens']} new tokens, "
             f"{c.get('sampling') or 'temperature ' + str(c['temperature'])}, seed {c.get('seed')}, "
             f"block size {c['block_size']}; methods run in rotated order per prompt after a warm-up; "
             f"{c.get('threads')} threads; " + (f"{c['auto']}; " if c.get("auto") else "")
             + "backends: " + ", ".join(f"{m} on {e}" for m, e in (c.get("backends") or {}).items())
             + (f"; static kernels: {c['static_kernels']}" if c.get("static_kernels") else "")
             + (f"; drafter `{d['path']}`" + (f" (weights sha256 {d['sha256'][:12]})" if d["sha256"] else "")
                if (d := c.get("drafter")) else "") + ".", ""]
    lines += cost_markdown(result.get("cost"))
    fastest = next(iter(result["methods"].values())).get("fastest_plain", "ar")
    headers = ["method", "backend", "tau", "tokens/s", "speedup vs ar", f"vs fastest plain ({fastest})", "vs hf-generate",
               "vs prompt-lookup", "decode speedup", "worst prompt vs plain", "drafted rounds", "ceiling",
               "ms/round draft", "verify", "other", "overhead"]
    cols = ("tau", "tokens_per_s", "speedup_vs_ar", "speedup_vs_fastest_plain", "speedup_vs_hf_generate",
            "speedup_vs_prompt_lookup", "decode_speedup_vs_ar")
    pct = lambda x: None if x is None else f"{100 * x:.0f}%"
    worst = lambda w: w and f"{w['ratio']:.2f}x ({w['prompt']})"
    rows = [[m, s.get("backend") or "-", *map(s.get, cols), worst(s.get("worst_prompt")), pct(s.get("drafted_share")), s.get("ceiling"),
             *map((s["ms_per_round"] or {}).get, ("draft", "verify", "other")),
             None if s["overhead"] is None else f"{100 * s['overhead']:.1f}%"] for m, s in result["methods"].items()]
    lines += ["## Methods", "", markdown_table(headers, rows, digits=2), *engines_markdown(result),
              *predicted_markdown(result)]
    lines += ["tau: mean tokens committed per round (accepted drafts + the bonus). ar is plain decoding in our engine "
              "(same dtype and kernels as every method); hf-generate is transformers' greedy `generate` and "
              "prompt-lookup its `generate(prompt_lookup_num_tokens=...)`, both timed end to end. ngram: continuation "
              "of the text's own last 1-3 tokens, verified by our tree loop; hybrid-N: DDTree-N of the drafter plus the "
              "n-gram branch in one verify; -auto: the tree cut per round to the nodes that maximize expected tokens "
              "per second under the cost curve, the drafter called only in rounds where what it has added in this "
              "request pays for it (the others plain decoding or the n-gram branch; `drafted rounds`). decode speedup "
              "excludes prefill; worst prompt vs plain: the lowest per-prompt decode tokens/s against plain decoding on "
              "the same backend; ceiling = tau * t_ar / (t_draft + t_verify); overhead = time outside drafter and "
              "target forwards / decode time.", ""]
    lines += category_markdown(result)
    lines += agreement_markdown(result.get("agreement"))
    if result.get("parity"):
        lines += parity_markdown(result["parity"])
    if c["temperature"] == 0:
        divergences = result.get("divergences") or []
        if result["mismatches"]:
            lines.append(f"**LOSSLESS CHECK FAILED**: {len(result['mismatches'])} outputs differ from plain decoding:")
            lines += [f"- {x['method']} on {x['prompt']}: first difference at token {x['first_difference']}"
                      + (f" (the static step's logits {x['logit_gap']:.1e} of the largest off transformers' float32 "
                         f"forward over the same weights at position {x['position']}, beyond {x['tolerance']:.0e})"
                         if "logit_gap" in x else f" (against {x['against']})" if "against" in x else "")
                      + (f" (logit gap {x['gap']:.4f}, beyond the dtype's rounding {x['tolerance']:.4f})"
                         if "gap" in x else "") for x in result["mismatches"]]
        elif not divergences:
            lines.append("Lossless check: every output equals plain greedy decoding token for token.")
        if divergences:
            lines.append(f"Rounding divergences ({c['dtype']} on {c['device']}, no invariant kernels there): "
                         f"{len(divergences)} outputs part from plain decoding at a near-tie whose logit gap the "
                         "dtype's rounding explains:")
            lines += [f"- {x['method']} on {x['prompt']}: token {x['first_difference']}, gap {x['gap']:.4f} "
                      f"(tolerance {x['tolerance']:.4f})" for x in divergences]
    else:
        lines.append("Temperature > 0: outputs are samples; the token-for-token check applies at temperature 0 only.")
    return "\n".join(lines) + "\n"


def engines_markdown(result: dict) -> list[str]:
    engines = {m: s for m, s in result["methods"].items() if is_engine(m)}
    if not engines:
        return []
    rows, parted = [], result.get("engine_divergences") or []
    own = [x for x in result["mismatches"] if x.get("against")] + parted
    for m, s in engines.items():
        p = s.get("ar_parting") or {}
        parts = p.get("parts_at") or {}
        diff = [x["first_difference"] for x in own if x["method"] == m]
        rows.append([m, s["tokens_per_s"], s["tau"], f"{(s.get('engine') or {}).get('start_s', 0):.0f} s",
                     "-" if m == plain_of(m) else f"{p.get('prompts', 0) - len(diff)}/{p.get('prompts', 0)}"
                     + (f" (first parting {min(diff)})" if diff else ""),
                     f"{p.get('equal', 0)}/{p.get('prompts', 0)}", min(parts.values()) if parts else "-"])
    lines = ["## Engine peers", "",
             "Each engine decodes the same conversations in the bench's rotation beside ours (started first, idle "
             "but for its own turns; one process computing at a time), greedy, in the bench's dtype "
             "and thread count (llama.cpp: the target converted to GGUF by its own converter; vLLM: the same "
             "safetensors). -dflash runs our drafter exported as the engine reads it (GGUF with the draft vocabulary's "
             "d2t map; z-lab folder with draft_vocab_size + d2t for vLLM). tau is the engine's own mean acceptance "
             "length. Kernels differ across engines, so an engine's plain output may part from our ar: reported "
             "here, not failed; its speculative output must equal its own plain output.", "",
             markdown_table(["engine", "tokens/s", "tau (engine)", "start", "equal to its own plain",
                             "equal to our ar", "earliest parting from ar"], rows, digits=2)]
    if parted:
        lines += ["", f"In {result['config']['dtype']} an engine's speculative output may part from its own plain "
                  "output: it verifies several tokens on other kernels than its one-token step, and a near-tie flips "
                  f"({len(parted)} outputs here; reported, not failed). In float32 they must be equal, and the bench "
                  "fails otherwise."]
    for t in result.get("tau_checks") or []:
        verdict = "within" if t["ok"] else "**BEYOND**"
        lines.append(f"- {t['method']}: engine tau {t['engine_tau']:.3f} vs {t['predicted_tau']:.3f} our drafter predicts "
                     f"on the engine's own output ({100 * t['gap']:+.1f}%, {verdict} the {100 * TAU_TOLERANCE:.0f}% "
                     f"tolerance; our chain on our own output: {t['chain_tau']:.3f})")
    return lines + [""]


def category_markdown(result: dict, image: str = "categories.png") -> list[str]:
    cats = result.get("categories") or {}
    if not cats:
        return []
    c, methods = result["config"], list(result["methods"])
    multi = sum(n > 1 for n in (c.get("turns") or {}).values())
    groups = [*cats.items(), ("overall", result["methods"])]

    def cell(s):
        tau = f" (tau {s['tau']:.2f})" if s["tau"] and s["accepted_hist"] is not None else ""
        return f"{fmt(s['speedup_vs_ar'], 2)}x{tau}" if s["speedup_vs_ar"] else ""

    speed = [[name, summary["ar"]["prompts"], summary["ar"]["new_tokens"]] + [cell(summary[m]) for m in methods]
             for name, summary in groups]
    tps = [[name] + [summary[m]["tokens_per_s"] for m in methods] for name, summary in groups]
    return ["## Per category", "",
            f"{len(cats)} categories; {multi} of {len(c['prompts'])} conversations are multi-turn (each user turn asked "
            "after the method's own answer to the one before; tokens and time count every answer). Speedup against "
            "plain decoding in the same category, with tau for the speculative methods:", "",
            markdown_table(["category", "prompts", "new tokens (ar)"] + methods, speed, digits=2),
            "Tokens per second:", "", markdown_table(["category"] + methods, tps, digits=1),
            f"![speedup per category]({image})", ""]


def hf_curve(target, proposer, rows: dict) -> CostCurve | None:
    """hf's cost curve where an -auto row or plain decoding runs on hf; else none."""
    cuts = any(e in ("hf", "hf-stock") and parse_method(m)[1] == "auto" for m, e in rows.values())
    if not cuts and rows.get("ar", ("ar", "hf"))[1] == "static":
        return None
    return tree_cost_curve(target, proposer.block_size if proposer else 4, extra=(9,))


def backend_cost(target, rows: dict, curve: CostCurve | None, decoder) -> dict | None:
    """The cost section: the curve of the backend plain decoding ran on, with the memory-bound floor."""
    backend = rows.get("ar", ("ar", "hf"))[1]
    if backend == "static" and decoder is not None and decoder.step_s:
        widths = sorted(decoder.step_s)
        curve = CostCurve(widths, [decoder.step_s[w] for w in widths])
    elif curve is None:
        return None
    return {**cost_report(target, curve), "backend": backend if backend == "static" else "hf"}


def cost_markdown(cost: dict | None, image: str = "cost.png") -> list[str]:
    if not cost:
        return []
    context = "200 slots of context" if cost.get("backend") == "static" else "a 400-token KV cache"
    return [f"## Cost of one target forward ({cost.get('backend', 'hf')} backend)", "",
            f"One forward over n new tokens after {context} (median), and its ratio to n = 1: a speculative "
            "round that verifies n tokens must commit more than that ratio to pay.", "",
            markdown_table(["n tokens", "ms", "ratio to n=1"], list(zip(cost["ns"], cost["ms"], cost["ratio"])),
                           digits=3),
            f"Memory-bound floor: {cost['weight_bytes'] / 1e6:.0f} MB of weights / {cost['bandwidth_gb_s']:.1f} GB/s "
            f"measured read bandwidth = {cost['floor_ms']:.1f} ms per forward; a one-token forward takes "
            f"{cost['one_token_vs_floor']:.2f}x that.", "", f"![cost curve]({image})", ""]


def write_bench(result: dict, out) -> list[Path]:
    """The results, records, report and plots under `out`, or a new temporary folder where `out` cannot be written."""
    try:
        return _write_bench(result, Path(out))
    except OSError as e:
        rescue = Path(tempfile.mkdtemp(prefix="dflashkit-bench-"))
        print(f"warning: could not write {out} ({e.strerror or e}); the results are in {rescue} instead",
              file=sys.stderr)
        return _write_bench(result, rescue)


def _write_bench(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {k: v for k, v in result.items() if k != "requests"})  # those: requests.jsonl
    write_text(out / "report.md", bench_markdown(result))
    paths = [out / "results.json", out / "report.md"]
    if result.get("requests") is not None:
        paths.append(write_requests(out / FILE, result["requests"]))
    groups = {m: {"end to end": s["speedup_vs_ar"] or 0.0, "decode": s["decode_speedup_vs_ar"] or 0.0,
                  "decode ceiling": s["ceiling"] or 0.0} for m, s in result["methods"].items()}
    paths.append(bar_plot(out / "speedup.png", groups, f"Speedup over plain decoding ({result['config']['target']})",
                          "x plain decoding"))
    if result.get("categories"):
        ar = STOCK_AR if STOCK_AR in result["methods"] else "ar"
        groups = {name: {m: s["speedup_vs_ar"] or 0.0 for m, s in summary.items() if m != ar}
                  for name, summary in [*result["categories"].items(), ("overall", result["methods"])]}
        paths.append(bar_plot(out / "categories.png", groups, f"Speedup per category ({result['config']['target']})",
                              "x plain decoding"))
    if (plot := predicted_plot(result, out / "predicted.png")) is not None:
        paths.append(plot)
    if hists := {m: s["accepted_hist"] for m, s in result["methods"].items() if s["accepted_hist"]}:
        paths.append(hist_plot(out / "accepted.png", hists, "Tokens committed per round", "tokens per round", start=1))
    if cost := result.get("cost"):
        paths.append(line_plot(out / "cost.png", {"measured": (cost["ns"], cost["ratio"]),
                                                 "one forward per token": (cost["ns"], cost["ns"])},
                               f"Cost of verifying n tokens ({result['config']['target']}, {result['config']['dtype']})",
                               "tokens in one forward", "time / one-token forward", ylim=(0, max(cost["ratio"]) * 1.5)))
    return paths
