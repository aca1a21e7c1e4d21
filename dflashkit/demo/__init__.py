"""`dflashkit demo`: the whole pipeline on the embedded default target, sized to a time budget on this machine.

    target   prepare and load the target
    data     the target's greedy answers to the training prompts, with the drafter's features captured
    cache    the eval suite's completions and features (the held-out eval cache)
    train    the shipped recipe smollm2-cpu (dflashkit/configs), time-boxed; an interrupted run resumes
    eval     offline: trained vs untrained vs first checkpoint, stride and walk anchors
    bench    online speculative decoding against the live target, on the eval suite and a held-out one
    report   report.md / report.json from what the stages wrote
A rerun skips every stage whose inputs and outputs are unchanged (stages.py); plan.py sizes the run to the budget."""

from __future__ import annotations

import argparse
import shutil
import time
from collections import namedtuple
from dataclasses import dataclass, field, replace
from pathlib import Path

from dflashkit.demo.stages import Stage, StageRunner
from dflashkit.errors import DFlashError
from dflashkit.fileio import read_json
from dflashkit.prompts import load_prompts
from dflashkit.rng import seeded
from dflashkit.targets.formats import parse_weights
from dflashkit.threads import add_threads_option

STEPS = ["target", "data", "cache", "train", "eval", "bench", "report"]
RECIPE = "smollm2-cpu"  # shipped with the package (dflashkit/configs): an installed dflashkit runs its own demo
EVAL_ANCHORS, EVAL_TREES = ("stride", "walk"), ("budget:4", "budget:8")


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    target: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"  # float32 forces the float32 path on a bf16 CPU (to measure what an AVX2-only CPU sees)
    weights: str = "auto"  # auto: the shipped GGUF's own blocks (Q4_1), widened to float32 (targets/formats.py)
    minutes: float = 15.0  # training time box, before the budget fits it
    budget_minutes: float | None = 40.0  # the whole demo on this machine (plan.py); None or 0: the sizes as given
    recipe: str = RECIPE  # the training settings (a `dflashkit train --config` file)
    train_prompts: int | None = 360  # of the built-in train-mix suite, the ones nearest the eval suite
    train_max_new_tokens: int = 192
    gen_batch_size: int = 96  # one weight read serves more rows than at 32
    eval_suite: str = "coding-10"
    eval_prompts: int | None = None
    eval_max_new_tokens: int = 256
    bench_prompts: int | None = None
    bench_max_new_tokens: int = 256  # at 128 the answers repeat less: n-gram tau 1.76 against 2.24 at 256
    bench_methods: str = "ar,ngram,ddtree-8,hybrid-auto,prompt-lookup"  # bench adds ar@hf-stock where kernels differ
    plain_peers: str = "auto"  # auto: llama.cpp beside ours on the eval suite, when installed | none
    engine: str = "auto"  # the backend our methods run on (measure/probe.py): auto picks the faster here
    holdout_suite: str = "complete-12"  # another style, never trained on or selected with: does the speedup hold?
    holdout_methods: str = "ar,ngram,hybrid-auto"  # the eval suite's bench has the baselines and peers
    holdout_max_new_tokens: int = 128  # a function body
    train: dict = field(default_factory=dict)  # overrides of the recipe (e.g. steps for a smoke run)
    progress: bool = True


class Paths:
    """Where each stage writes, under the demo's out folder."""

    def __init__(self, root: Path, eval_suite: str):
        self.root, self.data, self.eval_cache, self.train = root, root / "cache" / "train", root / "cache" / eval_suite, root / "train"
        self.drafters, self.eval, self.bench, self.holdout = root / "drafters", root / "eval", root / "bench", root / "bench-holdout"
        self.first, self.untrained = self.drafters / "first-checkpoint", self.drafters / "untrained"


def run_demo(cfg: DemoConfig, fresh: bool = False) -> dict:
    from rich.console import Console

    from dflashkit.measure.probe import probe_path
    from dflashkit.demo import plan
    from dflashkit.demo.report import write_report
    from dflashkit.targets.model import pick_device

    console, p, device = Console(), Paths(Path(cfg.out), cfg.eval_suite), pick_device(cfg.device)
    if fresh and p.root.exists():
        shutil.rmtree(p.root)
    console.print(f"dflashkit demo: target {cfg.target} on [bold]{device}[/bold], output {p.root}")
    runner = StageRunner(p.root, STEPS, console)
    runner.header("target")
    target, seconds = load_demo_target(cfg)
    runner.timings["target"] = {"seconds": seconds, "skipped": False, "settings": numeric_settings(target)}
    recipe, suites = load_recipe(cfg), demo_suites(cfg)
    rates = plan.timed(cfg, p.root / "plan.json", target, target.chat_ids(suites.train.items[0].messages), seconds,
                       console)
    work = {**stage_work(cfg, p, suites), "first_compile": not probe_path(target)[0].is_file()}  # eval's probe compiles
    prompts, minutes, note = plan.size(cfg, rates, work, len(suites.train.items))
    console.print(f"plan: {note}")
    sized = replace(cfg, train_prompts=prompts, minutes=minutes)
    runner.estimates = plan.estimates(rates, work, prompts, minutes)
    for stage in declare_stages(sized, p, target, recipe, device)[:2]:  # data and cache: then training is re-sized
        runner.run(stage)
    took = {s: runner.timings[s]["seconds"] for s in ("data", "cache")}
    sized = replace(sized, minutes=plan.refit(cfg, rates, runner.estimates, took))
    console.print(f"plan: training gets {sized.minutes:g} minutes")
    note += f"; after data and cache took {sum(took.values()):.0f} s, training gets {sized.minutes:g} minutes"
    runner.estimates = plan.estimates(rates, work, prompts, sized.minutes)
    for stage in declare_stages(sized, p, target, recipe, device)[2:]:
        runner.run(stage)
    runner.header("report")  # always rewritten: cheap, and carries the timings
    report = write_report(p.root, sized, target, runner.timings, note)
    console.print(*report["console"], f"report: {p.root / 'report.md'}", sep="\n")
    return report


Suites = namedtuple("Suites", "train eval bench holdout")  # train: the train-mix prompts nearest the eval suite


def demo_suites(cfg: DemoConfig) -> Suites:
    suite, holdout, train = load_prompts(cfg.eval_suite), load_prompts(cfg.holdout_suite), load_prompts("train-mix")
    if cfg.train_prompts:  # on-domain data: the training prompts closest to the eval suite's topic
        train = train.nearest(suite, min(cfg.train_prompts, len(train.items)))
    sized = ((suite, cfg.eval_prompts), (suite, cfg.bench_prompts), (holdout, cfg.bench_prompts))
    return Suites(train, *(s.subset(n) if n else s for s, n in sized))


def peer_methods(cfg: DemoConfig) -> list[str]:
    """Plain decoders beside ours, the fastest a user could run here: a speedup is stated against them too."""
    if cfg.plain_peers not in ("auto", "none"):
        raise DFlashError(f"demo plain_peers {cfg.plain_peers!r}: use auto or none")
    from dflashkit.engines import install  # loaded by the demo, not by every command's parser

    return ["llama.cpp"] if cfg.plain_peers == "auto" and install.find("llama.cpp") is not None else []


def bench_runs(cfg: DemoConfig, p: Paths, s: Suites) -> list[tuple]:
    """(suite, methods, max new tokens, out folder) of each online bench."""
    return [(s.bench, ",".join([cfg.bench_methods, *peer_methods(cfg)]), cfg.bench_max_new_tokens, p.bench),
            (s.holdout, cfg.holdout_methods, cfg.holdout_max_new_tokens, p.holdout)]


def stage_work(cfg: DemoConfig, p: Paths, s: Suites) -> dict:
    """What the stages repeat, for plan.estimates (on the eval suite bench adds ar@hf-stock or ar@hf, references)."""
    from dflashkit.measure.bench import parse_methods

    runs = bench_runs(cfg, p, s)
    return {"batch": cfg.gen_batch_size, "train_tokens": cfg.train_max_new_tokens, "eval_prompts": len(s.eval.items),
            "eval_tokens": cfg.eval_max_new_tokens,
            "bench_tokens": sum(len(st.items) * n * (len(parse_methods(m)) + (o == p.bench)) for st, m, n, o in runs)}


def declare_stages(cfg: DemoConfig, p: Paths, target, recipe, device) -> list[Stage]:
    """The demo's stages in order: what each reads (its fingerprint) and writes. Every stage reads the target, so
    every one carries its identity and numerics: a resumed demo in another dtype or on other kernels rebuilds."""
    from dflashkit.cache import extract
    from dflashkit.cache.store import content_digest
    from dflashkit.measure.costmodel import engine_version
    from dflashkit.train.loop import feature_layers

    def cache_stage(name, suite, out, tokens, batch):
        inputs = {"target": tid, "suite": suite.content_hash, "layers": layers, "max_new_tokens": tokens}
        return Stage(name, {**inputs, "batch_size": batch} if name == "data" else inputs, [out],
                     lambda: extract(target, suite, out, layer_ids=layers, max_new_tokens=tokens, batch_size=batch,
                                     progress=cfg.progress),
                     digest=lambda outputs: content_digest(outputs[0]), settings=settings)

    tid = {k: v for k, v in target.identity().items() if k != "path"}
    settings, layers, s = numeric_settings(target), feature_layers(recipe, target, None), demo_suites(cfg)
    runs = bench_runs(cfg, p, s)  # one choice of peers for the stage's key and its run
    return [
        cache_stage("data", s.train, p.data, cfg.train_max_new_tokens, cfg.gen_batch_size),
        cache_stage("cache", s.eval, p.eval_cache, cfg.eval_max_new_tokens, len(s.eval.items)),
        Stage("train", {"target": tid, "recipe": recipe.to_dict(), "minutes": cfg.minutes, "device": str(device),
                        "schedule": "time-fitted cosine"}, [p.train, p.drafters],
              lambda: train_drafters(cfg, p, target), after=("data", "cache"), settings=settings),
        Stage("eval", {"target": tid, "anchors": EVAL_ANCHORS, "trees": EVAL_TREES}, [p.eval],
              lambda: evaluate_drafters(cfg, p, target), after=("train", "cache"), settings=settings),
        Stage("bench", {"target": tid, "suite": s.bench.content_hash, "methods": runs[0][1],
                        "holdout": [s.holdout.content_hash, cfg.holdout_methods, cfg.holdout_max_new_tokens],
                        "max_new_tokens": cfg.bench_max_new_tokens, "decoders": engine_version("static")},
              [p.bench, p.holdout], lambda: bench_methods(cfg, p, target, runs), after=("train",), settings=settings),
    ]


def numeric_settings(target) -> dict:
    """What changes a stage's numbers besides its inputs ("kernels", eager since 2026-12-05, keeps older caches)."""
    return {"dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device), "kernels": "eager",
            **({"weights": target.weights} if target.weights != "float" else {})}


def load_demo_target(cfg: DemoConfig):
    """(target, seconds): the registry converts and caches the embedded default once per machine."""
    from dflashkit.targets.model import load_target
    from dflashkit.targets.registry import REGISTRY, prepare

    t0 = time.time()
    if cfg.target in REGISTRY:
        prepare(cfg.target)
    return load_target(cfg.target, device=cfg.device, dtype=cfg.dtype, weights=cfg.weights), time.time() - t0


def load_recipe(cfg: DemoConfig, overrides: dict | None = None):
    """The training settings: the recipe file, then the demo's own overrides (tests shorten it)."""
    from dflashkit.train.config import load_config  # yaml: loaded by the demo, not by every command's parser

    return load_config(cfg.recipe, {**cfg.train, **(overrides or {})})


def train_drafters(cfg: DemoConfig, p: Paths, target) -> None:
    """The trained drafter (time-boxed), its first periodic checkpoint and an untrained twin for comparison."""
    from dflashkit.drafter import DFlashDrafter
    from dflashkit.drafter.checkpoint import contract, load_drafter, save_drafter
    from dflashkit.train import train

    tc = load_recipe(cfg, {"target": cfg.target, "data": str(p.data), "out": str(p.train), "max_minutes": cfg.minutes,
                           "schedule_minutes": cfg.minutes, "device": cfg.device, "eval_cache": str(p.eval_cache),
                           "progress": cfg.progress})
    no_state = shutil.ignore_patterns("train_state.pt")

    def keep_first(step, row):  # the checkpoint of step save_every exists once the next step runs: copy it first
        src = p.train / "checkpoints" / f"step-{tc.save_every:08d}"
        if step == tc.save_every + 1 and src.is_dir() and not p.first.exists():
            shutil.copytree(src, p.first, ignore=no_state)

    summary = train(tc, target=target, on_step=keep_first)
    if not summary["finished"] and not str(summary["stop_reason"]).startswith("max_minutes"):
        raise DFlashError(f"training stopped early ({summary['stop_reason']}) at step {summary['steps']}; "
                          "rerun `dflashkit demo` to resume from its last checkpoint")
    final = load_drafter(summary["checkpoint"])
    with seeded(tc.seed):  # the untrained reference: the same architecture, draft vocabulary and seed
        untrained = DFlashDrafter(final.config)
    own = contract(untrained)  # keys save_drafter derives itself; carry over only the training extras
    save_drafter(untrained, p.untrained, format="dflashkit", target_identity=target.identity(),
                 **{k: v for k, v in (final.contract or {}).items() if k not in own})
    if not p.first.exists():  # the run ended before its first periodic checkpoint: use the earliest one left
        first = sorted((p.train / "checkpoints").glob("step-*"))
        shutil.copytree(first[0] if first else Path(summary["checkpoint"]), p.first, ignore=no_state)


def final_checkpoint(p: Paths) -> Path:  # by the run's own pointer (summary.json's path is relative to the cwd)
    return p.train / read_json(p.train / "latest.json")["checkpoint"]


def evaluate_drafters(cfg: DemoConfig, p: Paths, target) -> None:
    """Offline metrics of the three drafters with both anchor schedules, and their comparisons."""
    from dflashkit.cache import open_cache
    from dflashkit.evaluate.compare import compare_runs
    from dflashkit.evaluate.runs import run_eval
    from dflashkit.measure.cli import models_for, replays_for

    cache = open_cache(p.eval_cache, expect_target=target.identity())
    drafters = {"trained": final_checkpoint(p), "first-checkpoint": p.first, "untrained": p.untrained}
    for anchors in EVAL_ANCHORS:
        for name, path in drafters.items():  # the comparison draws all three; the trained walk replays hybrid-auto
            run_eval(path, target, cache, p.eval / f"{name}-{anchors}", anchors=anchors, trees=EVAL_TREES,
                     progress=cfg.progress, say=print if cfg.progress else (lambda line: None), plots=False,
                     replays=replays_for(models_for([cfg.engine], target, path)) if (name, anchors) == ("trained", "walk") else None)
        compare_runs([p.eval / f"{n}-{anchors}" for n in drafters], out=p.eval / f"compare-{anchors}")


def bench_methods(cfg: DemoConfig, p: Paths, target, runs: list) -> None:
    """Online decoding of each (suite, methods, max new tokens, out folder), one cost curve measured for all."""
    from dflashkit.measure.bench import parse_methods, run_bench, write_bench
    from dflashkit.measure.curve import CostCurve
    from dflashkit.drafter.checkpoint import drafter_identity, load_drafter

    folder = final_checkpoint(p)
    drafter = load_drafter(folder, target=target, device=target.device, dtype=target.dtype)
    which = drafter_identity(folder)  # the drafter the speedups are of
    walk, cost, offline = p.eval / "trained-walk" / "results.json", None, None
    if walk.is_file():  # bench predicts tokens/s on the eval suite from the trained drafter's walk too
        offline = {"": {**read_json(walk), "source": f"offline walk of the trained drafter ({walk.parent})"}}
    for suite, methods, max_new_tokens, out in runs:
        prompts = [(it.id, target.chat_ids(it.messages)) for it in suite.items]
        result = run_bench(target, drafter, prompts, parse_methods(methods), max_new_tokens=max_new_tokens,
                           progress=cfg.progress, cost=cost, engine=cfg.engine,
                           offline=offline if out == p.bench else None, references=out == p.bench)
        cost = CostCurve.from_dict(result["cost"])
        result["config"] |= {"suite": suite.name, "drafter": which}
        write_bench(result, out)


# ---- CLI: DemoConfig's fields, with its defaults ------------------------------------------------------------------
OPTIONS = {
    "minutes": {"type": float, "help": "training time box in minutes (the budget may shorten it)"},
    "budget_minutes": {"type": float, "help": "size training data and time to fit the demo here (0: as given)"},
    "device": {"help": "auto (CUDA when present) | cpu | cuda"},
    "dtype": {"help": "auto (bf16 on CUDA and on CPUs with native bf16, else float32) | float32 | bfloat16"},
    "weights": {"type": parse_weights, "help": "auto (the shipped GGUF's own blocks, widened to float32) | float | "
                "gguf | q8_0 | q4_0 | q4_1 | FILE.gguf (the target's matrices from that file), any with -int8"},
    "target": {"help": "the target model"}, "recipe": {"help": "training settings file or shipped name"},
    "out": {"help": "where the demo writes"},
    "train_prompts": {"type": int, "help": "train-mix prompts nearest the eval suite's topic (0: all 664)"},
    "eval_prompts": {"type": int, "help": "the first N prompts of the eval suite"},
    "bench_prompts": {"type": int, "help": "the first N prompts of each bench suite"},
    "bench_max_new_tokens": {"type": int, "help": "new tokens per answer on the eval suite"},
    "plain_peers": {"choices": ("auto", "none"), "help": "auto: bench llama.cpp too, when installed"},
    "engine": {"choices": ("auto", "hf", "static"), "help": "the backend our methods run on (auto: the faster here)"},
}


def register(sub) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on the embedded default target (what `make demo` runs)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, kwargs in OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), default=DemoConfig.__dataclass_fields__[name].default, **kwargs)
    p.add_argument("--fresh", action="store_true", help="discard every cached stage and start over")
    add_threads_option(p)
    p.set_defaults(func=cmd_demo, on_interrupt="interrupted; finished stages are kept, and a rerun resumes")


def cmd_demo(args) -> int:
    cfg = DemoConfig(**{name: getattr(args, name) for name in OPTIONS})
    run_demo(replace(cfg, budget_minutes=cfg.budget_minutes or None), fresh=args.fresh)
    return 0
