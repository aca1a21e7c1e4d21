"""Run by vLLM's own Python (its venv), never imported by dflashkit: one `LLM` configured by the JSON in argv[1],
one JSON request {"ids", "max_tokens"} a stdin line, one answer a stdout line prefixed REPLY (vLLM logs there too)."""

from __future__ import annotations

import json
import sys
import time
from itertools import zip_longest

REPLY = "@@dflashkit "


def counters(llm) -> dict:
    """vLLM's spec-decode counters; per_position stays None where this vLLM does not keep it."""
    out = {"drafts": 0, "accepted": 0, "per_position": None}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and getattr(m, "values", None) is not None:
            out["per_position"] = combine(out["per_position"] or [], [int(v) for v in m.values], 1)
    return out


def combine(a: list, b: list, sign: int) -> list:
    return [x + sign * y for x, y in zip_longest(a, b, fillvalue=0)]


def main() -> None:
    sys.path = [p for p in sys.path if p != __file__.rsplit("/", 1)[0]]  # this folder's modules are not vLLM's
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0,
              speculative_config=cfg.get("speculative"), disable_log_stats=False)
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False)
        before = counters(llm)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["ids"])], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        after = counters(llm)
        mine = None if after["per_position"] is None else \
            combine(after["per_position"], before["per_position"] or [], -1)  # this request's own counts
        delta = {k: after[k] - before[k] for k in ("drafts", "accepted")}
        print(REPLY + json.dumps({"tokens": list(out.outputs[0].token_ids), "seconds": seconds, **delta,
                                  "per_position": mine}), flush=True)


if __name__ == "__main__":  # vLLM starts worker processes that re-import the main module
    main()
