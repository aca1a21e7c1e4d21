"""The demo's training prompts and minutes, sized to `budget_minutes` on this machine: it times what its stages repeat
(a batched greedy step, a one-token forward) and scales each stage's work by them. When all does not fit, the prompts
shrink by sqrt(f) (f: the share of data and training time that fits) and training gets the rest (a CPU drafter is
bound by its data first); once data and cache have run, training gets what they left. `<out>/plan.json` keeps the
timing: a rerun with the same settings sizes the demo the same way and keeps what it built."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch

from dflashkit.fileio import read_json, sha256_json, write_json
from dflashkit.measure.curve import measure_cost_curve

MARGIN = 0.9  # plan for 90% of the budget: the estimates are good to about 25% per stage
MIN_PROMPTS, MIN_MINUTES = 64, 3.0  # below these the drafter learns too little to show anything
# seconds per token in one-token forwards, from the demo runs in benchmarks/results (docs/design.md section 10,
# measurement notes); bench also chooses its backend, compiles and starts peers
EVAL_TOKEN, BENCH_TOKEN, BENCH_START_S, TRAIN_OVERHEAD_S = 0.4, 0.5, 200.0, 10.0
COMPILE_S = 200.0  # the static decoder's first compile, in eval's engine probe where none is cached (design.md)


@torch.no_grad()
def measure(target, prompt_ids: list[int], batch: int) -> dict:
    """Seconds per row of a batched greedy step (features recorded, as the data stage generates) and of a one-token
    forward after 400 tokens."""
    t0, steps = time.perf_counter(), []
    with target.recording(target.default_layer_ids(5)):
        out = target.model(input_ids=torch.tensor([prompt_ids] * batch, device=target.device), use_cache=True,
                           logits_to_keep=1)
        for _ in range(4):  # the first step warms the one-token shapes up
            t = time.perf_counter()
            out = target.model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                               use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t)
    token_s = measure_cost_curve(target, ns=(1,), repeats=5)(1)
    return {"row_s": statistics.median(steps[1:]) / batch, "token_s": token_s, "seconds": time.perf_counter() - t0}


def timed(cfg, path, target, prompt_ids: list[int], spent_s: float, console) -> dict:
    """The timing in plan.json when made for the same settings (not the out folder), else a new one; spent_s: the
    seconds before the first stage, loading and timing."""
    key = sha256_json({k: v for k, v in asdict(cfg).items() if k not in ("out", "progress")})
    if path.is_file() and (old := read_json(path)).get("key") == key:
        return old
    console.print("[dim]timing this machine to size the demo...[/dim]")
    rates = measure(target, prompt_ids, cfg.gen_batch_size)
    write_json(path, rates := {"key": key, **rates, "spent_s": spent_s + rates["seconds"]})
    return rates


def estimates(rates: dict, work: dict, prompts: int, minutes: float) -> dict[str, float]:
    """Seconds of each stage here; work: what each repeats (demo.stage_work). A smaller batch than the one timed
    costs sqrt(rows timed / rows) more per row."""
    def generation(n: int, tokens: int, batch: int) -> float:
        return n * tokens * rates["row_s"] * (work["batch"] / max(1, min(batch, n))) ** 0.5

    return {"data": generation(prompts, work["train_tokens"], work["batch"]),
            "cache": generation(work["eval_prompts"], work["eval_tokens"], work["eval_prompts"]),
            "train": 60 * minutes + TRAIN_OVERHEAD_S,
            "eval": work["eval_prompts"] * work["eval_tokens"] * EVAL_TOKEN * rates["token_s"] + COMPILE_S * work.get("first_compile", 0),
            "bench": BENCH_START_S + work["bench_tokens"] * BENCH_TOKEN * rates["token_s"]}


def size(cfg, rates: dict, work: dict, prompts: int) -> tuple[int, float, str]:
    """(training prompts, training minutes, what was chosen in words) for cfg.budget_minutes (none: as asked)."""
    if not cfg.budget_minutes:
        return prompts, cfg.minutes, f"no budget: {prompts} training prompts, {cfg.minutes:g} training minutes"
    est = estimates(rates, work, prompts, 0.0)
    left = MARGIN * 60 * cfg.budget_minutes - rates["spent_s"] - sum(est.values()) + est["data"]  # data and training
    f = left / (est["data"] + 60 * cfg.minutes)
    n = prompts if f >= 1 else max(min(MIN_PROMPTS, prompts), int(prompts * max(f, 0.0) ** 0.5))
    minutes = refit(cfg, rates, estimates(rates, work, n, 0.0), {})
    total = (rates["spent_s"] + sum(estimates(rates, work, n, minutes).values())) / 60
    return n, minutes, (f"{cfg.budget_minutes:g}-minute budget: {n} of {prompts} training prompts, {minutes:g} of "
                        f"{cfg.minutes:g} training minutes (about {total:.0f} min on this machine)")


def refit(cfg, rates: dict, est: dict, took: dict[str, float]) -> float:
    """Training minutes, between MIN_MINUTES and those asked: what the budget leaves after the stages that ran
    (took: stage -> seconds) and the estimates of the others."""
    if not cfg.budget_minutes:
        return cfg.minutes
    others = sum(took.values()) + sum(v for k, v in est.items() if k not in took and k != "train") + TRAIN_OVERHEAD_S
    left = MARGIN * 60 * cfg.budget_minutes - rates["spent_s"] - others
    return round(max(min(MIN_MINUTES, cfg.minutes), min(cfg.minutes, left / 60)), 1)
