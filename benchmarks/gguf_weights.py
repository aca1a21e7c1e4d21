"""The weights CPU users run (issue 69): the embedded default on its shipped GGUF (Q4_1, head Q8_0) kept in its blocks
by our static backend, against llama.cpp decoding the very same file, beside the float32 copy and a q8_0 one. Each
row is one `dflashkit --isa LEVEL bench --weights W` process, as a user runs it: our plain decoding, our best method
and llama.cpp's plain decoding of the same weights alternate prompt by prompt in one run (same threads). At level v3
llama.cpp runs its AVX2 build (`dflashkit --isa v3 engines install llama.cpp`), what a float32-only CPU runs.

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


def bench(isa: str, weights: str, args) -> dict:
    """One bench process: {tokens/s of ar, of the best method, of llama.cpp on the same weights, tau, outputs}."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dflashkit.cli", "--isa", isa, "bench", "--target", args.target, "--dtype", "float32",
               "--weights", weights, "--engine", "static", "--drafter", args.drafter, "--methods",
               f"ar,{args.method},llama.cpp", "--prompts", args.prompts, "--max-new-tokens", str(args.new),
               "--no-predict", "--out", tmp] + (["--num-prompts", str(args.num_prompts)] if args.num_prompts else [])
        print(f"[{isa}, {weights}] {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, env=os.environ)
        res = json.loads((Path(tmp) / "results.json").read_text())
    m = res["methods"]
    tokens = {r["prompt"]: r["tokens"] for r in res["runs"] if r["method"] == "ar"}
    return {"isa": isa, "weights": weights, "format": res["config"]["weights"], "ar": m["ar"]["tokens_per_s"],
            "best": m[args.method]["tokens_per_s"], "tau": m[args.method]["tau"],
            "llama_cpp": m["llama.cpp"]["tokens_per_s"], "equal": not res["mismatches"],
            "kernels": res["config"].get("static_kernels"), "threads": res["config"]["threads"], "ar_tokens": tokens,
            "agreement": res.get("agreement")}


def agreement(a: dict | None) -> str:
    """bench's own agreement of a lossy format with float32 (top-1 along our plain output, prompts equal)."""
    if not a:
        return "float32's values"
    first = f", first parting at token {a['earliest_parting']}" if a["earliest_parting"] is not None else ""
    return f"top-1 {100 * a['top1']:.1f}%, {a['prompts_equal']}/{a['prompts']} equal{first}"


def table(rows: list[dict], method: str) -> list[str]:
    fastest = max(rows, key=lambda r: r["llama_cpp"])
    out = [f"| level | weights | ours plain tok/s | ours {method} tok/s | tau | llama.cpp plain tok/s (same weights) | "
           f"plain / llama.cpp | {method} / llama.cpp | {method} / llama.cpp {fastest['weights']} @ {fastest['isa']} "
           "(fastest plain here) | lossless | agreement with float32 (bench's) |", "|" + "---|" * 11]
    for r in rows:
        agree = agreement(r["agreement"])
        out.append(f"| {r['isa']} | {r['format']} | {r['ar']:.1f} | {r['best']:.1f} | {r['tau']:.2f} | "
                   f"{r['llama_cpp']:.1f} | {r['ar'] / r['llama_cpp']:.2f}x | {r['best'] / r['llama_cpp']:.2f}x | "
                   f"{r['best'] / fastest['llama_cpp']:.2f}x | {'yes' if r['equal'] else 'NO'} | {agree} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", required=True, help="a trained drafter for the target (the demo's: runs/demo/train/best)")
    ap.add_argument("--method", default="hybrid-auto")
    ap.add_argument("--prompts", default="coding-10")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--runs", default="v3:float,v3:gguf,v3:q8_0,v4:gguf", help="LEVEL:WEIGHTS pairs, one bench each")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [bench(*run.split(":"), args) for run in args.runs.split(",")]
    md = [f"# The shipped GGUF's own weights: ours (static backend) vs llama.cpp on the same weights, {args.prompts}, "
          f"{args.new} new tokens", "", f"Machine: {cpu_name()}; float32 math; drafter "
          f"{args.drafter}.", "", *table(rows, args.method), "",
          "gguf = the file's own blocks (the same values as the float32 copy `target prepare` writes, so the same "
          "outputs); q8_0 = quantized from that copy by GGUF's reference quantizer (llama.cpp's converter for its row): "
          "another model. Ratios are within one bench run (one process per row)."]
    print("\n".join(md))
    if args.out:
        write_results(args.out, md, {"machine": cpu_name(), "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
