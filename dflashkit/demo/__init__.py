"""`dflashkit demo`: the whole pipeline on the embedded default target, sized for a laptop CPU.

    target   prepare and load the target
    data     the target's greedy answers to the training prompts, with the drafter's features captured
    cache    the eval suite's completions and features (the held-out eval cache)
    train    the shipped recipe smollm2-cpu (dflashkit/configs), time-boxed; an interrupted run resumes
    eval     offline: trained vs untrained vs first checkpoint, stride and walk anchors
    bench    online speculative decoding against the live target, on the eval suite and a held-out one
    report   report.md / report.json from what the stages wrote

A rerun skips every stage whose inputs and outputs are unchanged (see stages.py).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dflashkit.demo.stages import Stage, StageRunner, Timing
from dflashkit.errors import DFlashError
from dflashkit.fileio import write_json
from dflashkit.rng import seeded

STEPS = ["target", "data", "cache", "train", "eval", "bench", "report"]
RECIPE = "smollm2-cpu"  # shipped with the package (dflashkit/configs): an installed dflashkit runs its own demo
EVAL_ANCHORS, EVAL_TREES = ("stride", "walk"), ("budget:4", "budget:8")


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    target: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"  # float32 forces the float32 path on a bf16 CPU (to measure what an AVX2-only CPU sees)
    minutes: float = 15.0  # training time box, before the plan fits it to the budget
    budget_minutes: float | None = 40.0  # the whole demo on this machine (plan.py); None or 0: the sizes as given
    recipe: str = str(RECIPE)  # the training settings (a `dflashkit train --config` file)
    train_prompts: int | None = 360  # of the built-in train-mix suite, the ones nearest the eval suite
    train_max_new_tokens: int = 192
    # answers generated per batch: 96 gave 1.42x the answer tokens/s of 32 on a 2-core bf16 CPU (batch 64 1.08x, 16
    # 0.81x; benchmarks/results/cpu-2026-12-02-bfloat16-generation-batch.md): one weight read serves more rows
    gen_batch_size: int = 96
    eval_suite: str = "coding-10"
    eval_prompts: int | None = None
    eval_max_new_tokens: int = 256
    bench_prompts: int | None = None
    bench_max_new_tokens: int = 256
    bench_methods: str = "ar,ngram,ddtree-8,hybrid-auto,prompt-lookup"  # bench adds ar-stock where kernels differ
    # the fastest plain decoding a user could run here, beside ours on the eval suite (plain_peers): auto =
    # llama.cpp (when `dflashkit engines install llama.cpp` has run); ours runs on the engine chosen (`engine`)
    plain_peers: str = "auto"  # auto | none
    engine: str = "auto"  # the backend our methods run on (decode/engine.py): auto picks the faster here
    # a second suite in another style, never used for training or selection: does the speedup hold there?
    holdout_suite: str = "complete-12"
    holdout_methods: str = "ar,ngram,hybrid-auto,prompt-lookup"
    holdout_max_new_tokens: int = 128  # a function body; the shorter answers keep the demo in its budget
    train: dict = field(default_factory=dict)  # overrides of the recipe (e.g. steps for a smoke run)
    progress: bool = True


class Paths:
    """Where each stage writes, under the demo's out folder."""

    def __init__(self, root: Path, eval_suite: str):
        self.root = root
        self.data, self.eval_cache = root / "cache" / "train", root / "cache" / eval_suite
        self.train, self.drafters = root / "train", root / "drafters"
        self.first, self.untrained = self.drafters / "first-checkpoint", self.drafters / "untrained"
        self.eval, self.bench, self.holdout = root / "eval", root / "bench", root / "bench-holdout"


def run_demo(cfg: DemoConfig, fresh: bool = False) -> dict:
    from rich.console import Console

    from dflashkit.targets.model import pick_device

    console, p, device = Console(), Paths(Path(cfg.out), cfg.eval_suite), pick_device(cfg.device)
    if fresh and p.root.exists():
        shutil.rmtree(p.root)
    budget = f"budget {cfg.budget_minutes:g} min" if cfg.budget_minutes else "no time budget"
    console.print(f"dflashkit demo: target {cfg.target} on [bold]{device}[/bold], {budget}, output {p.root}")
    runner = StageRunner(p.root, STEPS, console)
    runner.header("target")
    target, seconds = load_demo_target(cfg)
    runner.timings["target"] = Timing(seconds, skipped=False, settings=numeric_settings(target))
    recipe = load_recipe(cfg)
    plan = plan_demo(cfg, p, target, console, spent_s=seconds)
    console.print(f"plan: {plan.note}")
    asked_minutes, cfg = cfg.minutes, replace(cfg, train_prompts=plan.train_prompts, minutes=plan.minutes)
    runner.estimates = plan.estimates_s
    before_training = ("data", "cache")
    for stage in declare_stages(cfg, p, target, recipe, device):
        if stage.name in before_training:
            runner.run(stage)
    plan = refit_training(plan, p, asked_minutes, {s: runner.timings[s].seconds for s in before_training}, console)
    cfg, runner.estimates = replace(cfg, minutes=plan.minutes), plan.estimates_s
    for stage in declare_stages(cfg, p, target, recipe, device):
        if stage.name not in before_training:
            runner.run(stage)

    from dflashkit.demo.report import write_report

    # always rewritten: cheap, and carries the timings (and the numerics each stage was built with)
    report = write_report(p.root, cfg, device, runner.timings, plan=plan.note)
    runner.header("report")
    for line in report["console"]:
        console.print(line)
    console.print(f"report: {p.root / 'report.md'}")
    return report


@dataclass
class Suites:
    train: object  # the training prompts (the train-mix prompts nearest the eval suite)
    eval: object
    bench: object
    holdout: object


def demo_suites(cfg: DemoConfig) -> Suites:
    from dflashkit.prompts import load_prompts

    suite, holdout, train = load_prompts(cfg.eval_suite), load_prompts(cfg.holdout_suite), load_prompts("train-mix")
    if cfg.train_prompts:  # on-domain data: the training prompts closest to the eval suite's topic
        train = train.nearest(suite, min(cfg.train_prompts, len(train.items)))
    return Suites(train, suite.subset(cfg.eval_prompts) if cfg.eval_prompts else suite,
                  suite.subset(cfg.bench_prompts) if cfg.bench_prompts else suite,
                  holdout.subset(cfg.bench_prompts) if cfg.bench_prompts else holdout)


def plan_demo(cfg: DemoConfig, p: Paths, target, console, spent_s: float):
    """The plan of an earlier run with the same settings, or a new one from a short probe of this machine."""
    from dflashkit.decode.bench import parse_methods
    from dflashkit.demo import plan, probe
    from dflashkit.targets.invariant import needs_invariant

    key, path = plan.settings_key(cfg), p.root / "plan.json"
    old = plan.load_plan(path, key)
    if old is not None:
        return old
    s = demo_suites(cfg)

    def mean_prompt(suite) -> int:
        return round(sum(len(target.chat_ids(it.messages)) for it in suite.items) / max(1, len(suite.items)))

    train_context, eval_context = mean_prompt(s.train), mean_prompt(s.eval)
    console.print("[dim]timing this machine to plan the demo (about a minute)...[/dim]")
    measured = probe.probe(target, target.chat_ids(s.train.items[0].messages), cfg.gen_batch_size,
                           train_context + cfg.train_max_new_tokens // 2)
    stock = ["ar-stock"] if needs_invariant(target.model) else []  # bench adds plain decoding on the stock kernels
    bench_runs = [(len(s.bench.items), parse_methods(bench_suite_methods(cfg, target)) + stock, cfg.bench_max_new_tokens),
                  (len(s.holdout.items), parse_methods(cfg.holdout_methods) + stock, cfg.holdout_max_new_tokens)]
    fixed = {
        "cache": probe.data_seconds(measured, len(s.eval.items), len(s.eval.items), cfg.eval_max_new_tokens,
                                    eval_context),
        "eval": probe.eval_seconds(measured, len(s.eval.items) * (eval_context + cfg.eval_max_new_tokens)),
        "bench": probe.bench_seconds(measured, bench_runs),
    }

    def estimate(prompts: int, minutes: float) -> dict[str, float]:
        data = probe.data_seconds(measured, prompts, cfg.gen_batch_size, cfg.train_max_new_tokens, train_context)
        return {"data": data, "cache": fixed["cache"], "train": minutes * 60 + probe.TRAIN_OVERHEAD_S,
                "eval": fixed["eval"], "bench": fixed["bench"]}

    made = plan.make_plan(cfg, key, spent_s + measured.seconds, asdict(measured), estimate, len(s.train.items))
    plan.save_plan(path, made)
    return made


def refit_training(plan, p: Paths, asked_minutes: float, measured_s: dict[str, float], console):
    """Training re-sized to what the measured data stages left of the budget (plan.refit), saved with the plan."""
    from dflashkit.demo import plan as planning

    new = planning.refit(plan, asked_minutes, measured_s)
    if new is not plan:
        planning.save_plan(p.root / "plan.json", new)
        console.print(f"plan: {new.note.rpartition('; ')[2]}")
    return new


def peer_methods(cfg: DemoConfig, target) -> list[str]:
    """The plain decoders a speedup is also stated against besides ours (the brief's rule: the fastest a user could
    run on this machine, same weights, dtype and threads, in the same run)."""
    if cfg.plain_peers == "none":
        return []
    if cfg.plain_peers != "auto":
        raise DFlashError(f"demo plain_peers {cfg.plain_peers!r}: use auto or none")
    from dflashkit.engines.install import find

    return ["llama.cpp"] if find("llama.cpp") is not None else []


def bench_suite_methods(cfg: DemoConfig, target) -> str:
    return ",".join([cfg.bench_methods, *peer_methods(cfg, target)])


def declare_stages(cfg: DemoConfig, p: Paths, target, recipe, device) -> list[Stage]:
    """The demo's stages in order: what each reads (its fingerprint) and writes. Every stage reads the target, so
    every one carries its identity and numerics: a resumed demo in another dtype or on other kernels rebuilds."""
    from dflashkit.cache.store import content_digest
    from dflashkit.train.loop import feature_layers

    def cache_digest(outputs):
        return content_digest(outputs[0])

    tid = {k: v for k, v in target.identity().items() if k != "path"}
    numerics = {"settings": numeric_settings(target), "about": describe_numerics(target, cfg.dtype)}
    layer_ids = feature_layers(recipe, target, None)
    s = demo_suites(cfg)
    bench_suite = bench_suite_methods(cfg, target)  # one choice of peers for the stage's key and its run
    return [
        Stage("data", {"target": tid, "suite": s.train.content_hash, "layers": layer_ids,
                       "max_new_tokens": cfg.train_max_new_tokens, "batch_size": cfg.gen_batch_size}, [p.data],
              lambda: build_cache(target, s.train, p.data, layer_ids, cfg.train_max_new_tokens, cfg.gen_batch_size,
                                  cfg.progress), digest=cache_digest, **numerics),
        Stage("cache", {"target": tid, "suite": s.eval.content_hash, "layers": layer_ids,
                        "max_new_tokens": cfg.eval_max_new_tokens}, [p.eval_cache],
              lambda: build_cache(target, s.eval, p.eval_cache, layer_ids, cfg.eval_max_new_tokens,
                                  len(s.eval.items), cfg.progress), digest=cache_digest, **numerics),
        Stage("train", {"target": tid, "recipe": recipe.to_dict(), "minutes": cfg.minutes, "device": str(device),
                        "schedule": "time-fitted cosine"}, [p.train, p.drafters],
              lambda: train_drafters(cfg, p, target, recipe), after=("data", "cache"), **numerics),
        Stage("eval", {"target": tid, "anchors": EVAL_ANCHORS, "trees": EVAL_TREES}, [p.eval],
              lambda: evaluate_drafters(cfg, p, target), after=("train", "cache"), **numerics),
        Stage("bench", {"target": tid, "suite": s.bench.content_hash, "methods": bench_suite,
                        "holdout": [s.holdout.content_hash, cfg.holdout_methods, cfg.holdout_max_new_tokens],
                        "max_new_tokens": cfg.bench_max_new_tokens, "device": str(device)}, [p.bench, p.holdout],
              lambda: bench_methods(cfg, p, target, [(s.bench, bench_suite, cfg.bench_max_new_tokens, p.bench),
                                                     (s.holdout, cfg.holdout_methods, cfg.holdout_max_new_tokens,
                                                      p.holdout)]),
              after=("train",), **numerics),
    ]


def numeric_settings(target) -> dict:
    """What changes a stage's numbers besides its inputs: the dtype, device and kernels the target runs on."""
    # "kernels" stays in the fingerprint (the reference backend's linears are the stock ones since the compiled
    # ones went, 2026-12-05), so stages built before keep their cache
    return {"dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device), "kernels": "eager"}


def describe_numerics(target, asked: str = "auto") -> str:
    from dflashkit.targets.invariant import describe_kernels
    from dflashkit.targets.model import dtype_reason

    return (f"Numerics: dtype {dtype_reason(target.dtype, target.device, asked)}. Decoding kernels: "
            f"{describe_kernels(target.model)}.")


# ---- the stages ------------------------------------------------------------------------------------------------
def load_demo_target(cfg: DemoConfig):
    """(target, seconds): the registry converts and caches the embedded default once per machine."""
    import time

    from dflashkit.targets.model import load_target
    from dflashkit.targets.registry import REGISTRY, prepare

    t0 = time.time()
    if cfg.target in REGISTRY:
        prepare(cfg.target)
    return load_target(cfg.target, device=cfg.device, dtype=cfg.dtype), time.time() - t0


def load_recipe(cfg: DemoConfig):
    """The training settings: the recipe file, then the demo's own overrides (tests shorten it)."""
    from dflashkit.train.config import load_config

    from dflashkit.configs import find_config

    try:
        find_config(cfg.recipe)
    except DFlashError:
        raise DFlashError(f"{cfg.recipe}: the demo's training recipe is missing; pass --recipe FILE (or a "
                          "shipped name: `dflashkit config list`)") from None
    return load_config(cfg.recipe, cfg.train)


def build_cache(target, suite, out: Path, layer_ids, max_new_tokens: int, batch_size: int, progress: bool) -> None:
    """Greedy completions plus the features of the drafter's layers, captured once (batched), so that training
    never runs the target in its loop."""
    from dflashkit.cache import extract

    extract(target, suite, out, layer_ids=layer_ids, max_new_tokens=max_new_tokens, batch_size=batch_size,
            progress=progress)


def train_drafters(cfg: DemoConfig, p: Paths, target, recipe) -> None:
    """The trained drafter (time-boxed), its first periodic checkpoint and an untrained twin for comparison."""
    from dflashkit.drafter import DFlashDrafter
    from dflashkit.drafter.checkpoint import contract, load_drafter, run_latest, save_drafter
    from dflashkit.train import train
    from dflashkit.train.config import load_config

    tc = load_config(cfg.recipe, {**cfg.train, "target": cfg.target, "data": str(p.data), "out": str(p.train),
                                  "max_minutes": cfg.minutes, "schedule_minutes": cfg.minutes, "device": cfg.device,
                                  "eval_cache": str(p.eval_cache), "progress": cfg.progress})
    first_step = tc.save_every

    def keep_first(step, row):
        # the periodic checkpoint of step `first_step` exists once the next step runs; copy it before pruning
        src = p.train / "checkpoints" / f"step-{first_step:08d}"
        if step == first_step + 1 and src.is_dir() and not p.first.exists():
            shutil.copytree(src, p.first, ignore=shutil.ignore_patterns("train_state.pt"))

    if run_latest(p.train) is None:  # a fresh run (not a resume): forget an old first checkpoint
        shutil.rmtree(p.first, ignore_errors=True)
    summary = train(tc, target=target, on_step=keep_first)
    if not summary["finished"] and not str(summary["stop_reason"]).startswith("max_minutes"):
        raise DFlashError(f"training stopped early ({summary['stop_reason']}) at step {summary['steps']}; "
                          "rerun `dflashkit demo` to resume from its last checkpoint")
    # the untrained reference: the same architecture, draft vocabulary and seed, before any step
    final = load_drafter(summary["checkpoint"])
    with seeded(tc.seed):
        untrained = DFlashDrafter(final.config)
    own = contract(untrained)  # keys save_drafter derives itself; carry over only the training extras
    save_drafter(untrained, p.untrained, format="dflashkit", target_identity=target.identity(),
                 **{k: v for k, v in (final.contract or {}).items() if k not in own})
    if not p.first.exists():  # the run ended before its first periodic checkpoint: use the earliest one left
        first = sorted((p.train / "checkpoints").glob("step-*"))
        shutil.copytree(first[0] if first else Path(summary["checkpoint"]), p.first,
                        ignore=shutil.ignore_patterns("train_state.pt"))
    write_json(p.train / "demo-train.json", {"summary_checkpoint": summary["checkpoint"], "first_step": first_step})


def final_checkpoint(p: Paths) -> Path:
    return Path(json.loads((p.train / "demo-train.json").read_text())["summary_checkpoint"])


def evaluate_drafters(cfg: DemoConfig, p: Paths, target) -> None:
    """Offline metrics of the three drafters with both anchor schedules, their comparisons, and the data limits."""
    from dflashkit.cache import open_cache
    from dflashkit.demo.report import data_limits
    from dflashkit.evaluate.compare import compare_runs
    from dflashkit.evaluate.runs import run_eval

    cache = open_cache(p.eval_cache, expect_target=target.identity())
    drafters = {"trained": final_checkpoint(p), "first-checkpoint": p.first, "untrained": p.untrained}
    say = print if cfg.progress else (lambda line: None)
    for anchors in EVAL_ANCHORS:
        for name, path in drafters.items():
            run_eval(path, target, cache, p.eval / f"{name}-{anchors}", anchors=anchors, trees=EVAL_TREES,
                     progress=cfg.progress, say=say, plots=False)  # the comparison draws all three
        compare_runs([p.eval / f"{n}-{anchors}" for n in drafters], out=p.eval / f"compare-{anchors}")
    write_json(p.eval / "limits.json", data_limits(final_checkpoint(p), p.data, cache))


def bench_methods(cfg: DemoConfig, p: Paths, target, runs: list) -> None:
    """Online decoding of each (suite, methods, max new tokens, out folder), one cost curve measured for all."""
    from dflashkit.decode.bench import parse_methods, run_bench, write_bench
    from dflashkit.decode.cost import CostCurve
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.fileio import read_json

    drafter = load_drafter(final_checkpoint(p), target=target, device=target.device, dtype=target.dtype)
    cost = None
    for suite, methods, max_new_tokens, out in runs:
        prompts = [(it.id, target.chat_ids(it.messages)) for it in suite.items]
        # the trained drafter's walk on the eval cache: bench predicts tokens/s from it too (decode/predict.py)
        walk = p.eval / "trained-walk" / "results.json"
        offline = {**read_json(walk), "source": f"offline walk of the trained drafter ({walk.parent})"} \
            if out == p.bench and walk.is_file() else None
        result = run_bench(target, drafter, prompts, parse_methods(methods), max_new_tokens=max_new_tokens,
                           progress=cfg.progress, cost=cost, engine=cfg.engine, offline=offline)
        cost = CostCurve.from_dict(result["cost"])
        result["config"]["suite"] = suite.name
        write_bench(result, out)


# ---- CLI ---------------------------------------------------------------------------------------------------
def register(sub) -> None:
    from dflashkit.threads import add_threads_option

    p = sub.add_parser("demo", help="the whole pipeline on the embedded default target (what `make demo` runs)")
    p.add_argument("--minutes", type=float, default=15.0,
                   help="training time box in minutes (default 15; the budget may shorten it)")
    p.add_argument("--budget-minutes", type=float, default=40.0,
                   help="fit the whole demo to this many minutes on this machine by sizing the training data and "
                        "time from a probe (default 40; 0 = the sizes as given)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on CPUs with native bf16, else float32) | float32 | bfloat16")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--recipe", default=str(RECIPE), help="training settings file or shipped name (default smollm2-cpu)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--train-prompts", type=int, default=360,
                   help="train-mix prompts nearest the eval suite's topic (default 360; 0 = all 664)")
    p.add_argument("--eval-prompts", type=int, default=None)
    p.add_argument("--bench-prompts", type=int, default=None)
    p.add_argument("--bench-max-new-tokens", type=int, default=256)
    p.add_argument("--plain-peers", choices=("auto", "none"), default="auto",
                   help="auto: also bench llama.cpp (when installed) on the eval suite, the fastest plain decoding "
                        "a speedup is stated against; none: only ours")
    p.add_argument("--engine", choices=("auto", "hf", "static"), default="auto",
                   help="the backend our methods run on: auto (the faster here, measured once), hf or static")
    p.add_argument("--fresh", action="store_true", help="discard every cached stage and start over")
    add_threads_option(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    cfg = DemoConfig(out=args.out, target=args.target, device=args.device, dtype=args.dtype,
                     minutes=args.minutes, budget_minutes=args.budget_minutes or None,
                     recipe=args.recipe,
                     train_prompts=args.train_prompts, eval_prompts=args.eval_prompts, bench_prompts=args.bench_prompts,
                     bench_max_new_tokens=args.bench_max_new_tokens, plain_peers=args.plain_peers,
                     engine=args.engine)
    run_demo(cfg, fresh=args.fresh)
    return 0
