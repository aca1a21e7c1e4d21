"""The demo's sizing (demo/plan.py): stage estimates scale the measured step costs, a tight budget shrinks training
minutes faster than prompts, and training gets what the data stages left once they have run."""

import json

import pytest

from dflashkit.demo import DemoConfig
from dflashkit.demo.plan import (BENCH_START_S, BENCH_TOKEN, COMPILE_S, EVAL_TOKEN, MARGIN, MIN_MINUTES, MIN_PROMPTS,
                                 TRAIN_OVERHEAD_S, estimates, refit, size, timed)

RATES = {"row_s": 0.004, "token_s": 0.05, "spent_s": 30.0}
WORK = {"batch": 96, "train_tokens": 192, "eval_prompts": 10, "eval_tokens": 256, "bench_tokens": 20_000}


def total_s(prompts, minutes, rates=RATES):
    return rates["spent_s"] + sum(estimates(rates, WORK, prompts, minutes).values())


def test_estimates_scale_each_stages_work_by_the_measured_step():
    est = estimates(RATES, WORK, 360, 15)
    assert est["data"] == pytest.approx(360 * 192 * 0.004)  # batches of 96: the rows timed
    assert est["cache"] == pytest.approx(10 * 256 * 0.004 * (96 / 10) ** 0.5)  # 10 rows cost more per row
    assert est["train"] == 15 * 60 + TRAIN_OVERHEAD_S
    assert est["eval"] == pytest.approx(10 * 256 * EVAL_TOKEN * 0.05)
    first = estimates(RATES, {**WORK, "first_compile": True}, 360, 15)  # eval probes the engines: a compile
    assert first["eval"] == pytest.approx(est["eval"] + COMPILE_S) and first["data"] == est["data"]
    assert est["bench"] == pytest.approx(BENCH_START_S + 20_000 * BENCH_TOKEN * 0.05)
    slow = estimates({**RATES, "row_s": 0.008, "token_s": 0.1}, WORK, 360, 15)
    assert all(slow[k] > est[k] for k in ("data", "cache", "eval", "bench")) and slow["train"] == est["train"]


def test_a_budget_that_fits_keeps_the_sizes_asked_for():
    prompts, minutes, note = size(DemoConfig(budget_minutes=60), RATES, WORK, 360)
    assert (prompts, minutes) == (360, 15) and total_s(360, 15) <= MARGIN * 3600
    assert "60-minute budget: 360 of 360 training prompts, 15 of 15 training minutes" in note


def test_a_tight_budget_shrinks_minutes_faster_than_prompts_and_fits():
    cfg = DemoConfig(budget_minutes=30)
    assert total_s(360, 15) > MARGIN * 1800  # the sizes asked do not fit
    prompts, minutes, note = size(cfg, RATES, WORK, 360)
    assert MIN_PROMPTS <= prompts < 360 and MIN_MINUTES <= minutes < 15
    assert prompts / 360 > minutes / 15  # data is cut less than training
    assert total_s(prompts, minutes) == pytest.approx(MARGIN * 1800, abs=6)  # fits, not needlessly small
    assert f"{prompts} of 360 training prompts, {minutes:g} of 15 training minutes" in note
    slower = size(cfg, {**RATES, "token_s": 0.08}, WORK, 360)  # a slower machine gets less of both
    assert slower[0] < prompts and slower[1] < minutes


def test_minimums_hold_when_nothing_fits_and_no_budget_keeps_the_sizes():
    prompts, minutes, _ = size(DemoConfig(budget_minutes=5), RATES, WORK, 360)
    assert (prompts, minutes) == (MIN_PROMPTS, MIN_MINUTES)
    assert size(DemoConfig(budget_minutes=5, minutes=1), RATES, WORK, 10)[:2] == (10, 1)  # never more than asked
    prompts, minutes, note = size(DemoConfig(budget_minutes=None), RATES, WORK, 360)
    assert (prompts, minutes) == (360, 15) and "no budget" in note


def test_refit_gives_training_what_the_data_stages_left():
    cfg = DemoConfig(budget_minutes=30)
    prompts, minutes, _ = size(cfg, RATES, WORK, 360)
    est = estimates(RATES, WORK, prompts, minutes)
    as_estimated = refit(cfg, RATES, est, {"data": est["data"], "cache": est["cache"]})
    assert as_estimated == pytest.approx(minutes, abs=0.1)
    fast = refit(cfg, RATES, est, {"data": est["data"] / 2, "cache": est["cache"]})  # data took half its estimate
    assert fast == pytest.approx(min(15, minutes + est["data"] / 2 / 60), abs=0.1)
    slow = refit(cfg, RATES, est, {"data": est["data"] * 3, "cache": est["cache"]})
    assert MIN_MINUTES <= slow < minutes
    assert refit(DemoConfig(budget_minutes=300), RATES, est, {"data": 1.0, "cache": 1.0}) == 15  # never more
    assert refit(DemoConfig(budget_minutes=None, minutes=7), RATES, est, {"data": 1e6}) == 7


def test_the_timing_is_kept_for_the_same_settings_only(tmp_path, monkeypatch):
    from rich.console import Console

    from dflashkit.demo import plan

    calls = []

    def measure(*args):
        calls.append(args)
        return {"row_s": 0.01, "token_s": 0.1, "seconds": 5.0}

    monkeypatch.setattr(plan, "measure", measure)
    path, quiet = tmp_path / "plan.json", Console(quiet=True)
    first = timed(DemoConfig(out="a"), path, None, [1, 2], 20.0, quiet)
    assert first["spent_s"] == 25.0 and len(calls) == 1
    assert timed(DemoConfig(out="b", progress=False), path, None, [1, 2], 99.0, quiet) == first  # not inputs
    assert len(calls) == 1
    timed(DemoConfig(minutes=7), path, None, [1, 2], 20.0, quiet)
    assert len(calls) == 2 and json.loads(path.read_text())["key"] != first["key"]


def test_the_refit_counts_the_whole_of_a_data_stage_that_an_interruption_split_in_two(tmp_path):
    """The first run of the data stage wrote for 400 s and died; the resumed run finished it in moments. Training
    sees about 400 s spent, not the moments, so it does not overspend the budget."""
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
    whole = runner.timings["data"]["seconds"]
    assert 400 <= whole < 460 and (data / "0.txt").is_file()  # resumed, not rebuilt
    assert json.loads((tmp_path / "stages" / "data.json").read_text())["seconds"] == whole  # a later skip keeps it
    cfg = DemoConfig(budget_minutes=30)
    est = estimates(RATES, WORK, 200, 5)
    assert refit(cfg, RATES, est, {"data": whole}) == pytest.approx(refit(cfg, RATES, est, {"data": 400.0}), abs=0.1)
    assert refit(cfg, RATES, est, {"data": whole}) < refit(cfg, RATES, est, {"data": 1.0})
