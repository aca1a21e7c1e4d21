"""Issue 50: predicted decoding speed from an acceptance and an engine's cost model. The formula against a reference
written out here with a fixed model; the cost model's cache (reused, keyed); bad input as one-line errors; the
`cost` and `eval --engine` commands and bench's predicted-beside-measured rows on tiny random targets; the peers'
probes where llama.cpp and vLLM are installed."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics

import pytest
import torch

import dflashkit.measure.costmodel as cm
from dflashkit.cli import main
from dflashkit.measure.costmodel import CostModel, cost_model, load_model
from dflashkit.measure.predict import offline_acceptance, predict_offline, predict_rounds
from dflashkit.drafter.checkpoint import new_drafter, save_drafter
from dflashkit.engines.install import find
from dflashkit.errors import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread")

FIXED = CostModel("hf", [1, 2, 4, 8, 16, 32, 64], [10.0, 11.0, 12.0, 14.0, 18.0, 26.0, 42.0], 3.0,
                  {"ar": 1.0, "chain": 1.5, "tree": 2.5})
ACCEPTANCE = {"block_size": 4, "chain": [0.8, 0.5, 0.2], "ddtree": {1: 0.8, 2: 1.1, 4: 1.5, 8: 1.9, 16: 2.0}}


def test_the_formula_equals_a_reference_written_out():
    rows = predict_offline(ACCEPTANCE, FIXED)
    plain = 1000 / (10 + 1)
    chain = 1000 * (1 + 0.8 + 0.5 + 0.2) / (3 + 12 + 1.5)  # tokens per round / (draft + forward(4) + chain's work)
    forward9 = 14 + (18 - 14) * (9 - 8) / (16 - 8)  # between the measured 8 and 16
    ddtree8 = 1000 * (1 + 1.9) / (3 + forward9 + 2.5)
    forward17 = 18 + (26 - 18) * (17 - 16) / (32 - 16)
    ddtree16 = 1000 * 3.0 / (3 + forward17 + 2.5)
    assert rows["ar"]["tokens_per_s"] == pytest.approx(plain) and rows["ar"]["speedup"] == pytest.approx(1.0)
    assert rows["chain"]["tokens_per_s"] == pytest.approx(chain)
    assert rows["chain"]["speedup"] == pytest.approx(chain / plain)
    assert rows["ddtree-8"]["tokens_per_s"] == pytest.approx(ddtree8)
    assert rows["ddtree-16"]["tokens_per_s"] == pytest.approx(ddtree16)
    best = max((rows[f"ddtree-{b}"]["tokens_per_s"], b) for b in (1, 2, 4, 8, 16))
    assert rows["ddtree-auto"]["tokens_per_s"] == pytest.approx(best[0]) and rows["ddtree-auto"]["budget"] == best[1]


def test_compiled_widths_round_up_and_a_tree_past_the_widest_is_not_predicted():
    static = CostModel("static", [1, 4, 8, 16, 24], [10.0, 12.0, 13.0, 16.0, 19.0], 3.0, {"ar": 1.0}, rounding="up")
    assert [static.forward(n) for n in (1, 2, 5, 9, 24)] == [10.0, 12.0, 13.0, 16.0, 19.0]
    assert static.forward(25) == math.inf and static.overhead("tree") == 1.0  # a loop not measured: ar's
    rows = predict_offline({**ACCEPTANCE, "ddtree": {8: 1.9, 32: 2.5}}, static)
    assert rows["ddtree-32"]["tokens_per_s"] is None and rows["ddtree-auto"]["budget"] == 8


def test_a_backend_that_verifies_one_path_a_row_is_priced_on_its_paths_curve():
    """A tree one root-to-leaf path per batch row copies the KV to every row: it is priced on the model's own
    curve of such verifies over its leaves x (depth + 1) tokens."""
    by_paths = dataclasses.replace(FIXED, paths={"ns": [1, 4, 8, 16], "ms": [10.0, 12.0, 17.0, 25.0]})
    acceptance = {**ACCEPTANCE, "paths": {8: 14}}  # the budget-8 trees: e.g. 3.5 leaves x depth 3 + 1
    rows = predict_offline(acceptance, by_paths)
    paths14 = 17 + (25 - 17) * (14 - 8) / (16 - 8)
    assert rows["ddtree-8"]["width"] == 14
    assert rows["ddtree-8"]["tokens_per_s"] == pytest.approx(1000 * (1 + 1.9) / (3 + paths14 + 2.5))
    assert rows["ddtree-4"]["tokens_per_s"] is None and "budget_curve_paths" in rows["ddtree-4"]["why"]  # not flat
    assert predict_offline(acceptance, FIXED)["ddtree-8"]["width"] == 9  # a flattened verify: nodes + root
    rounds = predict_rounds([2, 3], [3, 12], [True, True], by_paths, "tree")  # a chain-shaped tree, 3 paths
    assert rounds["ms_per_round"]["verify"] == pytest.approx((10 + 2 * 2 / 3 + 17 + (25 - 17) * 4 / 8) / 2)
    back = CostModel.from_dict(json.loads(json.dumps(by_paths.to_dict())))
    assert back.paths == by_paths.paths and back.forward_paths(12) == by_paths.forward_paths(12)


def test_ddtree_auto_replays_the_walks_trees_cut_where_decoding_cuts_them():
    """Each round's cut maximizes (1 + expected accepted) / (draft + forward(nodes + 1) + the tree loop's work), as
    the online loop's prune does; the round commits the accepted path's nodes inside it (a reference written out)."""
    cuts = {"gains": [[1.0, 1.9, 2.5, 2.6], [1.0, 1.1, 1.15, 1.18]], "tokens": [[1, 2, 3, 4], [1, 2, 3, 4]],
            "path": [[1, 2], []]}
    fixed = FIXED.draft_ms + FIXED.overhead("tree")
    chosen = [max(range(4), key=lambda n: g[n] / (fixed + FIXED.forward(n + 1))) for g in cuts["gains"]]
    assert chosen == [3, 2]  # the second round's third node costs more than it is worth
    tokens, ms = (3 + 1) / 2, fixed + (FIXED.forward(4) + FIXED.forward(3)) / 2
    row = predict_offline({**ACCEPTANCE, "cuts": cuts}, FIXED)["ddtree-auto"]
    assert row["tokens_per_round"] == tokens and row["tokens_per_s"] == pytest.approx(1000 * tokens / ms)
    assert row["budget"] == "cut per round" and row["width"] == 3.5
    assert predict_offline(ACCEPTANCE, FIXED)["ddtree-auto"]["budget"] in ACCEPTANCE["ddtree"]  # no cuts: a budget


def test_a_hybrid_replayed_offline_is_priced_round_by_round_and_its_best_budget_is_auto():
    replay = {"accepted": [0, 3, 1, 5], "nodes": [9, 12, 9, 19], "path_tokens": [16, 20, 16, 30]}
    rows = predict_offline({**ACCEPTANCE, "hybrid": {4: {**replay, "accepted": [0, 0, 1, 0]}, 8: replay}}, FIXED)
    want = predict_rounds([1, 4, 2, 6], [9, 12, 9, 19], [True] * 4, FIXED, "tree")
    assert rows["hybrid-8"]["tokens_per_s"] == pytest.approx(want["tokens_per_s"])
    assert rows["hybrid-auto"]["budget"] == 8 and rows["hybrid-auto"]["speedup"] == rows["hybrid-8"]["speedup"]
    by_paths = dataclasses.replace(FIXED, paths={"ns": [1, 4, 8, 16, 32], "ms": [10.0, 12.0, 17.0, 25.0, 40.0]})
    assert predict_offline({**ACCEPTANCE, "hybrid": {8: replay}}, by_paths)["hybrid-8"]["width"] == 20.5  # path tokens
    overall = {"acc_cumulative": [0.6], "budget_curve": {"1": 0.6}, "hybrid": {"8": replay}}
    assert offline_acceptance(overall, 2)["hybrid"] == {8: replay}


def test_a_model_over_a_benchs_minutes_takes_the_samples_medians():
    """Each sampled curve (the forward, hf's paths): the median of the samples at every n they all hold; the drafter
    call and the loops' work stay as measured; a curve not sampled stays too."""
    model = dataclasses.replace(FIXED, paths={"ns": [1, 4], "ms": [10.0, 30.0]})
    fwd = [{1: 20.0, 4: 24.0, 8: 28.0}, {1: 22.0, 4: 26.0, 8: 30.0, 16: 50.0}, {1: 18.0, 4: 30.0, 8: 26.0}]
    m = cm.in_window(model, [{"forward": f} for f in fwd] + [None])
    assert m.ns == [1, 4, 8] and m.forward_ms == [20.0, 26.0, 28.0] and m.paths == model.paths
    assert m.draft_ms == FIXED.draft_ms and m.overhead_ms == FIXED.overhead_ms and FIXED.record == {}
    assert m.record["window"] == {"samples": 3, "level": statistics.median([20 / 10, 26 / 12, 28 / 14])}
    paths = [{1: 20.0, 8: 60.0}, {1: 22.0, 8: 64.0, 16: 99.0}, {1: 24.0, 8: 62.0}]
    m = cm.in_window(model, [{"forward": f, "paths": p} for f, p in zip(fwd, paths)])
    assert m.paths == {"ns": [1, 8], "ms": [22.0, 62.0]}
    assert cm.in_window(FIXED, [None]) is FIXED  # nothing sampled: the cached model alone


def test_an_engines_rounds_timed_in_the_window_set_its_loop_and_drafter():
    """Where the engine's own rounds were timed between the prompts (llama.cpp), a round priced from the window's
    model is those rounds' median: its plain loop's work and drafter call follow them, not the cached probe."""
    model = dataclasses.replace(FIXED, engine="llama.cpp", overhead_ms={"ar": 0.0}, record={"drafter": {"block_size": 4}})
    fwd = {1: 10.0, 4: 20.0}
    timed = [{"ar": 11.0, "chain": 26.0}, {"ar": 10.5, "chain": 27.0}, {"ar": 12.0, "chain": 26.5}]
    m = cm.in_window(model, [{"forward": fwd, "rounds": r} for r in timed])
    assert m.overhead("ar") == pytest.approx(1.0) and m.forward(1) + m.overhead("ar") == pytest.approx(11.0)
    assert m.draft_ms + m.forward(4) + m.overhead("chain") == pytest.approx(26.5)
    assert m.record["window"]["rounds"] == {"ar": 11.0, "chain": 26.5}
    assert predict_offline(ACCEPTANCE, m)["chain"]["ms_per_round"]["total"] == pytest.approx(26.5)
    fast = cm.in_window(model, [{"forward": fwd, "rounds": {"ar": 9.0, "chain": 15.0}}])  # never below the forwards
    assert fast.overhead("ar") == 0.0 and fast.draft_ms == 0.0
    plain = cm.in_window(model, [{"forward": fwd}])  # not timed: as cached
    assert plain.draft_ms == FIXED.draft_ms and plain.overhead_ms == {"ar": 0.0} and "rounds" not in plain.record["window"]


def test_a_window_sample_times_an_open_llama_cpp_peers_round(monkeypatch):
    """forward_sample hands the run's llama.cpp peer the probe prompt: one token, then PEER_TOKENS; a round is the
    difference over the rounds the engine reports (verify steps with a drafter, tokens without)."""
    from dflashkit.engines.llamacpp import EngineAnswer

    class Engine:
        def __init__(self, per_round, speculative):
            self.per_round, self.speculative, self.asked = per_round, speculative, []

        def complete(self, ids, n, stops):
            self.asked.append(n)
            rounds = n if not self.speculative else (0 if n == 1 else n // 2)
            return EngineAnswer(list(range(n)), 0.05 + rounds * self.per_round, 0.05, 0, 0, rounds)

    class Peer:
        def __init__(self, *a):
            self.engine = Engine(*a)

    class Target:
        stop_token_ids = [0]

        def chat_ids(self, messages):
            return [1, 2, 3]

    plain, dflash = Peer(0.010, False), Peer(0.026, True)
    assert cm.forward_sample("llama.cpp", Target(), None, {}, plain)["rounds"]["ar"] == pytest.approx(10.0)
    assert plain.engine.asked == [1, cm.PEER_TOKENS]
    assert cm.forward_sample("llama.cpp", Target(), None, {}, dflash, True)["rounds"]["chain"] == pytest.approx(26.0)
    assert cm.forward_sample("llama.cpp", Target(), None, {}) is None and cm.forward_sample("vllm", None, None, {}) is None
    rounds = cm.in_window(dataclasses.replace(FIXED, record={"drafter": {"block_size": 4}}), [{"rounds": {"chain": 26.0}}])
    assert rounds.forward_ms == FIXED.forward_ms and rounds.draft_ms + rounds.forward(4) + rounds.overhead("chain") == 26.0


def test_a_decodes_own_rounds_priced_by_the_model():
    row = predict_rounds([2, 3, 1], [9, 9, 1], [True, True, False], FIXED, "tree")
    forward9 = 14.5
    want = 1000 * (6 / 3) / (3 * 2 / 3 + (2 * forward9 + 10) / 3 + 2.5)
    assert row["tokens_per_s"] == pytest.approx(want)


def test_an_eval_overall_gives_the_acceptance_and_a_missing_field_is_named():
    overall = {"acc_cumulative": [0.6, 0.3], "budget_curve": {"1": 0.6, "2": 0.8}, "budget:8": 1.2}
    acc = offline_acceptance(overall, 3)
    assert acc["chain"] == [0.6, 0.3] and acc["ddtree"] == {1: 0.6, 2: 0.8, 8: 1.2}
    with pytest.raises(DFlashError, match="overall.acc_cumulative"):
        offline_acceptance({"budget_curve": {}}, 3, "run r/results.json")
    no_drafter = CostModel("hf", [1], [10.0], None, {"ar": 1.0})
    with pytest.raises(DFlashError, match="--drafter DIR --force"):
        predict_offline(ACCEPTANCE, no_drafter)


def test_a_cost_file_missing_a_field_is_one_line_naming_the_file_field_and_fix(tmp_path):
    path = tmp_path / "hf-x.json"
    d = FIXED.to_dict()
    del d["forward"]["ms"]
    path.write_text(json.dumps(d))
    with pytest.raises(DFlashError) as e:
        load_model(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "'forward.ms'" in msg and "--force" in msg
    path.write_text(json.dumps({**FIXED.to_dict(), "overhead_ms": {"chain": 1.0}}))
    with pytest.raises(DFlashError, match="'overhead_ms.ar' is missing"):
        load_model(path)
    for other in ({**FIXED.to_dict(), "format": "dflashkit-cost-model/0"}, [1, 2]):  # issue 72: never checked
        path.write_text(json.dumps(other))
        with pytest.raises(DFlashError, match=r"field 'format' is .*not 'dflashkit-cost-model/1'.*--force"):
            load_model(path)
    assert load_model(_written(tmp_path, FIXED)).forward(9) == pytest.approx(14.5)


def _written(tmp_path, model):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(model.to_dict()))
    return path


def test_an_engine_without_a_cost_model_is_one_line(tiny_targets, capsys):
    with pytest.raises(DFlashError, match=r"--engine 'tensorrt': no cost model for it; use one of auto, hf, static"):
        cost_model("tensorrt", tiny_targets["llama"])
    assert main(["cost", "--engine", "hf,tensorrt"]) == 2  # before any target loads
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensorrt" in err[0]


@pytest.fixture
def home(tmp_path, machine_env):
    machine_env(DFLASHKIT_HOME=tmp_path / "home")
    return tmp_path / "home"


def test_the_cache_is_reused_and_keyed(tiny_dirs, tiny_targets, home, monkeypatch):
    """A second call reads the file; another dtype or thread count measures again, as does `force`."""
    from dflashkit.targets.model import load_target

    calls = []
    monkeypatch.setitem(cm.PROBES, "hf", lambda target, proposer, state, log=None: calls.append(target.dtype) or FIXED)
    t = tiny_targets["llama"]
    first = cost_model("hf", t)
    assert len(calls) == 1 and first.path.parent == home / "cost-model" and first.path.is_file()
    again = cost_model("hf", t)
    assert len(calls) == 1 and again.forward_ms == FIXED.forward_ms and again.record["dtype"] == "float32"
    cost_model("hf", load_target(tiny_dirs["llama"], device="cpu", dtype="bfloat16"))
    assert calls[-1] == torch.bfloat16 and len(calls) == 2
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        cost_model("hf", t)
    finally:
        torch.set_num_threads(n)
    assert len(calls) == 3 and len(list((home / "cost-model").glob("hf-*.json"))) == 3
    cost_model("hf", t, force=True)
    assert len(calls) == 4
    with pytest.raises(DFlashError, match="no hf cost model cached"):
        cost_model("hf", t, new_proposer(t), measure=False)  # another drafter shape: not cached


def test_a_model_measured_under_load_is_marked_and_measured_again(tiny_targets, home, monkeypatch, capsys):
    """Issue 72: a cost model measured under contention (3x slow) was cached with no note of the load. Now the load
    is recorded, one line on stderr names the file and the fix, and the next call measures again (but where it
    may not measure, the loaded one serves); an old file without a load is read as it was."""
    import os

    calls = []
    monkeypatch.setitem(cm.PROBES, "hf", lambda target, proposer, state, log=None: calls.append(1) or FIXED)
    t = tiny_targets["llama"]
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 1.0, 1.0))  # no /proc/stat (conftest): the load average
    busy = cost_model("hf", t)
    err = capsys.readouterr().err.splitlines()
    assert busy.record["load"]["loaded"] and json.loads(busy.path.read_text())["record"]["load"]["start"] == 64.0
    assert len(err) == 1 and err[0].startswith("cost model: hf was measured under load (load 64.0 on ")
    assert f"{busy.path} is marked loaded" in err[0] and "`dflashkit cost --force` when the machine is quiet" in err[0]
    assert cost_model("hf", t, measure=False).record["load"]["loaded"] and len(calls) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 1.0, 1.0))
    assert not cost_model("hf", t).record["load"]["loaded"] and len(calls) == 2
    assert capsys.readouterr().err == ""
    old = json.loads(busy.path.read_text())
    del old["record"]["load"]
    busy.path.write_text(json.dumps(old))
    assert "load" not in cost_model("hf", t).record and len(calls) == 2
    assert "(load not recorded)" in "".join(cm.cost_markdown(cost_model("hf", t)))


def new_proposer(t, block_size=4):
    from dflashkit.decode.speculative import DFlashProposer

    torch.manual_seed(0)
    return DFlashProposer(t, new_drafter(t, num_layers=1, target_layer_ids=[1, 3], block_size=block_size).eval())


def test_the_hf_probe_measures_every_part(tiny_targets, home):
    t = tiny_targets["llama"]
    model = cost_model("hf", t, new_proposer(t))
    assert model.ns == list(cm.PROBE_NS) and all(ms > 0 for ms in model.forward_ms)
    assert model.draft_ms > 0 and set(model.overhead_ms) == {"ar", "chain", "tree"}
    assert model.record["drafter"]["block_size"] == 4 and model.record["probe_s"] >= 0
    assert predict_offline(ACCEPTANCE, model)["chain"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_the_static_probe_times_its_compiled_widths(tiny_targets, native_kernels, home, monkeypatch):
    from helpers import eager_decoders

    eager_decoders(monkeypatch, length=600)
    t = tiny_targets["llama"]
    model = cost_model("static", t, new_proposer(t))
    assert model.rounding == "up" and model.ns == [1, 4, 8, 16, 24] and model.forward(25) == math.inf
    assert model.draft_ms > 0 and set(model.overhead_ms) == {"ar", "chain", "tree"}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_targets):
    from dflashkit.cache import extract
    from dflashkit.prompts import load_prompts

    t = tiny_targets["llama"]
    root = tmp_path_factory.mktemp("predict")
    cache = extract(t, load_prompts("coding-10").subset(2), root / "cache", layer_ids=[1, 3], max_new_tokens=24,
                    progress=False)
    torch.manual_seed(0)
    save_drafter(new_drafter(t, num_layers=1, target_layer_ids=[1, 3], block_size=4), root / "d",
                 target_identity=t.identity())
    return root, cache


def test_eval_with_an_engine_prints_the_prediction(evaluated, home, capsys):
    root, cache = evaluated
    assert main(["eval", "--drafter", str(root / "d"), "--cache", str(cache), "--out", str(root / "run"),
                 "--engine", "hf", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "## Predicted decoding speed on hf" in out and "offline eval (stride anchors" in out
    for method in ("| ar ", "| chain ", "| ddtree-8 ", "| ddtree-auto "):
        assert method in out, method
    assert len(list((home / "cost-model").glob("hf-*.json"))) == 1
    assert main(["eval", "--drafter", str(root / "d"), "--cache", str(cache), "--out", str(root / "walk-hf"),
                 "--engine", "hf", "--threads", "1", "--anchors", "walk"]) == 0  # walk: hybrid-auto replayed on hf
    auto = json.loads((root / "walk-hf" / "results.json").read_text())["overall"]["hybrid_auto"]["hf"]
    assert len(auto["accepted"]) == len(auto["nodes"]) == len(auto["drafted"]) > 0
    dd = json.loads((root / "walk-hf" / "results.json").read_text())["overall"]["ddtree_auto"]["hf"]
    assert len(dd["accepted"]) == len(dd["drafted"]) > 0  # ddtree-auto replayed with its gate too (issue 73)
    out = capsys.readouterr().out
    assert re.search(r"\| hybrid-auto \|.*budget replayed per round", out)
    assert re.search(r"\| ddtree-auto \|.*budget replayed per round", out)
    assert main(["eval", "--drafter", str(root / "d"), "--cache", str(cache), "--out", str(root / "run2"),
                 "--engine", "nope"]) == 2
    assert "no cost model for it" in capsys.readouterr().err
    assert not (root / "run2").exists()  # refused before the evaluation


def test_the_cost_command_writes_a_table_and_a_plot(evaluated, home, tiny_dirs, capsys, tmp_path):
    root, _ = evaluated
    out = tmp_path / "cost"
    assert main(["cost", "--target", str(tiny_dirs["llama"]), "--drafter", str(root / "d"), "--engine", "hf",
                 "--dtype", "float32", "--out", str(out), "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert "## Cost model: hf" in text and "| 64 " in text and "Drafter call:" in text
    assert (out / "cost.png").stat().st_size > 0 and "hf" in json.loads((out / "cost.json").read_text())


def test_bench_predicts_beside_measured_from_its_rounds_and_an_offline_eval(evaluated, tiny_targets, home):
    from dflashkit.measure.bench import bench_markdown, parse_methods, run_bench
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.decode.speculative import DFlashProposer
    from dflashkit.fileio import read_json, write_json

    root, cache = evaluated
    t = tiny_targets["llama"]
    assert main(["eval", "--drafter", str(root / "d"), "--cache", str(cache), "--out", str(root / "walk"),
                 "--anchors", "walk"]) == 0
    offline = read_json(root / "walk" / "results.json")
    assert len(offline["overall"]["ddtree_cuts"]["path"]) == offline["overall"]["blocks"]  # one per walk round
    assert set(offline["overall"]["hybrid"]) == {"4", "8"}  # the default trees' budgets, replayed with the n-gram
    assert re.search(r"Hybrid replayed .* hybrid-4 tau=\d", (root / "walk" / "summary.md").read_text())
    prompts = [(x, t.chat_ids([{"role": "user", "content": x}])) for x in ("def add(a, b):", "Write a haiku.")]
    drafter = load_drafter(root / "d", target=t)
    slow = cost_model("hf", t, DFlashProposer(t, drafter, drafter.config.block_size))  # from a much slower hour
    slow.forward_ms = [1e6] * len(slow.forward_ms)
    write_json(slow.path, slow.to_dict())
    on_hf = {**offline, "overall": {**offline["overall"], "acc_cumulative": [0.0] * 3}, "source": "hf's answers"}
    res = run_bench(t, drafter, prompts, parse_methods("ar,chain,ddtree-8,ngram,hybrid-8"),
                    max_new_tokens=12, progress=False, warmup=False, offline={"": offline, "hf": on_hf})
    hf = res["cost_models"]["hf"]  # its forwards sampled before each run: 5 methods x 2 prompts
    assert max(hf["forward"]["ms"]) < 1e5 and hf["record"]["window"]["samples"] == 10
    s = res["methods"]
    assert all(s[m]["predicted"]["window"]["samples"] == 2 for m in ("ar", "chain", "ngram"))  # each row: its own runs
    assert s["hybrid-8"]["predicted"]["offline"]["tokens_per_s"] > 0
    for m in ("ar", "chain", "ddtree-8", "ngram"):
        p = s[m]["predicted"]
        assert p["engine"] == "hf" and p["online"]["tokens_per_s"] > 0 and p["online"]["error"] is not None, m
    assert s["ddtree-8"]["predicted"]["online"]["width"] > 1
    chain = s["chain"]["predicted"]["offline"]  # the eval on the hf rows' own answers, not the one for the rest
    assert chain["source"] == "hf's answers" and chain["tokens_per_round"] == 1.0
    ar, chain = s["ar"]["predicted"], s["chain"]["predicted"]  # the speedup over plain decoding, predicted vs measured
    want = (chain["online"]["tokens_per_s"] / ar["online"]["tokens_per_s"]) / (
        chain["measured_decode_tokens_per_s"] / ar["measured_decode_tokens_per_s"]) - 1
    assert chain["online"]["speedup_error"] == pytest.approx(want) and ar["online"]["speedup_error"] == pytest.approx(0)
    assert "offline" not in s["ngram"]["predicted"]  # the offline walk replays hybrids, not the n-gram alone
    md = bench_markdown(res)
    assert "hf" in res["cost_models"] and "## Predicted beside measured" in md and "](predicted.png)" in md
    spent = res["seconds"]  # what the prediction cost the bench (issue 70), stated in the report
    assert 0 < spent["predict"] < spent["bench"]
    assert f"The prediction took {spent['predict']:.1f} s of the bench's {spent['bench']:.0f} s" in md


def test_bench_offline_takes_one_eval_per_engine_and_refuses_a_misnamed_one(tmp_path):
    from dflashkit.measure.cli import offline_runs
    from dflashkit.fileio import write_json

    for name in ("a", "b"):
        write_json(tmp_path / name / "results.json", {"overall": {}, "settings": {"anchors": "walk"}})
    runs = offline_runs([str(tmp_path / "a"), f"static={tmp_path / 'b'}"])
    assert set(runs) == {"", "static"} and runs["static"]["source"].endswith("for the static rows")
    assert str(tmp_path / "b") in runs["static"]["source"] and "for the" not in runs[""]["source"]
    with pytest.raises(DFlashError, match="no engine 'stati'; name one of hf, static, llama.cpp, vllm"):
        offline_runs([f"stati={tmp_path / 'b'}"])
    with pytest.raises(DFlashError, match="engine static is given twice"):
        offline_runs([f"static={tmp_path / 'a'}", f"static={tmp_path / 'b'}"])
    with pytest.raises(DFlashError, match="no results.json there"):
        offline_runs([f"hf={tmp_path / 'c'}"])


def test_bench_offline_refuses_an_eval_of_another_target_drafter_or_block(tiny_targets, tmp_path):
    """Issue 72: an eval of another target or drafter, or at another block size, priced bench rows without a word
    (a chain 43% off); each is refused by name, and the eval of this drafter, target and block passes."""
    from dflashkit.measure.cli import check_offline
    from dflashkit.fileio import sha256_file

    t, other = tiny_targets["llama"], tiny_targets["qwen3"]
    save_drafter(new_drafter(t, num_layers=1, target_layer_ids=[1, 3], block_size=4), tmp_path / "d",
                 target_identity=t.identity())
    mine = sha256_file(tmp_path / "d" / "model.safetensors")
    run = lambda target=t, sha=mine, block=4: {"": {"source": "offline eval runs/e (walk anchors, 9 blocks)",
                                                    "target": target.identity(), "drafter": {"sha256": sha, "path": "x"},
                                                    "settings": {"block_size": block}}}
    check_offline(run(), t, str(tmp_path / "d"), 4)
    with pytest.raises(DFlashError, match="offline eval runs/e was made with target .*; pass an eval run of the "
                                          "bench's target"):
        check_offline(run(target=other), t, str(tmp_path / "d"), 4)
    with pytest.raises(DFlashError, match="evaluated another drafter"):
        check_offline(run(sha="0" * 64), t, str(tmp_path / "d"), 4)
    with pytest.raises(DFlashError, match="evaluated block size 8, bench runs 4"):
        check_offline(run(block=8), t, str(tmp_path / "d"), 4)


needs_llama = pytest.mark.skipif(find("llama.cpp") is None, reason="llama.cpp not installed: "
                                 "`dflashkit engines install llama.cpp`")
needs_vllm = pytest.mark.skipif(find("vllm") is None, reason="vLLM not installed: `dflashkit engines install vllm`")


@pytest.mark.engines
@pytest.mark.slow
@needs_llama
def test_data_generate_answers_on_llama_cpp(smollm2, tmp_path):
    """`data generate --engine llama.cpp`: every completion is the llama.cpp server's own greedy answer (a fresh
    server asked again answers the same), and the header says which engine wrote them."""
    from dflashkit.cache.sequences import generate_sequences, read_sequences
    from dflashkit.measure.peers import plain_answers
    from dflashkit.measure.peers import EnginePeer
    from dflashkit.prompts import load_prompts

    out = tmp_path / "seqs.jsonl"
    with plain_answers(smollm2, "llama.cpp", 16) as by:
        generate_sequences(smollm2, load_prompts("coding-10").subset(2), out, 16, progress=False, answered_by=by)
    head, recs = read_sequences(out)
    assert head["engine"] == "llama.cpp" and len(recs) == 2
    with EnginePeer("llama.cpp", smollm2, None, 0, 16) as peer:
        assert [r["completion_ids"] for r in recs] == [peer.one(r["prompt_ids"]).tokens for r in recs]
    assert all(0 < len(r["completion_ids"]) <= 16 for r in recs)


@pytest.mark.engines
@pytest.mark.slow
@needs_llama
def test_the_llama_cpp_probe_measures_its_curve_and_rounds(smollm2):
    model = cost_model("llama.cpp", smollm2, new_proposer(smollm2))
    assert model.ns == list(cm.PROBE_NS) and all(ms > 0 for ms in model.forward_ms)
    assert model.draft_ms is not None and model.overhead("ar") >= 0
    assert "llama.cpp build" in model.record["engine_version"]


@pytest.mark.engines
@pytest.mark.slow
@needs_vllm
def test_the_vllm_probe_measures_its_rounds(smollm2):
    model = cost_model("vllm", smollm2, new_proposer(smollm2))
    assert model.ns == [1, 4] and all(ms > 0 for ms in model.forward_ms) and model.draft_ms == 0.0


def test_predicted_against_measured_is_plotted_for_the_rows_that_have_both(tmp_path):
    from dflashkit.measure.predict import predicted_plot, predicted_points

    result = {"config": {"target": "t", "dtype": "float32"}, "methods": {
        "ar": {"predicted": {"measured_decode_tokens_per_s": 40.0, "online": {"tokens_per_s": 39.0},
                             "offline": {"tokens_per_s": 41.0}}},
        "ngram": {"predicted": {"measured_decode_tokens_per_s": 50.0, "online": {"tokens_per_s": 55.0}}},
        "prompt-lookup": {"predicted": {"why": "transformers' own loop"}},
        "llama.cpp": {}}}
    assert predicted_points(result) == {"ar": (40.0, 41.0), "ngram": (50.0, 55.0)}  # offline where given
    path = predicted_plot(result, tmp_path / "predicted.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result["methods"] = {"llama.cpp": {}}
    assert predicted_plot(result, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
