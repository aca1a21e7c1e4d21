"""One per-request acceptance record for every backend and engine peer, so that two engines' records compare line by
line (`dflashkit compare`, `dflashkit parity`). A field a source cannot give is null, and `missing` says why."""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.fileio import write_text

SCHEMA = "dflashkit-request/1"
FILE = "requests.jsonl"  # beside a bench's results.json; `generate --out` writes the same lines
# every record has every one of these keys (null where unknown, with the reason in `missing`)
FIELDS = ("schema", "prompt", "index", "method", "engine", "backend", "target", "target_path", "dtype", "prompt_ids",
          "prompt_tokens", "turn_tokens", "new_tokens", "tokens", "rounds", "tokens_per_round", "accepted", "accepted_per_position",
          "tau", "prefill_s", "draft_s", "verify_s", "total_s", "top2", "missing")


def per_position(tokens_per_round: list[int]) -> list[int]:
    """Rounds that accepted a draft at position k = 1..longest, as vLLM counts them, from our own rounds."""
    longest = max(tokens_per_round, default=1) - 1
    return [sum(n > k for n in tokens_per_round) for k in range(1, longest + 1)]


def request_record(prompt: str, index: int, method: str, engine: str, backend: str, tokens: list[int], *,
                   target: str | None = None, target_path: str | None = None, dtype: str | None = None,
                   prompt_ids: list[list[int]] | None = None, turn_tokens: list[int] | None = None,
                   tokens_per_round: list[int] | None = None, rounds: int | None = None, accepted: int | None = None,
                   accepted_per_position: list[int] | None = None, times: dict | None = None,
                   missing: dict[str, str] | None = None) -> dict:
    """The record of one request: `engine` decoded it on `backend`; rounds and accepted counts follow from
    `tokens_per_round` where known; `times`: seconds by name (prefill, draft, verify, total)."""
    if tokens_per_round is not None:
        rounds, accepted_per_position = len(tokens_per_round), per_position(tokens_per_round)
        accepted = sum(tokens_per_round) - rounds
    tau = 1 + accepted / rounds if rounds and accepted is not None else None
    rec = {"schema": SCHEMA, "prompt": prompt, "index": index, "method": method, "engine": engine, "backend": backend,
           "target": target, "target_path": target_path, "dtype": dtype, "prompt_ids": prompt_ids,
           "prompt_tokens": prompt_ids and [len(x) for x in prompt_ids], "turn_tokens": turn_tokens,
           "new_tokens": len(tokens), "tokens": list(tokens), "rounds": rounds, "tokens_per_round": tokens_per_round,
           "accepted": accepted, "accepted_per_position": accepted_per_position, "tau": tau,
           **{f"{k}_s": (times or {}).get(k) for k in ("prefill", "draft", "verify", "total")},
           "top2": None, "missing": dict(missing or {})}
    for k in FIELDS:  # a null nobody explained is a reader's guess: say it was not given
        if rec[k] is None and k not in rec["missing"] and k != "top2":
            rec["missing"][k] = "not given by this source"
    return rec


def add_margin(record: dict, index: int, margin: float, logit: float) -> None:
    """Record the target's top-2 logit margin at new token `index`: how `parity` tells a near-tie from a choice."""
    record["top2"] = {**(record.get("top2") or {}), str(index): {"margin": margin, "logit": logit}}


def check_record(rec: dict, where: str) -> dict:
    """A record as read: the schema named, every field present; else one line naming the file and field."""
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
        got = rec.get("schema") if isinstance(rec, dict) else type(rec).__name__
        raise DFlashError(f"{where}: field 'schema' is {got!r}, expected {SCHEMA!r}; write it with `dflashkit bench` "
                          "or `dflashkit generate --out`")
    if lost := [k for k in FIELDS if k not in rec]:
        raise DFlashError(f"{where}: a record lacks field {lost[0]!r} ({SCHEMA}); rewrite it with this dflashkit")
    return rec


def write_requests(path, records: list[dict]) -> Path:
    """One JSON line per record, atomically (an interrupted write leaves the old file or none)."""
    write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return Path(path)


def read_requests(path) -> list[dict]:
    path, out = Path(path), []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path}:{n}: invalid JSON ({e}); rewrite it with `dflashkit bench` or `generate --out`")
        out.append(check_record(rec, f"{path}:{n}"))
    return out
