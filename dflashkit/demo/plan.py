"""How much the demo does on this machine: its training data and training time sized to a wall-clock budget.

The same demo took 71 minutes on a float32-only CPU and about 35 on a bf16 one, so fixed sizes cannot fit one
budget everywhere. The probe (probe.py) says what each stage costs here; the plan keeps every stage and every
bench method and shrinks the two elastic quantities, the number of training prompts and the training minutes,
until the estimated total fits the budget with a margin: by one factor f, prompts as sqrt(f) and minutes as f^1.5.
Once the stages before training have run, `refit` gives training what their measured time left (the probe
overestimates a bf16 CPU by about 1.5x on the data stages, so the first plan alone left a quarter of the budget unused).
Data goes last because a CPU drafter runs out of data before it runs out of steps: on 149 prompts, 5 minutes of
a step-cheap recipe reached the held-out accuracy of one with 2.6x the steps (benchmarks/results/
cpu-2026-12-02-recipe-ablation.md, block-4 vs combo-b4). The plan is written to
`<out>/plan.json` once and reused by a rerun with the same settings, so a resumed demo builds the same stages and
pays no second probe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from dflashkit.fileio import read_json, sha256_json, write_json

MARGIN = 0.9  # plan for 90% of the budget: a stage's estimate is good to about 25%, their sum to about 10%
MIN_PROMPTS = 64  # below this the drafter learns too little to show anything
MIN_MINUTES = 3.0


@dataclass
class Plan:
    key: str  # hash of the settings the plan was made for
    budget_minutes: float | None  # None: the sizes as given, estimated only
    train_prompts: int
    minutes: float  # training time box
    estimates_s: dict[str, float]  # stage -> seconds expected here
    spent_s: float  # loading the target and probing the machine, before the first stage
    probe: dict
    note: str  # what the plan changed and why, for the console and the report
    refit: dict | None = None  # training re-sized from the measured stages before it (once; a resume reuses it)

    def total_minutes(self) -> float:
        return (self.spent_s + sum(self.estimates_s.values())) / 60


def fit(budget_s: float, spent_s: float, estimate: Callable[[int, float], dict[str, float]], prompts: int,
        minutes: float) -> tuple[int, float]:
    """The largest (prompts x sqrt(f), minutes x f^1.5), f <= 1, no smaller than the minimums, whose estimated stages
    fit MARGIN x budget after `spent_s`. At the minimums when even they do not fit."""
    def sized(f: float) -> tuple[int, float]:
        return (max(min(MIN_PROMPTS, prompts), min(prompts, int(prompts * f**0.5))),
                max(min(MIN_MINUTES, minutes), minutes * f**1.5))

    def fits(f: float) -> bool:
        return spent_s + sum(estimate(*sized(f)).values()) <= MARGIN * budget_s

    if fits(1.0):
        return sized(1.0)
    lo, hi = 0.0, 1.0
    for _ in range(20):  # bisection: the total grows with f
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return sized(lo)


def settings_key(cfg) -> str:
    """What a plan depends on: the settings, not the out folder or the progress display."""
    return sha256_json({k: v for k, v in asdict(cfg).items() if k not in ("out", "progress")})


def load_plan(path: Path, key: str) -> Plan | None:
    if not path.is_file():
        return None
    data = read_json(path)
    return Plan(**data) if data.get("key") == key else None


def make_plan(cfg, key: str, spent_s: float, probe: dict, estimate: Callable[[int, float], dict[str, float]],
              prompts: int) -> Plan:
    """Sizes the demo to cfg.budget_minutes (none: as given). `prompts`: the training prompts the settings ask for."""
    budget = cfg.budget_minutes or None
    sized_prompts, minutes = (prompts, cfg.minutes) if budget is None else fit(budget * 60, spent_s, estimate, prompts,
                                                                              cfg.minutes)
    estimates = estimate(sized_prompts, minutes)
    total = (spent_s + sum(estimates.values())) / 60
    if budget is None:
        note = f"no budget set: {prompts} training prompts, {minutes:g} training minutes (about {total:.0f} min here)"
    elif (sized_prompts, minutes) == (prompts, cfg.minutes):
        note = (f"fits the {budget:g}-minute budget as asked: {prompts} training prompts, {minutes:g} training minutes "
                f"(about {total:.0f} min here)")
    else:
        note = (f"sized to the {budget:g}-minute budget from this machine's probe: {sized_prompts} of {prompts} training "
                f"prompts and {minutes:.1f} of {cfg.minutes:g} training minutes (about {total:.0f} min here"
                + (", over the budget even at the smallest sizes" if total > budget else "") + ")")
    return Plan(key, budget, sized_prompts, round(minutes, 2), estimates, spent_s, probe, note)


def refit(plan: Plan, asked_minutes: float, measured_s: dict[str, float]) -> Plan:
    """The plan with training re-sized to what the measured stages (stage -> seconds) left of the budget, between
    MIN_MINUTES and the minutes asked; the other estimates stay (the report sets them against the actuals).
    Unchanged without a budget, or when already refitted."""
    if plan.budget_minutes is None or plan.refit is not None:
        return plan
    overhead = plan.estimates_s["train"] - plan.minutes * 60
    later = sum(s for k, s in plan.estimates_s.items() if k not in measured_s and k != "train")
    left = MARGIN * plan.budget_minutes * 60 - plan.spent_s - sum(measured_s.values()) - later - overhead
    minutes = round(max(min(MIN_MINUTES, asked_minutes), min(asked_minutes, left / 60)), 2)
    stages = ", ".join(f"{k} {measured_s[k]:.0f} s (est. {plan.estimates_s[k]:.0f})" for k in measured_s)
    resized = f"re-sized from {plan.minutes:g} to {minutes:g}" if minutes != plan.minutes else f"keeps its {minutes:g}"
    note = f"{plan.note}; after {stages}, training {resized} minutes"
    return replace(plan, minutes=minutes, estimates_s={**plan.estimates_s, "train": minutes * 60 + overhead},
                   note=note, refit={"measured_s": measured_s, "planned_minutes": plan.minutes})


def save_plan(path: Path, plan: Plan) -> None:
    write_json(path, asdict(plan))
