"""`dflashkit cost` (an engine's cost model: table and plot) and `dflashkit eval ... --engine NAME` (the offline
acceptance priced on that engine's cost model: predicted tokens/s and speedup before serving).

It sits above the stages because it joins two siblings: evaluate (the offline acceptance) and decode (the cost
models and the formula, measure/costmodel.py and measure/predict.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflashkit.errors import DFlashError
from dflashkit.targets.formats import add_weights_option

ENGINE_CHOICES = "auto, hf, static, llama.cpp or vllm"


def register(sub) -> None:
    """`cost`, and `--engine` on `eval` (evaluate/cli.py registers eval itself)."""
    from dflashkit.threads import add_threads_option

    c = sub.add_parser("cost", help="an engine's cost model: a target forward over n = 1..64 tokens, a drafter call, "
                                    "the loop's own work per round (measured once per machine, cached)")
    c.add_argument("--target", default="smollm2-135m", help="registry name or local Hugging Face folder")
    c.add_argument("--drafter", help="drafter folder: its call is priced too (needed to predict speculative methods)")
    c.add_argument("--engine", default="auto", help=f"{ENGINE_CHOICES}, several joined by commas; auto: the backend "
                   "speculative decoding picks here (measure/probe.py)")
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA and on CPUs with native bf16, else float32) | "
                   "float32 | bfloat16")
    add_weights_option(c)
    c.add_argument("--out", default="runs/cost", help="folder for cost.json, cost.md and cost.png")
    c.add_argument("--json", action="store_true", help="print the cost models as JSON")
    c.add_argument("--force", action="store_true", help="measure again, replacing the cached model")
    add_threads_option(c)
    c.set_defaults(func=cmd_cost)

    e = sub.choices["eval"]
    e.add_argument("--engine", default=None, help=f"also predict decoding speed on this engine ({ENGINE_CHOICES}) "
                   "from the run's acceptance and the engine's cost model (measured once and cached)")
    e.set_defaults(func=cmd_eval)


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def engines_of(spec: str) -> list[str]:
    from dflashkit.measure.costmodel import check_model_engine

    names = [e.strip() for e in spec.split(",") if e.strip()]
    for name in names:
        if name != "auto":
            check_model_engine(name)
    if not names:
        raise DFlashError(f"--engine {spec!r}: name one of {ENGINE_CHOICES}")
    return names


def models_for(names: list[str], target, drafter_ref=None, force: bool = False) -> list:
    """The cost model of each engine named (auto made concrete for the drafter's methods, or plain decoding), the
    drafter's call priced where one is given."""
    from dflashkit.measure.costmodel import cost_model
    from dflashkit.decode.backends import backend_for
    from dflashkit.measure.probe import new_session
    from dflashkit.decode.speculative import DFlashProposer
    from dflashkit.drafter.checkpoint import load_drafter

    proposer = DFlashProposer(target, load_drafter(drafter_ref, target=target, device=target.device,
                                                   dtype=target.dtype)) if drafter_ref else None
    session = new_session(target, proposer, log=_log, trees=True)
    method = "chain" if proposer else "ar"
    concrete = [backend_for(session, "auto", method) if n == "auto" else n for n in names]
    return [cost_model(e, target, proposer, session, force=force, log=_log) for e in dict.fromkeys(concrete)]


def replays_for(models: list) -> dict:
    """hybrid-auto as the offline walk replays it at each engine's prices (measure/predict.py, hybrid_replay)."""
    from dflashkit.measure.predict import hybrid_replay

    return {m.engine: hybrid_replay(m) for m in models}


def cmd_cost(args) -> int:
    from dflashkit.measure.costmodel import cost_markdown, cost_plot
    from dflashkit.fileio import write_json, write_text
    from dflashkit.targets.model import load_target

    names = engines_of(args.engine)  # a wrong name fails before the target loads
    target = load_target(args.target, device=args.device, dtype=args.dtype, weights=args.weights)  # as decoding runs it
    models = models_for(names, target, args.drafter, force=args.force)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
