"""Which recipe lever buys the most drafter per CPU-minute? Each lever alone and a combination, at equal wall time.

    python benchmarks/recipe_ablation.py [--minutes 5] [--levers recipe,kl,anchors-32,...] [--combo NAME:k=v,k=v ...]
                                         [--dtype float32|auto]

Every run trains from dflashkit/configs/smollm2-cpu.yaml for the same minutes (time-fitted schedule, all threads, one run at
a time: the regime of the demo's training stage) on the same cache, then is scored on the held-out coding-10 cache:
offline stride and walk tau, position-1 accuracy, and online drafter-only DDTree-8 tau (real speculative decoding
against the target, every output checked against plain greedy decoding). Levers (--levers, names from LEVERS):
  recipe       the recipe as it is (the baseline row)
  kl           soft targets: KL(target || drafter) over the draft vocabulary (needs --kl-data: the same cache with
               the target's last layer, made here with `dflashkit extract --completions-from` when missing)
  anchors-N    N anchors per sequence instead of the recipe's (fewer anchors: more steps and epochs per minute)
  layers-N     N drafter layers
  block-N      blocks of N tokens instead of 16: the recipe's gamma 1 puts 98% of the loss on the first 4
               positions, so a shorter block buys more anchors per minute for the positions that get accepted
  warm-start   the drafter's layers start as copies of the target's top layers
  dflash2      DFlash2's convolutions and candidate selector
  --combo NAME:k=v,k=v   a combination of levers as recipe overrides, under its own name (repeatable); data=CACHE
                         trains on other data (e.g. more prompts, or sampled answers: `dflashkit extract --samples`)
--dtype auto trains and decodes in bf16 where the CPU has native bf16 dot products, as the demo does there.
Each finished run leaves <out>/<lever>/row.json; a rerun skips it, so an interrupted ablation resumes. Writes
benchmarks/results/cpu-DATE-recipe-ablation.{md,json} after every row, naming the CPU and the dtype.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from common import cpu_name  # noqa: E402
from dflashkit.cache import open_cache  # noqa: E402
from dflashkit.decode.speculative import DFlashProposer, generate  # noqa: E402
from dflashkit.drafter.checkpoint import load_drafter, run_latest  # noqa: E402
from dflashkit.evaluate.runs import run_eval  # noqa: E402
from dflashkit.fileio import read_json, write_json, write_text  # noqa: E402
from dflashkit.prompts import load_prompts  # noqa: E402
from dflashkit.report import markdown_table  # noqa: E402
from dflashkit.targets.model import load_target  # noqa: E402

LEVERS = {"recipe": [], "kl": ["loss=kl"], "warm-start": ["warm_start=true"], "dflash2": ["arch=dflash2"]}


def overrides(lever: str, combos: dict[str, list[str]]) -> list[str]:
    if lever in LEVERS:
        return LEVERS[lever]
    if lever in combos:
        return combos[lever]
    kind, _, n = lever.rpartition("-")
    keys = {"anchors": "anchors_per_seq", "layers": "num_layers", "block": "block_size"}
    if kind in keys and n.isdigit():
        return [f"{keys[kind]}={n}"]
    raise SystemExit(f"--levers: unknown lever {lever!r}; use {', '.join(LEVERS)}, anchors-N, layers-N or block-N")


def kl_cache(data: Path, out: Path, target) -> Path:
    """The training cache again with the target's last layer (its distribution, for loss kl), same completions."""
    from dflashkit.cache import extract
    from dflashkit.demo import DemoConfig, demo_suites

    manifest = read_json(data / "manifest.json")
    suite = demo_suites(DemoConfig(train_prompts=manifest["suite"]["num_prompts"])).train
    if suite.content_hash != manifest["suite"]["content_hash"]:
        raise SystemExit(f"{data}: not a demo training cache (its prompts are not the demo's nearest "
                         f"{manifest['suite']['num_prompts']}); pass --kl-data with a cache that stores the last layer")
    extract(target, suite, out, layer_ids=[*manifest["layer_ids"], target.num_layers - 1], completions_from=data,
            batch_size=8, allow_final_layers=True, max_new_tokens=manifest["generation"]["max_new_tokens"])
    return out


def train(lever: str, extra: list[str], data: Path, eval_cache: Path, out: Path, minutes: float, threads: int,
          dtype: str) -> Path:
    run = out / lever / "train"
    if (run / "summary.json").is_file():
        return run
    cmd = [sys.executable, "-m", "dflashkit.cli", "train", "--threads", str(threads), "--config",
           "smollm2-cpu", f"out={run}", f"data={data}", f"eval_cache={eval_cache}",
           f"max_minutes={minutes}", f"schedule_minutes={minutes}", "progress=false", f"dtype={dtype}", *extra]
    print(f"[{lever}] training {minutes:g} min: {' '.join(extra) or '(the recipe)'}", flush=True)
    (out / lever).mkdir(parents=True, exist_ok=True)
    with open(out / lever / "train.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode:
            raise SystemExit(f"[{lever}] training failed; see {out / lever / 'train.log'}")
    return run


def score(lever: str, run: Path, target, cache, prompts, ar: dict, max_new: int, out: Path) -> dict:
    """Offline stride + walk on the eval cache and online drafter-only ddtree-8, lossless-checked."""
    ckpt, summary = run_latest(run), read_json(run / "summary.json")
    data = read_json(Path(summary["config"]["data"]) / "manifest.json")["totals"]
    row = {"lever": lever, "steps": summary["steps"], "minutes": summary["elapsed_s"] / 60,
           "train_prompts": data["prompts"], "train_tokens": data["completion_tokens"]}
    for anchors in ("stride", "walk"):
        o = run_eval(ckpt, target, cache, out / lever / f"eval-{anchors}", anchors=anchors, trees=("budget:8",),
                     progress=False, say=lambda line: None, plots=False)["overall"]
        row[f"{anchors}_tau"], row[f"{anchors}_pos1"] = o["tau"], o["pos1_acc"]
    proposer = DFlashProposer(target, load_drafter(ckpt, target=target, device=target.device, dtype=target.dtype))
    accepted = []
    for pid, ids in prompts:
        g = generate(target, ids, "ddtree-8", proposer, max_new_tokens=max_new)
        if g.tokens != ar[pid]:
            raise SystemExit(f"[{lever}] ddtree-8 on {pid}: LOSSLESS CHECK FAILED")
        accepted += g.accepted
    row["ddtree8_tau"] = sum(accepted) / len(accepted)
    print(f"[{lever}] " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
          flush=True)
    return row


def markdown(r: dict) -> str:
    best = max(r["rows"], key=lambda x: x["ddtree8_tau"])["lever"] if r["rows"] else "-"
    rows = [[x["lever"], " ".join(x["overrides"]) or "-", x["steps"], x.get("train_tokens", r["train_tokens"]),
             x["stride_tau"], x["walk_tau"], x["stride_pos1"], x["ddtree8_tau"]] for x in r["rows"]]
    return "\n".join([
        f"# Recipe levers at equal wall time ({r['date']})", "",
        f"Machine: {r['machine']}; torch {r['torch']}; dtype {r.get('dtype', 'float32')} (target and drafter). Each run: "
        f"dflashkit/configs/smollm2-cpu.yaml for {r['minutes']:g} min (time-fitted schedule), one run at a time, on "
        f"{r['data']} ({r['train_tokens']:,} response tokens from {r['train_prompts']} prompts) unless a row's overrides "
        "name other data. Held out: coding-10 "
        f"({r['prompts']} prompts): offline stride and walk tau and stride position-1 accuracy on its cache; online "
        f"drafter-only DDTree-8 tau over {r['max_new_tokens']} new tokens per prompt (every output equals plain greedy "
        "decoding). Produced by benchmarks/recipe_ablation.py.", "",
        markdown_table(["lever", "overrides", "steps", "train tokens", "stride tau", "walk tau", "pos-1 acc (held out)",
                        "online ddtree-8 tau"], rows, digits=3), "",
        f"Highest online DDTree-8 tau: {best}.", ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--levers", default="recipe,block-8,block-4,anchors-32,layers-1,layers-3,kl,warm-start,dflash2")
    ap.add_argument("--combo", action="append", default=[], metavar="NAME:K=V,K=V",
                    help="a named combination of recipe overrides (repeatable)")
    ap.add_argument("--data", default="runs/demo/cache/train")
    ap.add_argument("--kl-data", default="runs/ablation/cache-train-last")
    ap.add_argument("--eval-cache", default="runs/demo/cache/coding-10")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", default="float32", help="target and training dtype: float32 | auto (bf16 on a CPU with "
                    "native bf16 dot products, as the demo runs there)")
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    date, out = time.strftime("%Y-%m-%d"), Path(args.out)
    results = Path(args.results or ROOT / "benchmarks" / "results" / f"cpu-{date}-recipe-ablation")
    data, eval_cache = Path(args.data), Path(args.eval_cache)
    combos = {}
    for spec in args.combo:
        name, sep, kvs = spec.partition(":")
        if not sep or not all("=" in kv for kv in kvs.split(",")):
            raise SystemExit(f"--combo {spec!r}: write NAME:key=value,key=value")
        combos[name] = kvs.split(",")
    levers = [lv for lv in args.levers.split(",") if lv] + list(combos)
    plan = {lv: overrides(lv, combos) for lv in levers}
    manifest = read_json(data / "manifest.json")
    target = load_target(manifest["target"]["name"], device="cpu", dtype=args.dtype)
    runs = {}
    for lever, extra in plan.items():  # train everything first: one compile of the target for all the scoring
        kl = any(e == "loss=kl" for e in extra)
        runs[lever] = train(lever, extra, kl_cache(data, Path(args.kl_data), target) if kl else data,
                            eval_cache, out, args.minutes, args.threads, args.dtype)
    cache = open_cache(eval_cache, expect_target=target.identity())
    prompts = [(it.id, target.chat_ids(it.messages)) for it in load_prompts("coding-10").items]
    ar_file = out / f"ar-{args.max_new_tokens}.json"
    if not ar_file.is_file():
        write_json(ar_file, {pid: generate(target, ids, "ar", max_new_tokens=args.max_new_tokens).tokens
                             for pid, ids in prompts})
    ar = read_json(ar_file)
    r = {"date": date, "machine": cpu_name(), "torch": torch.__version__, "minutes": args.minutes, "data": str(data),
         "dtype": str(target.dtype).removeprefix("torch."),
         "train_prompts": manifest["totals"]["prompts"], "train_tokens": manifest["totals"]["completion_tokens"],
         "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rows": []}
    for lever, run in runs.items():
        row_file = out / lever / "row.json"
        if not row_file.is_file():
            write_json(row_file, score(lever, run, target, cache, prompts, ar, args.max_new_tokens, out))
        r["rows"].append({**read_json(row_file), "overrides": plan[lever]})
        write_json(results.with_suffix(".json"), r)
        write_text(results.with_suffix(".md"), markdown(r))
    print(markdown(r))
    print(f"wrote {results}.md, {results}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
