"""Plain decoding, ours against llama.cpp's, at this CPU's widest ISA level and at v3, a float32-only CPU's
(issues 53, 68). Each level is one `dflashkit --isa LEVEL bench --methods ar,llama.cpp --engine static` process, as a
user runs it, so our step and llama.cpp's alternate prompt by prompt in one run; v3 builds our kernels for
x86-64-v3, starts torch on its AVX2 kernels and runs llama.cpp's AVX2 build (install it once with
`dflashkit --isa v3 engines install llama.cpp`). The ratio is ours / llama.cpp within a run.

    python benchmarks/isa_plain.py --out benchmarks/results/cpu-DATE-isa-plain
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

PATHS = {"native": {}, "v3": {"DFLASHKIT_ISA": "v3"}}


def bench(isa: str, dtype: str, args) -> dict:
    """One bench run on code path `isa`: {tokens/s of ar on static, of llama.cpp, what the kernels were built for}."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dflashkit.cli", "bench", "--target", args.target, "--methods", "ar,llama.cpp",
               "--engine", "static", "--dtype", dtype, "--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
               "--max-new-tokens", str(args.new), "--out", tmp]
        print(f"[{isa}, {dtype}] {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, **PATHS[isa]})
        res = json.loads((Path(tmp) / "results.json").read_text())
    m, c = res["methods"], res["config"]
    ours = next(s for label, s in m.items() if label.split("@")[0] == "ar" and c["backends"].get(label) == "static")
    peer = m["llama.cpp"]
    return {"isa": isa, "dtype": dtype, "ours": ours["tokens_per_s"], "ours_decode": ours.get("decode_tokens_per_s"),
            "llama_cpp": peer["tokens_per_s"], "ratio": ours["tokens_per_s"] / peer["tokens_per_s"],
            "kernels": c.get("static_kernels"), "threads": c["threads"], "equal": not res["mismatches"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="coding-10")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--runs", default="v3:float32,native:float32,native:bfloat16",
                    help="ISA:DTYPE pairs, each one bench process")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [bench(*run.split(":"), args) for run in args.runs.split(",")]
    md = [f"# Plain decoding per code path: ours (static backend) vs llama.cpp, {args.prompts} x {args.num_prompts}, "
          f"{args.new} new tokens", "", f"Machine: {cpu_name()}.", "",
          "| code path | dtype | ours tok/s | llama.cpp tok/s | ours / llama.cpp | our kernels | outputs equal |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['isa']} | {r['dtype']} | {r['ours']:.1f} | {r['llama_cpp']:.1f} | {r['ratio']:.2f}x | "
                  f"{r['kernels']} | {'yes' if r['equal'] else 'NO'} |")
    print("\n".join(md))
    if args.out:
        write_results(args.out, md, {"machine": cpu_name(), "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
