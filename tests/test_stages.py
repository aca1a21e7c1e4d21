"""The demo's stage bookkeeping (demo/stages.py) on three trivial stages: a rerun skips what is unchanged, a
corrupted output rebuilds its stage, a stage whose earlier stages' outputs changed rebuilds too, and one that was
interrupted runs again."""

from __future__ import annotations

import json

from rich.console import Console

from dflashkit.demo.stages import Stage, StageRunner


def pipeline(root, builds, value="1"):
    """a -> b -> c, each writing one file from the one before; `builds` counts the builds per stage."""
    a, b, c = root / "a.txt", root / "b.txt", root / "c.txt"

    def write(name, path, text):
        builds[name] = builds.get(name, 0) + 1
        path.write_text(text)

    return [Stage("a", {"value": value}, [a], lambda: write("a", a, value)),
            Stage("b", {}, [b], lambda: write("b", b, a.read_text() + "b"), after=("a",)),
            Stage("c", {}, [c], lambda: write("c", c, b.read_text() + "c"), after=("b",))]


def run(root, builds, value="1"):
    runner = StageRunner(root, ["a", "b", "c"], Console(quiet=True))
    for stage in pipeline(root, builds, value):
        runner.run(stage)
    return runner


def test_reruns_skip_rebuild_what_changed_and_only_that(tmp_path):
    builds = {}
    run(tmp_path, builds)
    assert builds == {"a": 1, "b": 1, "c": 1} and (tmp_path / "c.txt").read_text() == "1bc"
    runner = run(tmp_path, builds)
    assert builds == {"a": 1, "b": 1, "c": 1} and all(t["skipped"] for t in runner.timings.values())
    (tmp_path / "b.txt").write_text("corrupt")  # b rebuilds; it writes what it wrote before, so c is skipped
    run(tmp_path, builds)
    assert builds == {"a": 1, "b": 2, "c": 1} and (tmp_path / "b.txt").read_text() == "1b"
    run(tmp_path, builds, value="2")  # new inputs of a: a's output changes, so b and c, which read it, rebuild
    assert builds == {"a": 2, "b": 3, "c": 2} and (tmp_path / "c.txt").read_text() == "2bc"
    stamp = json.loads((tmp_path / "stages" / "c.json").read_text())
    assert stamp["done"] and stamp["outputs"]


def test_an_interrupted_stage_is_run_again(tmp_path):
    builds = {}
    run(tmp_path, builds)
    stamp = tmp_path / "stages" / "b.json"
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "done": False}))  # as if stopped mid-build
    run(tmp_path, builds)
    assert builds["a"] == 1 and builds["b"] == 2


def test_a_cache_digest_is_what_it_holds_not_how_the_file_was_written(tmp_path):
    """safetensors writes its header from a hash map: the same tensors saved twice can differ byte for byte. The
    cache stages' digest reads the tensors, so a rebuild that extracts the same features does not retrain."""
    import torch
    from safetensors.torch import save_file

    from dflashkit.cache.store import content_digest, record_digest
    from dflashkit.fileio import sha256_file, write_json

    x = {"tokens": torch.arange(5), "layer_1": torch.ones(5, 4)}
    save_file(x, tmp_path / "a.safetensors", metadata={"prompt_id": "p", "format": "f"})
    save_file(x, tmp_path / "b.safetensors", metadata={"format": "f", "prompt_id": "p"})
    assert record_digest(tmp_path / "a.safetensors") == record_digest(tmp_path / "b.safetensors")
    save_file({**x, "layer_1": torch.zeros(5, 4)}, tmp_path / "c.safetensors", metadata={"prompt_id": "p", "format": "f"})
    assert record_digest(tmp_path / "c.safetensors") != record_digest(tmp_path / "a.safetensors")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "0.safetensors").write_bytes((tmp_path / "a.safetensors").read_bytes())
    write_json(cache / "manifest.json", {"created": "t0", "prompts": [{"id": "p", "sha256": sha256_file(cache / "0.safetensors")}]})
    first = content_digest(cache)
    (cache / "0.safetensors").write_bytes((tmp_path / "b.safetensors").read_bytes())  # rebuilt: same tensors, new bytes
    write_json(cache / "manifest.json", {"created": "t1", "prompts": [{"id": "p", "sha256": sha256_file(cache / "0.safetensors")}]})
    assert content_digest(cache) == first
    (cache / "0.safetensors").write_bytes((tmp_path / "a.safetensors").read_bytes()[:100])  # truncated: not what was built
    assert content_digest(cache) == ""


def test_a_stage_rebuilt_for_new_inputs_rebuilds_what_reads_it_even_when_its_outputs_come_out_the_same(tmp_path):
    builds = {}
    runner = StageRunner(tmp_path, ["a", "b"], Console(quiet=True))
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"

    def stages(dtype):
        return [Stage("a", {}, [a], lambda: (builds.update(a=builds.get("a", 0) + 1), a.write_text("x")),
                      settings={"dtype": dtype}),
                Stage("b", {}, [b], lambda: (builds.update(b=builds.get("b", 0) + 1), b.write_text("y")),
                      after=("a",), settings={"dtype": dtype})]

    for dtype in ("float32", "float32", "bfloat16"):
        for stage in stages(dtype):
            runner.run(stage)
    assert builds == {"a": 2, "b": 2}
    assert json.loads((tmp_path / "stages" / "b.json").read_text())["settings"] == {"dtype": "bfloat16"}


class Variant:
    """A target with some attributes replaced: what another dtype, device, kernels or checkpoint would report."""

    def __init__(self, target, **changed):
        self._target, self._changed = target, changed

    def __getattr__(self, name):
        return self._changed[name] if name in self._changed else getattr(self._target, name)


def test_every_input_that_changes_a_stages_numbers_changes_its_fingerprint(tiny_dirs, tiny_targets, tmp_path):
    """Each input of the demo changes the fingerprint of the stages that read it, and of every stage after them."""
    from dataclasses import replace

    import torch

    from dflashkit.demo import STEPS, DemoConfig, Paths, declare_stages, load_recipe

    base = DemoConfig(out=str(tmp_path), target=str(tiny_dirs["llama"]), device="cpu", dtype="float32",
                      train_prompts=6, eval_prompts=2, bench_prompts=2, train={"target_layer_ids": [1, 2, 3]})
    llama = tiny_targets["llama"]

    def keys(cfg=base, target=llama):
        runner = StageRunner(tmp_path, STEPS, Console(quiet=True))
        runner.digests = {s: "the same outputs" for s in STEPS}  # only the inputs differ
        for stage in declare_stages(cfg, Paths(tmp_path, cfg.eval_suite), target, load_recipe(cfg), target.device):
            runner.keys[stage.name] = runner.key(stage)
        return runner.keys

    every, trained = {"data", "cache", "train", "eval", "bench"}, {"train", "eval", "bench"}
    cases = {
        "dtype": ({}, {"dtype": torch.bfloat16}, every),
        "device": ({}, {"device": torch.device("cuda")}, every),
        "target": ({}, {"identity": lambda: {**llama.identity(), "weights_hash": "another fine-tune"}}, every),
        "recipe seed": ({"train": {**base.train, "seed": 7}}, {}, trained),
        "recipe layers": ({"train": {"target_layer_ids": [1, 2]}}, {}, every),
        "minutes": ({"minutes": 7.0}, {}, trained),
        "train prompts": ({"train_prompts": 5}, {}, {"data"} | trained),
        "train tokens": ({"train_max_new_tokens": 17}, {}, {"data"} | trained),
        "generation batch": ({"gen_batch_size": 3}, {}, {"data"} | trained),
        "eval prompts": ({"eval_prompts": 3}, {}, {"cache"} | trained),
        "eval tokens": ({"eval_max_new_tokens": 17}, {}, {"cache"} | trained),
        "bench prompts": ({"bench_prompts": 3}, {}, {"bench"}),
        "bench methods": ({"bench_methods": "ar,ngram"}, {}, {"bench"}),
        "bench tokens": ({"bench_max_new_tokens": 17}, {}, {"bench"}),
        "holdout": ({"holdout_methods": "ar"}, {}, {"bench"}),
        "holdout tokens": ({"holdout_max_new_tokens": 17}, {}, {"bench"}),
    }
    before = keys()
    for name, (cfg_change, target_change, expected) in cases.items():
        after = keys(replace(base, **cfg_change), Variant(llama, **target_change) if target_change else llama)
        assert {s for s in before if after[s] != before[s]} == expected, name
    assert keys(replace(base, out=str(tmp_path / "elsewhere"), progress=True)) == before  # not inputs
