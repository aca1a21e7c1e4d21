"""The demo pipeline in reduced form on a tiny fixture: every stage writes its outputs, a rerun skips the
cached stages, a corrupted intermediate file is detected and rebuilt, and a rerun in another dtype rebuilds."""

import json
import shutil
from dataclasses import replace

import pytest

from dflashkit.demo import DemoConfig, run_demo
from dflashkit.errors import DFlashError
from helpers import stock_bf16

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.xdist_group(name="demo")]  # the whole pipeline: `make test-e2e`


@pytest.fixture(scope="module")
def demo_run(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    # float32 on every machine: on a bf16 CPU a rebuilt cache record differs in its last bits (another batch), which
    # rebuilds what follows (correct, but not what the rerun test checks), and bench adds ar@hf-stock
    cfg = DemoConfig(out=str(out), target=str(tiny_dirs["llama"]), device="cpu", dtype="float32", minutes=5, train_prompts=6,
                     plain_peers="none", engine="hf",  # auto would time and compile the static step here
                     train_max_new_tokens=24, gen_batch_size=6, eval_prompts=2, eval_max_new_tokens=24,
                     bench_prompts=2, bench_max_new_tokens=20, holdout_max_new_tokens=16, progress=False,
                     train={"steps": 3, "target_layer_ids": [1, 2, 3], "save_every": 2, "anchors_per_seq": 8,
                            "batch_size": 2})
    report = run_demo(cfg)
    return cfg, out, report


def stamps(out):
    return {p.stem: json.loads(p.read_text()) for p in (out / "stages").glob("*.json")}


def test_every_stage_writes_its_outputs(demo_run):
    cfg, out, report = demo_run
    for rel in ["cache/train/manifest.json", "cache/coding-10/manifest.json", "train/summary.json", "drafters/untrained/config.json",
                "drafters/first-checkpoint/model.safetensors", "eval/trained-stride/results.json",
                "eval/untrained-walk/results.json", "eval/compare-stride", "bench/results.json", "report.md"]:
        assert (out / rel).exists(), rel
    assert (out / "eval/compare-walk/acceptance.png").is_file() and not list((out / "eval/trained-walk").glob("*.png"))
    first = json.loads((out / "drafters/first-checkpoint/dflashkit.json").read_text())
    assert first["trained_steps"] == 2  # the first periodic checkpoint, not the final one (step 3)
    text = (out / "report.md").read_text()
    assert "## Online speculative decoding on `coding-10`" in text and "## Held-out suite `complete-12`" in text
    # bench's own report: every method with tau and its speedups, against the fastest plain decoder too
    assert "| method | backend | tau | tokens/s | speedup vs ar | vs fastest plain (ar) |" in text
    assert "Lossless check: every output equals plain greedy decoding token for token." in text
    assert "threads, torch" in text and "## Training" in text and "position-1 accuracy (train, last steps)" in text
    bench = json.loads((out / "bench/results.json").read_text())
    assert not bench["mismatches"]
    assert set(bench["methods"]) == {"ar", "ngram", "ddtree-8", "hybrid-auto", "prompt-lookup"}
    holdout = json.loads((out / "bench-holdout/results.json").read_text())
    assert holdout["config"]["suite"] == "complete-12" and not holdout["mismatches"]
    assert holdout["config"]["drafter"] == bench["config"]["drafter"] and "sha256" in bench["config"]["drafter"]
    assert holdout["config"]["max_new_tokens"] == cfg.holdout_max_new_tokens
    assert bench["cost"]["ns"][0] == 1 and "### Cost of one target forward" in text
    assert "Numerics: dtype float32" in text and "Decoding kernels: the stock kernels" in text
    # issue 50: the offline walk priced on the cost model, beside measured, in the report and as a plot
    assert "### Predicted beside measured" in text and "![predicted against measured](bench/predicted.png)" in text
    walk = json.loads((out / "eval/trained-walk/results.json").read_text())["overall"]
    assert set(walk["hybrid_auto"]) == {bench["methods"]["hybrid-auto"]["predicted"]["engine"]}  # replayed on it
    assert bench["methods"]["hybrid-auto"]["predicted"]["offline"]["budget"] == "replayed per round"
    summary = json.loads((out / "report.json").read_text())
    assert set(summary["bench"]) == set(bench["methods"]) and summary["training"]["steps"] == 3
    assert summary["offline"]["stride/trained"]["tau"] >= 1.0 and summary["machine"]["threads"] >= 1


def test_the_stages_are_estimated_from_a_timing_of_this_machine_and_sized_to_the_budget(demo_run):
    from dflashkit.demo.plan import TRAIN_OVERHEAD_S

    cfg, out, _ = demo_run
    timing = json.loads((out / "plan.json").read_text())  # the timing of this machine the sizes come from
    assert timing["row_s"] > 0 and timing["token_s"] > 0 and timing["spent_s"] > timing["seconds"] > 0
    built = stamps(out)
    assert set(built) == {"data", "cache", "train", "eval", "bench"}
    assert all(stamp["estimate_s"] > 0 for stamp in built.values())
    # the budget has room for everything asked: all the prompts, and the minutes once data and cache have run
    assert built["train"]["estimate_s"] == cfg.minutes * 60 + TRAIN_OVERHEAD_S
    text = (out / "report.md").read_text()
    assert "| stage | seconds | estimated s | actual / estimate |" in text
    assert f"Plan: {cfg.budget_minutes:g}-minute budget: 6 of 6 training prompts, {cfg.minutes:g} of" in text
    assert f"training gets {cfg.minutes:g} minutes" in text


def test_every_image_the_report_links_exists(demo_run):
    import re

    cfg, out, report = demo_run
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", (out / "report.md").read_text())
    assert len(images) >= 5
    missing = [i for i in images if not (out / i).is_file()]
    assert not missing, missing
    assert all(s["done"] for s in stamps(out).values())


def test_rerun_skips_cached_stages_and_rebuilds_a_corrupted_one(demo_run, capsys):
    cfg, out, _ = demo_run
    before, planned = stamps(out), (out / "plan.json").stat().st_mtime_ns
    run_demo(cfg)
    after = stamps(out)
    assert (out / "plan.json").stat().st_mtime_ns == planned  # the same plan: no second probe
    assert after == before  # nothing rebuilt: same inputs, same outputs
    assert "unchanged, skipped" in capsys.readouterr().out
    # corrupt one prompt file of the eval cache: the cache stage rebuilds it; the rebuilt cache holds what it held
    # before (only its manifest's timestamps differ), so what was built from it is not rebuilt
    victim = sorted((out / "cache" / "coding-10").glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    run_demo(cfg)
    printed = capsys.readouterr().out
    assert "cache: outputs changed or corrupted since they were written; rebuilding" in printed
    assert all(f"{s}: unchanged, skipped" in printed for s in ("train", "eval", "bench")), printed
    from dflashkit.cache.store import verify_cache

    problems, _ = verify_cache(out / "cache" / "coding-10")
    assert problems == []
    rebuilt = stamps(out)
    assert all(s["done"] for s in rebuilt.values())
    assert {k for k in rebuilt if rebuilt[k] != after[k]} == {"cache"}


@stock_bf16  # the rerun's stages run bf16 on torch's own kernels
def test_a_rerun_in_another_dtype_rebuilds_every_stage_and_reports_what_they_were_built_with(demo_run, tmp_path,
                                                                                          capsys):
    cfg, out, _ = demo_run
    copy = tmp_path / "run"  # the float32 demo, resumed in bfloat16 (a copy: the other tests read the original)
    shutil.copytree(out, copy)
    before = stamps(copy)
    capsys.readouterr()
    run_demo(replace(cfg, out=str(copy), dtype="bfloat16"))
    assert "unchanged, skipped" not in capsys.readouterr().out
    after = stamps(copy)
    assert set(after) == set(before) and all(after[s]["inputs"] != before[s]["inputs"] for s in after)
    assert all(s["done"] and s["settings"]["dtype"] == "bfloat16" for s in after.values())
    text = (copy / "report.md").read_text()
    assert "Numerics: dtype bfloat16" in text and "Numerics: dtype float32" not in text
    built = [line for line in text.splitlines() if line.startswith(("| data ", "| bench "))]
    assert len(built) == 2 and all("bfloat16 / cpu / eager" in line for line in built), built
    assert before["data"]["settings"]["dtype"] == "float32"


def test_the_demo_trains_the_recipe_file_with_its_own_overrides_on_top(demo_run, tmp_path):
    """One CPU recipe: dflashkit/configs/smollm2-cpu.yaml is what the demo trains (only the demo's own overrides differ)."""
    from dflashkit.demo import RECIPE, DemoConfig, load_recipe
    from dflashkit.errors import DFlashError
    from dflashkit.train.config import load_config

    cfg, out, _ = demo_run
    from dflashkit.configs import find_config

    assert RECIPE == "smollm2-cpu" and find_config(RECIPE).parent.name == "configs"  # shipped in the package
    trained = json.loads((out / "train" / "summary.json").read_text())["config"]
    recipe = load_config(RECIPE).to_dict()
    assert trained["gamma"] == recipe["gamma"] == 1.0 and trained["num_layers"] == recipe["num_layers"]
    assert trained["num_target_layers"] == recipe["num_target_layers"] == 5 and recipe["target_layer_ids"] is None
    assert trained["anchors_per_seq"] == 8 and trained["out"] == str(out / "train")  # the demo's overrides
    with pytest.raises(DFlashError, match=r"nope.yaml: config file not found"):
        load_recipe(DemoConfig(recipe=str(tmp_path / "nope.yaml")))


def test_the_plain_peers_are_llama_cpp_when_installed(monkeypatch):
    """A speedup is also stated against the fastest plain decoding a user could run here: auto benches llama.cpp
    where it is installed (our own plain decoding runs on the engine chosen, and on hf beside it when that is
    static); none, neither."""
    from dflashkit.demo import peer_methods
    from dflashkit.engines import install

    monkeypatch.setattr(install, "find", lambda engine: None)
    assert peer_methods(DemoConfig()) == []
    monkeypatch.setattr(install, "find", lambda engine: object() if engine == "llama.cpp" else None)
    assert peer_methods(DemoConfig()) == ["llama.cpp"]
    assert peer_methods(DemoConfig(plain_peers="none")) == []
    with pytest.raises(DFlashError, match="plain_peers 'all': use auto or none"):
        peer_methods(DemoConfig(plain_peers="all"))


def test_the_console_line_sets_our_best_method_against_the_fastest_plain_decoder():
    """hybrid-auto at 2x our ar but 0.67x ar on the static backend: the line says both; the plain peers and
    transformers' prompt lookup are not ours, however fast."""
    from dflashkit.demo.report import headline

    rows = {"ar": (30.0, 1.0), "ar@static": (90.0, 3.0), "llama.cpp": (75.0, 2.5), "hybrid-auto": (60.0, 2.0),
            "ngram": (45.0, 1.5), "prompt-lookup": (80.0, 2.7)}
    bench = {"mismatches": [], "methods": {
        m: {"tokens_per_s": t, "speedup_vs_ar": s, "speedup_vs_fastest_plain": t / 90.0, "fastest_plain": "ar@static",
            "tau": 1.6 if m == "hybrid-auto" else None} for m, (t, s) in rows.items()}}
    line = headline(bench, "coding-10")
    assert line.startswith("coding-10: hybrid-auto 2.00x plain decoding, 0.67x the fastest plain decoder here "
                           "(ar@static), tau 1.60; every output equal")
    assert "OUTPUTS DIFFER" in headline({**bench, "mismatches": [{"method": "ngram"}]}, "coding-10")
    assert headline({}, "complete-12") == "complete-12: not run"


def test_the_trained_drafter_is_found_from_any_directory(tmp_path, monkeypatch):
    """A demo resumed from another directory (`--out` elsewhere) found its trained drafter by the path summary.json
    records relative to where training ran, and failed at the bench stage; it now follows the run's own pointer."""
    from dflashkit.demo import Paths, final_checkpoint
    from dflashkit.fileio import write_json

    p = Paths(tmp_path / "demo", "coding-10")
    write_json(p.train / "latest.json", {"step": 3, "checkpoint": "checkpoints/step-00000003"})
    write_json(p.train / "summary.json", {"checkpoint": "runs/demo/train/checkpoints/step-00000003"})
    monkeypatch.chdir(tmp_path)
    assert final_checkpoint(p) == tmp_path / "demo" / "train" / "checkpoints" / "step-00000003"
