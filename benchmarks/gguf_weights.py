"""The weights CPU users run (issue 69): the embedded default on its shipped GGUF (Q4_1, head Q8_0) kept in its blocks
by our static backend, widened to float32 (`gguf`: the float32 copy's outputs) or through integer dots (`gguf-int8`:
activations in 8 bits, as llama.cpp computes), against llama.cpp decoding the very same file, beside other formats:
`q4_k_m` is the file llama-quantize writes for Q4_K_M from the float32 copy (q5_0, q8_0, q4_K, q6_K), passed as
`--weights FILE.gguf`, with llama.cpp on that file; `bf16`, `f16` round the float32 copy to 16-bit floats kept at 2
bytes a weight (llama.cpp runs its converter's file of that type).
Each row is one `dflashkit --isa LEVEL bench --weights W` process, as a user runs it: our plain decoding, our best
method, the drafter's chain (its tau on these weights) and llama.cpp's plain decoding of the same weights alternate
prompt by prompt in one run (same threads). At level v3 llama.cpp runs its AVX2 build (`dflashkit --isa v3 engines
install llama.cpp`), what a float32-only CPU runs. The drafter's offline tau on each format's features comes from
`dflashkit extract --weights W` then `dflashkit eval` (kept under --work, so a rerun reuses them).

    python benchmarks/gguf_weights.py --drafter runs/demo/train/best --out benchmarks/results/cpu-DATE-gguf-weights
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import cpu_name, write_results

DFLASHKIT = [sys.executable, "-m", "dflashkit.cli"]


def q4_k_m(args) -> Path:
    """The target as llama-quantize writes it for Q4_K_M from its float32 GGUF (the installed llama.cpp's), once."""
    from dflashkit.engines.install import require
    from dflashkit.engines.llamacpp import target_gguf
    from dflashkit.targets.model import load_target

    out = Path(args.work) / f"{args.target}-Q4_K_M.gguf"
    if not out.is_file():
        engine = require("llama.cpp")
        f32 = target_gguf(engine, load_target(args.target, device="cpu", dtype="float32"), "float32")
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(engine.binary("llama-quantize")), str(f32), str(out) + ".tmp", "Q4_K_M", "2"], check=True,
                       capture_output=True)
        os.replace(str(out) + ".tmp", out)
    return out.resolve()


def bench(isa: str, weights: str, args) -> dict:
    """One bench process: tokens/s of ar, the best method, the chain and llama.cpp on the same weights (where its
    converter writes them), taus, agreement with float32."""
    row = weights
    if weights.removesuffix("-int8") == "q4_k_m":  # llama-quantize's file, the target's matrices from it
        weights = str(q4_k_m(args)) + weights.removeprefix("q4_k_m")
    peer = ",llama.cpp" if weights.removesuffix("-int8") not in ("q4_0", "q4_1") else ""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*DFLASHKIT, "--isa", isa, "bench", "--target", args.target, "--dtype", "float32", "--weights", weights,
               "--engine", "static", "--drafter", args.drafter, "--methods", f"ar,{args.method},chain{peer}",
               "--prompts", args.prompts, "--max-new-tokens", str(args.new), "--no-predict", "--out", tmp]
        cmd += ["--num-prompts", str(args.num_prompts)] if args.num_prompts else []
        print(f"[{isa}, {weights}] {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, env=os.environ)
        res = json.loads((Path(tmp) / "results.json").read_text())
    m, cost = res["methods"], res["cost"]
    return {"isa": isa, "weights": row, "format": res["config"]["weights"], "dots": res["config"].get("static_kernels"),
            "ar": m["ar"]["tokens_per_s"],
            "best": m[args.method]["tokens_per_s"], "tau": m[args.method]["tau"], "chain_tau": m["chain"]["tau"],
            "worst": m[args.method]["worst_prompt"], "llama_cpp": m["llama.cpp"]["tokens_per_s"] if peer else None,
            "equal": not res["mismatches"], "bytes_per_weight": cost["weight_bytes"] / cost["weights"],
            "kernels": res["config"].get("static_kernels"), "threads": res["config"]["threads"],
            "agreement": res.get("agreement")}


def eval_tau(weights: str, args) -> float | None:
    """The drafter's offline tau (eval, stride anchors) on features extracted at `weights`' values (gguf: the float32
    copy's, the same values); None for -int8, whose integer dots run in the static backend's decoding only."""
    if weights.endswith("-int8"):
        return None
    w = "float" if weights == "gguf" else weights
    cache, run = Path(args.work) / f"cache-{w}", Path(args.work) / f"eval-{w}"
    w = str(q4_k_m(args)) if w == "q4_k_m" else w
    if not (run / "results.json").exists():
        subprocess.run([*DFLASHKIT, "extract", "--target", args.target, "--dtype", "float32", "--weights", w,
                        "--prompts", args.prompts, "--max-new-tokens", str(args.new), "--out", str(cache)],
                       check=True, env=os.environ)
        subprocess.run([*DFLASHKIT, "eval", "--drafter", args.drafter, "--cache", str(cache), "--out", str(run),
                        "--force"], check=True, env=os.environ)
    return json.loads((run / "results.json").read_text())["overall"]["tau"]


def agreement(a: dict | None) -> str:
    """bench's own agreement of a lossy format with float32 (top-1 along our plain output, prompts equal)."""
    if not a:
        return "float32's values"
    first = f", first parting at token {a['earliest_parting']}" if a["earliest_parting"] is not None else ""
    return f"top-1 {100 * a['top1']:.1f}%, {a['prompts_equal']}/{a['prompts']} equal{first}"


def table(rows: list[dict], method: str) -> list[str]:
    fastest = max((r for r in rows if r["llama_cpp"]), key=lambda r: r["llama_cpp"])
    ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"  # noqa: E731
    out = [f"| level | weights | bytes / weight | ours plain tok/s | ours {method} tok/s (tau) | worst prompt vs plain "
           "| chain tau (bench) | tau offline (eval) | llama.cpp plain tok/s (same weights) | plain / llama.cpp | "
           f"{method} / llama.cpp | {method} / llama.cpp {fastest['weights']} @ {fastest['isa']} (fastest plain here) "
           "| lossless | agreement with float32 (bench's) |", "|" + "---|" * 14]
    for r in rows:
        evaluated = f"{r['eval_tau']:.2f}" if r["eval_tau"] is not None else "-"
        peer = f"{r['llama_cpp']:.1f}" if r["llama_cpp"] else "-"
        vnni = " (VNNI)" if r["weights"].endswith("-int8") and "integer dots through" in (r.get("dots") or "") else ""
        out.append(f"| {r['isa']}{vnni} | {r['format']} | {r['bytes_per_weight']:.2f} | {r['ar']:.1f} | {r['best']:.1f} "
                   f"({r['tau']:.2f}) | {r['worst']['ratio']:.2f}x ({r['worst']['prompt']}) | {r['chain_tau']:.2f} | "
                   f"{evaluated} | {peer} | {ratio(r['ar'], r['llama_cpp'])} | "
                   f"{ratio(r['best'], r['llama_cpp'])} | {ratio(r['best'], fastest['llama_cpp'])} | "
                   f"{'yes' if r['equal'] else 'NO'} | {agreement(r['agreement'])} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", required=True, help="a trained drafter for the target (the demo's: runs/demo/train/best)")
    ap.add_argument("--method", default="hybrid-auto")
    ap.add_argument("--prompts", default="coding-10")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--runs", default="v3:gguf,v3:gguf-int8,v3:q8_0,v3:q4_0,v3:q4_k_m,v3:q4_k_m-int8,v4:gguf,"
                    "v4:gguf-int8,v4:q4_k_m,v4:q4_k_m-int8",
                    help="LEVEL:WEIGHTS pairs, one bench each")
    ap.add_argument("--work", default="runs/gguf-weights", help="the eval caches and runs and each bench row, reused by "
                    "a rerun (delete its rows/ to measure again)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for run in args.runs.split(","):  # each row kept under --work as it ends: a rerun resumes after the last
        isa, weights = run.split(":", 1)
        kept = Path(args.work) / "rows" / f"{isa}-{weights}.json"
        if not kept.is_file():
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.with_suffix(".tmp").write_text(json.dumps(bench(isa, weights, args)))
            kept.with_suffix(".tmp").replace(kept)
        rows.append(json.loads(kept.read_text()))
    for r in rows:
        r["eval_tau"] = eval_tau(r["weights"], args)
    md = [f"# The shipped GGUF's own weights: ours (static backend) vs llama.cpp on the same weights, {args.prompts}, "
          f"{args.new} new tokens", "", f"Machine: {cpu_name()}; drafter {args.drafter}.", "",
          *table(rows, args.method), "",
          "gguf = the file's own blocks widened to float32 (the same values as the float32 copy `target prepare` "
          "writes, so the same outputs); -int8 = the same blocks against activations quantized to 8 bits per block "
          "of 32, integer dots (as llama.cpp computes; another model, lossless against its own plain decoding); "
          "q8_0, q4_0 = quantized from the float32 copy by GGUF's reference quantizer (llama.cpp's converter for "
          "q8_0's row; its converter writes no 4-bit file): other models; q4_k_m = the file llama-quantize writes "
          "for Q4_K_M from the float32 copy (`--weights FILE.gguf`; llama.cpp runs that very file), another model; "
          "bf16, f16 = the float32 copy rounded to 16-bit floats (llama.cpp: its converter's --outtype bf16 or f16 "
          "file, the same values), another model. "
          "(VNNI): the integer dots through vpdpbusd. Ratios are within one bench run (one "
          "process per row). Agreement: float32's top-1 token along our plain output, teacher-forced, and the "
          "prompts on which float32's greedy decoding is ours. tau offline: the drafter on that format's features "
          "(dflashkit extract --weights, then eval)."]
    print("\n".join(md))
    if args.out:
        write_results(args.out, md, {"machine": cpu_name(), "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
