"""The per-request records (report/requests.py) of bench's runs and generate's answers, one conversion for all."""

from __future__ import annotations

from pathlib import Path

from dflashkit.decode.methods import PEER_METHODS, parse_method
from dflashkit.report.requests import add_margin, request_record

TRANSFORMERS = ("prompt-lookup", "hf-generate", "transformers-dflash")  # transformers' own loops: timed end to end
END_TO_END = "timed end to end by transformers' generate: no draft/verify split"


def kind_of(label: str) -> str:
    """A row's method kind: 'hybrid-auto@static' -> 'hybrid', 'llama.cpp-dflash' itself."""
    return parse_method(label.split("@")[0])[0]


def run_record(run: dict, index: int, target: dict, dtype: str | None) -> dict:
    """One bench run (or a generate answer in its shape) as a per-request record; `target`: identity (name, path)."""
    label = run["method"]
    common = dict(target=target.get("name"), target_path=target.get("path"), dtype=dtype, turn_tokens=run.get("turns"),
                  prompt_ids=run.get("turn_prompts"))
    if label in PEER_METHODS:
        return _engine_record(run, index, common)
    if kind_of(label) in TRANSFORMERS:  # timed end to end; its DFlash loop's rounds counted at the target's forwards
        rounds = list(run["accepted"]) or None
        why = {k: END_TO_END for k in ("draft_s", "verify_s", "prefill_s", *(() if rounds else (
            "tokens_per_round", "rounds", "accepted", "accepted_per_position", "tau")))}
        return request_record(run["prompt"], index, label, "transformers", run.get("backend", "hf"), run["tokens"],
                              tokens_per_round=rounds, times={"total": run["times"]["total"]}, missing=why, **common)
    return request_record(run["prompt"], index, label, "dflashkit", run.get("backend", "hf"), run["tokens"],
                          tokens_per_round=list(run["accepted"]), times=run["times"], **common)


def _engine_record(run: dict, index: int, common: dict) -> dict:
    """An engine peer's run: its own counters and our end-to-end time; `missing` names why a field is null."""
    label, counts, t = run["method"], run.get("engine") or {}, run["times"]
    engine, speculative = label.removesuffix("-dflash"), label.endswith("-dflash")
    missing = {"tokens_per_round": f"{engine} reports totals per request, not rounds",
               "draft_s": f"{engine} does not time its drafter apart",
               "verify_s": f"{engine} does not time its verify apart"}
    if not counts.get("prefill_known", True):
        missing["prefill_s"] = f"{engine} does not report its prompt time apart"
    if counts.get("per_position") is None:
        missing["accepted_per_position"] = f"{engine} does not report acceptance per draft position"
    if not speculative:
        missing.update(rounds="plain decoding in the engine: no draft rounds", accepted="no drafts",
                       accepted_per_position="no drafts", tau="no drafts")
    drafts = counts if speculative else {}
    return request_record(run["prompt"], index, label, engine, engine, run["tokens"], rounds=drafts.get("steps"),
                          accepted=drafts.get("accepted"), accepted_per_position=drafts.get("per_position"),
                          times={"total": t["total"], "prefill": t["prefill"] if "prefill_s" not in missing else None},
                          missing=missing, **common)


def generation_record(pid: str, index: int, conversation, target) -> dict:
    """A `generate` answer (every turn of a conversation) as its per-request record."""
    g = conversation.generation
    run = {"prompt": pid, "method": g.method, "tokens": g.tokens, "accepted": g.accepted, "times": g.times,
           "turns": conversation.lengths, "turn_prompts": conversation.prompts, "backend": g.engine}
    return run_record(run, index, {"name": target.name, "path": str(Path(target.path).resolve())},
                      str(target.dtype).removeprefix("torch."))


def bench_records(result: dict) -> list[dict]:
    c = result["config"]
    index = {p: i for i, p in enumerate(c["prompts"])}
    target = c.get("target_identity") or {"name": c.get("target")}
    return [run_record(r, index.get(r["prompt"], -1), target, c.get("dtype")) for r in result["runs"]]


def plain_row(rows: dict, engine: str = "hf", default: str | None = None) -> str | None:
    """The label of plain decoding (ar) on `engine` among bench's rows: what that engine's rows are held to."""
    return next((label for label, (m, e) in rows.items() if m == "ar" and e == engine), default)


def baseline_of(label: str, rows: dict) -> str | None:
    """The plain decoding a row is held to: an engine's own, our ar for a plain engine, plain decoding on its own
    backend for ours, hf's for plain decoding on another backend; None for the reference itself."""
    if label in PEER_METHODS:
        return label.removesuffix("-dflash") if label.endswith("-dflash") else "ar"
    method, engine = rows.get(label, (label, "hf"))
    if method != "ar":
        return plain_row(rows, engine, "ar")
    ref = plain_row(rows, "hf", "ar")
    return None if label == ref else ref


def bench_parity(target, records: list[dict], rows: dict) -> dict:
    """{label: parity against its baseline (baseline_of)}; the top-2 margin at a divergence goes into the baseline's."""
    from dflashkit.report.parity import first_divergence, parity, top2_at  # looked up now: a test spies on top2_at

    by = {(r["prompt"], r["method"]): r for r in records}
    out = {}
    for label in dict.fromkeys(r["method"] for r in records):
        base = baseline_of(label, rows)
        pairs = [(by[(r["prompt"], base)], r) for r in records if r["method"] == label and (r["prompt"], base) in by]
        if base is None or not pairs:
            continue
        for ref, r in pairs:
            i = first_divergence(ref["tokens"], r["tokens"])
            if (i is not None and i < min(len(ref["tokens"]), len(r["tokens"])) and ref["prompt_ids"]
                    and str(i) not in (ref["top2"] or {})):
                add_margin(ref, i, *top2_at(target, ref, i))
        out[label] = {"against": base, **parity([a for a, _ in pairs], [b for _, b in pairs],
                                                lambda ids: target.tokenizer.decode(ids))}
    return out
