"""The demo's plan (demo/plan.py): training time, then data, shrink until the estimates fit the budget."""

import json

import pytest

from dflashkit.demo import DemoConfig
from dflashkit.demo.plan import (MARGIN, MIN_MINUTES, MIN_PROMPTS, fit, load_plan, make_plan, refit, save_plan,
                                 settings_key)


def estimate(prompts: int, minutes: float) -> dict[str, float]:
    """2 s per prompt of data, the training minutes, and 600 s of fixed stages."""
    return {"data": 2.0 * prompts, "train": 60 * minutes, "bench": 600.0}


def total(prompts, minutes, spent=50.0):
    return spent + sum(estimate(prompts, minutes).values())


def test_a_budget_that_fits_keeps_the_sizes_asked_for():
    assert fit(3600, 50, estimate, 360, 15) == (360, 15)


def test_a_tight_budget_shrinks_minutes_faster_than_prompts_to_the_largest_that_fits():
    prompts, minutes = fit(1800, 50, estimate, 360, 15)
    assert total(prompts, minutes) <= MARGIN * 1800
    f = (minutes / 15) ** (2 / 3)  # one factor: minutes x f^1.5, prompts x f^0.5
    assert prompts / 360 == pytest.approx(f**0.5, abs=0.01) and prompts / 360 > minutes / 15
    g = f * 1.02
    assert total(int(360 * g**0.5), 15 * g**1.5) > MARGIN * 1800  # not needlessly small


def test_minimums_hold_even_when_nothing_fits():
    assert fit(300, 50, estimate, 360, 15) == (MIN_PROMPTS, MIN_MINUTES)
    assert fit(300, 50, estimate, 10, 1) == (10, 1)  # never more than asked


def test_the_plan_says_what_it_cut_and_is_reused_only_for_the_same_settings(tmp_path):
    cfg = DemoConfig(minutes=15, budget_minutes=30)
    plan = make_plan(cfg, settings_key(cfg), 50.0, {"verify_s": 0.1}, estimate, 360)
    assert plan.train_prompts < 360 and plan.minutes < 15
    assert f"{plan.train_prompts} of 360 training prompts" in plan.note and "30-minute budget" in plan.note
    assert plan.total_minutes() <= MARGIN * 30
    over = make_plan(DemoConfig(budget_minutes=5), "k", 50.0, {}, estimate, 360)
    assert "over the budget even at the smallest sizes" in over.note
    unbounded = make_plan(DemoConfig(budget_minutes=None), "k", 50.0, {}, estimate, 360)
    assert (unbounded.train_prompts, unbounded.minutes) == (360, 15) and "no budget set" in unbounded.note
    save_plan(tmp_path / "plan.json", plan)
    assert load_plan(tmp_path / "plan.json", settings_key(cfg)) == plan
    assert load_plan(tmp_path / "plan.json", settings_key(DemoConfig(minutes=15, budget_minutes=31))) is None
    assert settings_key(DemoConfig(out="a")) == settings_key(DemoConfig(out="b"))


def test_refit_gives_training_what_the_measured_data_stages_left_and_happens_once(tmp_path):
    cfg = DemoConfig(minutes=15, budget_minutes=30)
    plan = make_plan(cfg, settings_key(cfg), 50.0, {}, estimate, 360)
    fast = refit(plan, 15, {"data": plan.estimates_s["data"] / 2})  # the data took half its estimate
    saved = plan.estimates_s["data"] / 2
    assert fast.minutes == pytest.approx(min(15, plan.minutes + saved / 60), abs=0.05) and fast.minutes > plan.minutes
    assert fast.train_prompts == plan.train_prompts and fast.estimates_s["data"] == plan.estimates_s["data"]
    assert 50 + saved + sum(fast.estimates_s.values()) - plan.estimates_s["data"] <= MARGIN * 30 * 60 + 1
    assert f"training re-sized from {plan.minutes:g} to {fast.minutes:g} minutes" in fast.note
    assert refit(fast, 15, {"data": 1.0}) is fast  # once: a resumed demo keeps the minutes it trains for
    slow = refit(plan, 15, {"data": plan.estimates_s["data"] * 3})  # slower than probed: training shrinks
    assert MIN_MINUTES <= slow.minutes < plan.minutes
    roomy = make_plan(DemoConfig(minutes=15, budget_minutes=300), "k", 50.0, {}, estimate, 360)
    assert refit(roomy, 15, {"data": 1.0}).minutes == 15  # never more than asked
    unbounded = make_plan(DemoConfig(budget_minutes=None), "k", 50.0, {}, estimate, 360)
    assert refit(unbounded, 15, {"data": 1.0}) is unbounded
    save_plan(tmp_path / "plan.json", fast)
    assert load_plan(tmp_path / "plan.json", settings_key(cfg)) == fast


def test_the_refit_counts_the_whole_of_a_data_stage_that_an_interruption_split_in_two(tmp_path):
    """The first run of the data stage wrote for 400 s and died; the resumed run finished it in moments. The refit
    sees about 400 s, not the moments, so training does not overspend the budget."""
    import os

    from rich.console import Console

    from dflashkit.demo.stages import Stage, StageRunner

    data = tmp_path / "data"

    def interrupted():
        data.mkdir()
        (data / "0.txt").write_text("first half")
        stamp = json.loads((tmp_path / "stages" / "data.json").read_text())
        os.utime(data / "0.txt", (stamp["started"] + 400, stamp["started"] + 400))  # written 400 s into the run
        raise KeyboardInterrupt

    def resumed():
        (data / "1.txt").write_text("second half")

    runner = StageRunner(tmp_path, ["data"], Console(quiet=True))
    with pytest.raises(KeyboardInterrupt):
        runner.run(Stage("data", {"prompts": 6}, [data], interrupted))
    runner.run(Stage("data", {"prompts": 6}, [data], resumed))
    whole = runner.timings["data"].seconds
    assert 400 <= whole < 460 and (data / "0.txt").is_file()  # resumed, not rebuilt
    assert json.loads((tmp_path / "stages" / "data.json").read_text())["seconds"] == whole  # a later skip keeps it
    cfg = DemoConfig(minutes=15, budget_minutes=30)
    plan = make_plan(cfg, settings_key(cfg), 50.0, {}, estimate, 360)
    fitted = refit(plan, 15, {"data": whole})
    assert fitted.refit["measured_s"] == {"data": whole}
    assert fitted.minutes == pytest.approx(refit(plan, 15, {"data": 400.0}).minutes, abs=0.02)
    assert fitted.minutes < refit(plan, 15, {"data": 1.0}).minutes  # what the resumed part alone would have left
