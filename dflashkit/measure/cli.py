"""`dflashkit generate`, `bench` and `cost`, and the pricing of `eval --engine`: thin recipes over this package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflashkit.decode.methods import DEFAULT_METHODS, ENGINE_HELP, ENGINES, METHODS_HELP, PRICED, needs_drafter, parse_method
from dflashkit.decode.sampling import Sampling
from dflashkit.errors import DFlashError
from dflashkit.fileio import read_json, write_json, write_text
from dflashkit.measure.journal import Journal
from dflashkit.measure.records import generation_record
from dflashkit.prompts import PromptItem, select_prompts
from dflashkit.report.requests import write_requests
from dflashkit.targets.formats import add_weights_option
from dflashkit.threads import add_threads_option

ENGINE_CHOICES = "auto, " + ", ".join(PRICED)
REPROBE_HELP = "auto: time the backends again (a probe cached from a busy hour), replacing the cached answer"
DTYPE_HELP = "auto (bf16 on CUDA and on CPUs with native bf16, else float32) | float32 | bfloat16"


def register(sub) -> None:
    g = sub.add_parser("generate", help="decode (ar, chain, ddtree, ngram, hybrid, prompt-lookup); lossless")
    _common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompts", help="a built-in suite (coding-10, train-mix) or JSONL files (ours, OpenAI chat, "
                     "ShareGPT, z-lab turns, Spec-Bench; several joined by commas)")
    g.add_argument("--method", default="chain", help=f"one of {METHODS_HELP} (default chain)")
    g.add_argument("--engine", default="auto", choices=ENGINES, help=f"{ENGINE_HELP}; default auto")
    g.add_argument("--reprobe", action="store_true", help=REPROBE_HELP)
    g.add_argument("--budget", type=int, default=8,
                   help="drafter tree nodes per round for a bare ddtree or hybrid, root excluded (default 8)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--json", action="store_true", help="print ids, text, accepted length per round and timings as JSON")
    g.add_argument("--out", help="file for the per-request records, one JSON line per prompt (the schema bench writes "
                   "to requests.jsonl; `dflashkit parity` and `compare` read it)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="all decoding methods on the same prompts: tau, tokens/s, speedup, time split")
    _common(b)
    b.add_argument("--prompts", default="coding-10",
                   help="a built-in suite or JSONL files (ours, OpenAI chat, ShareGPT, z-lab turns, Spec-Bench; several "
                   "joined by commas make one suite with a category per file); default coding-10")
    b.add_argument("--methods", default=None, help=f"comma list (default {DEFAULT_METHODS})")
    b.add_argument("--engine", default="auto", help=f"{ENGINE_HELP}; several joined by commas (hf,static) run each "
                   "method on each, rows on the second named METHOD@ENGINE; default auto")
    b.add_argument("--reprobe", action="store_true", help=REPROBE_HELP)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--out", default="runs/bench", help="folder for results.json, report.md and plots")
    b.add_argument("--offline", metavar="[ENGINE=]RUN", action="append", help="an eval run of the drafter (best --anchors "
                   "walk on these prompts): bench predicts tokens/s from it too; ENGINE=RUN for that engine's rows alone "
                   "(an eval on its own answers: `data generate --engine`, docs/decoding.md); repeatable")
    b.add_argument("--no-predict", action="store_true", help="measure only: no predicted column, so no engine "
                   "samples between runs nor cost models (a few seconds a run on a CPU)")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("cost", help="an engine's cost model: a target forward over n = 1..64 tokens, a drafter call, "
                                    "the loop's own work per round (measured once per machine, cached)")
    c.add_argument("--target", default="smollm2-135m", help="registry name or local Hugging Face folder")
    c.add_argument("--drafter", help="drafter folder: its call is priced too (needed to predict speculative methods)")
    c.add_argument("--engine", default="auto", help=f"{ENGINE_CHOICES}, several joined by commas; auto: the backend "
                   "speculative decoding picks here (measure/probe.py)")
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_weights_option(c)
    c.add_argument("--out", default="runs/cost", help="folder for cost.json, cost.md and cost.png")
    c.add_argument("--json", action="store_true", help="print the cost models as JSON")
    c.add_argument("--force", action="store_true", help="measure again, replacing the cached model")
    add_threads_option(c)
    c.set_defaults(func=cmd_cost)


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _common(p) -> None:
    p.add_argument("--target", default="smollm2-135m", help="registry name or local Hugging Face folder")
    p.add_argument("--drafter", help="drafter folder (z-lab or dflashkit format); not needed for ar / prompt-lookup")
    p.add_argument("--allow-skipped", action="store_true",
                   help="load a drafter with tensors its config has no place for (the load report names the model run)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts of the suite")
    p.add_argument("--per-category", type=int, default=None, metavar="N",
                   help="use the first N prompts of each category (Spec-Bench's, or one per file)")
    p.add_argument("--block-size", type=int, default=None, help="drafter block size (default: the drafter's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; above 0 samples, still lossless")
    p.add_argument("--acceptance", choices=("match", "rejection"), default="match",
                   help="chain's rule at T>0: match (greedy drafts kept iff equal to the target's own sample) or rejection "
                   "(drafts sampled from the drafter's q, kept with min(1, p/q), as z-lab's reference; with the CPU "
                   "drafters at T=0.7 it accepted less with q at T and as much with q at T/2, "
                   "benchmarks/results/cpu-2026-12-02-acceptance-T0.7-mix.md)")
    p.add_argument("--draft-temperature", type=float, default=None,
                   help="rejection: the temperature of the drafter's q (default: --temperature, as the reference)")
    p.add_argument("--draft-mix", type=float, default=1.0,
                   help="rejection: the share of each draft position sampled from q; the rest keeps the drafter's "
                   "greedy choice (1 = the reference; 0 accepts exactly as match)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    add_weights_option(p)
    add_threads_option(p)


def _check(args):
    """Every option checked before anything loads; returns the command's one Sampling value (none dropped on the way)."""
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.block_size is not None and args.block_size < 2:
        raise DFlashError(f"--block-size {args.block_size}: must be at least 2 (the anchor plus one draft)")
    if getattr(args, "budget", 1) < 1:
        raise DFlashError(f"--budget {args.budget}: a DDTree needs at least 1 node")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise DFlashError(f"--num-prompts {args.num_prompts}: must be at least 1")
    return Sampling(temperature=args.temperature, acceptance=args.acceptance, draft_temperature=args.draft_temperature,
                    draft_mix=args.draft_mix, seed=args.seed)


def _load(args, need_drafter: bool):
    from dflashkit.targets.model import load_target

    target = load_target(args.target, device=args.device, dtype=args.dtype, weights=args.weights)
    drafter = None
    if args.drafter:
        from dflashkit.drafter.checkpoint import load_drafter

        drafter = load_drafter(args.drafter, target=target, device=target.device, dtype=target.dtype,
                               allow_skipped=args.allow_skipped)
        if args.allow_skipped:
            print(drafter.load_report[-1], file=sys.stderr)
    elif need_drafter:
        raise DFlashError("--drafter is required for chain, ddtree and hybrid methods; pass a drafter folder, or use "
                          "ar, ngram, prompt-lookup or hf-generate")
    return target, drafter


def _prompts(args) -> list:
    """(id, PromptItem) per conversation; multi-turn items are decoded turn after turn (decode/conversation.py)."""
    if getattr(args, "prompt", None) is not None:
        return [("prompt", PromptItem("prompt", ({"role": "user", "content": args.prompt},)))]
    return [(item.id, item) for item in select_prompts(args.prompts, args.num_prompts, args.per_category).items]


def cmd_generate(args) -> int:
    from dflashkit.decode.backends import backend_for
    from dflashkit.decode.speculative import DFlashProposer
    from dflashkit.measure.bench import _run
    from dflashkit.measure.curve import tree_cost_curve
    from dflashkit.measure.probe import new_session

    sampling = _check(args)
    try:
        _, size = parse_method(args.method)
    except ValueError as e:
        raise DFlashError(f"--method: {e}") from None
    prompts = _prompts(args)  # a bad prompt file fails before the target loads
    target, drafter = _load(args, need_drafter=needs_drafter(args.method))
    proposer = DFlashProposer(target, drafter, args.block_size) if drafter is not None else None
    session = new_session(target, proposer, args.reprobe, _say)  # the static decoder and auto's choice
    engine = backend_for(session, args.engine, args.method)
    cost = tree_cost_curve(target, proposer.block_size, repeats=3) if size == "auto" and engine == "hf" else None
    records, requests, rows = [], [], {args.method: (args.method, engine)}
    for i, (pid, item) in enumerate(prompts):
        c = _run(target, proposer, item, args.method, args.max_new_tokens, sampling, sampling.seed + i, cost, session,
                 rows, args.budget)
        g, texts = c.generation, c.answers
        rec = {"id": pid, "category": item.category, "method": g.method, "engine": g.engine, "prompt_tokens": [len(p) for p in c.prompts],
               "tokens": g.tokens, "turns": texts, "text": texts[-1], "accepted": g.accepted,
               "tau": g.tau if g.accepted else None, "tokens_per_s": len(g.tokens) / g.times["total"], "times": g.times}
        records.append(rec)
        requests.append(generation_record(pid, i, c, target))
        if not args.json:
            tau = f"tau {g.tau:.2f}, " if g.accepted else ""
            print(f"== {pid} [{g.method} on {g.engine}] {len(g.tokens)} tokens, {tau}{rec['tokens_per_s']:.1f} tokens/s")
            for k, text in enumerate(texts):
                print(f"-- turn {k + 1} --\n{text}" if len(texts) > 1 else text)
    if args.json:
        print(json.dumps(records, indent=1))
    if args.out:
        print(f"wrote {write_requests(args.out, requests)}", file=sys.stderr)
    return 0


def offline_runs(args: list[str]) -> dict[str, dict]:
    """{engine, or "" for every engine: an eval run's results.json, its "source" added} of `--offline [ENGINE=]RUN`."""
    runs: dict[str, dict] = {}
    for arg in args:
        engine, _, folder = arg.rpartition("=")
        if engine and engine not in PRICED:
            raise DFlashError(f"--offline {arg}: no engine {engine!r}; name one of {', '.join(PRICED)} "
                              "(ENGINE=RUN) or pass the run alone for every engine")
        if engine in runs:
            raise DFlashError(f"--offline {arg}: {'engine ' + engine if engine else 'a run for every engine'} is "
                              "given twice; pass one eval run each")
        path = Path(folder) / "results.json"
        if not path.is_file():
            raise DFlashError(f"--offline {folder}: no results.json there; pass a folder `dflashkit eval --out` wrote")
        res = runs[engine] = read_json(path, fix="rerun `dflashkit eval` to rewrite it")
        if "overall" not in res or "settings" not in res:
            raise DFlashError(f"--offline {folder}: {path} has no 'overall' or 'settings'; it is not an eval run")
        res["source"] = (f"offline eval {folder} ({res['settings'].get('anchors')} anchors, "
                         f"{res['overall'].get('blocks')} blocks)" + (f" for the {engine} rows" if engine else ""))
    return runs


def check_offline(offline: dict[str, dict], target, drafter_path: str | None, block_size: int | None,
                  sha: str | None = None) -> None:
    """An offline eval prices bench rows only if it evaluated this target, drafter (`sha`: its weights', if hashed
    already) and block size; else refused."""
    from dflashkit.drafter.checkpoint import drafter_identity
    from dflashkit.targets.model import check_same_target

    for res in offline.values():
        where = res["source"].split(" (")[0]
        check_same_target(res.get("target"), target.identity(), where, "pass an eval run of the bench's target")
        ran = (res.get("drafter") or {}).get("sha256")
        if drafter_path and ran and (sha := sha or drafter_identity(drafter_path)["sha256"]) and ran != sha:
            raise DFlashError(f"{where} evaluated another drafter ({res['drafter'].get('path')}) than --drafter "
                              f"{drafter_path}; pass an eval run of this drafter")
        if block_size and res["settings"].get("block_size") not in (None, block_size):
            raise DFlashError(f"{where} evaluated block size {res['settings']['block_size']}, bench runs "
                              f"{block_size}; pass an eval run at the bench's block size (or --block-size)")


def cmd_bench(args) -> int:
    import torch

    from dflashkit.drafter.checkpoint import drafter_identity
    from dflashkit.measure.bench import bench_markdown, parse_methods, run_bench, write_bench

    sampling = _check(args)
    methods = parse_methods(args.methods or DEFAULT_METHODS)
    prompts = _prompts(args)  # a bad prompt file fails before the target loads
    if args.offline and args.no_predict:
        raise DFlashError("--offline and --no-predict: the offline runs are read only to predict; drop one")
    offline = offline_runs(args.offline or [])  # a bad run folder fails before the target loads
    target, drafter = _load(args, need_drafter=any(needs_drafter(m) for m in methods))
    which = drafter_identity(args.drafter) if args.drafter else None  # the drafter the speedups are of
    check_offline(offline, target, args.drafter, args.block_size or (drafter.config.block_size if drafter else None),
                  which and which["sha256"])
    # the finished runs, keyed by what they depend on
    journal = Journal(Path(args.out) / "runs.jsonl", {
        "target": target.identity(), "dtype": str(target.dtype), "methods": methods, "engine": args.engine,
        "prompts": [pid for pid, _ in prompts], "max_new_tokens": args.max_new_tokens, "block_size": args.block_size,
        "sampling": repr(sampling), "threads": torch.get_num_threads(),
        "drafter": which and (which["sha256"] or args.drafter)})
    args.on_interrupt = (f"interrupted; the finished runs are in {journal.path}: the same command resumes from there "
                         "(another --out starts anew)")
    result = run_bench(target, drafter, prompts, methods, max_new_tokens=args.max_new_tokens,
                       block_size=args.block_size, sampling=sampling, engine=args.engine, log=_say, offline=offline,
                       predict=not args.no_predict, journal=journal, reprobe=args.reprobe)
    if which:
        result["config"]["drafter"] = which
    paths = write_bench(result, args.out)
    journal.finish()
    print(bench_markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    if result["mismatches"]:  # a failed check, not a mistake of the user's: exit 1 (docs/design.md section 11)
        print(f"error: {len(result['mismatches'])} speculative outputs differ from plain decoding at temperature 0 "
              f"(see {paths[1]}); the lossless check failed", file=sys.stderr)
        return 1
    off = [t for t in result.get("tau_checks") or [] if not t["ok"]]
    if off:  # the engine and our loop accept differently on the same drafter: one of them computes something else
        print("error: " + "; ".join(f"{t['method']} mean acceptance length {t['engine_tau']:.3f} vs the "
                                    f"{t['predicted_tau']:.3f} our drafter predicts on its output "
                                    f"({100 * t['gap']:+.1f}%, beyond 5%)" for t in off), file=sys.stderr)
        return 1
    return 0


def engines_of(spec: str) -> list[str]:
    from dflashkit.measure.costmodel import check_model_engine

    names = [e.strip() for e in spec.split(",") if e.strip()]
    if not names:
        raise DFlashError(f"--engine {spec!r}: name one of {ENGINE_CHOICES}")
    for name in [n for n in names if n != "auto"]:
        check_model_engine(name)
    return names


def models_for(names: list[str], target, drafter_ref=None, force: bool = False) -> list:
    """The cost model of each engine named (auto made concrete), the drafter's call priced where one is given."""
    from dflashkit.measure.costmodel import cost_model
    from dflashkit.decode.backends import backend_for
    from dflashkit.measure.probe import new_session
    from dflashkit.decode.speculative import DFlashProposer
    from dflashkit.drafter.checkpoint import load_drafter

    proposer = DFlashProposer(target, load_drafter(drafter_ref, target=target, device=target.device,
                                                   dtype=target.dtype)) if drafter_ref else None
    session = new_session(target, proposer, log=_say, trees=True)
    concrete = [backend_for(session, "auto", "chain" if proposer else "ar") if n == "auto" else n for n in names]
    return [cost_model(e, target, proposer, session, force=force, log=_say) for e in dict.fromkeys(concrete)]


def replays_for(models: list) -> dict:
    """hybrid-auto as the offline walk replays it at each engine's prices (measure/predict.py, hybrid_replay)."""
    from dflashkit.measure.predict import hybrid_replay

    return {m.engine: hybrid_replay(m) for m in models}


def cmd_cost(args) -> int:
    from dflashkit.measure.costmodel import cost_markdown, cost_plot
    from dflashkit.targets.model import load_target

    names = engines_of(args.engine)  # a wrong name fails before the target loads
    target = load_target(args.target, device=args.device, dtype=args.dtype, weights=args.weights)  # as decoding runs it
    models = models_for(names, target, args.drafter, force=args.force)
    out = Path(args.out)  # write_json makes the folder before the plot goes in
    lines = [f"# Cost models: {target.name}", ""] + [line for m in models for line in cost_markdown(m)]
    lines += ["![cost against n](cost.png)", ""]
    table = {m.engine: m.to_dict() for m in models}
    write_json(out / "cost.json", table)
    write_text(out / "cost.md", "\n".join(lines))
    cost_plot(out / "cost.png", models, f"One target forward over n tokens ({target.name}, "
                                        f"{str(target.dtype).removeprefix('torch.')})")
    print(json.dumps(table, indent=1) if args.json else "\n".join(lines))
    print(f"wrote {out / 'cost.json'}, {out / 'cost.md'}, {out / 'cost.png'}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    """`dflashkit eval`, then (with --engine) the run's acceptance priced on that engine's cost model."""
    from dflashkit.evaluate.cli import run_eval_command

    names = engines_of(args.engine) if args.engine else []  # a wrong name fails before the evaluation runs
    models: list = []  # each engine's cost model, read (or measured) once, when the eval has loaded the target

    def replays(target):  # the walk replays hybrid-auto at each engine's prices
        models.extend(models_for(names, target, args.drafter))
        return replays_for(models)
    result = run_eval_command(args, replays if names else None)
    for line in predict_eval(result, models):
        print(line)
    return 0


def predict_eval(result: dict, models: list) -> list[str]:
    from dflashkit.measure.predict import offline_acceptance, predict_offline, prediction_markdown

    settings = result["settings"]  # eval loads the target in the dtype decoding picks (auto), as the models price it
    source = (f"offline eval ({settings['anchors']} anchors, {result['overall']['blocks']} blocks, "
              f"{result['overall']['prompts']} prompts)")
    acceptance = offline_acceptance(result["overall"], settings["block_size"], source)
    return [line for model in models for line in prediction_markdown(predict_offline(acceptance, model), model, source)]
