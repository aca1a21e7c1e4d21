"""DFlash vs DFlash2 at equal CPU minutes on the demo's data, offline and online, plus T>0 acceptance schemes.

    python benchmarks/dflash2_vs_dflash.py [--minutes 10] [--out runs/dflash2-vs-dflash] [--results FILE]

1. The demo's data and eval-cache stages (fingerprinted under runs/demo: `make demo` reuses them, and so does a
   rerun of this script).
2. Both drafters train from dflashkit/configs/smollm2-cpu.yaml for the same minutes, side by side, one thread each (so both
   see the same machine; two 1-thread jobs on 2 cores do not oversubscribe). DFlash2 adds its convolutions and
   candidate selector (rank --selector-rank, top-16); everything else is the recipe's.
3. Offline: stride and walk tau on the held-out coding-10 cache (DFlash2: its selector's path).
4. Online on coding-10: ar, chain and ddtree-8 at T=0 (every output checked against plain decoding), then chain
   at T=0.7 under both acceptance rules (match: greedy drafts kept iff equal to the target's sample; rejection:
   drafts sampled from q and kept with min(1, p/q)), same prompts and seeds.
Writes JSON + Markdown to --results (default benchmarks/results/cpu-DATE-dflash2-vs-dflash.*), naming the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name  # noqa: E402
from dflashkit.cache import open_cache  # noqa: E402
from dflashkit.measure.bench import parse_methods, run_bench  # noqa: E402
from dflashkit.decode.sampling import Sampling  # noqa: E402
from dflashkit.decode.speculative import DFlashProposer, generate  # noqa: E402
from dflashkit.demo import DemoConfig, Paths, declare_stages, load_demo_target, load_recipe  # noqa: E402
from dflashkit.demo.stages import StageRunner  # noqa: E402
from dflashkit.drafter.checkpoint import load_drafter, run_latest  # noqa: E402
from dflashkit.evaluate.runs import run_eval  # noqa: E402
from dflashkit.fileio import write_json  # noqa: E402
from dflashkit.prompts import load_prompts  # noqa: E402


def build_data(demo: DemoConfig):
    """The demo's data + cache stages only (skipped when their fingerprints match)."""
    from rich.console import Console

    from dflashkit.targets.model import pick_device

    p = Paths(Path(demo.out), demo.eval_suite)
    target, _ = load_demo_target(demo)
    recipe = load_recipe(demo)
    runner = StageRunner(p.root, ["data", "cache"], Console())
    for stage in declare_stages(demo, p, target, recipe, pick_device(demo.device))[:2]:
        runner.run(stage)
    return target, p


def train_both(p: Paths, out: Path, minutes: float, rank: int) -> dict:
    """Two `dflashkit train` processes at once, one thread each, equal max_minutes."""
    common = [f"data={p.data}", f"eval_cache={p.eval_cache}", f"max_minutes={minutes}", f"schedule_minutes={minutes}",
              "progress=false", "dtype=float32"]
    runs = {"dflash": [], "dflash2": ["arch=dflash2", f"selector_rank={rank}"]}
    procs = {}
    for name, extra in runs.items():
        cmd = [sys.executable, "-m", "dflashkit.cli", "train", "--threads", "1", "--config",
               "smollm2-cpu", f"out={out / name}", *common, *extra]
        if run_latest(out / name) is not None and (out / name / "summary.json").exists():
            continue  # already trained
        log = open(out / f"train-{name}.log", "w")
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    t0 = time.time()
    while any(pr.poll() is None for pr in procs.values()):
        print(f"  training {', '.join(procs)}: {(time.time() - t0) / 60:.1f} / {minutes:g} min", flush=True)
        time.sleep(30)
    bad = {n: pr.returncode for n, pr in procs.items() if pr.returncode}
    if bad:
        raise SystemExit(f"training failed: {bad}; see {out}/train-*.log")
    return {name: run_latest(out / name) for name in runs}


def offline(target, p: Paths, ckpts: dict, out: Path) -> dict:
    cache = open_cache(p.eval_cache, expect_target=target.identity())
    res = {}
    for name, ckpt in ckpts.items():
        trees = ("budget:4", "budget:8") + (("selector:4", "selector:8") if name == "dflash2" else ())
        for anchors in ("stride", "walk"):
            r = run_eval(ckpt, target, cache, out / "eval" / f"{name}-{anchors}", anchors=anchors,
                         trees=trees, progress=False, say=lambda line: None)
            o = r["overall"]
            res[f"{name}/{anchors}"] = {"tau": o["tau"], "pos1": o.get("pos1_acc"), "blocks": o["blocks"],
                                        **{t: o[t] for t in trees}}
            print(f"  offline {name} {anchors}: tau {o['tau']:.3f} over {o['blocks']} blocks", flush=True)
    return res


def online(target, ckpts: dict, prompts, max_new: int, temperature: float, seed: int) -> dict:
    res = {}
    for name, ckpt in ckpts.items():
        d = load_drafter(ckpt, target=target, device=target.device, dtype=target.dtype)
        r = run_bench(target, d, prompts, parse_methods("chain,ddtree-8"), max_new_tokens=max_new, progress=False)
        if r["mismatches"]:
            raise SystemExit(f"{name}: LOSSLESS CHECK FAILED {r['mismatches'][:2]}")
        res[name] = {m: {k: s[k] for k in ("tau", "tokens_per_s", "speedup_vs_ar") if k in s}
                     for m, s in r["methods"].items()}
        if name == "dflash2":  # its DDTree over the marginals alone, against the selector-scored one above
            ar = {x["prompt"]: x["tokens"] for x in r["runs"] if x["method"] == "ar"}
            marginal, acc, t = DFlashProposer(target, d, selector_trees=False), [], 0.0
            for pid, ids in prompts:
                g = generate(target, ids, "ddtree-8", marginal, max_new_tokens=max_new)
                if g.tokens != ar[pid]:
                    raise SystemExit(f"{name} marginal ddtree-8: LOSSLESS CHECK FAILED on {pid}")
                acc, t = acc + g.accepted, t + g.times["total"]
            res[name]["ddtree-8 marginals"] = {"tau": sum(acc) / len(acc), "tokens_per_s": sum(map(len, ar.values())) / t}
        res[name]["sampled"] = {}
        proposer = DFlashProposer(target, d)
        for acceptance in ("match", "rejection"):
            acc = []
            for i, (_, ids) in enumerate(prompts):
                gen = torch.Generator().manual_seed(seed + i)
                g = generate(target, ids, "chain", proposer, max_new_tokens=max_new,
                             sampling=Sampling(temperature, acceptance), generator=gen)
                acc += g.accepted
            res[name]["sampled"][acceptance] = {"tau": sum(acc) / len(acc), "rounds": len(acc)}
        print(f"  online {name}: {json.dumps(res[name])}", flush=True)
    return res


def markdown(r: dict) -> str:
    lines = [f"# DFlash vs DFlash2 at equal CPU minutes ({r['date']})", "",
             f"Machine: {r['machine']}. Target SmolLM2-135M-Instruct, float32. Both drafters trained "
             f"{r['minutes']:g} min from dflashkit/configs/smollm2-cpu.yaml ({r['recipe_note']}), side by side, one thread each. "
             f"Held-out suite coding-10 ({r['prompts']} prompts, {r['max_new_tokens']} new tokens online). "
             "Produced by benchmarks/dflash2_vs_dflash.py.", "",
             "| drafter | train steps | offline stride tau | offline walk tau | chain tau (T=0) | ddtree-8 tau (T=0) | "
             "chain speedup | ddtree-8 speedup | chain tau T=0.7 match | chain tau T=0.7 rejection |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("dflash", "dflash2"):
        on, off = r["online"][name], r["offline"]
        lines.append(f"| {name} | {r['steps'][name]} | {off[name + '/stride']['tau']:.3f} | "
                     f"{off[name + '/walk']['tau']:.3f} | {on['chain']['tau']:.3f} | {on['ddtree-8']['tau']:.3f} | "
                     f"{on['chain']['speedup_vs_ar']:.2f}x | {on['ddtree-8']['speedup_vs_ar']:.2f}x | "
                     f"{on['sampled']['match']['tau']:.3f} | {on['sampled']['rejection']['tau']:.3f} |")
    d2, off2 = r["online"]["dflash2"], r["offline"]
    lines += ["", "Every T=0 output equals plain greedy decoding (checked). DFlash2's offline streak and online chain "
              "drafts are its candidate selector's path.", "",
              "DDTree over DFlash2: children scored by the selector given their parent (`selector:B`, new) against the "
              "reference's independent marginals (`budget:B`), mean accepted depth per block (offline, stride) and "
              "online ddtree-8 tau:", "",
              "| tree | offline depth, budget 4 | offline depth, budget 8 | online ddtree-8 tau | online tokens/s |",
              "|---|---|---|---|---|",
              f"| marginals | {off2['dflash2/stride']['budget:4']:.3f} | {off2['dflash2/stride']['budget:8']:.3f} | "
              f"{d2['ddtree-8 marginals']['tau']:.3f} | {d2['ddtree-8 marginals']['tokens_per_s']:.1f} |",
              f"| selector | {off2['dflash2/stride']['selector:4']:.3f} | {off2['dflash2/stride']['selector:8']:.3f} | "
              f"{d2['ddtree-8']['tau']:.3f} | {d2['ddtree-8']['tokens_per_s']:.1f} |"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--out", default="runs/dflash2-vs-dflash")
    ap.add_argument("--demo-out", default="runs/demo", help="where the demo keeps its data stages (reused)")
    ap.add_argument("--selector-rank", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    date = time.strftime("%Y-%m-%d")
    results = Path(args.results or ROOT / "benchmarks" / "results" / f"cpu-{date}-dflash2-vs-dflash")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo = DemoConfig(out=args.demo_out, device="cpu")
    target, p = build_data(demo)
    ckpts = train_both(p, out, args.minutes, args.selector_rank)
    steps = {n: json.loads((out / n / "summary.json").read_text()).get("steps") for n in ckpts}
    target = load_demo_target(DemoConfig(device="cpu", target=demo.target))[0]
    suite = load_prompts(demo.eval_suite)
    prompts = [(it.id, target.chat_ids(it.messages)) for it in suite.items]
    r = {"date": date, "machine": cpu_name(), "minutes": args.minutes, "steps": steps, "prompts": len(prompts),
         "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
         "recipe_note": f"DFlash2: arch dflash2, selector rank {args.selector_rank}, top-16, conv kernel 2 group 16",
         "offline": offline(target, p, ckpts, out),
         "online": online(target, ckpts, prompts, args.max_new_tokens, args.temperature, 0)}
    write_json(results.with_suffix(".json"), r)
    results.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
