"""Plain decoding on a shared machine (issue 38): tokens/s quiet and beside one busy process, default threads.

Each run is `dflashkit generate` in its own process, as a user runs it, so the default thread count is chosen
as the CLI chooses it (dflashkit/threads.py: the physical cores less those other work keeps busy). The busy
process is one Python loop spinning on one core. Quiet and loaded runs alternate, `--repeats` times; the ratio
is loaded / quiet per method. About 3 minutes on 2 cores with the static decoder's compile cached.

    python benchmarks/loaded_decode.py --out benchmarks/results/cpu-DATE-loaded-decode
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import cpu_name, write_results


def run(method: str, args, busy: bool) -> tuple[float, str]:
    """(tokens/s over the prompts, the CLI's thread line or '') of one `dflashkit generate` process."""
    method, _, threads = method.partition("@")  # NAME[:ENGINE]@N: --threads N instead of the default
    method, _, engine = method.partition(":")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        time.sleep(0.5 if busy else 0)
        res = subprocess.run([sys.executable, "-m", "dflashkit.cli", "generate", "--target", args.target,
                              "--method", method, "--prompts", "coding-10", "--num-prompts", str(args.prompts),
                              "--max-new-tokens", str(args.new), "--dtype", args.dtype, "--json"]
                             + (["--threads", threads] if threads else []) + ["--engine", engine or "auto"],
                             capture_output=True, text=True, check=True)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    recs = json.loads(res.stdout)
    tokens = sum(len(r["tokens"]) for r in recs)
    seconds = sum(r["times"]["total"] for r in recs)
    note = next((line for line in res.stderr.splitlines() if line.startswith("threads:")), "")
    return tokens / seconds, note


def threads_cell(method: str, note: str) -> str:
    if "@" in method:
        return f"{method.partition('@')[2]} (--threads)"
    return note.removeprefix("threads: ") or "all cores (none seen busy)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="ar:static,ar:hf,ar:static@2",
                    help="NAME[:ENGINE][@N]: on --engine ENGINE (default auto), with --threads N")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    methods = args.methods.split(",")
    figures = {m: {"quiet": [], "loaded": [], "note": ""} for m in methods}
    run(methods[0], args, False)  # warm-up: the static decoder's compile lands in inductor's cache
    for r in range(args.repeats):
        for m in methods:
            for busy in (False, True):
                tps, note = run(m, args, busy)
                figures[m]["loaded" if busy else "quiet"].append(tps)
                figures[m]["note"] = note or figures[m]["note"]
                print(f"repeat {r + 1} {m:10s} {'loaded' if busy else 'quiet':6s} {tps:6.1f} tok/s {note}", flush=True)
    md = ["# Plain decoding quiet and beside one busy process", "",
          f"Machine: {cpu_name()}; {args.target}, {args.dtype}, coding-10 first {args.prompts} prompts, "
          f"{args.new} new tokens, default threads (NAME@N: --threads N), {args.repeats} alternating repeats "
          "(`benchmarks/loaded_decode.py`).", "",
          "| method | quiet tok/s | beside a busy process | loaded / quiet | threads when loaded |", "|---|---|---|---|---|"]
    for m, f in figures.items():
        q, lo = sum(f["quiet"]) / len(f["quiet"]), sum(f["loaded"]) / len(f["loaded"])
        f.update(quiet_mean=q, loaded_mean=lo, ratio=lo / q)
        md.append(f"| {m} | {q:.1f} | {lo:.1f} | {lo / q:.2f} | {threads_cell(m, f['note'])} |")
    print("\n".join(md))
    if args.out:
        write_results(args.out, md, {"machine": cpu_name(), "args": vars(args), "figures": figures})


if __name__ == "__main__":
    main()
