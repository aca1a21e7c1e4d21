"""The drafter on a quantized target in a static session: its float32 matrices against the q8_0 blocks the session
now gives it (StaticDecoder.drafter_in_blocks), side by side in one process per ISA level.

    python benchmarks/drafter_blocks.py [--levels v3,v4] [--weights gguf,gguf-int8] [--out benchmarks/results/...]

Replays DFlashProposer.propose as a decoding round runs it, compiled as decoder_for compiles it and with the head
on the target's own head blocks: 1-4 new context positions per call after a 200-token context, 96 MB streamed
through the caches before each call (the target forward's stand-in). The two drafters alternate round by round;
reported: median ms per call, float / blocks, and how often the two propose the same token (their drafts move by
rounding; the verify keeps every output exact either way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one(level: str, weights: str, args) -> dict:
    """One level's figures, in this process (torch loaded after the level's environment)."""
    from dflashkit import levels

    levels.choose(level)
    import torch

    from dflashkit.decode.speculative import DFlashProposer
    from dflashkit.decode.static import StaticDecoder
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.targets.model import load_target

    target = load_target(args.target, device="cpu", dtype="float32", weights=weights)
    prop = DFlashProposer(target, load_drafter(args.drafter, target=target, device="cpu", dtype=torch.float32))
    d = StaticDecoder(target, 512, compile=False, layer_ids=prop.layer_ids, verify_width=prop.block_size)
    blocks, linear = d.drafter_in_blocks(prop.drafter)
    calls = {"float32": (None, None, prop.compiled()), "q8_0 blocks": (blocks, linear, prop.compiled(blocks, linear))}
    g = torch.Generator().manual_seed(0)
    width = len(prop.layer_ids) * target.hidden_size
    first, news = torch.randn(1, 200, width, generator=g), [torch.randn(1, 1 + i % 4, width, generator=g)
                                                             for i in range(args.calls)]
    flush = torch.zeros(96 * 2**20 // 4)

    def run(name: str):
        module, lin, call = calls[name]
        with torch.no_grad(), prop.calling(call, d.head_linear(), module, lin):
            prop.reset([])
            anchor, start = torch.tensor([5]), 200
            prop.propose(first, anchor, start)
            times, tokens = [], []
            for f in news:
                start += f.shape[1]
                flush.add_(1.0)
                t0 = time.perf_counter()
                tokens.append(prop.propose(f, anchor, start).argmax(-1))
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000, torch.cat(tokens)

    ms, tokens = {name: [] for name in calls}, {}
    for r in range(args.rounds):
        for name in (list(calls) if r % 2 == 0 else reversed(list(calls))):
            t, tokens[name] = run(name)
            ms[name].append(t)
    med = {k: statistics.median(v) for k, v in ms.items()}
    same = float((tokens["float32"] == tokens["q8_0 blocks"]).float().mean())
    return {"level": level, "weights": weights, "ms": ms, "float_ms": med["float32"], "blocks_ms": med["q8_0 blocks"],
            "same_drafts": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default="runs/demo/train/best")
    ap.add_argument("--levels", default="v3,v4")
    ap.add_argument("--weights", default="gguf,gguf-int8")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # LEVEL:WEIGHTS, in a child process
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one.split(":"), args)))
        return
    from common import cpu_name, write_results

    from dflashkit import levels

    rows = []
    for level in args.levels.split(","):
        for weights in args.weights.split(","):
            env = {**os.environ, **levels.torch_environment(level), "DFLASHKIT_ISA": level}
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", f"{level}:{weights}"], env=env,
                                 check=True, stdout=subprocess.PIPE, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{level} {weights}: float32 {r['float_ms']:.2f} ms, q8_0 blocks {r['blocks_ms']:.2f} ms, "
                  f"{r['float_ms'] / r['blocks_ms']:.2f}x; same drafts {100 * r['same_drafts']:.1f}%", flush=True)
    md = ["# The drafter's matrices on a quantized target: float32 vs q8_0 blocks, one drafter call", "",
          f"Machine: {cpu_name()}; drafter {args.drafter}; target {args.target}. `python benchmarks/drafter_blocks.py`: "
          f"{args.calls} compiled calls of DFlashProposer.propose on 1-4 new positions after a 200-token context, head "
          "on the target's head blocks, 96 MB streamed through the caches before each; median ms per call, median of "
          f"{args.rounds} alternating rounds, one process per row.", "",
          "| level | target weights | float32 drafter ms | q8_0 blocks ms | float32 / blocks | same top-1 draft |",
          "|---|---|---|---|---|---|",
          *(f"| {r['level']} | {r['weights']} | {r['float_ms']:.2f} | {r['blocks_ms']:.2f} | "
            f"{r['float_ms'] / r['blocks_ms']:.2f}x | {100 * r['same_drafts']:.1f}% |" for r in rows)]
    print("\n".join(md))
    if args.out:
        write_results(args.out, md, {"machine": cpu_name(), "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
